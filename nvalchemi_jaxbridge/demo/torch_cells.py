"""Lennard-Jones with a cell list: O(R) memory and work per block (``jaxbridge_demo::`` namespace).

Importing this module registers

- ``jaxbridge_demo::lj_energy_forces_cells(positions, owned_mask, epsilon, sigma, cutoff)``

with the schema, block convention, outputs ``(energy (), forces (R, 3))``, fake
registration, input checks and autograd rules of the dense
``jaxbridge_demo::lj_energy_forces`` (``torch_ops``), but without its R x R pair
matrices:

1. bin the rows into cells of edge >= cutoff over the block's bounding box (the
   block is not periodic: ghost rows arrive already imaged, padding rows are
   parked outside the box and simply land in far, otherwise empty cells);
2. sort the rows by cell; with the key ``(cx * ny + cy) * nz + cz`` the 27
   neighbour cells of a cell are 9 runs of 3 consecutive keys, i.e. 9
   contiguous ranges of sorted rows, found with ``searchsorted``;
3. a chunk of rows at a time (at most ``PAIR_SLOTS`` candidate pairs, or one
   row), test each row against the rows of its 9 ranges, pack those within the
   cutoff into a neighbour table, and evaluate the pair terms on that table.

Only occupied cells are stored (sorted keys, no dense grid), so a block whose
padding lies far from its atoms costs no more than one without. The distance
test costs 9 x (the longest 3-cell run of the block) per row, the pair terms the
row's neighbours: linear in R at fixed density, R^2 only when every atom sits in
one cell (then it is the dense op, in chunks). The op is deterministic (no
atomics: each row's sum runs over its own table row).

Plain torch ops: runs on CPU and CUDA tensors, float32 or float64.
"""

import math

import torch
from torch import Tensor

from ._checks import check_scalars
from .params import LJParams
from .torch_ops import NAMESPACE, _check_inputs, _fake, _nonzero, _setup_lj, lj_pair_terms

_LJ = LJParams()
_OP = "lj_energy_forces_cells"

PAIR_SLOTS = {"cpu": 1 << 18, "cuda": 1 << 25}
"""Candidate pairs per chunk, by device type (others: the CUDA value).

Peak temporaries are about 45 B per slot in float64, 33 B in float32 (measured on
the CPU): 12 MB on the CPU, where cache-sized chunks ran 2.7x faster than 2^25 slots
at 5 x 10^4 rows; 1.5 GB on a GPU, where fewer, larger chunks mean fewer launches
and host syncs.
"""

_MAX_CELLS_PER_AXIS = 1 << 20  # keys (cx * ny + cy) * nz + cz stay below 2^60: int64-safe
_SLACK = {torch.float32: 64 * torch.finfo(torch.float32).eps, torch.float64: 64 * torch.finfo(torch.float64).eps}
_STRIPS = torch.tensor([(dx, dy) for dx in (-1, 0, 1) for dy in (-1, 0, 1)])  # (9, 2)


# --- binning ---


def _bin_edges(lo: list[float], hi: list[float], cutoff: float, dtype: torch.dtype):
    """Cells per axis and cell edges (>= cutoff plus a rounding margin) of the box [lo, hi]."""
    # A pair the kernel's distance test accepts (in the positions' dtype) is at most a few
    # rounding steps longer than the cutoff: widen the cells by more than that, so it can
    # never be two cells apart when binned in float64.
    reach = cutoff * (1.0 + _SLACK[dtype] + 1e-8)
    counts, edges = [], []
    for a, b in zip(lo, hi):
        extent = b - a
        n = max(1, min(_MAX_CELLS_PER_AXIS, math.floor(extent / reach)))
        counts.append(n)
        edges.append(extent / n if n > 1 else max(extent, reach))
    return counts, edges


def _check_finite(positions: Tensor, lo_hi: list[list[float]]) -> None:
    """Raise if the bounding box is not finite (some row is NaN or infinite)."""
    if all(math.isfinite(v) for row in lo_hi for v in row) and all(
        math.isfinite(b - a) for a, b in zip(*lo_hi)
    ):
        return
    bad = (~torch.isfinite(positions).all(dim=1)).nonzero().flatten()[:5].tolist()
    raise ValueError(
        f"{NAMESPACE}::{_OP}: positions must be finite to be binned into cells, but "
        + (f"rows {bad} (first 5) hold NaN or infinite coordinates" if bad else
           f"the bounding box {lo_hi} overflows")
        + "; check the integrator's step and the padding rows' parking points."
    )


