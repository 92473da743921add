"""Spatial partitioner: one owner per atom and the ghost images each domain needs (numpy only).

Geometry is done in fractional coordinates `s = x @ inv(basis)`, where `basis`
is the cell with zero rows of non-periodic axes filled in (see
`effective_cell`). On periodic axes every atom is first wrapped into the cell:
`frame = floor(s)` is its unwrap frame and `w = s - frame` its wrapped
coordinate (non-periodic axes: `frame = 0`, `w = s`). Ownership and the ghost
search use `w` only, so the result does not depend on which periodic image the
caller passed. A periodic axis is cut into `n_k` equal slices of `w_k`; a
non-periodic axis into `n_k` equal slices of the atoms' extent along it.

For each rank, every image `w_j + t` (integer `t` on periodic axes, `t = 0`
otherwise) inside the fractional bounding box of its owned atoms, widened by
`reach * |reciprocal row k|` on axis `k`, is a ghost, except an owned atom at
`t = 0` (that is its owned row). The widening is a conservative superset of
"within `reach` of an owned atom", so the owner of an atom sees every partner
within `reach`, under every periodic image, in the wrapped frame.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Relative widening of the search margin: a pair at exactly `reach` must not
# be lost to rounding in the fractional projection.
_MARGIN_EPS = 1e-9


@dataclasses.dataclass(frozen=True, eq=False)
class Partition:
    """Owners and (unordered) ghost images of a system on a device grid."""

    grid: tuple[int, int, int]
    owner: np.ndarray  # (N,) int64 rank of each atom
    frame: np.ndarray  # (N, 3) int64 unwrap frame floor(s) on periodic axes, 0 elsewhere
    ghost_atom: tuple[np.ndarray, ...]  # per rank: (G_d,) int64 global atom id
    ghost_image: tuple[np.ndarray, ...]  # per rank: (G_d, 3) int64 lattice shift from the wrapped position


def effective_cell(cell: np.ndarray, periodic: tuple[bool, bool, bool], positions: np.ndarray) -> np.ndarray:
    """`cell` with each zero row of a non-periodic axis replaced by a direction completing a 3-D basis.

    The filled row is a unit direction orthogonal to the other rows, scaled to
    the atoms' extent along it (at least 1); it only sets the fractional frame
    and never shifts a position.
    """
    cell = np.array(cell, dtype=np.float64)
    norms = np.linalg.norm(cell, axis=1)
    scale = max(float(norms.max()), float(np.ptp(positions, axis=0).max()) if len(positions) else 0.0, 1.0)
    zero = norms <= 1e-12 * scale
    for k in range(3):
        if zero[k] and periodic[k]:
            raise ValueError(
                f"HaloPlan: lattice vector {k} (cell[{k}]) is zero but axis {k} is periodic; "
                f"give the periodic length in cell[{k}] or mark the axis non-periodic."
            )
    for k in np.flatnonzero(zero):
        others = cell[[i for i in range(3) if i != k and not zero[i]]]
        if len(others):
            _, _, vt = np.linalg.svd(others)
            direction = vt[len(others)]  # first right-singular vector of the null space
        else:
            direction = np.eye(3)[k]
        extent = float(np.ptp(positions @ direction)) if len(positions) else 0.0
        cell[k] = direction * max(extent, 1.0)
        zero[k] = False
    norms = np.linalg.norm(cell, axis=1)
    if abs(np.linalg.det(cell)) <= 1e-10 * np.prod(norms):
        raise ValueError(
            f"HaloPlan: cell is singular (rows {cell.tolist()} do not span 3-D); give three independent "
            "lattice vectors, or zero rows for non-periodic axes."
        )
    return cell


def assign_owners(
    frac: np.ndarray, periodic: tuple[bool, bool, bool], grid: tuple[int, int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Rank of each atom and its unwrap frame `floor(s)` on periodic axes (0 elsewhere)."""
    n_atoms = len(frac)
    index = np.zeros((n_atoms, 3), dtype=np.int64)
    frame = np.zeros((n_atoms, 3), dtype=np.int64)
    for k in range(3):
        n_k, s = grid[k], frac[:, k]
        if periodic[k]:
            frame[:, k] = np.floor(s).astype(np.int64)
            u = (s - frame[:, k]) * n_k
        elif n_atoms and (hi := s.max()) > (lo := s.min()):
            u = (s - lo) / (hi - lo) * n_k
        else:
            u = np.zeros(n_atoms)
        index[:, k] = np.clip(np.floor(u), 0, n_k - 1).astype(np.int64)
    rank = (index[:, 0] * grid[1] + index[:, 1]) * grid[2] + index[:, 2]
    return rank, frame


