"""Hand-built plan stand-ins and numpy references for the lower-layer tests.

The stand-ins carry the fields of the layout layer's HaloPlan / ShardPlan that
the lower layer reads; the numpy references are plain loops written from
docs/design.md, sharing no code with the package.
"""

from __future__ import annotations

import types

import numpy as np


def halo_plan(n_owned, n_ghost, oc, gc, offsets, caps, sends, recvs, halo_offset=None):
    """A HaloPlan stand-in from per-offset (D, cap) send/recv tables (padding filled in here)."""
    d = len(n_owned)
    hr = oc + gc
    send_idx, recv_slot = [], []
    for j, cap in enumerate(caps):
        s = np.full((d, cap), oc, np.int32)
        r = np.full((d, cap), hr, np.int32)
        for dev in range(d):
            s[dev, : len(sends[j][dev])] = sends[j][dev]
            r[dev, : len(recvs[j][dev])] = recvs[j][dev]
        send_idx.append(s)
        recv_slot.append(r)
    owned_mask = np.arange(oc)[None, :] < np.asarray(n_owned)[:, None]
    halo_owned_mask = np.zeros((d, hr), bool)
    halo_owned_mask[:, :oc] = owned_mask
    return types.SimpleNamespace(
        n_devices=d, owned_capacity=oc, ghost_capacity=gc, halo_rows=hr,
        offsets=tuple(offsets), pair_capacities=tuple(caps),
        send_idx=tuple(send_idx), recv_slot=tuple(recv_slot),
        halo_offset=np.zeros((d, hr, 3)) if halo_offset is None else halo_offset,
        owned_offset=np.zeros((d, oc, 3)), owned_mask=owned_mask, halo_owned_mask=halo_owned_mask,
        n_owned=np.asarray(n_owned), n_ghost=np.asarray(n_ghost),
    )


def golden_halo_plan():
    """The 2-rank golden setup: r0 owns g0..g2 and borrows g3; r1 owns g3..g5 and borrows g1, g2."""
    return halo_plan(
        n_owned=[3, 3], n_ghost=[1, 2], oc=3, gc=3, offsets=[1], caps=[2],
        sends=[[[1, 2], [0]]],      # r0 sends its rows 1, 2 to r1; r1 sends its row 0 to r0
        recvs=[[[3], [3, 4]]],      # r0 stores g3 in row 3; r1 stores g1, g2 in rows 3, 4
    )


def shard_plan(owner, n_devices):
    """A ShardPlan stand-in from an owner per global ID (local indices in stable order)."""
    owner = np.asarray(owner)
    n_owned = np.bincount(owner, minlength=n_devices)
    oc = int(n_owned.max())
    local = np.zeros_like(owner)
    owned_global = np.full((n_devices, oc), -1)
    for d in range(n_devices):
        ids = np.flatnonzero(owner == d)
        local[ids] = np.arange(len(ids))
        owned_global[d, : len(ids)] = ids
    return types.SimpleNamespace(
        n_devices=n_devices, n_global=len(owner), owner=owner, local_index=local,
        n_owned=n_owned, owned_capacity=oc, owned_global=owned_global,
    )


def random_halo_plan(rng: np.random.Generator, d: int, oc: int = 5, gc: int = 7, cap: int = 3):
    """Random tables with every offset 0..D-1 present (so the program shape depends on D only)."""
    n_owned = rng.integers(0, oc + 1, d)
    free = [list(rng.permutation(np.arange(oc, oc + gc))) for _ in range(d)]
    sends = [[[] for _ in range(d)] for _ in range(d)]
    recvs = [[[] for _ in range(d)] for _ in range(d)]
    for k in range(d):
        for src in range(d):
            dst = (src + k) % d
            c = int(rng.integers(0, cap + 1)) if n_owned[src] else 0
            c = min(c, len(free[dst]))
            sends[k][src] = list(rng.integers(0, n_owned[src], c)) if c else []
            recvs[k][dst] = [free[dst].pop() for _ in range(c)]
    n_ghost = [gc - len(f) for f in free]
    shift = rng.normal(size=(d, oc + gc, 3))
    return halo_plan(n_owned, n_ghost, oc, gc, range(d), [cap] * d, sends, recvs, halo_offset=shift)


def np_forward(plan, x, positions=False):
    """Reference forward exchange: global owned storage (D*oc, *F) -> global halo storage."""
    d, oc, hr = plan.n_devices, plan.owned_capacity, plan.halo_rows
    x = np.asarray(x).reshape((d, oc) + x.shape[1:])
    out = np.zeros((d, hr) + x.shape[2:], x.dtype)
    for dev in range(d):
        for i in range(plan.n_owned[dev]):
            out[dev, i] = x[dev, i]
    for j, k in enumerate(plan.offsets):
        for src in range(d):
            dst = (src + k) % d
            for row, slot in zip(plan.send_idx[j][src], plan.recv_slot[j][dst]):
                if row < oc and slot < hr:
                    out[dst, slot] += x[src, row]
    if positions:
        out = out + plan.halo_offset
    return out.reshape((d * hr,) + out.shape[2:])


def np_reverse(plan, y):
    """Reference reverse exchange: global halo storage -> global owned storage."""
    d, oc, hr = plan.n_devices, plan.owned_capacity, plan.halo_rows
    y = np.asarray(y).reshape((d, hr) + y.shape[1:])
    out = np.zeros((d, oc) + y.shape[2:], y.dtype)
    for dev in range(d):
        for i in range(plan.n_owned[dev]):
            out[dev, i] = y[dev, i]
    for j, k in enumerate(plan.offsets):
        for src in range(d):
            dst = (src + k) % d
            for row, slot in zip(plan.send_idx[j][src], plan.recv_slot[j][dst]):
                if row < oc and slot < hr:
                    out[src, row] += y[dst, slot]
    return out.reshape((d * oc,) + out.shape[2:])


def make_spec(policy, *adapters):
    """A DistributionSpec with `adapters` as its custom ops."""
    from nvalchemi_jaxbridge.spec.distribution import DistributionSpec

    return DistributionSpec(policy=policy, custom_ops=tuple(adapters))
