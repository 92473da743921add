"""A plan's exchange tables as sharded `jax.Array`s: one pytree per plan, data not code.

Every per-device table is stored flat and sharded row-wise, `P(axis)`, so that
inside `shard_map` each device sees exactly its own table (e.g. `send_idx[j]`
is `(pair_capacities[j],)` locally). Capacities and offsets are static aux
data: two plans with equal aux data give tables of equal type, and a compiled
program built for one runs on the other without retracing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .mesh import mesh_axis


@dataclasses.dataclass(frozen=True)
class HaloTables:
    """Halo exchange tables of a `HaloPlan`, sharded over the mesh axis.

    Global shapes (D devices; local blocks are these divided by D on axis 0):
    `send_idx[j]`, `recv_slot[j]`: `(D * pair_capacities[j],)` int32;
    `halo_offset`: `(D * halo_rows, 3)`; `owned_offset`: `(D * owned_capacity, 3)`;
    `owned_mask`: `(D * owned_capacity,)` bool; `halo_owned_mask`: `(D * halo_rows,)` bool;
    `n_owned`, `n_ghost`: `(D,)` int32.

    Block tables (docs/design.md, "Exchange tables"), present when `blocks` is
    True: `recv_start[j]`: `(D,)` int32, the halo row where device `d` adds the
    whole `pair_capacities[j]`-row message of offset `offsets[j]`, chosen so the
    block never runs past `halo_rows`; `send_block[j]`: `(D * pair_capacities[j],)`
    int32, the sender's rows in the order that puts each received row on its
    slot (padding `owned_capacity`). They are built by `device_tables` when every
    message lands in one contiguous run of halo rows (always so for a layout
    `HaloPlan`); otherwise `blocks` is False and the exchanges scatter by `recv_slot`.
    """

    send_idx: tuple[jax.Array, ...]
    recv_slot: tuple[jax.Array, ...]
    halo_offset: jax.Array
    owned_offset: jax.Array
    owned_mask: jax.Array
    halo_owned_mask: jax.Array
    n_owned: jax.Array
    n_ghost: jax.Array
    n_devices: int
    owned_capacity: int
    ghost_capacity: int
    offsets: tuple[int, ...]
    pair_capacities: tuple[int, ...]
    recv_start: tuple[jax.Array, ...] = ()
    send_block: tuple[jax.Array, ...] = ()
    blocks: bool = False

    def __post_init__(self):
        if self.blocks and not (len(self.recv_start) == len(self.send_block) == len(self.offsets)):
            raise ValueError(
                f"HaloTables: blocks=True needs one recv_start and one send_block per offset "
                f"({len(self.offsets)}), got {len(self.recv_start)} and {len(self.send_block)}; "
                "build the tables with device_tables(plan, mesh)."
            )

    @property
    def halo_rows(self) -> int:
        """Rows of one device's halo block: owned capacity plus ghost capacity."""
        return self.owned_capacity + self.ghost_capacity

    @property
    def static_key(self) -> tuple:
        """What a compiled program depends on: capacities and offsets, not table contents."""
        return ("halo", self.n_devices, self.owned_capacity, self.ghost_capacity,
                self.offsets, self.pair_capacities, self.blocks)

    def specs(self, axis: str) -> HaloTables:
        """The same pytree with a `PartitionSpec` in place of every array (for `in_specs`)."""
        s = P(axis)
        return dataclasses.replace(
            self, send_idx=tuple(s for _ in self.send_idx), recv_slot=tuple(s for _ in self.recv_slot),
            recv_start=tuple(s for _ in self.recv_start), send_block=tuple(s for _ in self.send_block),
            halo_offset=s, owned_offset=s, owned_mask=s, halo_owned_mask=s, n_owned=s, n_ghost=s)


@dataclasses.dataclass(frozen=True)
class ShardTables:
    """Routing tables of a `ShardPlan` (sharded storage, one block per device).

    `gather_index`: `(n_global,)` int32, replicated: row of global ID `g` in the
    `all_gather` of the owned blocks (`owner[g] * owned_capacity + local_index[g]`).
    `owned_global`: `(D * owned_capacity,)` int32, sharded: global ID of each
    owned row; padding rows hold `PAD_ID` (int32 max, out of range of any block).
    `n_owned`: `(D,)` int32, sharded.
    """

    gather_index: jax.Array
    owned_global: jax.Array
    n_owned: jax.Array
    n_devices: int
    n_global: int
    owned_capacity: int

    @property
    def static_key(self) -> tuple:
        """What a compiled program depends on: device count, global rows and capacity."""
        return ("shard", self.n_devices, self.n_global, self.owned_capacity)

    def specs(self, axis: str) -> ShardTables:
        """The same pytree with a `PartitionSpec` in place of every array (for `in_specs`)."""
        return dataclasses.replace(self, gather_index=P(), owned_global=P(axis), n_owned=P(axis))


