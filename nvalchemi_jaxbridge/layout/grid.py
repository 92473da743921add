"""Device-grid choice: how many domains along each lattice axis (numpy only)."""

from __future__ import annotations

import itertools

import numpy as np

from .inputs import positive_int


def perpendicular_widths(cell: np.ndarray) -> np.ndarray:
    """Distance between opposite faces of the cell along each axis: `1 / |reciprocal row|`."""
    return 1.0 / np.linalg.norm(np.linalg.inv(cell), axis=0)


def _factor_triples(n: int) -> list[tuple[int, int, int]]:
    """All ordered `(nx, ny, nz)` with `nx * ny * nz == n`."""
    divs = [k for k in range(1, n + 1) if n % k == 0]
    return [(a, b, n // (a * b)) for a, b in itertools.product(divs, divs) if n % (a * b) == 0]


def choose_grid(n_devices: int, cell: np.ndarray, periodic: tuple[bool, bool, bool]) -> tuple[int, int, int]:
    """Pick the device grid `(nx, ny, nz)` with the least interface area between domains.

    The score of a grid is the total area of the cuts per unit volume,
    `sum_k cuts_k / width_k`, where `width_k` is the perpendicular width of the
    cell along lattice axis `k` and `cuts_k` is `n_k` on a periodic axis (the
    wrap-around face is a cut too: even an unsplit periodic axis needs images
    across it) and `n_k - 1` on a non-periodic axis. The widest axes are therefore split most;
    a prime device count gives slabs across the widest axis. Ties go to the grid
    with fewer split axes, then to the larger count on the earlier axis.

    Args:
        n_devices: number of devices (>= 1); the product of the result.
        cell: `(3, 3)` lattice vectors as rows; must span 3-D.
        periodic: periodic flag per lattice axis.

    Returns:
        `(nx, ny, nz)`; rank of domain `(ix, iy, iz)` is `(ix * ny + iy) * nz + iz`.

    Raises:
        TypeError: `n_devices` is not an int (a bool is not one).
        ValueError: `n_devices` is below 1 or `cell` is not a non-singular `(3, 3)` matrix.
    """
    n_devices = positive_int("choose_grid", "n_devices", n_devices)
    cell = np.asarray(cell, dtype=np.float64)
    if cell.shape != (3, 3) or not np.all(np.isfinite(cell)):
        raise ValueError(f"choose_grid: cell must be a finite (3, 3) array of lattice rows, got shape {cell.shape}.")
    norms = np.linalg.norm(cell, axis=1)
    if np.any(norms == 0.0) or abs(np.linalg.det(cell)) <= 1e-12 * np.prod(norms):
        raise ValueError(
            "choose_grid: cell is singular; give three lattice vectors that span 3-D "
            "(HaloPlan.build fills zero rows of non-periodic axes before calling this)."
        )
    widths = perpendicular_widths(cell)
    periodic = tuple(bool(p) for p in periodic)

    def score(g: tuple[int, int, int]) -> tuple[float, int, tuple[int, int, int]]:
        cuts = [n if p else n - 1 for n, p in zip(g, periodic)]
        area = sum(c / w for c, w in zip(cuts, widths))
        return (round(area, 12), sum(n > 1 for n in g), tuple(-n for n in g))

    return min(_factor_triples(int(n_devices)), key=score)
