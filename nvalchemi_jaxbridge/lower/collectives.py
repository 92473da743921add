"""Each transform as a function of one device's block, for use inside `jax.shard_map`.

All functions take local blocks (what one device sees inside
`shard_map(..., check_vma=True)` over `axis`) and the local view of the plan's
tables (`HaloTables` / `ShardTables` passed through `shard_map` with
`tables.specs(axis)`). The exchanges are linear maps whose transposes are
formed by JAX's autodiff (`ppermute` transposes to the inverse permutation,
gathers with `mode="fill"` to scatter-adds with `mode="drop"`), so `jax.grad`
of a forward exchange is exactly the hand-written reverse exchange below.

Table padding conventions (docs/design.md, "Exchange tables"): unused
`send_idx` entries are `owned_capacity` and unused `recv_slot` entries are
`halo_rows`; both are out of range, so padding gathers zeros and scatters
nothing. Owned-storage rows past `n_owned` are treated as zero everywhere.

Block path (`t.blocks`, every table from a layout `HaloPlan`): the rows one
device receives for one offset fill one contiguous run of halo rows, so the
receiver adds the whole message into rows `recv_start .. recv_start + cap` with
a `dynamic_update_slice` (and the reverse reads them back with a
`dynamic_slice`) instead of a scatter / gather by `recv_slot`. The sender orders
its rows by `send_block` so that each lands on its slot; the block's other rows
are padding entries and carry zeros, so adding them changes nothing (but the
sign of a zero), whatever the order of the offsets and wherever the block
overlaps other ghost groups.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .tables import HaloTables, ShardTables


def _perm(n_devices: int, k: int) -> list[tuple[int, int]]:
    """The ppermute pairs for rank offset `k`: device `d` sends to `(d + k) % D`."""
    return [(d, (d + k) % n_devices) for d in range(n_devices)]


def _inverse(n_devices: int, k: int) -> list[tuple[int, int]]:
    """The pairs of the reverse exchange for offset `k`: `(d + k) % D` sends back to `d`."""
    return [((d + k) % n_devices, d) for d in range(n_devices)]


def _send(x: jax.Array, axis: str, n_devices: int, pairs: list[tuple[int, int]]) -> jax.Array:
    """`ppermute`, skipped when every device sends to itself (offset 0: periodic self-images)."""
    if all(a == b for a, b in pairs):
        return x
    return jax.lax.ppermute(x, axis, perm=pairs)


def _mask_rows(x: jax.Array, mask: jax.Array) -> jax.Array:
    """`x` with the rows where `mask` is False set to zero."""
    return jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def _add_block(out: jax.Array, msg: jax.Array, start: jax.Array) -> jax.Array:
    """`out` with `msg` added into rows `start[0] ..`; the tables keep the block inside `out`."""
    at = (start[0],) + (jnp.zeros((), start.dtype),) * (out.ndim - 1)
    return jax.lax.dynamic_update_slice(out, jax.lax.dynamic_slice(out, at, msg.shape) + msg, at)


def _read_block(x: jax.Array, start: jax.Array, rows: int) -> jax.Array:
    """Rows `start[0] .. start[0] + rows` of `x`."""
    at = (start[0],) + (jnp.zeros((), start.dtype),) * (x.ndim - 1)
    return jax.lax.dynamic_slice(x, at, (rows,) + x.shape[1:])


def _check_rows(fn: str, x: jax.Array, rows: int, what: str) -> None:
    """Raise if the local block `x` does not have `rows` rows."""
    if x.ndim == 0 or x.shape[0] != rows:
        raise ValueError(
            f"{fn}: the local block has shape {tuple(x.shape)} but {what} has {rows} rows per device; "
            f"pass a global array of {rows} * n_devices rows sharded P(axis)."
        )


def halo_forward(x_owned: jax.Array, t: HaloTables, axis: str, *, positions: bool = False) -> jax.Array:
    """Owned storage -> halo storage: owners' rows copied into their neighbours' ghost rows.

    Args:
        x_owned: `(owned_capacity, *F)` local block; rows past `n_owned` are ignored.
        t: local view of the `HaloTables`.
        axis: the mesh axis name.
        positions: add `halo_offset` (periodic image shifts for ghosts, parking
            points for padding rows); the map stays linear in `x_owned`.

    Returns:
        `(halo_rows, *F)`: owned rows, ghost rows in their receive slots, zero padding.
    """
    _check_rows("halo_forward", x_owned, t.owned_capacity, "owned storage")
    zeros = jnp.zeros((t.ghost_capacity,) + x_owned.shape[1:], x_owned.dtype)
    out = jnp.concatenate([_mask_rows(x_owned, t.owned_mask), zeros], axis=0)
    if t.blocks:  # the shift goes in first: the blocks are added on top, in one pass with the copy
        if positions:
            out = out + t.halo_offset.astype(out.dtype)
        for k, send, start in zip(t.offsets, t.send_block, t.recv_start):
            msg = jnp.take(x_owned, send, axis=0, mode="fill", fill_value=0)
            out = _add_block(out, _send(msg, axis, t.n_devices, _perm(t.n_devices, k)), start)
        return out
    for k, send_idx, recv_slot in zip(t.offsets, t.send_idx, t.recv_slot):
        msg = jnp.take(x_owned, send_idx, axis=0, mode="fill", fill_value=0)
        msg = _send(msg, axis, t.n_devices, _perm(t.n_devices, k))
        out = out.at[recv_slot].add(msg, mode="drop")
    if positions:
        out = out + t.halo_offset.astype(out.dtype)
    return out


def halo_reverse(x_halo: jax.Array, t: HaloTables, axis: str) -> jax.Array:
    """Halo storage -> owned storage: each ghost row sent back and added into its owner row.

    The exact transpose of `halo_forward` (without the positions shift).

    Args:
        x_halo: `(halo_rows, *F)` local block.
        t: local view of the `HaloTables`.
        axis: the mesh axis name.

    Returns:
        `(owned_capacity, *F)`: own rows plus all ghost partials of them; padding rows zero.
    """
    _check_rows("halo_reverse", x_halo, t.halo_rows, "halo storage")
    out = _mask_rows(x_halo[: t.owned_capacity], t.owned_mask)
    if t.blocks:
        for k, send, start, cap in zip(t.offsets, t.send_block, t.recv_start, t.pair_capacities):
            msg = _send(_read_block(x_halo, start, cap), axis, t.n_devices, _inverse(t.n_devices, k))
            out = out.at[send].add(msg, mode="drop")
        return out
    for k, send_idx, recv_slot in zip(t.offsets, t.send_idx, t.recv_slot):
        msg = jnp.take(x_halo, recv_slot, axis=0, mode="fill", fill_value=0)
        msg = _send(msg, axis, t.n_devices, _inverse(t.n_devices, k))
        out = out.at[send_idx].add(msg, mode="drop")
    return out


def halo_scatter(x_halo: jax.Array, t: HaloTables, axis: str) -> jax.Array:
    """ScatterOutputs: reverse then forward exchange; self-adjoint.

    Owned rows get the owner's partial plus every borrower's ghost partial;
    ghost rows get the owner's corrected total; padding rows are zero.
    """
    return halo_forward(halo_reverse(x_halo, t, axis), t, axis)


def slice_owned(x_halo: jax.Array, t: HaloTables) -> jax.Array:
    """SliceOwned: halo storage -> the first `owned_capacity` rows, rows past `n_owned` zeroed."""
    _check_rows("slice_owned", x_halo, t.halo_rows, "halo storage")
    return _mask_rows(x_halo[: t.owned_capacity], t.owned_mask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _psum_replicated(x: jax.Array, axis: str) -> jax.Array:
    """psum whose result stays varying and whose adjoint is the identity."""
    return jax.lax.pcast(jax.lax.psum(x, axis), axis, to="varying")


def _psum_replicated_fwd(x: jax.Array, axis: str) -> tuple[jax.Array, None]:
    return _psum_replicated(x, axis), None


def _psum_replicated_bwd(axis: str, _: None, ct: jax.Array) -> tuple[jax.Array]:
    return (ct,)


_psum_replicated.defvjp(_psum_replicated_fwd, _psum_replicated_bwd)


def all_reduce_sum(x: jax.Array, axis: str, *, replicated_consumer: bool = False) -> jax.Array:
    """AllReduceSum: the sum of every device's partial `x`.

    Args:
        x: this device's partial (any shape).
        axis: the mesh axis name.
        replicated_consumer: `False` (default): a `psum` with an invariant
            result (usable with `out_specs=P()`); its adjoint hands the
            cotangent to every partial, and per-device cotangents of a
            replicated consumer are summed across devices. `True`: every
            device holds a copy (varying) that feeds a replicated computation
            whose cotangent is already global on each device, so the adjoint
            passes it through unchanged instead of summing it again.

    Returns:
        The global sum, same shape as `x`.
    """
    if replicated_consumer:
        return _psum_replicated(x, axis)
    return jax.lax.psum(x, axis)


def gather_full(x_local: jax.Array, t: ShardTables, axis: str) -> jax.Array:
    """GatherInputsFull: `(owned_capacity + k, *F)` -> `(n_global + k, *F)` in global-ID order.

    The first `owned_capacity` local rows are all-gathered and reordered by
    global ID; the `k` trailing local rows (the "+1" pad row) are kept as they
    are, so index `n_global` still hits the pad row. The adjoint (autodiff) is a
    reduce-scatter of the gathered rows' cotangent back to their owners.
    """
    if x_local.ndim == 0 or x_local.shape[0] < t.owned_capacity:
        raise ValueError(
            f"gather_full: the local block has shape {tuple(x_local.shape)} but sharded storage "
            f"needs at least owned_capacity={t.owned_capacity} rows per device (plus trailing pad rows)."
        )
    owned = x_local[: t.owned_capacity]
    every = jax.lax.all_gather(owned, axis, tiled=True)
    full = jnp.take(every, t.gather_index, axis=0, mode="fill", fill_value=0)
    return jnp.concatenate([full, x_local[t.owned_capacity:]], axis=0)


def slice_outputs_owned(x_full: jax.Array, t: ShardTables, axis: str) -> jax.Array:
    """SliceOutputsOwned: `(n_global + k, *F)` -> `(owned_capacity + k, *F)`: this device's rows.

    Rows are looked up by this device's owned global IDs (any assignment, not
    only contiguous blocks); padding rows are zero; the `k` trailing rows (from
    `n_global` on) are kept. Adjoint: zero for other devices' rows. `axis` is
    accepted for symmetry with the other transforms; no communication happens.
    """
    del axis
    if x_full.ndim == 0 or x_full.shape[0] < t.n_global:
        raise ValueError(
            f"slice_outputs_owned: the kernel output has shape {tuple(x_full.shape)} but must have at "
            f"least n_global={t.n_global} rows (global-ID order, then trailing pad rows)."
        )
    mine = jnp.take(x_full[: t.n_global], t.owned_global, axis=0, mode="fill", fill_value=0)
    return jnp.concatenate([mine, x_full[t.n_global:]], axis=0)
