"""Coincident atoms: two atoms at one point, or an atom on a periodic image of another (numpy only).

A model divides by pair distances, so two atoms at one point make it return NaN, while
a distributed run may give a finite number (the pair can land on two devices, or be
dropped as an edge of length zero). `HaloPlan.build` refuses such a structure with the
atom ids (`check_coincident`).

The search is a hash of the wrapped positions, not a pair loop: fractional coordinates
are wrapped into `[0, 1)` on periodic axes, so a coincidence under periodicity is one
within the cell or across a face; points within `COINCIDENT_DISTANCE` of a periodic face
get a copy one lattice vector across it. The points are binned on a grid of `_BIN` Å
(each point also into the neighbouring bin when it lies within the distance of a bin
face), and only points sharing a bin are compared, so one sort of about N points does
it: triclinic cells, slabs and cells thinner than the cutoff alike. An atom meets its
own image only if a periodic axis is thinner than the distance (`|n_k| <= d / width_k`
for a lattice vector `n` of length `d`), which is refused as such.
"""

from __future__ import annotations

from typing import Any

import numpy as np

COINCIDENT_DISTANCE = 1e-8
"""Atoms closer than this (Å), under any periodic image, are the same point."""

_BIN = 1e-3  # Å; far below any interatomic distance, so bins hold one atom each in a real structure
_SHOWN = 5


class CoincidentAtomsError(ValueError):
    """Two atoms (or an atom and a periodic image of another) lie at one point.

    Attributes:
        pairs: the first pairs found, `(i, j, (n1, n2, n3))`: atom `j` shifted by the lattice vector
            `n @ cell` lies on atom `i`.
    """

    def __init__(self, message: str, pairs: tuple[tuple[int, int, tuple[int, int, int]], ...]):
        super().__init__(message)
        self.pairs = pairs


def _with_images(frac: np.ndarray, periodic: tuple[bool, bool, bool], near: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Atom ids and fractional points: every atom, plus a copy one cell across each periodic face it is near."""
    atom, f = np.arange(len(frac)), frac
    for k in range(3):
        if periodic[k]:
            sel = f[:, k] < near[k]
            step = np.zeros(3)
            step[k] = 1.0
            atom, f = np.concatenate([atom, atom[sel]]), np.concatenate([f, f[sel] + step])
    return atom, f


def _binned(x: np.ndarray, index: np.ndarray, tol: float, size: float
            ) -> tuple[np.ndarray, np.ndarray]:
    """Bins `(M, 3)` of the points, each point also in the neighbouring bin across a face it is near."""
    b = np.floor(x / size).astype(np.int64)
    for k in range(3):
        off = x[:, k] - b[:, k] * size
        lo, hi = off < tol, size - off < tol
        sel = lo | hi
        if sel.any():
            extra = b[sel].copy()
            extra[:, k] += np.where(lo[sel], -1, 1)
            b, index, x = np.concatenate([b, extra]), np.concatenate([index, index[sel]]), np.concatenate([x, x[sel]])
    return b, index


def coincident_pairs(positions: np.ndarray, basis: np.ndarray, periodic: tuple[bool, bool, bool], *,
                     tol: float = COINCIDENT_DISTANCE, limit: int = _SHOWN
                     ) -> list[tuple[int, int, tuple[int, int, int], float]]:
    """Up to `limit` pairs `(i, j, n, distance)` with atom `j + n @ basis` within `tol` of atom `i` (`i < j`).

    Args:
        positions: `(N, 3)` finite Cartesian positions, wrapped or not.
        basis: `(3, 3)` non-singular lattice (`partition.effective_cell`).
        periodic: periodic flag per lattice axis.
    """
    pos = np.asarray(positions, dtype=np.float64)
    if len(pos) < 2:
        return []
    inv = np.linalg.inv(basis)
    raw = pos @ inv
    per = np.array(periodic)
    frac = raw.copy()
    frac[:, per] -= np.floor(frac[:, per])
    near = 2.0 * tol * np.linalg.norm(inv, axis=0) + 1e-12  # tol / width per axis, with room for rounding
    atom, f = _with_images(frac, periodic, near)
    x = f @ basis
    size = max(_BIN, 4.0 * tol)
    bins, index = _binned(x, np.arange(len(atom)), tol, size)
    # one int64 key per bin (a hash: two bins may share a key, which only adds a comparison)
    with np.errstate(over="ignore"):
        key = (bins[:, 0] * 73856093) ^ (bins[:, 1] * 19349663) ^ (bins[:, 2] * 83492791)
    order = np.argsort(key)
    key, index = key[order], index[order]
    same = key[1:] == key[:-1]
    if not same.any():
        return []
    found: dict[tuple[int, int], tuple[int, int, tuple[int, int, int], float]] = {}
    starts = np.flatnonzero(np.diff(np.concatenate([[False], same, [False]]).astype(np.int8)) == 1)
    for s in starts:
        e = s + 1
        while e < len(same) and same[e]:
            e += 1
        members = index[s: e + 1]  # one bin's points (rare: real atoms are far apart)
        while len(members) > 1 and len(found) < limit:
            p, rest = members[0], members[1:]
            d = np.linalg.norm(x[rest] - x[p], axis=1)
            for q in rest[d < tol]:
                i, j = int(atom[p]), int(atom[q])
                if i == j:
                    continue
                i, j = min(i, j), max(i, j)
                n = np.where(per, np.rint(raw[i] - raw[j]), 0.0).astype(np.int64)
                dist = float(np.linalg.norm((raw[j] + n - raw[i]) @ basis))
                found.setdefault((i, j), (i, j, tuple(int(v) for v in n), dist))
            members = rest
        if len(found) >= limit:
            break
    return sorted(found.values())[:limit]


def check_coincident(where: str, positions: np.ndarray, basis: np.ndarray, periodic: tuple[bool, bool, bool], *,
                     tol: float = COINCIDENT_DISTANCE) -> None:
    """Raise `CoincidentAtomsError` naming the atoms if two of them (under periodic images) are one point."""
    widths = 1.0 / np.linalg.norm(np.linalg.inv(basis), axis=0)
    thin = [k for k in range(3) if periodic[k] and not widths[k] > tol]
    if thin and len(positions):
        k = thin[0]
        raise CoincidentAtomsError(
            f"{where}: periodic lattice vector {k} leaves a perpendicular width of {widths[k]:.3g} Å, below "
            f"{tol:g} Å, so every atom lies on its own periodic image (atom 0 among them); give cell[{k}] its "
            f"real length (check the cell's units and rows), or set pbc[{k}] = False.",
            ((0, 0, tuple(int(i == k) for i in range(3))),),
        )
    pairs = coincident_pairs(positions, basis, periodic, tol=tol)
    if not pairs:
        return
    parts = []
    for i, j, n, dist in pairs:
        img = f"atom {j}'s periodic image shifted by lattice vector {list(n)}" if any(n) else f"atom {j}"
        parts.append(f"atom {i} and {img} ({dist:.3g} Å apart)")
    raise CoincidentAtomsError(
        f"{where}: coincident atoms, closer than {tol:g} Å: " + "; ".join(parts)
        + (" (first pairs found)" if len(pairs) >= _SHOWN else "")
        + ". A model divides by the pair distance and gives NaN there. Remove the duplicate atoms (a structure "
        "built by repeating a cell often holds an atom twice, e.g. at fractional 0 and 1 of a periodic axis, "
        "which are one lattice vector apart).",
        tuple((i, j, n) for i, j, n, _ in pairs),
    )
