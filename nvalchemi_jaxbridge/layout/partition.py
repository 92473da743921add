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
otherwise) within `reach` (Cartesian) of one of its owned atoms is a ghost (with `exact`; else every
image of the search box below), except
an owned atom at `t = 0` (that is its owned row); so the owner of an atom sees every
partner within `reach`, under every periodic image, in the wrapped frame. The
candidates are the images inside the fractional bounding box of its owned atoms,
widened by `reach * |reciprocal row k|` on axis `k` (a superset); in a skewed cell
that box holds several times the images within reach (32 atoms in
[[7.5,0,0],[7,2.5,0],[3,2,7.5]] with a reach of 12.5 Å on 8 devices: ~11,000 ghosts
per device in the box, ~2,100 within reach), so only the latter are kept.

The plan's size is bounded before its tables are allocated: a cell whose
lattice vector lies almost in the plane of the others (`MIN_CELL_SINE`), an
atom absurdly many cells from the origin (`MAX_CELLS`), or a search that would
hold more than `MAX_PLAN_ROWS` rows in all (e.g. a periodic axis far thinner
than `reach`, which needs about `2 * reach / width` images of every atom across
it) is refused with the axis, atom or rank named.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .budget import MemoryBudget, rows_over_budget

# Relative widening of the search margin: a pair at exactly `reach` must not
# be lost to rounding in the fractional projection.
_MARGIN_EPS = 1e-9

MIN_CELL_SINE = 1e-6
"""A lattice vector must leave the plane of the other two at this sine at least (else the cell is degenerate)."""

MAX_CELLS = 2.0**31
"""An atom may be at most this many cells from the origin along a periodic axis (fractional coordinate)."""

_CHUNK = 2**20
"""Candidate images listed (and filtered by distance) at a time, per rank."""

_MAX_CANDIDATES = 2**30
"""Most candidate images the ranks' search boxes may hold in all (counted before any is listed; bounds the time
of the search as `MAX_PLAN_ROWS` bounds the rows kept)."""

