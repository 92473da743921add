"""A block's node energies computed tile by tile (`tiles.TilePlan`), inside a device's program.

The tiles run one after another (`lax.scan`), each as the model's `whole` op on its own rows and
edges, so only one tile's intermediates are alive at a time. Differentiated, each tile's forward
and backward run together in its turn and its gradients are added into the block's rows and
edges, so a tile's edge-level tensors die with its turn and nothing is computed twice:
`tiled_node_energies` is a `custom_vjp` whose forward keeps the block gradients of the owned
atoms' summed energy. The backward scales them, when the cotangent is the same on every owned
row (an energy, the only thing forces and stress differentiate); any other cotangent (a weighted
sum of atomic energies) runs every tile's backward again with it, so every derivative is exact.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class TileArrays:
    """One device's tile tables as local arrays (`T` tiles), from `TilePlan` (see there)."""

    rows: jax.Array  # (T, Rc) int32
    owned: jax.Array  # (T, Rc) bool
    edges: jax.Array  # (T, Ec, 2) int32
    edge_ids: jax.Array  # (T, Ec) int32
    valid: jax.Array  # (T, Ec) bool
    spare: jax.Array  # (T, Ec) int32


jax.tree_util.register_dataclass(TileArrays, data_fields=["rows", "owned", "edges", "edge_ids", "valid", "spare"],
                                 meta_fields=[])


def tile_arrays(tiles: Any, sharding: Any) -> TileArrays:
    """A `tiles.TilePlan`'s tables as `(D * T, ...)` device arrays placed with `sharding` (rows on the mesh axis)."""
    from ..lower.tables import place

    d, t = tiles.rows.shape[:2]

    def put(x: np.ndarray) -> jax.Array:
        return place(np.ascontiguousarray(x.reshape((d * t,) + x.shape[2:])), sharding)

    return TileArrays(put(tiles.rows), put(tiles.owned_mask), put(tiles.edges), put(tiles.edge_ids),
                      put(tiles.edge_mask), put(tiles.spare))


def tiled_node_energies(whole: Any, pos: jax.Array, shifts: jax.Array, attrs: jax.Array, kept: jax.Array,
                        tiles: TileArrays, far: float) -> jax.Array:
    """`(rows,)` node energies of a block's owned atoms (zero elsewhere), tile by tile.

    Args:
        whole: the model as one op, `whole(pos, attrs, edges, shifts) -> (rows,)` node energies.
        pos: `(rows, 3)` block positions; shifts: `(E, 3)` the block edges' shifts; attrs: `(rows, A)`.
        kept: `(E,)` bool, the block edges within the cutoff now (`active_edges`).
        tiles: the device's tiles; far: the length of a padding edge's shift.
    """
    return _tiled(whole, far, pos, shifts, attrs, kept, tiles)


def _tile_graph(t: tuple[jax.Array, ...], pos, shifts, attrs, kept, far):
    """One tile's `(pos, attrs, edges, shifts)` from the block arrays."""
    rows, _, edges, ids, valid, spare = t
    keep = valid & kept[ids]
    e = jnp.where(keep[:, None], edges, spare[:, None])
    s = jnp.where(keep[:, None], shifts[ids], jnp.asarray([far, 0.0, 0.0], shifts.dtype))
    return pos[rows], attrs[rows], e, s


def _fields(tiles: TileArrays) -> tuple[jax.Array, ...]:
    return (tiles.rows, tiles.owned, tiles.edges, tiles.edge_ids, tiles.valid, tiles.spare)


def _scatter_energies(node, t, out):
    rows, owned = t[0], t[1]
    return out.at[rows].add(jnp.where(owned, node, jnp.zeros((), node.dtype)))


def _primal(whole, far, pos, shifts, attrs, kept, tiles):
    def turn(out, t):
        p, a, e, s = _tile_graph(t, pos, shifts, attrs, kept, far)
        return _scatter_energies(whole(p, a, e, s), t, out), None

    out, _ = jax.lax.scan(turn, jnp.zeros_like(pos[:, 0]), _fields(tiles))
    return out


def _grads(whole, far, pos, shifts, attrs, kept, tiles, weight):
    """Node energies, and the block gradients of `sum(weight * node energies)` over owned rows, tile by tile."""
    def turn(carry, t):
        out, g_pos, g_shift = carry
        rows, owned, _, ids, valid, _ = t
        p, a, e, s = _tile_graph(t, pos, shifts, attrs, kept, far)
        w = jnp.where(owned, weight[rows], jnp.zeros((), pos.dtype))

        def weighted(p, s):
            node = whole(p, a, e, s)
            return jnp.sum(w * node), node

        (_, node), (gp, gs) = jax.value_and_grad(weighted, argnums=(0, 1), has_aux=True)(p, s)
        keep = valid & kept[ids]
        g_pos = g_pos.at[rows].add(gp)
        g_shift = g_shift.at[ids].add(jnp.where(keep[:, None], gs, jnp.zeros((), gs.dtype)))
        return (_scatter_energies(node, t, out), g_pos, g_shift), None

    zero = (jnp.zeros_like(pos[:, 0]), jnp.zeros_like(pos), jnp.zeros_like(shifts))
    (out, g_pos, g_shift), _ = jax.lax.scan(turn, zero, _fields(tiles))
    return out, g_pos, g_shift


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _tiled(whole, far, pos, shifts, attrs, kept, tiles):
    return _primal(whole, far, pos, shifts, attrs, kept, tiles)


def _tiled_fwd(whole, far, pos, shifts, attrs, kept, tiles):
    ones = jnp.ones_like(pos[:, 0])
    out, g_pos, g_shift = _grads(whole, far, pos, shifts, attrs, kept, tiles, ones)
    return out, (pos, shifts, attrs, kept, tiles, g_pos, g_shift)


def _tiled_bwd(whole, far, res, ct):
    pos, shifts, attrs, kept, tiles, g_pos, g_shift = res
    owned = jnp.zeros_like(pos[:, 0], dtype=bool).at[tiles.rows].max(tiles.owned)
    first = jnp.argmax(owned)  # an owned row (row 0 when the block owns none: nothing to scale then)
    c0 = ct[first]
    uniform = jnp.all(jnp.where(owned, ct == c0, True))

    def scaled():
        return c0 * g_pos, c0 * g_shift

    def again():
        _, gp, gs = _grads(whole, far, pos, shifts, attrs, kept, tiles, ct)
        return gp, gs

    gp, gs = jax.lax.cond(uniform, scaled, again)
    zeros = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, jax.dtypes.float0) if not jnp.issubdtype(
        x.dtype, jnp.inexact) else jnp.zeros_like(x), (attrs, kept, tiles))
    return (gp, gs, *zeros)


_tiled.defvjp(_tiled_fwd, _tiled_bwd)