def _neighbour_runs(positions: Tensor, cutoff: float):
    """Cell-sorted row order and, per row, its 9 neighbour runs of sorted rows.

    Returns (order (R,), cell of each sorted row (R,), run starts (K, 9), run lengths
    (K, 9), longest run) for the K occupied cells.
    """
    dev = positions.device
    p = positions.detach().to(torch.float64)
    box = torch.stack([p.min(dim=0).values, p.max(dim=0).values])
    lo_hi = box.tolist()  # host sync: the grid's shape decides tensor sizes below
    _check_finite(positions, lo_hi)
    counts, edges = _bin_edges(lo_hi[0], lo_hi[1], cutoff, positions.dtype)
    n = torch.tensor(counts, device=dev)
    cell = ((p - box[0]) / torch.tensor(edges, dtype=torch.float64, device=dev)).floor().long()
    cell = torch.minimum(cell.clamp_(min=0), n - 1)
    key = (cell[:, 0] * counts[1] + cell[:, 1]) * counts[2] + cell[:, 2]
    key_sorted, order = torch.sort(key, stable=True)
    occupied, row_cell = torch.unique_consecutive(key_sorted, return_inverse=True)
    cx = occupied // (counts[1] * counts[2])
    cy = (occupied // counts[2]) % counts[1]
    cz = occupied % counts[2]
    strips = _STRIPS.to(dev)
    bx = cx[:, None] + strips[None, :, 0]
    by = cy[:, None] + strips[None, :, 1]
    inside = (bx >= 0) & (bx < counts[0]) & (by >= 0) & (by < counts[1])
    base = (bx * counts[1] + by) * counts[2]
    first = base + (cz - 1).clamp(min=0)[:, None]
    last = base + (cz + 1).clamp(max=counts[2] - 1)[:, None]
    start = torch.searchsorted(key_sorted, first.flatten()).view_as(first)
    end = torch.searchsorted(key_sorted, last.flatten(), right=True).view_as(last)
    length = torch.where(inside, end - start, torch.zeros_like(start))
    return order, row_cell, start, length, int(length.max())


# --- pair math on one chunk of sorted rows ---


@torch.no_grad()
def _neighbours(xyz: Tensor, row_cell: Tensor, start: Tensor, length: Tensor, longest: int, a: int, b: int,
                cutoff: float) -> tuple[Tensor, Tensor]:
    """Neighbour table of sorted rows a..b: (columns (C, K) of sorted rows, filled (C, K)).

    Row i's candidates are the rows of its 9 runs; those within the cutoff plus a few
    rounding steps are packed to the front of row i (in sorted-row order) and the rest
    of the row points at i itself. The table is a superset of the pairs: the pair math
    applies the exact distance test.
    """
    i = torch.arange(a, b, device=xyz.device)
    k = torch.arange(longest, device=xyz.device)
    cells = row_cell[a:b]
    cand = start[cells][:, :, None] + k  # (C, 9, longest)
    cand = torch.where(k < length[cells][:, :, None], cand, i[:, None, None]).flatten(1)
    r2 = None
    for x in xyz:  # one coordinate at a time: (C, 9 longest) temporaries, no (..., 3) gather
        dx = x[a:b, None] - x.take(cand)
        r2 = dx * dx if r2 is None else r2.addcmul_(dx, dx)
    near = (r2 <= cutoff * cutoff * (1.0 + _SLACK[xyz.dtype])) & (cand != i[:, None])
    del r2, dx
    counts = near.sum(1)
    width = int(counts.max())  # host sync: the table's width
    row, col = near.nonzero(as_tuple=True)  # row-major: each row's candidates in sorted order
    slot = torch.arange(row.shape[0], device=xyz.device) - (counts.cumsum(0) - counts)[row]
    table = i[:, None].expand(-1, width).clone()
    table[row, slot] = cand[row, col]
    return table, torch.arange(width, device=xyz.device) < counts[:, None]


def _chunk(ps: Tensor, own: Tensor, table: Tensor, valid: Tensor, a: int, b: int, epsilon: float,
           sigma: float, cutoff: float) -> tuple[Tensor, Tensor]:
    """(energy part, forces (b - a, 3)) of sorted rows a..b over their neighbour table (differentiable)."""
    d = ps[a:b, None, :] - ps.index_select(0, table.flatten()).view(*table.shape, 3)
    r2 = (d * d).sum(-1)
    inside = valid & (r2 <= cutoff * cutoff)  # the dense op's test, on the same r2
    w = torch.where(inside, 0.5 * (own[a:b, None] + own.take(table)), torch.zeros_like(r2))
    return lj_pair_terms(d, torch.where(inside, r2, torch.ones_like(r2)), w, epsilon, sigma, cutoff)


def _chunks(rows: int, longest: int, pair_slots: int | None, device: torch.device):
    """Row ranges of the chunks: as many rows as fit `pair_slots` candidate pairs (at least one)."""
    slots = PAIR_SLOTS.get(device.type, PAIR_SLOTS["cuda"]) if pair_slots is None else pair_slots
    if slots < 1:
        raise ValueError(f"{NAMESPACE}::{_OP}: pair_slots must be >= 1, got {slots}.")
    step = max(1, slots // max(1, 9 * longest))
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def lj_cells_torch(positions: Tensor, owned_mask: Tensor, epsilon: float = _LJ.epsilon,
                   sigma: float = _LJ.sigma, cutoff: float = _LJ.cutoff, *,
                   pair_slots: int | None = None) -> tuple[Tensor, Tensor]:
    """Lennard-Jones block energy and forces with a cell list, in plain (differentiable) torch.

    Same formulas, weights and outputs as ``torch_ops.lj_torch``; differentiable in
    ``positions`` (the binning is piecewise constant), though autograd then keeps every
    chunk's temporaries (the op's backward instead differentiates one chunk at a time).

    Args:
        positions: (R, 3) halo rows, float32 or float64, Å.
        owned_mask: (R,) bool or float, 1 for owned rows.
        epsilon, sigma, cutoff: eV, Å, Å.
        pair_slots: candidate pairs per chunk (default ``PAIR_SLOTS`` of the device type);
            bounds peak memory.

    Returns:
        (energy partial, scalar eV; forces (R, 3) eV/Å, weighted, ghost rows included).
    """
    rows = positions.shape[0]
    if rows == 0:
        return positions.sum() * 0.0, positions * 0.0
    order, row_cell, start, length, longest = _neighbour_runs(positions, cutoff)
    ps = positions[order]
    xyz = ps.detach().t().contiguous()
    own = owned_mask.to(positions.dtype)[order]
    energy = positions.new_zeros(())
    parts = []
    for a, b in _chunks(rows, longest, pair_slots, positions.device):
        table, valid = _neighbours(xyz, row_cell, start, length, longest, a, b, cutoff)
        e, f = _chunk(ps, own, table, valid, a, b, epsilon, sigma, cutoff)
        energy = energy + e
        parts.append(f)
    forces_sorted = torch.cat(parts)
    forces = torch.empty_like(forces_sorted).index_copy(0, order, forces_sorted)
    return energy, forces


def _cells_hvp(positions: Tensor, owned_mask: Tensor, g_forces: Tensor, epsilon: float, sigma: float,
               cutoff: float) -> Tensor:
    """d(sum g_forces . forces)/d positions, differentiating one chunk of rows at a time."""
    order, row_cell, start, length, longest = _neighbour_runs(positions, cutoff)
    own = owned_mask.to(positions.dtype)[order]
    g_sorted = g_forces[order]
    ps = positions.detach()[order].requires_grad_(True)
    xyz = ps.detach().t().contiguous()
    grad = torch.zeros_like(ps)
    for a, b in _chunks(positions.shape[0], longest, None, positions.device):
        table, valid = _neighbours(xyz, row_cell, start, length, longest, a, b, cutoff)
        with torch.enable_grad():
            _, f = _chunk(ps, own, table, valid, a, b, epsilon, sigma, cutoff)
            (g,) = torch.autograd.grad(f, ps, g_sorted[a:b])
        grad += g
    return torch.empty_like(grad).index_copy(0, order, grad)


# --- the op ---


def _backward_cells(ctx, g_energy, g_forces):
    positions, owned_mask, forces = ctx.saved_tensors
    grad = -forces * g_energy
    if _nonzero(g_forces):
        grad = grad + _cells_hvp(positions, owned_mask, g_forces, *ctx.scalars)
    return grad, None, None, None, None


@torch.library.custom_op(f"{NAMESPACE}::{_OP}", mutates_args=())
def lj_energy_forces_cells(
    positions: Tensor,
    owned_mask: Tensor,
    epsilon: float = _LJ.epsilon,
    sigma: float = _LJ.sigma,
    cutoff: float = _LJ.cutoff,
) -> tuple[Tensor, Tensor]:
    """Lennard-Jones on a block of halo rows with a cell list: (energy partial, forces (R, 3))."""
    _check_inputs(_OP, positions, owned_mask)
    check_scalars(_OP, epsilon=epsilon, sigma=sigma, cutoff=cutoff)
    return lj_cells_torch(positions, owned_mask, epsilon, sigma, cutoff)


lj_energy_forces_cells.register_fake(_fake)
lj_energy_forces_cells.register_autograd(_backward_cells, setup_context=_setup_lj)
