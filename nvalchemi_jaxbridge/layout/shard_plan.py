"""ShardPlan: which device owns which global row under PlainShard storage (numpy only)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .inputs import headroom as headroom_number
from .inputs import positive_int

_INT32_MAX = np.iinfo(np.int32).max


def _readonly(a: np.ndarray) -> np.ndarray:
    """`a`, made read-only (plans are immutable)."""
    a.setflags(write=False)
    return a


@dataclasses.dataclass(frozen=True, eq=False)
class ShardPlan:
    """Owner and local row of every global row, for sharded (`PlainShard`) storage.

    Owned storage holds `owned_capacity` rows per device, real rows first in
    ascending global id, then zero padding; `to_owned` appends `pad_rows`
    trailing "+1" pad rows to each block (the AIMNet2 convention).

    Attributes:
        n_devices: number of devices (ranks).
        n_global: number of global rows (atoms).
        owner: `(N,)` int32 rank owning each global row.
        local_index: `(N,)` int32 row of each global row in its owner's block.
        n_owned: `(D,)` int32 rows owned per device.
        owned_capacity: static rows per device (>= max n_owned, >= 1).
        owned_global: `(D, owned_capacity)` int64 global id per owned row, -1 for padding.
    """

    n_devices: int
    n_global: int
    owner: np.ndarray
    local_index: np.ndarray
    n_owned: np.ndarray
    owned_capacity: int
    owned_global: np.ndarray

    @classmethod
    def from_assignment(
        cls,
        assignment: np.ndarray,
        n_devices: int | None = None,
        owned_capacity: int | None = None,
        headroom: float = 1.0,
    ) -> ShardPlan:
        """Plan from the rank of every global row; local rows keep ascending global-id order.

        Args:
            assignment: `(N,)` integer rank per global row (any assignment, not only blocks).
            n_devices: number of devices; default `max(assignment) + 1`.
            owned_capacity: fixed rows per device; default `ceil(headroom * max n_owned)`.
            headroom: relative spare rows when the capacity is chosen (>= 1).

        Returns:
            The plan.

        Raises:
            TypeError: `n_devices` is not an int, or `headroom` not a real number (a bool is neither).
            ValueError: a rank out of range, a non-integer assignment, or a capacity too small
                (the message gives the capacity that fits).
        """
        a = np.asarray(assignment)
        if a.ndim != 1 or not (np.issubdtype(a.dtype, np.integer) or a.size == 0):
            raise ValueError(
                f"ShardPlan.from_assignment: assignment must be a 1-D integer array (rank per global row), "
                f"got {a.dtype} {a.shape}."
            )
        a = a.astype(np.int64)
        if n_devices is None:
            n_devices = int(a.max()) + 1 if a.size else 1
        n_devices = positive_int("ShardPlan.from_assignment", "n_devices", n_devices)
        if (bad := np.flatnonzero((a < 0) | (a >= n_devices))).size:
            raise ValueError(
                f"ShardPlan.from_assignment: global rows {bad[:5].tolist()} are assigned ranks "
                f"{a[bad[:5]].tolist()} outside [0, {n_devices}); pass n_devices or fix the assignment."
            )
        if a.size > _INT32_MAX:
            raise ValueError(f"ShardPlan: {a.size} global rows do not fit int32 row indices.")
        headroom = headroom_number("ShardPlan.from_assignment", headroom)
        n_owned = np.bincount(a, minlength=n_devices)
        needed = max(int(n_owned.max(initial=0)), 1)
        if owned_capacity is None:
            owned_capacity = max(math.ceil(needed * headroom), needed)
        elif isinstance(owned_capacity, bool) or not isinstance(owned_capacity, (int, np.integer)):
            raise ValueError(f"ShardPlan: owned_capacity must be an int, got {owned_capacity!r}.")
        elif owned_capacity < needed:
            rank = int(np.argmax(n_owned))
            raise ValueError(
                f"ShardPlan: owned_capacity={owned_capacity} is too small: rank {rank} owns {needed} rows; "
                f"pass owned_capacity={needed} or more (or leave it None)."
            )
        order = np.argsort(a, kind="stable")
        starts = np.cumsum(n_owned) - n_owned
        local = np.empty(a.size, dtype=np.int64)
        local[order] = np.arange(a.size) - starts[a[order]]
        owned_global = np.full((n_devices, int(owned_capacity)), -1, dtype=np.int64)
        owned_global[a, local] = np.arange(a.size)
        return cls(
            n_devices=int(n_devices), n_global=int(a.size), owner=_readonly(a.astype(np.int32)),
            local_index=_readonly(local.astype(np.int32)), n_owned=_readonly(n_owned.astype(np.int32)),
            owned_capacity=int(owned_capacity), owned_global=_readonly(owned_global),
        )

    @classmethod
    def contiguous(cls, n_global: int, n_devices: int) -> ShardPlan:
        """Blocks of consecutive global ids in rank order, sizes differing by at most one."""
        if isinstance(n_global, bool) or not isinstance(n_global, (int, np.integer)) or n_global < 0:
            raise ValueError(f"ShardPlan.contiguous: n_global must be an int >= 0, got {n_global!r}.")
        if isinstance(n_devices, bool) or not isinstance(n_devices, (int, np.integer)) or n_devices < 1:
            raise ValueError(f"ShardPlan.contiguous: n_devices must be an int >= 1, got {n_devices!r}.")
        return cls.from_assignment(np.arange(n_global) * n_devices // max(n_global, 1), n_devices=n_devices)

    @property
    def owned_mask(self) -> np.ndarray:
        """`(D, owned_capacity)` True on real owned rows."""
        return self.owned_global >= 0

    def to_owned(self, x_global: np.ndarray, pad_rows: int = 1) -> np.ndarray:
        """`(N, ...)` values as owned storage `(D * (owned_capacity + pad_rows), ...)`, padding zero."""
        x = np.asarray(x_global)
        if x.ndim == 0 or x.shape[0] != self.n_global:
            raise ValueError(f"ShardPlan.to_owned: expected {self.n_global} rows (one per global id), got {x.shape}.")
        if pad_rows < 0:
            raise ValueError(f"ShardPlan.to_owned: pad_rows must be >= 0, got {pad_rows}.")
        out = np.zeros((self.n_devices, self.owned_capacity + pad_rows, *x.shape[1:]), dtype=x.dtype)
        mask = self.owned_mask
        out[:, : self.owned_capacity][mask] = x[self.owned_global[mask]]
        return out.reshape(-1, *x.shape[1:])

    def from_owned(self, x_owned: np.ndarray, pad_rows: int = 1) -> np.ndarray:
        """Owned storage `(D * (owned_capacity + pad_rows), ...)` back to `(N, ...)` in global-id order."""
        x = np.asarray(x_owned)
        rows = self.owned_capacity + pad_rows
        if pad_rows < 0 or x.ndim == 0 or x.shape[0] != self.n_devices * rows:
            raise ValueError(
                f"ShardPlan.from_owned: expected D * (owned_capacity + pad_rows) = {self.n_devices} * {rows} rows, "
                f"got shape {x.shape}; pass the pad_rows used in to_owned."
            )
        x = x.reshape(self.n_devices, rows, *x.shape[1:])
        return x[self.owner, self.local_index]
