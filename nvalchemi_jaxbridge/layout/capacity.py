"""Static capacities: how one is chosen, how it grows, and the record of each growth (numpy only).

XLA programs are compiled for fixed row counts, so every growth of a capacity
compiles the programs again. Growth is therefore geometric, not to the row: a
capacity that no longer fits becomes `max(ceil(needed * headroom), ceil(old *
GROWTH))`, and when one capacity of a layout grows, every other one that has
used part of its headroom is grown with it (that compilation is paid anyway).

When a growth follows a change of the cell, every capacity grows (all counts scale with the
density). `BFGS` under `FrechetCellFilter` shrinking a 108-atom cell by 12 % on 8
devices (1.5x the ghost rows, 2.1x the edges) then compiles 3 times instead of 20.

Each growth is logged once at INFO (logger `nvalchemi_jaxbridge.layout.capacity`)
with its capacities `old -> new`; a `GrowthLog` (one per model or potential)
warns once when a run has grown more than `WARN_AFTER` times, naming `headroom`.
"""

from __future__ import annotations

import dataclasses
import logging
import math

_log = logging.getLogger(__name__)

#: Factor a capacity grows by, at least, when it no longer fits (measured in benchmarks/RESULTS.md).
GROWTH = 1.5
#: Growths of one model or potential after which `GrowthLog` warns (each one compiles the programs again).
WARN_AFTER = 3


def fitted(needed: int, headroom: float) -> int:
    """Capacity for `needed` rows with relative `headroom` (never less than `needed`)."""
    return max(needed, math.ceil(needed * headroom))


def regrown(old: int, fresh: int) -> int:
    """A grown capacity: the one chosen afresh for what is needed now (`fresh`), and at least `GROWTH` x `old`."""
    return max(fresh, math.ceil(old * GROWTH))


@dataclasses.dataclass(frozen=True)
class Growth:
    """One capacity grown by a re-plan: its name, the rows it had and has, the rows now needed."""

    name: str
    old: int
    new: int
    needed: int

    def __str__(self) -> str:
        return f"{self.name} {self.old} -> {self.new} (needs {self.needed})"


def describe(growth: tuple[Growth, ...]) -> str:
    """`"ghost_capacity 41 -> 62 (needs 45), edge_capacity ..."`."""
    return ", ".join(str(g) for g in growth)


def log_growth(where: str, growth: tuple[Growth, ...]) -> None:
    """The INFO line of one growth (nothing when `growth` is empty)."""
    if growth:
        _log.info("%s: capacities grew: %s; the programs compiled for the old capacities compile again once",
                  where, describe(growth))


class GrowthLog:
    """The growths of one model or potential: each logged once at INFO, a warning once past `WARN_AFTER`.

    Attributes:
        events: growths recorded so far (each compiled the programs again).
        history: every `Growth` recorded, in order.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.events = 0
        self.history: list[Growth] = []
        self._warned = False

    def record(self, growth: tuple[Growth, ...], headroom: float, *, logged: bool = False) -> None:
        """Count and log one re-plan's `growth` (`logged`: its INFO line was already written, e.g. by
        `HaloPlan.rebuild`)."""
        if not growth:
            return
        self.events += 1
        self.history.extend(growth)
        if not logged:
            log_growth(self.where, growth)
        if self.events > WARN_AFTER and not self._warned:
            self._warned = True
            _log.warning(
                "%s: the capacities have grown %d times (each growth compiles the programs again); the "
                "structure outgrows headroom=%g, e.g. a cell that shrinks under a cell filter. Pass a larger "
                "headroom= to the model or potential (e.g. 2.0 under a cell filter).",
                self.where, self.events, headroom)