def _images_in_box(
    frac: np.ndarray, lo: np.ndarray, hi: np.ndarray, periodic: tuple[bool, bool, bool]
) -> tuple[np.ndarray, np.ndarray]:
    """All `(atom, t)` with `frac[atom] + t` inside `[lo, hi]` (t = 0 on non-periodic axes)."""
    tmin = np.zeros(frac.shape, dtype=np.int64)
    tmax = np.zeros(frac.shape, dtype=np.int64)
    for k in range(3):
        s = frac[:, k]
        if periodic[k]:
            tmin[:, k] = np.ceil(lo[k] - s).astype(np.int64)
            tmax[:, k] = np.floor(hi[k] - s).astype(np.int64)
        else:
            tmax[:, k] = np.where((s >= lo[k]) & (s <= hi[k]), 0, -1)
    span = np.clip(tmax - tmin + 1, 0, None)
    count = span.prod(axis=1)
    atoms = np.flatnonzero(count)
    if len(atoms) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 3), dtype=np.int64)
    reps = count[atoms]
    atom = np.repeat(atoms, reps)
    local = np.arange(len(atom)) - np.repeat(np.cumsum(reps) - reps, reps)
    sx, sy, sz = (span[atom, k] for k in range(3))
    step = np.stack([local // (sy * sz), (local // sz) % sy, local % sz], axis=1)
    return atom, tmin[atom] + step


def find_ghosts(
    wrapped: np.ndarray,
    periodic: tuple[bool, bool, bool],
    owner: np.ndarray,
    n_ranks: int,
    margin: np.ndarray,
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """Ghost images per rank from wrapped coordinates: `(atom ids, lattice shifts)`, without duplicates."""
    margin = margin * (1.0 + _MARGIN_EPS) + _MARGIN_EPS
    atoms_out, images_out = [], []
    for rank in range(n_ranks):
        members = wrapped[owner == rank]
        if len(members) == 0:
            atoms_out.append(np.zeros(0, dtype=np.int64))
            images_out.append(np.zeros((0, 3), dtype=np.int64))
            continue
        lo, hi = members.min(axis=0) - margin, members.max(axis=0) + margin
        atom, image = _images_in_box(wrapped, lo, hi, periodic)
        keep = ~((owner[atom] == rank) & ~image.any(axis=1))  # an owned atom at t = 0 is its owned row
        atoms_out.append(atom[keep])
        images_out.append(image[keep])
    return tuple(atoms_out), tuple(images_out)


def partition(
    positions: np.ndarray,
    basis: np.ndarray,
    periodic: tuple[bool, bool, bool],
    grid: tuple[int, int, int],
    reach: float,
) -> Partition:
    """Owners, unwrap frames and ghost images (relative to wrapped positions) for `positions` on `grid`.

    Args:
        positions: `(N, 3)` Cartesian positions, wrapped or not (the result is the same).
        basis: `(3, 3)` non-singular lattice (see `effective_cell`).
        periodic: periodic flag per lattice axis.
        grid: `(nx, ny, nz)` domains per axis.
        reach: cutoff + skin; every image within it of an owned atom is a ghost.

    Returns:
        A `Partition`.
    """
    inv = np.linalg.inv(basis)
    frac = positions @ inv
    owner, frame = assign_owners(frac, periodic, grid)
    margin = reach * np.linalg.norm(inv, axis=0)
    n_ranks = grid[0] * grid[1] * grid[2]
    atoms, images = find_ghosts(frac - frame, periodic, owner, n_ranks, margin)
    return Partition(grid=tuple(grid), owner=owner, frame=frame, ghost_atom=atoms, ghost_image=images)
