"""The front door's transforms (cached steps, sharding, zero blocks; issue 7) against closed forms.

One process, one device: GatherInputs puts `x[g]` on every halo row of atom `g`,
ScatterOutputs then holds `count[g] * x[g]` (all copies of `g` summed back and
sent out again), and its gradient on owned rows is `count[g] * S_w[g]` (self
adjoint), all from the plan's `halo_global` ids, never from the exchange tables.
`refresh_halo` / `fold_halo` are checked the same way (a periodic one-device
plan has ghost rows: images of its own atoms). The path before issue 7 (steps
rebuilt per call) was compared bit for bit with this one until it was removed;
its timings are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nvalchemi_jaxbridge.layout import HaloPlan
from nvalchemi_jaxbridge.torch import functions as F
from nvalchemi_jaxbridge.torch.block_programs import _jax_dtype, _pad
from nvalchemi_jaxbridge.torch.layer_exchange import fold_halo, refresh_halo


def _plan(n: int, seed: int, headroom: float) -> HaloPlan:
    pos = np.random.default_rng(seed).uniform(0.0, 5.0, (n, 3))
    return HaloPlan.build(pos, np.eye(3) * 5.0, cutoff=1.4, n_devices=1, headroom=headroom)


def _round_trip(ctx: F.PlanContext, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ScatterOutputs(GatherInputs(x)) and d<w, out>/dx through the front door's functions."""
    x = x.clone().requires_grad_(True)
    halo = F.halo_from_owned(ctx, x, positions=False)
    step = F.scatter_outputs_step(ctx, tuple(halo.shape), _jax_dtype(halo))
    out = F.apply(F.ScatterOutputsFn, halo, step)
    (grad,) = torch.autograd.grad((out * w).sum(), x)
    return out.detach(), grad


@settings(max_examples=8)  # every example compiles its own programs (~1 s each)
@given(n=st.integers(6, 18), seed=st.integers(0, 10**6), headroom=st.sampled_from([1.0, 1.6]),
       feat=st.sampled_from([1, 3]), dtype=st.sampled_from([torch.float32, torch.float64]))
@pytest.mark.slow
def test_round_trip_and_gradient_match_the_closed_form(n, seed, headroom, feat, dtype):
    plan = _plan(n, seed, headroom)
    ctx = F.context_for(plan)
    rng = np.random.default_rng(seed + 1)
    x_global = rng.normal(size=(n, feat))
    n_pad = ctx.n_owned + ctx.n_ghost
    ids = np.asarray(plan.halo_global)[0, :n_pad]
    owned = np.asarray(plan.owned_global)[0, : ctx.n_owned]
    w = rng.normal(size=(n_pad, feat))
    count = np.bincount(ids, minlength=n).astype(float)
    s_w = np.zeros((n, feat))
    np.add.at(s_w, ids, w)
    want_out, want_grad = count[ids, None] * x_global[ids], count[owned, None] * s_w[owned]
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    x, wt = torch.tensor(x_global[owned], dtype=dtype), torch.tensor(w, dtype=dtype)
    for _ in range(2):  # the second call reuses the cached steps and zero blocks
        out, grad = _round_trip(ctx, x, wt)
        np.testing.assert_allclose(out.numpy(), want_out, rtol=tol, atol=tol)
        np.testing.assert_allclose(grad.numpy(), want_grad, rtol=tol, atol=tol)


def test_gather_full_and_all_reduce_match_closed_forms():
    plan = _plan(11, 3, 1.6)
    ctx = F.context_for(plan)
    x_global = np.random.default_rng(4).normal(size=(11, 2))
    owned = np.asarray(plan.owned_global)[0, : ctx.n_owned]
    full = F.gather_owned(ctx, torch.tensor(x_global[owned]))
    np.testing.assert_array_equal(full.numpy(), x_global)  # one rank: all rows, in global-id order
    y = torch.tensor(x_global)
    step = F.all_reduce_step(ctx, tuple(y.shape), _jax_dtype(y), replicated_consumer=False)
    np.testing.assert_array_equal(F.apply(F.AllReduceSumFn, y, step).numpy(), x_global)  # a sum over one rank


def test_steps_are_reused_per_shape():
    ctx = F.context_for(_plan(9, 1, 1.0))
    shape, dtype = (ctx.n_owned, 3), np.dtype("float64")
    a = F.gather_inputs_step(ctx, shape, dtype, positions=False)
    b = F.gather_inputs_step(ctx, shape, dtype, positions=False)
    other = F.gather_inputs_step(ctx, (ctx.n_owned, 2), dtype, positions=False)
    assert a is b and a is not other
    assert F.gather_inputs_step(ctx, shape, dtype, positions=True) is not a


