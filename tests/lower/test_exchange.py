"""The storage policy's exchanges (lower/exchange.py) against independent references.

References: the golden 2-rank vectors of the semantics reference, the numpy
loops of tests/lower/plans.py (written from docs/design.md), and closed forms
from a real plan's `halo_global` ids (every halo row of atom g holds g's value;
a fold gives every copy of g the sum over all copies), which use no exchange table.
"""

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
from nvalchemi_jaxbridge.lower import compile, exchange, make_mesh
from nvalchemi_jaxbridge.lower.tables import device_tables, place
from nvalchemi_jaxbridge.spec.policies import (
    GraphParallelPolicy,
    HaloStoragePolicy,
    PlainShard,
    RefreshOnlyHaloPolicy,
)

from .plans import golden_halo_plan, make_spec, np_forward, np_reverse, shard_plan

AX = "atoms"
HALO = HaloStoragePolicy()


def smap(fn, mesh, tables):
    """jit(shard_map(fn(t, block))) with the tables and one row-sharded array."""
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(tables.specs(AX), P(AX)), out_specs=P(AX)))


def sharded(mesh, x):
    return place(np.asarray(x), NamedSharding(mesh, P(AX)))


def halo_rows(r0, r1, hr=6):
    """Two ranks' first rows, zero-padded to `hr` rows each, as one (2*hr,) vector."""
    out = np.zeros(2 * hr)
    out[: len(r0)] = r0
    out[hr: hr + len(r1)] = r1
    return out


def np_slice_owned(plan, y):
    """Reference SliceOwned: owned rows kept (padding zero), ghost and padding rows dropped."""
    d, oc, hr = plan.n_devices, plan.owned_capacity, plan.halo_rows
    y = np.asarray(y).reshape((d, hr) + y.shape[1:])
    out = np.zeros((d, oc) + y.shape[2:], y.dtype)
    for dev in range(d):
        out[dev, : plan.n_owned[dev]] = y[dev, : plan.n_owned[dev]]
    return out.reshape((d * oc,) + out.shape[2:])


def ids_refresh(plan, y):
    """Closed form of refresh from `halo_global`: each halo row of atom g gets g's owned value."""
    d, oc, hr = plan.n_devices, plan.owned_capacity, plan.halo_rows
    y = np.asarray(y).reshape((d, hr) + y.shape[1:])
    value = {}
    for dev in range(d):
        for r in range(plan.n_owned[dev]):
            value[int(plan.owned_global[dev, r])] = y[dev, r]
    out = np.zeros_like(y)
    for dev in range(d):
        for r in range(hr):
            g = int(plan.halo_global[dev, r])
            if g >= 0:
                out[dev, r] = value[g]
    return out.reshape((d * hr,) + y.shape[2:])


def ids_totals(plan, y):
    """`{g: sum of y over every halo row (owned and ghost, all devices) of atom g}`."""
    d, hr = plan.n_devices, plan.halo_rows
    y = np.asarray(y).reshape((d, hr) + y.shape[1:])
    tot = {}
    for dev in range(d):
        for r in range(hr):
            g = int(plan.halo_global[dev, r])
            if g >= 0:
                tot[g] = tot.get(g, 0.0) + y[dev, r]
    return tot


def ids_fold(plan, y):
    """Closed form of fold: every halo row of atom g holds the sum over all copies of g."""
    d, hr = plan.n_devices, plan.halo_rows
    tot = ids_totals(plan, y)
    out = np.zeros((d, hr) + np.asarray(y).shape[1:])
    for dev in range(d):
        for r in range(hr):
            g = int(plan.halo_global[dev, r])
            if g >= 0:
                out[dev, r] = tot[g]
    return out.reshape(np.asarray(y).shape)


def ids_refresh_adjoint(plan, y):
    """Closed form of refresh's transpose: owned row of g gets the sum over all copies of g; ghosts zero."""
    d, hr = plan.n_devices, plan.halo_rows
    tot = ids_totals(plan, y)
    out = np.zeros((d, hr) + np.asarray(y).shape[1:])
    for dev in range(d):
        for r in range(plan.n_owned[dev]):
            out[dev, r] = tot[int(plan.owned_global[dev, r])]
    return out.reshape(np.asarray(y).shape)


