"""Block tables (issue 7): each message added as one block of halo rows instead of a scatter by recv_slot.

References: the numpy loops of `plans.py` (np_forward / np_reverse), the layout
plan's own numpy layouts (`to_halo`, `reference_reverse`), and the scatter path
(`blocks=False`) of the same tables.
"""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvalchemi_jaxbridge.lower import collectives as C
from nvalchemi_jaxbridge.lower.mesh import make_mesh
from nvalchemi_jaxbridge.lower.tables import device_tables, place

from .plans import golden_halo_plan, halo_plan, np_forward, np_reverse, random_halo_plan, shard_plan

AX = "atoms"
OC, GC, CAP = 5, 9, 4


def smap(fn, mesh, tables):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(tables.specs(AX), P(AX)), out_specs=P(AX)))


def sharded(mesh, x):
    return place(np.asarray(x), NamedSharding(mesh, P(AX)))


def contiguous_halo_plan(rng: np.random.Generator, d: int):
    """Random tables whose moving entries land in one run of halo rows per (device, offset).

    Runs start anywhere (inside owned rows, overlapping other offsets' runs, up to
    the last halo row, so the block start is pulled back), rows arrive in any order
    within a message and may repeat (periodic images); one extra entry per message
    moves nothing (padding on one side only).
    """
    hr = OC + GC
    n_owned = rng.integers(0, OC + 1, d)
    sends = [[[] for _ in range(d)] for _ in range(d)]
    recvs = [[[] for _ in range(d)] for _ in range(d)]
    for k in range(d):
        for src in range(d):
            dst = (src + k) % d
            c = int(rng.integers(0, CAP + 1)) if n_owned[src] else 0
            rows = list(rng.integers(0, n_owned[src], c)) if c else []
            lo = int(rng.integers(0, hr - c + 1))
            slots = list(lo + rng.permutation(c))
            if c < CAP and rng.random() < 0.5:
                if n_owned[src] and rng.random() < 0.5:
                    rows, slots = rows + [int(rng.integers(0, n_owned[src]))], slots + [hr]  # dropped
                else:
                    rows, slots = rows + [OC], slots + [int(rng.integers(0, hr))]  # adds zero
            sends[k][src], recvs[k][dst] = rows, slots
    shift = rng.normal(size=(d, hr, 3))
    return halo_plan(n_owned, [0] * d, OC, GC, range(d), [CAP] * d, sends, recvs, halo_offset=shift)


@functools.cache
def programs(d):
    """Forward, forward with positions, reverse and scatter on a d-device mesh, for block tables."""
    mesh = make_mesh(d)
    tmpl = device_tables(contiguous_halo_plan(np.random.default_rng(0), d), mesh, blocks=True)
    return mesh, {
        "fwd": smap(lambda t, x: C.halo_forward(x, t, AX), mesh, tmpl),
        "pos": smap(lambda t, x: C.halo_forward(x, t, AX, positions=True), mesh, tmpl),
        "rev": smap(lambda t, y: C.halo_reverse(y, t, AX), mesh, tmpl),
        "scat": smap(lambda t, y: C.halo_scatter(y, t, AX), mesh, tmpl),
    }


@pytest.mark.slow
@hypothesis.settings(max_examples=15)  # each example compiles its own programs
@hypothesis.given(d=st.sampled_from([1, 2, 3, 4, 8]), seed=st.integers(0, 2**31 - 1))
def test_block_tables_match_reference_and_transpose(d, seed):
    rng = np.random.default_rng(seed)
    plan = contiguous_halo_plan(rng, d)
    mesh, p = programs(d)
    t = device_tables(plan, mesh, blocks=True)
    assert t.blocks
    for start, cap in zip(t.recv_start, t.pair_capacities):  # no block is clamped by XLA
        assert np.all((np.asarray(start) >= 0) & (np.asarray(start) + cap <= plan.halo_rows))
    x = rng.normal(size=(d * OC, 3))
    y = rng.normal(size=(d * plan.halo_rows, 3))
    xs, ys = sharded(mesh, x), sharded(mesh, y)
    fx, ry = np.asarray(p["fwd"](t, xs)), np.asarray(p["rev"](t, ys))
    np.testing.assert_allclose(fx, np_forward(plan, x), rtol=0, atol=1e-12)
    np.testing.assert_allclose(ry, np_reverse(plan, y), rtol=0, atol=1e-12)
    np.testing.assert_allclose(p["pos"](t, xs), np_forward(plan, x, positions=True), rtol=0, atol=1e-12)
    np.testing.assert_allclose(p["scat"](t, ys), np_forward(plan, np_reverse(plan, y)), rtol=0, atol=1e-12)
    # autodiff's transpose of the block forward is the block reverse, and the other way round
    np.testing.assert_allclose(jax.vjp(lambda a: p["fwd"](t, a), xs)[1](ys)[0], ry, rtol=0, atol=1e-12)
    np.testing.assert_allclose(jax.vjp(lambda a: p["pos"](t, a), xs)[1](ys)[0], ry, rtol=0, atol=1e-12)
    np.testing.assert_allclose(jax.vjp(lambda b: p["rev"](t, b), ys)[1](xs)[0], fx, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.vdot(y, fx), np.vdot(ry, x), rtol=1e-10, atol=1e-10)