MAX_PLAN_ROWS = 2**30
"""Most rows a plan may hold in all devices' halo blocks, `n_devices * max(owned + ghost rows)`.

About 80 bytes of host tables and temporaries per row, so roughly 90 GB at the limit; a plan that
would need more is refused before anything is allocated.
"""


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

    Raises:
        ValueError: a periodic axis has a zero row, or the filled cell is singular or nearly so (a
            lattice vector within a sine of `MIN_CELL_SINE` of the other two's plane), naming the vectors.
    """
    cell = np.array(cell, dtype=np.float64)
    norms = np.linalg.norm(cell, axis=1)
    zero = norms <= 1e-12 * float(norms.max())  # relative to the cell itself, never to the coordinates
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
    _check_not_degenerate(cell)
    return cell


def cell_sines(cell: np.ndarray) -> np.ndarray:
    """Per lattice vector, the sine of its angle to the plane of the other two: perpendicular width / length."""
    norms = np.linalg.norm(cell, axis=1)
    volume = abs(float(np.linalg.det(cell)))
    faces = np.linalg.norm(np.cross(cell[[1, 2, 0]], cell[[2, 0, 1]]), axis=1)  # |a_j x a_k| opposite a_i
    with np.errstate(divide="ignore", invalid="ignore"):
        sines = volume / (faces * norms)
    return np.nan_to_num(sines, nan=0.0, posinf=0.0)


def _check_not_degenerate(cell: np.ndarray) -> None:
    """Raise if some lattice vector of a (filled) cell lies within `MIN_CELL_SINE` of the other two's plane."""
    sines = cell_sines(cell)
    if sines.min() >= MIN_CELL_SINE:
        return
    bad = [int(k) for k in np.flatnonzero(sines < MIN_CELL_SINE)]
    norms = np.linalg.norm(cell, axis=1)
    detail = "; ".join(f"cell[{k}] has perpendicular width {sines[k] * norms[k]:.3g} for length {norms[k]:.3g}"
                       for k in bad)
    raise ValueError(
        f"HaloPlan: cell is singular or nearly so: lattice vector(s) {bad} lie within a sine of "
        f"{float(sines.min()):.3g} of the plane of the others (the limit is {MIN_CELL_SINE:g}; {detail}). "
        "Give three independent lattice vectors (check the rows and units of the cell), or zero rows for "
        "non-periodic axes."
    )


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


def _image_range(
    frac: np.ndarray, lo: np.ndarray, hi: np.ndarray, periodic: tuple[bool, bool, bool]
) -> tuple[np.ndarray, np.ndarray]:
    """Float `(tmin, tmax)` per atom and axis: the shifts `t` with `frac + t` inside `[lo, hi]` (t = 0 off-periodic)."""
    tmin = np.zeros(frac.shape)
    tmax = np.zeros(frac.shape)
    for k in range(3):
        s = frac[:, k]
        if periodic[k]:
            tmin[:, k] = np.ceil(lo[k] - s)
            tmax[:, k] = np.floor(hi[k] - s)
        else:
            tmax[:, k] = np.where((s >= lo[k]) & (s <= hi[k]), 0.0, -1.0)
    return tmin, tmax


def _images_in_range(tmin: np.ndarray, tmax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All `(atom, t)` with `tmin[atom] <= t <= tmax[atom]` (integral floats, counted before this allocates)."""
    tmin, tmax = tmin.astype(np.int64), tmax.astype(np.int64)
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


Box = tuple[np.ndarray, np.ndarray] | None


def search_boxes(wrapped: np.ndarray, owner: np.ndarray, n_ranks: int, margin: np.ndarray) -> tuple[Box, ...]:
    """Per rank, the fractional box `(lo, hi)` of its owned atoms widened by `margin` (None: owns no atom)."""
    margin = margin * (1.0 + _MARGIN_EPS) + _MARGIN_EPS
    boxes: list[Box] = []
    for rank in range(n_ranks):
        members = wrapped[owner == rank]
        boxes.append((members.min(axis=0) - margin, members.max(axis=0) + margin) if len(members) else None)
    return tuple(boxes)


def find_ghosts(
    wrapped: np.ndarray,
    periodic: tuple[bool, bool, bool],
    owner: np.ndarray,
    boxes: tuple[Box, ...],
    widths: np.ndarray,
    reach: float,
    basis: np.ndarray,
    budget: MemoryBudget | None = None,
    exact: bool = True,
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """Ghost images per rank from wrapped coordinates: `(atom ids, lattice shifts)`, without duplicates.

    The images in a rank's search box are candidates; those within `reach` of one of its owned atoms
    (Cartesian distance, `basis`) are its ghosts (`exact=False`: every candidate is one). The candidates
    are counted before any is listed (all
    ranks' above `_MAX_CANDIDATES` raise, naming `widths` and `reach`), then listed and filtered `_CHUNK`
    at a time; `n_ranks` times a rank's owned + ghost rows above `MAX_PLAN_ROWS` raises the same way, and
    above `budget.max_rows` raises `LayoutBudgetError` (nothing more is listed).
    """
    atoms_out, images_out = [], []
    limit = reach * (1.0 + _MARGIN_EPS) + _MARGIN_EPS
    for rank, box in enumerate(boxes):
        if box is None:
            atoms_out.append(np.zeros(0, dtype=np.int64))
            images_out.append(np.zeros((0, 3), dtype=np.int64))
            continue
        tmin, tmax = _image_range(wrapped, box[0], box[1], periodic)
        per_atom = np.clip(tmax - tmin + 1.0, 0.0, None).prod(axis=1)
        if len(boxes) * float(per_atom.sum()) > _MAX_CANDIDATES:
            _raise_too_large(rank, float(per_atom.sum()), len(boxes), periodic, widths, reach, _MAX_CANDIDATES,
                             ", counted in its search box")
        mine = owner == rank
        tree = search_tree(wrapped[mine] @ basis) if exact else None
        n_owned, kept_atoms, kept_images, kept = int(mine.sum()), [], [], 0
        steps = np.arange(1, math.ceil(float(per_atom.sum()) / _CHUNK)) * _CHUNK
        cuts = np.unique(np.r_[0, np.searchsorted(np.cumsum(per_atom), steps, side="right"), len(wrapped)])
        for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            # only atoms with an image besides their owned row (an owned atom's own box holds it at t = 0)
            some = lo + np.flatnonzero(per_atom[lo:hi] > mine[lo:hi])
            atom, image = _images_in_range(tmin[some], tmax[some])
            atom = some[atom]
            keep = ~((owner[atom] == rank) & ~image.any(axis=1))  # an owned atom at t = 0 is its owned row
            atom, image = atom[keep], image[keep]
            if exact:
                dist, _ = tree.query((wrapped[atom] + image) @ basis, distance_upper_bound=limit)
                near = dist <= limit
            else:
                near = np.ones(len(atom), dtype=bool)
            kept_atoms.append(atom[near])
            kept_images.append(image[near])
            kept += int(near.sum())
            if len(boxes) * (n_owned + kept) > MAX_PLAN_ROWS:
                _raise_too_large(rank, float(n_owned + kept), len(boxes), periodic, widths, reach, MAX_PLAN_ROWS)
            if budget is not None and n_owned + kept > budget.max_rows:
                rows_over_budget(rank, n_owned, kept, budget.max_rows, reach, budget.fix)
        atoms_out.append(np.concatenate(kept_atoms) if kept_atoms else np.zeros(0, dtype=np.int64))
        images_out.append(np.concatenate(kept_images) if kept_images else np.zeros((0, 3), dtype=np.int64))
    return tuple(atoms_out), tuple(images_out)


def search_tree(points: np.ndarray):
    """A `cKDTree` of `points` for exact radius queries (its shape does not change any answer; this one builds fastest)."""
    from scipy.spatial import cKDTree

    return cKDTree(points, balanced_tree=False, compact_nodes=False)


def _check_frames(frac: np.ndarray, periodic: tuple[bool, bool, bool]) -> None:
    """Raise if an atom lies more than `MAX_CELLS` cells from the origin along a periodic axis."""
    far = (np.abs(frac) > MAX_CELLS) & np.array(periodic)
    if far.any():
        atom, axis = (int(i) for i in np.argwhere(far)[0])
        raise ValueError(
            f"HaloPlan: atom {atom} is {abs(float(frac[atom, axis])):.3g} cells from the origin along periodic "
            f"lattice vector {axis} (the limit is {MAX_CELLS:.3g}). Wrap positions into the cell, or check the "
            "units of positions and cell."
        )


def _raise_too_large(
    rank: int, rows: float, n_ranks: int, periodic: tuple[bool, bool, bool], widths: np.ndarray, reach: float,
    limit: int, where: str = "",
) -> None:
    """The error for a plan whose halo blocks would hold more than `MAX_PLAN_ROWS` rows (rank `rank` has `rows`)."""
    thin = [f"axis {k} is {widths[k]:.3g} wide, so every atom has ~{2 * reach / widths[k] + 1:.3g} images across it"
            for k in range(3) if periodic[k] and widths[k] < reach]
    why = "; ".join(thin) if thin else "the system is large for this many devices"
    shown = [float(f"{w:.3g}") for w in widths]
    raise ValueError(
        f"HaloPlan: the plan would hold {n_ranks * rows:.3g} rows ({n_ranks} devices x {rows:.3g} owned + ghost "
        f"rows on rank {rank}{where}), above the limit MAX_PLAN_ROWS = {limit}; its tables were not allocated. "
        f"The cell's perpendicular widths are {shown} against cutoff + skin = {reach:g}: {why}. Check the "
        "cell and cutoff (units; a periodic cell far thinner than the cutoff), use a smaller cutoff + skin, or "
        "more devices for a large system."
    )


def partition(
    positions: np.ndarray,
    basis: np.ndarray,
    periodic: tuple[bool, bool, bool],
    grid: tuple[int, int, int],
    reach: float,
    budget: MemoryBudget | None = None,
    exact: bool = True,
) -> Partition:
    """Owners, unwrap frames and ghost images (relative to wrapped positions) for `positions` on `grid`.

    Args:
        positions: `(N, 3)` Cartesian positions, wrapped or not (the result is the same).
        basis: `(3, 3)` non-singular lattice (see `effective_cell`).
        periodic: periodic flag per lattice axis.
        grid: `(nx, ny, nz)` domains per axis.
        reach: cutoff + skin; every image within it of an owned atom is a ghost.
        budget: a `MemoryBudget`: a rank may hold at most `budget.max_rows` owned + ghost rows (None: only
            `MAX_PLAN_ROWS` in all).
        exact: keep the images within `reach` of an owned atom only (True), or every image of the search box
            (False: a superset whose rows vary less between rebuilds; several times more in a skewed cell).

    Returns:
        A `Partition`.

    Raises:
        ValueError: an atom is more than `MAX_CELLS` cells from the origin on a periodic axis, or the
            plan would hold more than `MAX_PLAN_ROWS` rows (each rank's images are counted before they
            are listed, so no step allocates more than that).
        LayoutBudgetError: a rank would hold more than `budget.max_rows` rows (found `_CHUNK` candidates
            at a time, so no more than that is listed beyond the limit).
    """
    inv = np.linalg.inv(basis)
    frac = positions @ inv
    _check_frames(frac, periodic)
    owner, frame = assign_owners(frac, periodic, grid)
    reciprocal = np.linalg.norm(inv, axis=0)  # 1 / perpendicular width per axis
    n_ranks = grid[0] * grid[1] * grid[2]
    wrapped = frac - frame
    boxes = search_boxes(wrapped, owner, n_ranks, reach * reciprocal)
    atoms, images = find_ghosts(wrapped, periodic, owner, boxes, 1.0 / reciprocal, reach, basis, budget, exact)
    return Partition(grid=tuple(grid), owner=owner, frame=frame, ghost_atom=atoms, ghost_image=images)
