"""Transforms as collectives: golden 2-rank vectors, adjoint identities, random tables."""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvalchemi_jaxbridge.lower import collectives as C
from nvalchemi_jaxbridge.lower.mesh import make_mesh
from nvalchemi_jaxbridge.lower.tables import device_tables, place

from .plans import golden_halo_plan, np_forward, np_reverse, random_halo_plan, shard_plan

AX = "atoms"


def smap(fn, mesh, tables, n_args, out_specs=P(AX)):
    """jit(shard_map(fn(t, *blocks))) with the tables and `n_args` row-sharded arrays."""
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(tables.specs(AX),) + (P(AX),) * n_args,
                                 out_specs=out_specs))


def sharded(mesh, x):
    return place(np.asarray(x), NamedSharding(mesh, P(AX)))


@pytest.fixture(scope="module")
def golden():
    mesh = make_mesh(2)
    plan = golden_halo_plan()
    return mesh, plan, device_tables(plan, mesh)


def halo_rows(r0, r1, hr=6):
    """Two ranks' first rows, zero-padded to `hr` rows each, as one (2*hr,) vector."""
    out = np.zeros(2 * hr)
    out[: len(r0)] = r0
    out[hr: hr + len(r1)] = r1
    return out


# ---------------------------------------------------------------- golden vectors


def test_golden_forward_and_reverse(golden):
    mesh, _, t = golden
    fwd = smap(lambda t, x: C.halo_forward(x, t, AX), mesh, t, 1)
    rev = smap(lambda t, y: C.halo_reverse(y, t, AX), mesh, t, 1)
    owned = sharded(mesh, 10.0 * np.arange(6) + 1)           # r0 [1, 11, 21], r1 [31, 41, 51]
    np.testing.assert_array_equal(fwd(t, owned), halo_rows([1, 11, 21, 31], [31, 41, 51, 11, 21]))
    ones = sharded(mesh, halo_rows([1] * 4, [1] * 5))         # ones on the n_padded rows
    np.testing.assert_array_equal(rev(t, ones), [1, 2, 2, 2, 1, 1])


def test_golden_gather_inputs_adjoint(golden):
    mesh, _, t = golden
    fwd = smap(lambda t, x: C.halo_forward(x, t, AX), mesh, t, 1)
    g = jax.grad(lambda x: jnp.sum(2.0 * fwd(t, x)))(sharded(mesh, np.ones(6)))
    np.testing.assert_array_equal(g, [2, 4, 4, 4, 2, 2])


def test_golden_scatter_outputs_value_and_adjoint(golden):
    mesh, _, t = golden
    scat = smap(lambda t, y: C.halo_scatter(2.0 * y, t, AX), mesh, t, 1)
    out = scat(t, sharded(mesh, halo_rows([1] * 4, [1] * 5)))
    np.testing.assert_array_equal(out, halo_rows([2, 4, 4, 4], [4, 2, 2, 4, 4]))
    w = sharded(mesh, halo_rows([1, 2, 3, 4], [1, 2, 3, 4, 5]))
    _, vjp = jax.vjp(lambda y: scat(t, y), sharded(mesh, halo_rows([1] * 4, [1] * 5)))
    np.testing.assert_array_equal(vjp(w)[0], halo_rows([2, 12, 16, 10], [10, 4, 6, 12, 16]))


@pytest.mark.parametrize("replicated, want", [(False, [2, 2, 2, 0]), (True, [1, 1, 1, 0])])
def test_golden_all_reduce_sum_adjoints(golden, replicated, want):
    """Each rank sums its replicated copy into its own loss; the losses are added over ranks."""
    mesh, _, t = golden

    def per_rank_loss(t, leaf):
        out1 = C.all_reduce_sum(jnp.sum(C.slice_owned(leaf, t), axis=0), AX, replicated_consumer=replicated)
        return out1, jax.lax.psum(out1, AX)

    f = smap(per_rank_loss, mesh, t, 1, out_specs=(P(AX) if replicated else P(), P()))
    leaf = sharded(mesh, halo_rows([1, 2, 3, 4], [11, 12, 13, 14, 15]))
    out1, _ = f(t, leaf.reshape(12, 1))
    np.testing.assert_array_equal(np.asarray(out1).ravel(), [42, 42] if replicated else [42])
    g = jax.grad(lambda x: f(t, x)[1][0])(leaf.reshape(12, 1))
    np.testing.assert_array_equal(np.asarray(g).ravel(), halo_rows(want, want[:3] + [0, 0]))