@pytest.fixture(scope="module")
def golden():
    mesh = make_mesh(2)
    plan = golden_halo_plan()
    return mesh, plan, device_tables(plan, mesh)


# ---------------------------------------------------------------- golden vectors


def test_golden_refresh_puts_owner_values_on_ghosts_and_zeroes_padding(golden):
    mesh, _, t = golden
    f = smap(lambda t, x: exchange.refresh(x, t, AX, HALO), mesh, t)
    stale = np.array([1, 11, 21, 99, 98, 97, 31, 41, 51, 96, 95, 94.0])   # junk on ghost and padding rows
    np.testing.assert_array_equal(f(t, sharded(mesh, stale)), halo_rows([1, 11, 21, 31], [31, 41, 51, 11, 21]))
    # adjoint: ghost cotangents summed into owners, zero on ghost rows
    _, vjp = jax.vjp(lambda x: f(t, x), sharded(mesh, stale))
    w = sharded(mesh, halo_rows([1, 2, 3, 4], [5, 6, 7, 8, 9]))
    np.testing.assert_array_equal(vjp(w)[0], halo_rows([1, 2 + 8, 3 + 9], [5 + 4, 6, 7]))


def test_golden_fold_is_forward_of_reverse(golden):
    mesh, plan, t = golden
    rev = smap(lambda t, y: C.halo_reverse(y, t, AX), mesh, t)
    fold = smap(lambda t, y: exchange.fold(y, t, AX, HALO), mesh, t)
    ones = sharded(mesh, halo_rows([1] * 4, [1] * 5))
    np.testing.assert_array_equal(rev(t, ones), [1, 2, 2, 2, 1, 1])               # reverse(ones)
    np.testing.assert_array_equal(fold(t, 2.0 * ones), halo_rows([2, 4, 4, 4], [4, 2, 2, 4, 4]))
    y = np.arange(12.0) + 1
    np.testing.assert_array_equal(fold(t, sharded(mesh, y)), np_forward(plan, np_reverse(plan, y)))


def test_golden_adjoint_identities(golden):
    mesh, plan, t = golden
    ref = smap(lambda t, x: exchange.refresh(x, t, AX, HALO), mesh, t)
    fold = smap(lambda t, y: exchange.fold(y, t, AX, HALO), mesh, t)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=12), rng.normal(size=12)
    xs, ys = sharded(mesh, x), sharded(mesh, y)
    rx, rty = np.asarray(ref(t, xs)), np.asarray(jax.vjp(lambda a: ref(t, a), xs)[1](ys)[0])
    np.testing.assert_allclose(rx, np_forward(plan, np_slice_owned(plan, x)), rtol=0, atol=1e-14)
    np.testing.assert_allclose(np.vdot(y, rx), np.vdot(rty, x), rtol=1e-12)
    # R^T = (F S)^T = S^T R_ev: the reverse exchange, placed on owned rows, zero on ghosts
    want = np.zeros((2, 6))
    want[:, :3] = np_reverse(plan, y).reshape(2, 3)
    np.testing.assert_allclose(rty, want.ravel(), rtol=0, atol=1e-14)
    fty = np.asarray(jax.vjp(lambda a: fold(t, a), xs)[1](ys)[0])
    np.testing.assert_allclose(fty, np.asarray(fold(t, ys)), rtol=0, atol=1e-14)   # self-adjoint


# ------------------------------------------------------------ policy meanings


def test_exchanges_of_each_policy():
    assert exchange.exchanges_of(HaloStoragePolicy()) == (True, True)
    assert exchange.exchanges_of(HaloStoragePolicy(scatter_mode="local")) == (True, False)
    assert exchange.exchanges_of(HaloStoragePolicy(gather_mode="local")) == (False, True)
    assert exchange.exchanges_of(HaloStoragePolicy("local", "local")) == (False, False)
    assert exchange.exchanges_of(RefreshOnlyHaloPolicy()) == (True, False)
    assert exchange.exchanges_of(GraphParallelPolicy()) == (True, False)
    assert exchange.exchanges_of(PlainShard()) == (False, False)
    assert exchange.exchanges_of(None) == (False, False)