def test_ghost_groups_in_source_order_differ_from_offset_order():
    """4 slabs: device d receives from d - 1 (offset 1) and d + 1 (offset 3), so by source rank
    device 0 stores offset 3's group first and device 2 offset 1's; the blocks' padding rows run
    over the neighbouring group on some device, and the result is still exact."""
    from nvalchemi_jaxbridge.layout import HaloPlan

    rng = np.random.default_rng(3)
    cell = np.diag([16.0, 4.0, 4.0])
    pos = rng.uniform(0, 1, (64, 3)) @ cell
    plan = HaloPlan.build(pos, cell, periodic=(True, False, False), cutoff=1.5, n_devices=4, grid=(4, 1, 1),
                          pair_capacities=12)
    assert plan.offsets == (1, 3)
    mesh = make_mesh(4)
    t = device_tables(plan, mesh)
    assert t.blocks
    start = [np.asarray(s) for s in t.recv_start]
    first = [int(np.argmin([start[j][dev] for j in range(2)])) for dev in range(4)]
    assert first[0] == 1 and first[2] == 0                      # the group orders really differ
    runs = {(dev, j): (plan.recv_slot[j][dev] < plan.halo_rows).sum() for dev in range(4) for j in range(2)}
    assert any(start[j][dev] + plan.pair_capacities[j] > start[1 - j][dev] > start[j][dev]
               and runs[dev, 1 - j] > 0 for dev in range(4) for j in range(2))  # a block covers the next group
    fwd = smap(lambda t, x: C.halo_forward(x, t, AX, positions=True), mesh, t)
    rev = smap(lambda t, y: C.halo_reverse(y, t, AX), mesh, t)
    x = plan.to_owned(pos, positions=True)
    fx = fwd(t, sharded(mesh, x))
    np.testing.assert_allclose(fx, plan.to_halo(pos, positions=True), rtol=0, atol=1e-12)
    y = rng.normal(size=(4 * plan.halo_rows, 3))
    ry = rev(t, sharded(mesh, y))
    np.testing.assert_allclose(ry, plan.reference_reverse(y), rtol=0, atol=1e-12)
    np.testing.assert_allclose(jax.vjp(lambda a: fwd(t, a), sharded(mesh, x))[1](sharded(mesh, y))[0], ry,
                               rtol=0, atol=1e-12)


def test_which_plans_get_block_tables():
    from nvalchemi_jaxbridge.layout import HaloPlan

    mesh = make_mesh(2)
    assert not device_tables(golden_halo_plan(), mesh).blocks           # stand-ins: scatter by default
    assert device_tables(golden_halo_plan(), mesh, blocks=True).blocks
    rng = np.random.default_rng(0)
    cell = np.diag([6.0, 5.0, 4.0])
    pos = rng.uniform(0, 1, (30, 3)) @ cell
    plan = HaloPlan.build(pos, cell, cutoff=1.5, n_devices=2)
    assert device_tables(plan, mesh).blocks and not device_tables(plan, mesh, blocks=False).blocks
    # a pair capacity beyond halo_rows cannot be one block: the HaloPlan keeps the scatter, same result
    wide = HaloPlan.build(pos, cell, cutoff=1.5, n_devices=2, pair_capacities=2 * plan.halo_rows)
    t = device_tables(wide, mesh)
    assert not t.blocks
    f = smap(lambda t, x: C.halo_forward(x, t, AX, positions=True), mesh, t)
    np.testing.assert_allclose(f(t, sharded(mesh, wide.to_owned(pos, positions=True))),
                               wide.to_halo(pos, positions=True), rtol=0, atol=1e-12)


def test_block_tables_errors():
    mesh = make_mesh(2)
    scattered = random_halo_plan(np.random.default_rng(1), 2)           # slots drawn at random
    with pytest.raises(ValueError, match=r"device_tables\(blocks=True\): device \d receives the rows of offset "
                                         r"\d into halo rows .* not one run.*pass blocks=False"):
        device_tables(scattered, mesh, blocks=True)
    negative = golden_halo_plan()
    negative.send_idx = (np.array([[1, -1], [0, 3]], np.int32),)
    with pytest.raises(ValueError, match=r"offset 1 has negative send_idx"):
        device_tables(negative, mesh, blocks=True)
    wide = golden_halo_plan()
    wide.pair_capacities = (7,)
    wide.send_idx = (np.pad(wide.send_idx[0], ((0, 0), (0, 5)), constant_values=3),)
    wide.recv_slot = (np.pad(wide.recv_slot[0], ((0, 0), (0, 5)), constant_values=6),)
    with pytest.raises(ValueError, match=r"offset 1 has pair capacity 7 > halo_rows=6"):
        device_tables(wide, mesh, blocks=True)
    with pytest.raises(TypeError, match=r"blocks=True applies to halo plans only, got a ShardPlan"):
        device_tables(shard_plan([0, 1], 2), mesh, blocks=True)
