"""Do the ranks hold the same structure? One small all-gather of fingerprints per evaluation.

On the PyTorch front door every rank passes the same global structure and computes
its own atoms from it. A rank given another one (an atom fewer, swapped species,
moved atoms, another cell) would build another layout: the exchanges then mix two
structures into an energy that matches neither, or gloo aborts on a message of the
wrong size. `check_same_structure` compares, before any collective whose size
depends on the input, a fingerprint of each rank's input: the atom count, the pbc
flags, and 64-bit digests (SHA-256, cut) of the atomic numbers, the cell, the
positions and the layout. The fingerprints are 10 int32 per rank, all-gathered in one
collective whose size does not depend on the input (and works with
`jax_enable_x64` off), so a mismatch is an error on every rank naming the ranks
and the fields that differ.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

FIELDS = ("atom count", "atomic numbers", "cell", "pbc", "positions", "layout (state=)")
_COUNT, _NUMBERS, _CELL, _PBC, _POSITIONS, _LAYOUT = range(len(FIELDS))
_SLOTS = (slice(0, 1), slice(1, 3), slice(3, 5), slice(5, 6), slice(6, 8), slice(8, 10))
WIDTH = 10  # int32 per rank
_LIST_AT_MOST = 6  # groups of ranks named in a message


class RankMismatchError(ValueError):
    """The ranks of a multi-process job were given different inputs for one collective evaluation."""


def _digest(x: Any, dtype: Any) -> np.ndarray:
    """Two int32 words of SHA-256 over `x` as a C-contiguous `dtype` array (shape included); `x`'s repr if it
    is not numeric (the caller's own checks then reject it, on every rank alike)."""
    h = hashlib.sha256()
    try:
        a = np.ascontiguousarray(np.asarray(x, dtype=dtype))
        h.update(repr(a.shape).encode())
        h.update(memoryview(a).cast("B"))
    except (TypeError, ValueError):
        h.update(b"not numeric:" + repr(x).encode())
    return np.frombuffer(h.digest()[:8], dtype="<i4").astype(np.int32)


def _pbc_bits(pbc: Any) -> int:
    """pbc as 3 bits (x = 1, y = 2, z = 4), or -1 if it is not 1 or 3 booleans."""
    try:
        flags = np.broadcast_to(np.asarray(pbc, dtype=bool), (3,))
    except (TypeError, ValueError):
        return -1
    return int(flags[0]) + 2 * int(flags[1]) + 4 * int(flags[2])


def fingerprint(positions: Any, numbers: Any, cell: Any, pbc: Any, layout: Any = None) -> np.ndarray:
    """The `WIDTH` int32 that stand for one rank's input: count, digests of numbers, cell, pbc bits,
    digests of positions (float64) and of `layout` (any picklable-as-repr summary of a passed state, or None)."""
    out = np.zeros(WIDTH, dtype=np.int32)
    try:
        count = len(positions)
    except TypeError:
        count = -1
    out[_SLOTS[_COUNT]] = min(count, 2**31 - 1)
    out[_SLOTS[_NUMBERS]] = _digest(numbers, np.float64)  # 29 and 29.0 alike
    out[_SLOTS[_CELL]] = _digest(np.zeros(0) if cell is None else cell, np.float64)
    out[_SLOTS[_PBC]] = _pbc_bits(pbc)
    out[_SLOTS[_POSITIONS]] = _digest(positions, np.float64)
    out[_SLOTS[_LAYOUT]] = _digest(np.zeros(0) if layout is None else np.asarray(layout, np.int64), np.int64)
    return out


def layout_key(plan: Any, edges: Any = None) -> np.ndarray:
    """The integers that make a layout (a passed `state=`): device count, atom count, capacities, every rank's
    owned and ghost counts, and the edge plan's capacity and counts."""
    parts: list[Any] = [plan.n_devices, getattr(plan, "n_atoms", getattr(plan, "n_global", -1)),
                        plan.owned_capacity, getattr(plan, "ghost_capacity", -1)]
    parts += [*getattr(plan, "offsets", ()), *getattr(plan, "pair_capacities", ())]
    parts += [*np.asarray(plan.n_owned).ravel(), *np.asarray(getattr(plan, "n_ghost", ())).ravel()]
    if edges is not None:
        parts += [edges.edge_capacity, *np.asarray(edges.n_edges).ravel()]
    return np.asarray(parts, dtype=np.int64)


def differences(prints: np.ndarray) -> list[tuple[list[int], list[str]]]:
    """For each group of ranks with one fingerprint other than rank 0's: (its ranks, what differs, with the
    count and pbc values). Empty when every rank holds rank 0's."""
    prints = np.asarray(prints, dtype=np.int64).reshape(-1, WIDTH)
    ref = prints[0]
    groups: dict[bytes, list[int]] = {}
    for r in range(1, len(prints)):
        if not np.array_equal(prints[r], ref):
            groups.setdefault(prints[r].tobytes(), []).append(r)
    out = []
    for ranks in groups.values():
        mine = prints[ranks[0]]
        what = []
        for i, (name, s) in enumerate(zip(FIELDS, _SLOTS)):
            if np.array_equal(mine[s], ref[s]):
                continue
            if i == _COUNT:
                name += f" ({_count(mine[s][0])} vs {_count(ref[s][0])})"
            elif i == _PBC:
                name += f" ({_pbc_text(mine[s][0])} vs {_pbc_text(ref[s][0])})"
            what.append(name)
        out.append((ranks, what))
    return out


def _count(v: int) -> str:
    return str(v) if v >= 0 else "not an array"


def _pbc_text(bits: int) -> str:
    return "unreadable" if bits < 0 else str(tuple(bool(bits >> k & 1) for k in range(3)))


def check_fingerprints(prints: np.ndarray, caller: str) -> None:
    """Raise `RankMismatchError` unless every rank's fingerprint (one row per rank) is rank 0's."""
    groups = differences(prints)
    if not groups:
        return
    parts = [f"{_ranks(ranks)} differ{'s' if len(ranks) == 1 else ''} from rank 0 in {', '.join(what)}"
             for ranks, what in groups[:_LIST_AT_MOST]]
    if len(groups) > _LIST_AT_MOST:
        parts.append(f"and {len(groups) - _LIST_AT_MOST} more groups of ranks")
    world = len(np.asarray(prints).reshape(-1, WIDTH))
    raise RankMismatchError(
        f"{caller}: the {world} ranks were not given the same structure: {'; '.join(parts)}. Every rank must "
        "pass the same global structure (positions, numbers, cell, pbc, and state= if given) to each "
        "evaluation; each computes its own atoms from it. Build or read it the same way on every rank (same "
        "file, same seed), or broadcast rank 0's, and move the atoms on every rank with the results of the "
        "evaluation (the same on every rank)."
    )


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


@functools.cache
def _gather_program(mesh: Any) -> Any:
    """A jitted program: each device's `(1, WIDTH)` int32 row -> every row, `(world, WIDTH)`, on each device."""
    import jax
    from jax.sharding import PartitionSpec as P

    from ..lower.mesh import mesh_axis

    axis = mesh_axis(mesh)
    gather = jax.shard_map(lambda x: jax.lax.all_gather(x, axis, tiled=True), mesh=mesh,
                           in_specs=P(axis), out_specs=P(axis))
    return jax.jit(gather)


def gather_fingerprints(mine: np.ndarray) -> np.ndarray:
    """Every rank's fingerprint, `(world, WIDTH)`, by rank (one all-gather over the front door's mesh)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..lower.mesh import mesh_axis
    from .plan_context import front_door_mesh

    mesh = front_door_mesh()
    world = mesh.devices.size
    here = jax.device_put(np.asarray(mine, np.int32).reshape(1, WIDTH), mesh.devices.flat[jax.process_index()])
    g = jax.make_array_from_single_device_arrays((world, WIDTH), NamedSharding(mesh, P(mesh_axis(mesh))), [here])
    return np.asarray(_gather_program(mesh)(g).addressable_data(0))


def check_same_structure(positions: Any, numbers: Any, cell: Any, pbc: Any, *, caller: str,
                         layout: Any = None) -> None:
    """Raise `RankMismatchError` on every rank unless every rank passed the same structure (and `layout`).

    A collective: every rank of the job calls it at the same point. Nothing is exchanged in a
    single-process job.

    Raises:
        RankMismatchError: names the ranks that differ from rank 0 and in what (atom count, atomic
            numbers, cell, pbc, positions, layout), and the fix.
    """
    import jax

    if jax.process_count() == 1:
        return
    check_fingerprints(gather_fingerprints(fingerprint(positions, numbers, cell, pbc, layout)), caller)