jax.tree_util.register_dataclass(
    HaloTables,
    data_fields=["send_idx", "recv_slot", "halo_offset", "owned_offset", "owned_mask",
                 "halo_owned_mask", "n_owned", "n_ghost", "recv_start", "send_block"],
    meta_fields=["n_devices", "owned_capacity", "ghost_capacity", "offsets", "pair_capacities", "blocks"],
)
jax.tree_util.register_dataclass(
    ShardTables,
    data_fields=["gather_index", "owned_global", "n_owned"],
    meta_fields=["n_devices", "n_global", "owned_capacity"],
)

Tables = HaloTables | ShardTables

PAD_ID = np.iinfo(np.int32).max


def is_halo_plan(plan: Any) -> bool:
    """Whether `plan` looks like a `HaloPlan` (has halo exchange tables)."""
    return all(hasattr(plan, f) for f in ("send_idx", "recv_slot", "halo_offset", "ghost_capacity"))


def is_shard_plan(plan: Any) -> bool:
    """Whether `plan` looks like a `ShardPlan` (owner / local-index routing)."""
    return all(hasattr(plan, f) for f in ("owner", "local_index", "owned_global", "n_global"))


def place(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global numpy array as a `jax.Array` with `sharding`; works under `jax.distributed`."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def device_tables(plan: Any, mesh: Mesh, *, blocks: bool | None = None) -> Tables:
    """A plan's tables as sharded `jax.Array`s on `mesh` (`HaloTables` or `ShardTables`).

    Args:
        plan: a `HaloPlan` or `ShardPlan` from the layout layer, built for as
            many devices as the mesh has (or an object with the same fields).
        mesh: a 1-D mesh from `make_mesh`.
        blocks: halo plans only. Whether the exchanges move each message as one
            block of halo rows (`HaloTables.blocks`). `None` (default): yes for a
            layout `HaloPlan` whose pair capacities do not exceed `halo_rows`,
            no for other objects, so that every plan of one static shape gives
            tables of one pytree type; `True`: required (raises if a message
            does not land in one contiguous run); `False`: scatter by `recv_slot`.

    Returns:
        `HaloTables` for a halo plan, `ShardTables` for a shard plan.

    Raises:
        TypeError: `plan` is neither kind, or `blocks` is given for a shard plan.
        ValueError: the plan's device count differs from the mesh's, a table
            has the wrong shape, or block tables were asked for and cannot be built.
    """
    axis = mesh_axis(mesh)
    d = int(mesh.shape[axis])
    if is_halo_plan(plan):
        kind = "HaloPlan"
    elif is_shard_plan(plan):
        kind = "ShardPlan"
    else:
        raise TypeError(
            f"device_tables: expected a HaloPlan or ShardPlan, got {type(plan).__name__}; "
            "build one with nvalchemi_jaxbridge.layout."
        )
    if int(plan.n_devices) != d:
        raise ValueError(
            f"device_tables: the {kind} was built for {plan.n_devices} devices but the mesh has {d}; "
            f"build the mesh with make_mesh({plan.n_devices}) or re-plan for {d} devices."
        )
    sharded = NamedSharding(mesh, P(axis))
    if kind == "ShardPlan":
        if blocks is not None:
            raise TypeError(
                f"device_tables: blocks={blocks!r} applies to halo plans only, got a ShardPlan; leave it out."
            )
        return _shard_tables(plan, d, mesh, sharded)
    return _halo_tables(plan, d, sharded, blocks)


def _flat(name: str, a: Any, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """`a` checked to have `shape`, cast to `dtype` without loss, and merged on its first two axes."""
    a = np.asarray(a)
    if a.shape != shape:
        raise ValueError(f"device_tables: plan.{name} has shape {a.shape}, expected {shape}.")
    if np.issubdtype(np.dtype(dtype), np.integer) and a.size and (
        a.min() < np.iinfo(dtype).min or a.max() > np.iinfo(dtype).max
    ):
        raise ValueError(f"device_tables: plan.{name} has values outside {np.dtype(dtype)}.")
    return a.astype(dtype).reshape((shape[0] * shape[1],) + shape[2:])


def _halo_tables(plan: Any, d: int, sharded: NamedSharding, blocks: bool | None) -> HaloTables:
    """HaloTables from a HaloPlan."""
    oc, gc = int(plan.owned_capacity), int(plan.ghost_capacity)
    hr = oc + gc
    if int(plan.halo_rows) != hr:
        raise ValueError(f"device_tables: plan.halo_rows={plan.halo_rows} != owned_capacity + ghost_capacity = {hr}.")
    offsets = tuple(int(k) for k in plan.offsets)
    caps = tuple(int(c) for c in plan.pair_capacities)
    if not (len(offsets) == len(caps) == len(plan.send_idx) == len(plan.recv_slot)):
        raise ValueError(
            f"device_tables: plan.offsets ({len(offsets)}), pair_capacities ({len(caps)}), send_idx "
            f"({len(plan.send_idx)}) and recv_slot ({len(plan.recv_slot)}) must have one entry per offset."
        )
    fdt = np.asarray(plan.halo_offset).dtype
    i32 = np.int32
    put = lambda a: place(a, sharded)  # noqa: E731
    sends = [_flat("send_idx", s, (d, c), i32).reshape(d, c) for s, c in zip(plan.send_idx, caps)]
    recvs = [_flat("recv_slot", r, (d, c), i32).reshape(d, c) for r, c in zip(plan.recv_slot, caps)]
    if blocks is None:
        from ..layout.halo_plan import HaloPlan

        blocks = isinstance(plan, HaloPlan) and all(c <= hr for c in caps)
        where = "the HaloPlan's tables break the layout's contiguous ghost groups (a bug; please report it)"
    else:
        where = "device_tables(blocks=True)"
    made = _block_tables(sends, recvs, offsets, d, oc, hr) if blocks else None
    if isinstance(made, str):
        raise ValueError(f"{where}: {made}; pass blocks=False to exchange by scattering into recv_slot.")
    return HaloTables(
        send_idx=tuple(put(s.ravel()) for s in sends),
        recv_slot=tuple(put(r.ravel()) for r in recvs),
        recv_start=tuple(put(st) for st, _ in made or ()),
        send_block=tuple(put(sb.ravel()) for _, sb in made or ()),
        blocks=made is not None,
        halo_offset=put(_flat("halo_offset", plan.halo_offset, (d, hr, 3), fdt)),
        owned_offset=put(_flat("owned_offset", plan.owned_offset, (d, oc, 3), fdt)),
        owned_mask=put(_flat("owned_mask", plan.owned_mask, (d, oc), bool)),
        halo_owned_mask=put(_flat("halo_owned_mask", plan.halo_owned_mask, (d, hr), bool)),
        n_owned=put(np.asarray(plan.n_owned, dtype=i32).reshape(d)),
        n_ghost=put(np.asarray(plan.n_ghost, dtype=i32).reshape(d)),
        n_devices=d, owned_capacity=oc, ghost_capacity=gc, offsets=offsets, pair_capacities=caps,
    )


def _block_tables(
    sends: list[np.ndarray], recvs: list[np.ndarray], offsets: tuple[int, ...], d: int, oc: int, hr: int
) -> list[tuple[np.ndarray, np.ndarray]] | str:
    """Per offset `(recv_start (D,), send_block (D, cap))`, or why a message is not one block.

    A message entry moves a row only when its send index is in `[0, oc)` and its
    slot in `[0, hr)` (other entries gather zero or are dropped). If the slots
    that move rows are distinct and consecutive, from `lo`, the receiver adds the
    whole message block at `start = min(lo, hr - cap)` (so the block ends inside
    the halo rows), and the sender puts the row for slot `start + i` at position
    `i`, padding elsewhere: the other block rows carry zeros and add nothing.
    """
    out = []
    for k, send, recv in zip(offsets, sends, recvs):
        cap = send.shape[1]
        if cap > hr:
            return f"offset {k} has pair capacity {cap} > halo_rows={hr}, so its block does not fit"
        if (send < 0).any() or (recv < 0).any():
            return f"offset {k} has negative send_idx / recv_slot entries (padding is owned_capacity / halo_rows)"
        start = np.zeros(d, np.int32)
        block = np.full((d, cap), oc, np.int32)
        for dst in range(d):
            src = (dst - k) % d
            moves = (send[src] < oc) & (recv[dst] < hr)
            rows, slots = send[src][moves], recv[dst][moves]
            if slots.size == 0:
                continue
            lo = int(slots.min())
            if int(slots.max()) - lo + 1 != slots.size or np.unique(slots).size != slots.size:
                return (f"device {dst} receives the rows of offset {k} into halo rows {sorted(slots.tolist())[:8]}"
                        f"{'...' if slots.size > 8 else ''}, not one run of distinct consecutive rows")
            start[dst] = min(lo, hr - cap)
            block[src, slots - start[dst]] = rows
        out.append((start, block))
    return out


def _shard_tables(plan: Any, d: int, mesh: Mesh, sharded: NamedSharding) -> ShardTables:
    """ShardTables from a ShardPlan."""
    oc, ng = int(plan.owned_capacity), int(plan.n_global)
    owner = np.asarray(plan.owner, dtype=np.int64).reshape(ng)
    local = np.asarray(plan.local_index, dtype=np.int64).reshape(ng)
    if ng and (owner.min() < 0 or owner.max() >= d or local.min() < 0 or local.max() >= oc):
        raise ValueError(
            f"device_tables: ShardPlan.owner must lie in [0, {d}) and local_index in [0, {oc}) "
            "(owned_capacity); rebuild the plan."
        )
    owned_global = _flat("owned_global", plan.owned_global, (d, oc), np.int64)
    owned_global = np.where(owned_global < 0, PAD_ID, owned_global)  # -1 would wrap around in jnp.take
    return ShardTables(
        gather_index=place((owner * oc + local).astype(np.int32), NamedSharding(mesh, P())),
        owned_global=place(owned_global.astype(np.int32), sharded),
        n_owned=place(np.asarray(plan.n_owned, dtype=np.int32).reshape(d), sharded),
        n_devices=d, n_global=ng, owned_capacity=oc,
    )