def test_check_exchanges_refuses_switched_off_exchanges():
    assert exchange.check_exchanges(HaloStoragePolicy(gather_mode="local")) == (False, True)
    assert exchange.check_exchanges(None) == (False, False)
    with pytest.raises(ValueError, match=(r"a per-layer message-passing model needs each layer's ghost rows refreshed.*"
                                          r"scatter_mode='local': no fold; gather_mode='local': no refresh.*"
                                          r"silently wrong; use HaloStoragePolicy\(\)")):
        exchange.check_exchanges(HaloStoragePolicy("local", "local"))
    with pytest.raises(ValueError, match=r"MACE needs each layer's ghost rows.*gather_mode='local'"):
        exchange.check_exchanges(RefreshOnlyHaloPolicy(gather_mode="local"), what="MACE")
    with pytest.raises(ValueError, match=r"stores owned rows only and exchanges nothing; use GraphParallelPolicy"):
        exchange.check_exchanges(PlainShard())
    with pytest.raises(ValueError, match="exchanges_of: the policy 3 has no exchanges known to the lower layer"):
        exchange.exchanges_of(3)


@pytest.mark.parametrize("policy, refresh_id, fold_id", [
    (RefreshOnlyHaloPolicy(), False, True),
    (HaloStoragePolicy(scatter_mode="local"), False, True),
    (HaloStoragePolicy(gather_mode="local"), True, False),
    (HaloStoragePolicy("local", "local"), True, True),
])
def test_switched_off_exchanges_are_the_identity(golden, policy, refresh_id, fold_id):
    mesh, plan, t = golden
    y = np.random.default_rng(1).normal(size=(12, 2))
    ref = smap(lambda t, x: exchange.refresh(x, t, AX, policy), mesh, t)(t, sharded(mesh, y))
    fold = smap(lambda t, x: exchange.fold(x, t, AX, policy), mesh, t)(t, sharded(mesh, y))
    want_ref = y if refresh_id else np_forward(plan, np_slice_owned(plan, y))
    want_fold = y if fold_id else np_forward(plan, np_reverse(plan, y))
    np.testing.assert_allclose(ref, want_ref, rtol=0, atol=1e-14)
    np.testing.assert_allclose(fold, want_fold, rtol=0, atol=1e-14)


def test_local_functions_check_policy_tables_and_rows(golden):
    mesh, _, t = golden
    with pytest.raises(ValueError, match=r"refresh: a 'graph_parallel' policy needs ShardTables, got HaloTables"):
        smap(lambda t, x: exchange.refresh(x, t, AX, GraphParallelPolicy()), mesh, t)(t, sharded(mesh, np.ones(12)))
    with pytest.raises(ValueError, match=r"fold: the local block has shape \(4,\) but halo storage has 6 rows"):
        smap(lambda t, x: exchange.fold(x, t, AX, HALO), mesh, t)(t, sharded(mesh, np.ones(8)))


# ---------------------------------------------------------------- graph parallel


def test_graph_parallel_refresh_is_gather_full_and_its_adjoint_a_reduce_scatter():
    owner = [1, 0, 1, 0, 0, 1, 1]
    mesh = make_mesh(2)
    plan = shard_plan(owner, 2)
    t = device_tables(plan, mesh)
    oc = plan.owned_capacity
    glob = 100.0 + np.arange(7)
    local = np.zeros((2, oc + 1))
    for g, d in enumerate(owner):
        local[d, plan.local_index[g]] = glob[g]
    local[:, -1] = [-5.0, -6.0]                                    # each device's "+1" pad row
    xs = sharded(mesh, local.ravel())
    f = smap(lambda t, x: exchange.refresh(x, t, AX, GraphParallelPolicy()), mesh, t)
    g_full = smap(lambda t, x: C.gather_full(x, t, AX), mesh, t)
    out = np.asarray(f(t, xs)).reshape(2, 8)
    np.testing.assert_array_equal(out, [list(glob) + [-5.0], list(glob) + [-6.0]])
    np.testing.assert_array_equal(out.ravel(), g_full(t, xs))
    w = np.random.default_rng(2).normal(size=(2, 8))
    (ct,) = jax.vjp(lambda x: f(t, x), xs)[1](sharded(mesh, w.ravel()))
    want = np.zeros((2, oc + 1))
    for g, d in enumerate(owner):
        want[d, plan.local_index[g]] = w[0, g] + w[1, g]          # summed over every device's copy
    want[:, -1] = w[:, -1]
    np.testing.assert_allclose(np.asarray(ct).reshape(2, oc + 1), want, rtol=0, atol=1e-14)
    for policy in (GraphParallelPolicy(), PlainShard()):           # fold: identity; PlainShard refresh too
        np.testing.assert_array_equal(smap(lambda t, x, p=policy: exchange.fold(x, t, AX, p), mesh, t)(t, xs), xs)
    np.testing.assert_array_equal(smap(lambda t, x: exchange.refresh(x, t, AX, PlainShard()), mesh, t)(t, xs), xs)