def test_golden_gather_full_and_slice_outputs_owned():
    mesh = make_mesh(2)
    t = device_tables(shard_plan([0, 0, 0, 1, 1, 1], 2), mesh)
    seen = []

    def body(t, x):
        full = C.gather_full(x, t, AX)
        seen.append(full.shape)
        return C.slice_outputs_owned(2.0 * full, t, AX)

    f = smap(body, mesh, t, 1)
    x = sharded(mesh, [1.0, 11, 21, -1, 31, 41, 51, -1])        # local (3 + 1) rows, pad row -1
    np.testing.assert_array_equal(f(t, x), [2, 22, 42, -2, 62, 82, 102, -2])
    assert seen[0] == (7,)                                    # n_global + 1 rows
    np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(f(t, x)))(x), np.full(8, 2.0))


def test_slice_outputs_owned_any_assignment():
    """A non-block assignment: each device gets exactly its global IDs' rows."""
    owner = [1, 0, 1, 0, 0, 1, 1]
    mesh = make_mesh(2)
    plan = shard_plan(owner, 2)
    t = device_tables(plan, mesh)
    glob = 100.0 + np.arange(7)
    local = np.zeros((2, plan.owned_capacity + 1))
    for g, d in enumerate(owner):
        local[d, plan.local_index[g]] = glob[g]
    local[:, -1] = -5.0
    f = smap(lambda t, x: (C.gather_full(x, t, AX), C.slice_outputs_owned(C.gather_full(x, t, AX), t, AX)),
             mesh, t, 1)
    full, back = f(t, sharded(mesh, local.ravel()))
    np.testing.assert_array_equal(np.asarray(full).reshape(2, 8), [list(glob) + [-5.0]] * 2)
    np.testing.assert_array_equal(np.asarray(back), local.ravel())


# ------------------------------------------------------------ random halo tables


@functools.cache
def programs(d):
    """Forward (plain and positions), reverse and scatter programs on a d-device mesh."""
    mesh = make_mesh(d)
    tmpl = device_tables(random_halo_plan(np.random.default_rng(0), d), mesh)
    fwd = smap(lambda t, x: C.halo_forward(x, t, AX), mesh, tmpl, 1)
    pos = smap(lambda t, x: C.halo_forward(x, t, AX, positions=True), mesh, tmpl, 1)
    rev = smap(lambda t, y: C.halo_reverse(y, t, AX), mesh, tmpl, 1)
    scat = smap(lambda t, y: C.halo_scatter(y, t, AX), mesh, tmpl, 1)
    return mesh, fwd, pos, rev, scat


