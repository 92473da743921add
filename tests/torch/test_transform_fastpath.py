"""The front door's fast path (issue 7: cached steps, sharding, zero blocks) against closed forms and the old path.

One process, one device: GatherInputs puts `x[g]` on every halo row of atom `g`,
ScatterOutputs then holds `count[g] * x[g]` (all copies of `g` summed back and
sent out again), and its gradient on owned rows is `count[g] * S_w[g]` (self
adjoint), all from the plan's `halo_global` ids, never from the exchange tables.
Both values of the benchmark switch must give these, and the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nvalchemi_jaxbridge.layout import HaloPlan
from nvalchemi_jaxbridge.torch import functions as F


@pytest.fixture(params=[True, False], ids=["fast", "before"])
def path(request, monkeypatch):
    """Run the test under one value of the benchmark switch `_FAST_PATH`."""
    monkeypatch.setattr(F, "_FAST_PATH", request.param)
    return request.param


def _plan(n: int, seed: int, headroom: float) -> HaloPlan:
    pos = np.random.default_rng(seed).uniform(0.0, 5.0, (n, 3))
    return HaloPlan.build(pos, np.eye(3) * 5.0, cutoff=1.4, n_devices=1, headroom=headroom)


def _round_trip(ctx: F.PlanContext, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ScatterOutputs(GatherInputs(x)) and d<w, out>/dx through the front door's functions."""
    x = x.clone().requires_grad_(True)
    halo = F.halo_from_owned(ctx, x, positions=False)
    step = F.scatter_outputs_step(ctx, tuple(halo.shape), F._jax_dtype(halo))
    out = F.apply(F.ScatterOutputsFn, halo, step)
    (grad,) = torch.autograd.grad((out * w).sum(), x)
    return out.detach(), grad


@settings(max_examples=8)  # every example compiles its own programs (~1 s each)
@given(n=st.integers(6, 18), seed=st.integers(0, 10**6), headroom=st.sampled_from([1.0, 1.6]),
       feat=st.sampled_from([1, 3]), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_round_trip_and_gradient_match_the_closed_form_on_both_paths(n, seed, headroom, feat, dtype):
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
    got = {}
    for fast in (True, False):
        old, F._FAST_PATH = F._FAST_PATH, fast
        try:
            got[fast] = _round_trip(ctx, x, wt)
        finally:
            F._FAST_PATH = old
        out, grad = got[fast]
        np.testing.assert_allclose(out.numpy(), want_out, rtol=tol, atol=tol)
        np.testing.assert_allclose(grad.numpy(), want_grad, rtol=tol, atol=tol)
    assert all(torch.equal(a, b) for a, b in zip(got[True], got[False]))  # same programs, same bits


def test_gather_full_and_all_reduce_match_closed_forms(path):
    plan = _plan(11, 3, 1.6)
    ctx = F.context_for(plan)
    x_global = np.random.default_rng(4).normal(size=(11, 2))
    owned = np.asarray(plan.owned_global)[0, : ctx.n_owned]
    full = F.gather_owned(ctx, torch.tensor(x_global[owned]))
    np.testing.assert_array_equal(full.numpy(), x_global)  # one rank: all rows, in global-id order
    y = torch.tensor(x_global)
    step = F.all_reduce_step(ctx, tuple(y.shape), F._jax_dtype(y), replicated_consumer=False)
    np.testing.assert_array_equal(F.apply(F.AllReduceSumFn, y, step).numpy(), x_global)  # a sum over one rank


def test_steps_are_reused_per_shape_only_on_the_fast_path(path):
    ctx = F.context_for(_plan(9, 1, 1.0))
    shape, dtype = (ctx.n_owned, 3), np.dtype("float64")
    a = F.gather_inputs_step(ctx, shape, dtype, positions=False)
    b = F.gather_inputs_step(ctx, shape, dtype, positions=False)
    other = F.gather_inputs_step(ctx, (ctx.n_owned, 2), dtype, positions=False)
    assert (a is b) == path and a is not other
    assert F.gather_inputs_step(ctx, shape, dtype, positions=True) is not a


@given(n=st.integers(0, 7), extra=st.integers(0, 5), tail=st.sampled_from([(), (2,), (2, 3)]))
def test_pad_with_cached_zeros_matches_numpy_and_keeps_the_cache_zero(n, extra, tail):
    memo: dict = {}
    x = np.random.default_rng(n).normal(size=(n, *tail))
    want = np.concatenate([x, np.zeros((extra, *tail))])
    for _ in range(2):  # the second call takes the cached block
        got = F._pad(torch.tensor(x), n + extra, memo)
        np.testing.assert_array_equal(got.numpy(), want)
        np.testing.assert_array_equal(F._pad(torch.tensor(x), n + extra).numpy(), want)
        got.fill_(7.0)  # a caller writing into its block must not reach the cached zeros
    assert all(not z.any() for z in memo.values())


def test_pad_beyond_the_capacity_raises():
    with pytest.raises(ValueError, match="block of 5 rows exceeds the capacity 4"):
        F._pad(torch.zeros(5, 3), 4, {})