# ---------------------------------------------------------------- real plans


@functools.cache
def plan_programs(d, static_key):
    """Refresh and fold programs for real HaloPlans of one static shape (filled on first use)."""
    del static_key
    return make_mesh(d), {}


@hypothesis.settings(max_examples=12)
@hypothesis.given(d=st.sampled_from([1, 2, 4, 8]), n=st.integers(20, 60), periodic=st.booleans(),
                  seed=st.integers(0, 2**31 - 1))
@pytest.mark.slow
def test_real_halo_plans_match_closed_forms_and_are_adjoint(d, n, periodic, seed):
    from nvalchemi_jaxbridge.layout import HaloPlan

    rng = np.random.default_rng(seed)
    cell = np.diag([6.0, 5.0, 4.0])
    pos = rng.uniform(0, 1, (n, 3)) @ cell
    plan = HaloPlan.build(pos, cell, periodic=(periodic,) * 3, cutoff=1.5, n_devices=d, owned_capacity=64,
                          ghost_capacity=400, pair_capacities={k: 160 for k in range(d)})
    mesh = make_mesh(d)
    t = device_tables(plan, mesh)
    _, progs = plan_programs(d, t.static_key)
    if not progs:
        progs["refresh"] = smap(lambda t, x: exchange.refresh(x, t, AX, HALO), mesh, t)
        progs["fold"] = smap(lambda t, x: exchange.fold(x, t, AX, HALO), mesh, t)
    x = rng.normal(size=(d * plan.halo_rows, 2))                  # junk on ghost and padding rows too
    y = rng.normal(size=(d * plan.halo_rows, 2))
    xs, ys = sharded(mesh, x), sharded(mesh, y)
    rx, fy = np.asarray(progs["refresh"](t, xs)), np.asarray(progs["fold"](t, ys))
    np.testing.assert_allclose(rx, ids_refresh(plan, x), rtol=0, atol=1e-12)
    np.testing.assert_allclose(fy, ids_fold(plan, y), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(fy, np_forward(plan, np_reverse(plan, y)), rtol=1e-12, atol=1e-12)
    rty = np.asarray(jax.vjp(lambda a: progs["refresh"](t, a), xs)[1](ys)[0])
    np.testing.assert_allclose(rty, ids_refresh_adjoint(plan, y), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.vdot(y, rx), np.vdot(rty, x), rtol=1e-10, atol=1e-10)
    fty = np.asarray(jax.vjp(lambda a: progs["fold"](t, a), ys)[1](xs)[0])
    np.testing.assert_allclose(np.vdot(x, fy), np.vdot(fty, y), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(fty, ids_fold(plan, x), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------ global-array API


@pytest.fixture(scope="module")
def real():
    from nvalchemi_jaxbridge.layout import HaloPlan

    rng = np.random.default_rng(7)
    cell = np.diag([6.0, 5.0, 4.0])
    pos = rng.uniform(0, 1, (40, 3)) @ cell
    plan = HaloPlan.build(pos, cell, cutoff=1.5, n_devices=4)
    cs = compile(make_spec(HaloStoragePolicy()), make_mesh(4), plan)
    return plan, pos, cs


def test_global_methods_inside_an_outer_jit_with_the_spec_as_argument(real):
    plan, pos, cs = real
    rng = np.random.default_rng(8)
    x_glob = rng.normal(size=(40, 3))
    stale = rng.normal(size=(4 * plan.halo_rows, 3))
    w = rng.normal(size=(4 * plan.halo_rows, 3))
    f = jax.jit(lambda cs, x: cs.fold(cs.refresh(x)))
    np.testing.assert_allclose(f(cs, cs._sharded(stale)), ids_fold(plan, ids_refresh(plan, stale)), rtol=1e-12,
                               atol=1e-12)
    # grad of <w, fold(refresh(x))>: refresh^T fold w (fold self-adjoint)
    g = jax.jit(jax.grad(lambda x, cs: jnp.vdot(w, cs.fold(cs.refresh(x)))))(cs._sharded(stale), cs)
    np.testing.assert_allclose(g, ids_refresh_adjoint(plan, ids_fold(plan, w)), rtol=1e-12, atol=1e-12)
    # owned_to_halo is the forward exchange; halo_to_owned its left inverse on owned rows
    h = jax.jit(lambda cs, x: cs.owned_to_halo(x))(cs, cs.owned(x_glob))
    np.testing.assert_allclose(h, plan.to_halo(x_glob), rtol=0, atol=1e-14)
    hp = cs.owned_to_halo(cs.owned(pos, positions=True), positions=True)
    np.testing.assert_allclose(hp, plan.to_halo(pos, positions=True), rtol=0, atol=1e-12)
    np.testing.assert_allclose(jax.jit(lambda cs, x: cs.halo_to_owned(x))(cs, cs.halo(x_glob)), plan.to_owned(x_glob),
                               rtol=0, atol=0)
    gh = jax.grad(lambda x: jnp.vdot(w, cs.owned_to_halo(x)))(cs.owned(x_glob))
    np.testing.assert_allclose(gh, np_reverse(plan, w), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cs.halo_to_global(cs.halo(x_glob)), x_glob, rtol=0, atol=0)
    np.testing.assert_allclose(cs.halo_to_global(np.asarray(cs.refresh(cs.halo(x_glob)))), x_glob, rtol=0, atol=0)


def test_global_methods_reuse_programs_per_shape(real):
    plan, _, cs = real
    x = cs.halo(np.ones((40, 2)))
    cs.refresh(x)
    n = len(cs._cache)
    cs.refresh(2.0 * x)
    cs.with_plan(plan).refresh(x)
    assert len(cs._cache) == n
    cs.refresh(cs.halo(np.ones((40, 5))))
    assert len(cs._cache) == n + 1


def test_global_methods_name_rows_and_storage(real, golden):
    plan, _, cs = real
    rows = 4 * plan.halo_rows
    with pytest.raises(ValueError, match=rf"CompiledSpec.refresh: expected halo storage with {rows} rows, got "
                                         rf"shape \(5, 3\); build it with cs.halo\(x\)"):
        cs.refresh(np.ones((5, 3)))
    with pytest.raises(ValueError, match=r"CompiledSpec.owned_to_halo: expected owned storage with \d+ rows.*"
                                         r"cs.owned\(x\)"):
        cs.owned_to_halo(np.ones((5, 3)))
    with pytest.raises(ValueError, match=r"CompiledSpec.halo_to_global: expected halo storage with \d+ rows"):
        cs.halo_to_global(np.ones(3))
    with pytest.raises(TypeError, match=r"CompiledSpec.fold: expected an array of per-atom rows, got list"):
        cs.fold([1.0])
    from nvalchemi_jaxbridge.layout import ShardPlan

    gp = compile(make_spec(GraphParallelPolicy()), golden[0], ShardPlan.from_assignment(np.array([0, 1, 1]), 2))
    with pytest.raises(ValueError, match=r"CompiledSpec.halo_to_owned: the spec uses sharded storage"):
        gp.halo_to_owned(np.ones(4))
    full = np.asarray(gp.refresh(gp.owned(np.array([1.0, 2.0, 3.0]))))    # (2 * (3 + 1),): every device all rows
    np.testing.assert_array_equal(full, [1, 2, 3, 0, 1, 2, 3, 0])
    np.testing.assert_array_equal(gp.fold(gp.owned(np.array([1.0, 2.0, 3.0]))), [1, 0, 0, 2, 3, 0])