@pytest.mark.slow
@hypothesis.settings(max_examples=15)  # each example compiles its own programs
@hypothesis.given(d=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
def test_random_tables_match_reference_and_are_adjoint(d, seed):
    rng = np.random.default_rng(seed)
    plan = random_halo_plan(rng, d)
    mesh, fwd, pos, rev, scat = programs(d)
    t = device_tables(plan, mesh)
    x = rng.normal(size=(d * plan.owned_capacity, 3))
    y = rng.normal(size=(d * plan.halo_rows, 3))
    xs, ys = sharded(mesh, x), sharded(mesh, y)
    fx, ry = np.asarray(fwd(t, xs)), np.asarray(rev(t, ys))
    np.testing.assert_allclose(fx, np_forward(plan, x), rtol=0, atol=1e-12)
    np.testing.assert_allclose(ry, np_reverse(plan, y), rtol=0, atol=1e-12)
    np.testing.assert_allclose(pos(t, xs), np_forward(plan, x, positions=True), rtol=0, atol=1e-12)
    # global adjoint identity <y, F x> = <F^T y, x>, and autodiff's transpose is the reverse
    np.testing.assert_allclose(np.vdot(y, fx), np.vdot(ry, x), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(jax.vjp(lambda a: fwd(t, a), xs)[1](ys)[0], ry, rtol=0, atol=1e-12)
    np.testing.assert_allclose(jax.vjp(lambda a: pos(t, a), xs)[1](ys)[0], ry, rtol=0, atol=1e-12)
    np.testing.assert_allclose(jax.vjp(lambda b: rev(t, b), ys)[1](xs)[0], fx, rtol=0, atol=1e-12)
    # ScatterOutputs = F R, self-adjoint
    sy, sx = np.asarray(scat(t, ys)), np.asarray(scat(t, sharded(mesh, fx)))
    np.testing.assert_allclose(sy, np_forward(plan, np_reverse(plan, y)), rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.vdot(fx, sy), np.vdot(sx, y), rtol=1e-10, atol=1e-10)
    # reverse(forward(ones)) = 1 + out-degree on owned rows; forward -> zero ghosts -> reverse = id
    ones = np.ones((d * plan.owned_capacity, 3))
    degree = np.zeros((d, plan.owned_capacity))
    for j in range(len(plan.offsets)):
        for src in range(d):
            for row in plan.send_idx[j][src]:
                if row < plan.owned_capacity:
                    degree[src, row] += 1
    want = (plan.owned_mask + degree).reshape(-1, 1) * np.ones(3)
    rf = rev(t, fwd(t, sharded(mesh, ones)))
    np.testing.assert_allclose(rf, want, rtol=0, atol=1e-12)
    no_ghosts = (np.arange(plan.halo_rows) < plan.owned_capacity)[None, :].repeat(d, 0).reshape(-1, 1)
    np.testing.assert_allclose(rev(t, sharded(mesh, fx * no_ghosts)), x * plan.owned_mask.reshape(-1, 1),
                               rtol=0, atol=1e-12)


def test_slice_owned_zeroes_padding_and_ghosts():
    mesh = make_mesh(2)
    plan = golden_halo_plan()
    plan.owned_mask[1, 2] = False                              # r1 owns 2 of its 3 rows
    t = device_tables(plan, mesh)
    f = smap(lambda t, y: C.slice_owned(y, t), mesh, t, 1)
    y = sharded(mesh, np.arange(12.0) + 1)
    np.testing.assert_array_equal(f(t, y), [1, 2, 3, 7, 8, 0])
    np.testing.assert_array_equal(jax.grad(lambda y: jnp.sum(f(t, y)))(y), [1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0])


def test_wrong_block_rows_are_rejected(golden):
    mesh, _, t = golden
    f = smap(lambda t, x: C.halo_forward(x, t, AX), mesh, t, 1)
    with pytest.raises(ValueError, match=r"halo_forward: the local block has shape \(4,\).*3 rows per device"):
        f(t, sharded(mesh, np.zeros(8)))


def test_device_tables_checks_device_count():
    with pytest.raises(ValueError, match=r"built for 2 devices but the mesh has 4.*make_mesh\(2\)"):
        device_tables(golden_halo_plan(), make_mesh(4))
    with pytest.raises(TypeError, match="expected a HaloPlan or ShardPlan, got int"):
        device_tables(3, make_mesh(2))


@functools.cache
def plan_programs(d, static_key):
    """Forward-with-positions and reverse programs for real HaloPlans of one static shape."""
    del static_key
    return make_mesh(d), {}


@hypothesis.settings(max_examples=10)
@hypothesis.given(d=st.integers(1, 8), n=st.integers(20, 60), seed=st.integers(0, 2**31 - 1))
def test_real_halo_plans_match_layout_reference(d, n, seed):
    """Layout's HaloPlan (periodic, random atoms) through the collectives vs its numpy reference."""
    from nvalchemi_jaxbridge.layout import HaloPlan

    rng = np.random.default_rng(seed)
    cell = np.diag([6.0, 5.0, 4.0])
    pos = rng.uniform(0, 1, (n, 3)) @ cell
    plan = HaloPlan.build(pos, cell, cutoff=1.5, n_devices=d, owned_capacity=64, ghost_capacity=400,
                          pair_capacities={k: 160 for k in range(d)})
    mesh = make_mesh(d)
    t = device_tables(plan, mesh)
    _, progs = plan_programs(d, t.static_key)
    if not progs:
        progs["pos"] = smap(lambda t, x: C.halo_forward(x, t, AX, positions=True), mesh, t, 1)
        progs["rev"] = smap(lambda t, y: C.halo_reverse(y, t, AX), mesh, t, 1)
    x = plan.to_owned(pos, positions=True)
    y = rng.normal(size=(d * plan.halo_rows, 3))
    fx = np.asarray(progs["pos"](t, sharded(mesh, x)))
    np.testing.assert_allclose(fx, plan.to_halo(pos, positions=True), rtol=0, atol=1e-12)
    np.testing.assert_allclose(fx, plan.reference_forward(x, positions=True), rtol=0, atol=1e-12)
    ry = np.asarray(progs["rev"](t, sharded(mesh, y)))
    np.testing.assert_allclose(ry, plan.reference_reverse(y), rtol=0, atol=1e-12)
    lin = fx - plan.halo_offset.reshape(-1, 3)                          # the linear part of the forward
    np.testing.assert_allclose(np.vdot(y, lin), np.vdot(ry, x), rtol=1e-10, atol=1e-10)
