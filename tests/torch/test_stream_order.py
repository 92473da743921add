"""Memory ordering of the front door's JAX programs (what replaces the per-program host sync on GPU).

The GPU race itself cannot happen on CPU; what is checked here is the logic the
GPU path relies on, shared with the CPU path: JAX holds a torch reference to an
imported block, the program's output is converted while its input is still
held, and fresh blocks give closed-form results on the front door's (only,
stream-ordered) path.
"""

from __future__ import annotations

import gc

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.kernels.dlpack import torch_to_jax
from nvalchemi_jaxbridge.layout import HaloPlan
from nvalchemi_jaxbridge.torch import block_programs
from nvalchemi_jaxbridge.torch import functions as F
from tests.torch import model, stress

BOX = 6.0


@pytest.fixture(scope="module")
def plan() -> HaloPlan:
    return HaloPlan.build(model.system(12, BOX, 1), np.eye(3) * BOX, cutoff=model.CUTOFF, n_devices=1)


def _uses(storage: torch.UntypedStorage) -> int:
    """How many owners hold `storage` (torch's own count; our handle is one of them)."""
    return torch._C._storage_Use_Count(storage._cdata)


@pytest.mark.slow
def test_jax_holds_a_torch_reference_to_an_imported_block():
    t = torch.arange(64, dtype=torch.float64)
    s = t.untyped_storage()
    a = torch_to_jax(t, name="block")
    assert a.unsafe_buffer_pointer() == t.data_ptr()  # zero copy
    del t
    gc.collect()
    assert _uses(s) == 2  # our handle + the DLPack capsule JAX holds
    np.testing.assert_array_equal(np.asarray(a), np.arange(64.0))
    del a
    gc.collect()
    assert _uses(s) == 1  # JAX's reference went with the array


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_output_is_converted_while_the_input_block_is_held(monkeypatch, plan, direction):
    ctx = F.context_for(plan)
    step = F.gather_inputs_step(ctx, (ctx.n_owned, 3), np.float64, positions=False)
    rng = np.random.default_rng(0)
    if direction == "forward":  # owned storage, not contiguous: the exported block is a temporary copy
        x = torch.tensor(rng.normal(size=(3, ctx.owned_capacity))).T
        want = plan.reference_forward(x.numpy())[: ctx.n_owned + ctx.n_ghost]
    else:  # fewer rows than halo_rows: the exported block is a padded temporary
        x = torch.tensor(rng.normal(size=(ctx.n_owned + ctx.n_ghost, 3)))
        full = np.zeros((ctx.halo_rows, 3))
        full[: len(x)] = x.numpy()
        want = plan.reference_reverse(full)[: ctx.n_owned]
    exported: list[torch.UntypedStorage] = []
    at_convert: list[list[int]] = []

    def probe_import(t, **kw):
        exported.append(t.untyped_storage())
        return torch_to_jax(t, **kw)

    def probe_convert(a, **kw):
        at_convert.append([_uses(s) for s in exported])
        return real_convert(a, **kw)

    real_convert = block_programs.jax_to_torch
    monkeypatch.setattr(block_programs, "torch_to_jax", probe_import)
    monkeypatch.setattr(block_programs, "jax_to_torch", probe_convert)
    got = step.forward(x) if direction == "forward" else step.backward(x)
    gc.collect()
    assert len(exported) == 1 and exported[0].data_ptr() != x.data_ptr()
    assert len(at_convert) == 1 and at_convert[0][0] >= 2, "the input block was released before the conversion"
    assert _uses(exported[0]) == 1  # the temporary is released afterwards (so the check above can fail)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12)


@hypothesis.settings(max_examples=4)
@hypothesis.given(seed=st.integers(0, 99), features=st.sampled_from([1, 3]))
def test_fresh_blocks_match_closed_form(plan, seed, features):
    res = stress.exchange_stress(plan, 0, torch.device("cpu"), iters=3, features=features, seed=seed)
    assert max(res["forward"]) < 1e-12 and max(res["backward"]) < 1e-12, res


def test_model_with_fresh_plans_matches_numpy():
    res = stress.model_stress(model.system(12, BOX, 1), BOX, 1, torch.device("cpu"), iters=2)
    assert max(res["energy"]) < 1e-12 and max(res["forces"]) < 1e-9, res


def test_exchange_reference_matches_the_layout_tables(plan):
    # the stress checks' closed form (ids only) agrees with the plan's table-based numpy exchanges
    rng = np.random.default_rng(1)
    x = rng.normal(size=(plan.n_atoms, 2))
    n_pad = int(plan.n_owned[0] + plan.n_ghost[0])
    w = rng.normal(size=(n_pad, 2))
    out, grad = stress.exchange_reference(plan, 0, x, [w])
    halo = plan.reference_forward(plan.to_owned(x))
    np.testing.assert_allclose(out, plan.reference_forward(plan.reference_reverse(halo))[:n_pad], rtol=1e-12)
    w_full = np.zeros((plan.halo_rows, 2))
    w_full[:n_pad] = w
    scat = plan.reference_forward(plan.reference_reverse(w_full))
    scat[n_pad:] = 0.0
    np.testing.assert_allclose(grad, plan.reference_reverse(scat)[: int(plan.n_owned[0])], rtol=1e-12)