@given(n=st.integers(0, 7), extra=st.integers(0, 5), tail=st.sampled_from([(), (2,), (2, 3)]))
def test_pad_with_cached_zeros_matches_numpy_and_keeps_the_cache_zero(n, extra, tail):
    memo: dict = {}
    x = np.random.default_rng(n).normal(size=(n, *tail))
    want = np.concatenate([x, np.zeros((extra, *tail))])
    for _ in range(2):  # the second call takes the cached block
        got = _pad(torch.tensor(x), n + extra, memo)
        np.testing.assert_array_equal(got.numpy(), want)
        got.fill_(7.0)  # a caller writing into its block must not reach the cached zeros
    assert all(not z.any() for z in memo.values())


def test_pad_beyond_the_capacity_raises():
    with pytest.raises(ValueError, match="block of 5 rows exceeds the capacity 4"):
        _pad(torch.zeros(5, 3), 4, {})


@settings(max_examples=6)
@given(n=st.integers(6, 18), seed=st.integers(0, 10**6), feat=st.sampled_from([1, 3]))
def test_refresh_and_fold_halo_match_closed_forms_on_one_rank(n, seed, feat):
    plan = _plan(n, seed, 1.6)
    ctx = F.context_for(plan)
    rng = np.random.default_rng(seed + 2)
    n_pad = ctx.n_owned + ctx.n_ghost
    ids = np.asarray(plan.halo_global)[0, :n_pad]
    owned = np.asarray(plan.owned_global)[0, : ctx.n_owned]
    x_global = rng.normal(size=(n, feat))
    stale = np.concatenate([x_global[owned], rng.normal(size=(ctx.n_ghost, feat))])  # junk on ghost rows
    w = rng.normal(size=(n_pad, feat))
    s_w = np.zeros((n, feat))
    np.add.at(s_w, ids, w)
    block = torch.tensor(stale, requires_grad=True)
    out = refresh_halo(plan, block)
    np.testing.assert_allclose(out.detach().numpy(), x_global[ids], rtol=0, atol=1e-14)
    (grad,) = torch.autograd.grad((out * torch.tensor(w)).sum(), block)
    want = np.zeros((n_pad, feat))
    want[: ctx.n_owned] = s_w[owned]                                  # ghost gradients summed into owners
    np.testing.assert_allclose(grad.numpy(), want, rtol=1e-12, atol=1e-12)
    y = torch.tensor(w, requires_grad=True)
    folded = fold_halo(plan, y)
    np.testing.assert_allclose(folded.detach().numpy(), s_w[ids], rtol=1e-12, atol=1e-12)
    (g2,) = torch.autograd.grad((folded * block.detach()).sum(), y)
    np.testing.assert_allclose(g2.numpy(), fold_halo(plan, block.detach()).numpy(), rtol=1e-12, atol=1e-12)


def test_refresh_and_fold_halo_follow_the_policy():
    from nvalchemi_jaxbridge.layout import ShardPlan
    from nvalchemi_jaxbridge.spec.policies import (
        GraphParallelPolicy, HaloStoragePolicy, PlainShard, RefreshOnlyHaloPolicy)

    plan = _plan(12, 5, 1.6)
    ctx = F.context_for(plan)
    block = torch.randn(ctx.n_owned + ctx.n_ghost, 2, dtype=torch.float64)
    assert refresh_halo(plan, block, HaloStoragePolicy(gather_mode="local")) is block
    for off in (RefreshOnlyHaloPolicy(), HaloStoragePolicy(scatter_mode="local")):
        assert fold_halo(plan, block, off) is block
    assert torch.equal(refresh_halo(plan, block, RefreshOnlyHaloPolicy()), refresh_halo(plan, block))
    with pytest.raises(ValueError, match=r"refresh_halo: expected this rank's halo block of n_owned \+ n_ghost"):
        refresh_halo(plan, block[:-1])
    with pytest.raises(ValueError, match=r"fold_halo: the policy PlainShard\(\) uses shard storage but the plan"):
        fold_halo(plan, block, PlainShard())
    splan = ShardPlan.from_assignment(np.zeros(5, int), 1)
    x = torch.arange(6.0, dtype=torch.float64)                        # 5 owned rows, then a pad row
    np.testing.assert_array_equal(refresh_halo(splan, x, GraphParallelPolicy()).numpy(), x.numpy())
    assert refresh_halo(splan, x) is x and fold_halo(splan, x, GraphParallelPolicy()) is x
