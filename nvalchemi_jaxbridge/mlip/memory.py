"""A model's layout budget: how much memory one device's block may take, and the estimate checked before building.

`memory_budget=` of `DistributedMLIP` / `TorchDistributedMLIP` is in bytes per device. The default
is `budget.DEFAULT_FRACTION` (half) of what each device has, or `budget.MEASURED_FRACTION` (80 %) with
`tiles="auto"`, whose model cost is measured: a GPU's memory limit, or on the CPU
the host's available memory shared by its devices (virtual CPU devices of one process, or the
processes of one host on the PyTorch door, `LOCAL_WORLD_SIZE`). The layout is refused (with its
numbers and the fix) when its estimate, its rows, or its edges would cost more
(`layout.budget`): per-layer exchange, more devices, or a larger budget where the memory is there.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..layout import budget as B
from ..layout.grid import choose_grid
from ..layout.partition import effective_cell


def device_bytes(devices: Sequence[Any], processes_per_host: int = 1) -> float:
    """Memory each of `devices` (JAX devices, all of one kind) can use: a GPU's limit, or its share of the host."""
    first = devices[0]
    if first.platform != "cpu":
        stats = first.memory_stats() or {}
        if stats.get("bytes_limit"):
            return float(stats["bytes_limit"])
    local = sum(1 for d in devices if d.process_index == first.process_index)
    return B.host_available_bytes() / max(local * processes_per_host, 1)


def check_argument(memory_budget: Any, where: str) -> None:
    """Raise unless `memory_budget` is None or a number of bytes > 0."""
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(
            memory_budget, (int, float, np.integer, np.floating)) or not memory_budget > 0):
        raise ValueError(
            f"{where}: memory_budget must be a number of bytes per device > 0, or None for half of each device's "
            f"memory; got {memory_budget!r}."
        )


def model_budget(memory_budget: Any, exchange: str, devices: Sequence[Any], where: str,
                 processes_per_host: int | None = None, *, measured: bool = False) -> B.MemoryBudget:
    """The budget of a model's layouts: `memory_budget` bytes per device, or the default share of `devices`' memory
    (`measured`: the model's cost is measured, `tiles="auto"`, and the larger share applies).

    Raises:
        ValueError: `memory_budget` is not a number > 0 (or None).
    """
    check_argument(memory_budget, where)
    if processes_per_host is None:
        processes_per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    default = memory_budget is None
    fraction = B.MEASURED_FRACTION if measured else B.DEFAULT_FRACTION
    value = fraction * device_bytes(devices, processes_per_host) if default else float(memory_budget)
    fix = ("use exchange='per_layer' (a halo of one cutoff instead of n_layers cutoffs, same numbers), more "
           "devices, " if exchange == "deep_halo" else "use more devices, ")
    given = f"the default is {_share(fraction)} of each device's memory" if default else "it was given"
    fix += f"or, where the memory is there, a larger memory_budget= (bytes per device; {given})"
    return B.MemoryBudget(value, fix)


def _share(fraction: float) -> str:
    """A default share in words, as messages say it."""
    return "half" if fraction == 0.5 else f"{fraction:.0%}"


def check_estimate(wrapper: Any, exchange: str, positions: np.ndarray, cell: np.ndarray,
                   periodic: tuple[bool, bool, bool], n_devices: int, skin: float, budget: B.MemoryBudget) -> None:
    """Refuse, before any table is built, a layout whose estimated rows and edges per device exceed `budget`."""
    basis = effective_cell(cell, periodic, positions)
    grid = choose_grid(n_devices, basis, periodic)
    depth = wrapper.cutoff if exchange == "per_layer" else wrapper.n_layers * wrapper.cutoff
    receive = None if exchange == "per_layer" else (wrapper.n_layers - 1) * wrapper.cutoff + skin
    est = B.estimate(positions, basis, periodic, grid, depth + skin, wrapper.cutoff + skin, receive)
    budget.check(f"{wrapper.name} ({exchange}, {n_devices} devices)", est.rows, est.edges, estimated=True)


TABLE_BYTES_PER_ROW = 64
"""Bytes a row of a block evaluated in tiles keeps outside the tiles (positions, attributes, their gradients)."""

TABLE_BYTES_PER_EDGE = 112
"""Bytes an edge of a block evaluated in tiles keeps outside the tiles: the block's edge, shift and spare, the
shift's gradient, and the tile tables' entries (an edge lies in about two tiles)."""


def tables_budget(budget: B.MemoryBudget, tiles: int) -> B.MemoryBudget:
    """`budget` for the block's tables alone: with tiles, a block's evaluation holds one tile's intermediates."""
    return dataclasses.replace(
        budget, bytes_per_row=TABLE_BYTES_PER_ROW, bytes_per_edge=TABLE_BYTES_PER_EDGE,
        fix=f"use more devices (the block's tables alone do not fit, whatever the tiles; tiles={tiles}), " + budget.fix)


def check_tiles_fit(budget: B.MemoryBudget, tiles: Any, where: str) -> None:
    """Refuse, before the first evaluation, tiles whose largest one costs more than `budget` (the fix: more tiles)."""
    cost = budget.cost(tiles.n_rows, tiles.n_edges)
    d, t = np.unravel_index(int(np.argmax(cost)), cost.shape)
    more = dataclasses.replace(budget, fix=f"use more tiles (tiles={2 * tiles.n_tiles} or more), " + budget.fix)
    more.check(where, int(tiles.n_rows[d, t]), int(tiles.n_edges[d, t]), estimated=False,
               detail=f"; its largest tile, tile {t} of device {d}, of {tiles.n_tiles} tiles")
