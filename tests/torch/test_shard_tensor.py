"""ShardTensor in one process (world size 1): metadata, round trips, the model, errors."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.layout import HaloPlan, ShardPlan
from nvalchemi_jaxbridge.spec import AllReduceSum, OpAdapter
from nvalchemi_jaxbridge.torch import ShardTensor, installed
from nvalchemi_jaxbridge.torch.dispatch import make_marshaller
from nvalchemi_jaxbridge.torch.meaning import ShardTensorMeaningError
from tests.torch import model

BOX = 6.0


@pytest.fixture(scope="module")
def pos() -> np.ndarray:
    return model.system(12, BOX, 1)


@pytest.fixture(scope="module")
def plan(pos) -> HaloPlan:
    return HaloPlan.build(pos, np.eye(3) * BOX, cutoff=model.CUTOFF, n_devices=1)


def test_metadata_follows_the_leading_dimension(plan, pos):
    x = ShardTensor.from_global(torch.tensor(pos), plan, positions=True)
    assert isinstance(x, ShardTensor) and x.layout == "owned" and x.is_positions
    for y in (x * 2 + 1, torch.sin(x), x[:, 0], x[:, torch.tensor([0, 2])], x.clone()):
        assert isinstance(y, ShardTensor) and y.layout == "owned", y.shape
    assert x[:12].layout == "owned" and x[..., 1:].layout == "owned"  # basic slicing that keeps every row
    assert x.sum().layout == "replicated"  # a sum over atoms: owned rows, then an all-reduce
    refused = (lambda: x.reshape(-1), lambda: x.amax(dim=0), lambda: x[torch.arange(12)], lambda: x[:3])
    for f in refused:  # see test_meaning.py and test_op_catalogue.py
        with pytest.raises(ShardTensorMeaningError):
            f()
    y = x.clone()
    assert y.add_(1) is y and y.layout == "owned"  # in place keeps identity and metadata
    assert x.policy.to_dict()["kind"] == "halo" and x.plan is plan and x.n_owned == 12


def test_replicated_results_are_marked_replicated_and_reductions_drop_metadata(plan, pos):
    x = ShardTensor.from_global(torch.tensor(pos), plan, positions=True)
    ad = OpAdapter(torch.ops.jbtest.system_sum, owned_slice_inputs=[0], all_reduce_outputs=[0])
    with installed(ad):
        e = torch.ops.jbtest.system_sum(x[:, 0])
    assert e.layout == "replicated" and e.shape == (1,) and e.pad_rows == 0
    assert (e * 2).layout == "replicated"
    torch.testing.assert_close(e.to_local(), torch.tensor(pos)[:, :1].sum(0))


@pytest.mark.slow
@hypothesis.settings(max_examples=4)
@hypothesis.given(n=st.integers(4, 14), seed=st.integers(0, 99), replicated=st.booleans())
def test_one_process_model_matches_numpy_reference(n, seed, replicated):
    box = 5.0
    pos = model.system(n, box, seed)
    plan = HaloPlan.build(pos, np.eye(3) * box, cutoff=model.CUTOFF, n_devices=1)
    x = ShardTensor.from_global(torch.tensor(pos), plan, positions=True, requires_grad=True)
    total = OpAdapter(torch.ops.jbtest.system_sum, owned_slice_inputs=[0],
                      output_transforms={0: AllReduceSum(replicated_consumer=replicated)})
    with installed(OpAdapter(torch.ops.jbtest.pair_energy, gather_inputs=[0], scatter_outputs=[0]), total):
        energy = torch.ops.jbtest.pair_energy(x, x.n_owned, model.CUTOFF)
        energy = torch.ops.jbtest.system_sum(energy)
        energy.backward()
    e_ref, f_ref = model.reference(pos, box)
    np.testing.assert_allclose(energy.item(), e_ref, rtol=1e-12)
    forces = -ShardTensor.from_local(x.grad, plan).full_tensor()
    np.testing.assert_allclose(forces.numpy(), f_ref, rtol=1e-9, atol=1e-12)


def test_round_trips_and_adjoint_identity(plan, pos):
    x = ShardTensor.from_global(torch.tensor(pos), plan, positions=True)
    np.testing.assert_array_equal(x.full_tensor().numpy(), pos)
    # halo block from the front door equals the layout layer's numpy halo storage
    h = ShardTensor.from_global(torch.tensor(pos), plan, layout="halo", positions=True)
    want = plan.to_halo(pos, positions=True)[: h.shape[0]]
    np.testing.assert_allclose(h.to_local().numpy(), want, rtol=0, atol=1e-12)
    # <G a, b> == <a, G^T b> for the gather, with G^T from autograd (the program's VJP)
    rng = np.random.default_rng(0)
    a = ShardTensor.from_local(torch.tensor(rng.normal(size=(12, 2))), plan, requires_grad=True)
    b = torch.tensor(rng.normal(size=(h.shape[0], 2)))
    with installed(OpAdapter(torch.ops.jbtest.twice, gather_inputs=[0])):
        ga = torch.ops.jbtest.twice(a, a, scale=1.0)
    (gtb,) = torch.autograd.grad((ga.to_local() * b).sum(), a, create_graph=True)
    np.testing.assert_allclose(float((ga.to_local() * b).sum().detach()), float((a.to_local() * gtb).sum().detach()), rtol=1e-12)
    # double backward: d/db of <a, G^T b> is G a (the adjoint's adjoint is the forward)
    b2 = b.clone().requires_grad_(True)
    (gtb2,) = torch.autograd.grad((ga.to_local() * b2).sum(), a, create_graph=True)
    (back,) = torch.autograd.grad((a.to_local().detach() * gtb2).sum(), b2)
    np.testing.assert_allclose(back.numpy(), ga.to_local().detach().numpy(), rtol=1e-12)


def test_plain_tensor_at_declared_position_follows_the_rule(plan, pos):
    n_own, n_pad = int(plan.n_owned[0]), int(plan.n_owned[0] + plan.n_ghost[0])
    x = ShardTensor.from_global(torch.tensor(pos), plan)
    ad = OpAdapter(torch.ops.jbtest.twice, gather_inputs=[1])
    with installed(ad):
        ok = torch.ops.jbtest.twice(x, torch.ones(n_own), scale=1.0)  # owned block: exchanged
        assert ok.shape == (n_own, 3)
        with pytest.raises(ValueError, match=r"argument 1 \('y'\) has shape \(5,\).*n_owned = 12"):
            torch.ops.jbtest.twice(x, torch.ones(5))
        with pytest.raises(TypeError, match=r"argument 1 \('y', by keyword\) declares GatherInputs but got int"):
            torch.ops.jbtest.twice.default(x, y=3)
    assert n_pad > n_own


def test_transform_for_the_other_storage_kind_raises(plan):
    splan = ShardPlan.from_assignment(np.zeros(5, dtype=int), n_devices=1)
    xs = ShardTensor.from_local(torch.ones(6), splan)  # 5 owned rows + the "+1" pad row
    assert xs.pad_rows == 1
    with installed(OpAdapter(torch.ops.jbtest.twice, gather_inputs=[0])):
        with pytest.raises(TypeError, match=r"arg_transforms\[0\] is GatherInputs, a halo-storage.*ShardPlan"):
            torch.ops.jbtest.twice(xs, xs)
    xh = ShardTensor.from_local(torch.ones(12), plan)
    with installed(OpAdapter(torch.ops.jbtest.twice, slice_outputs_owned=[0])):
        with pytest.raises(TypeError, match=r"output_transforms\[0\] is SliceOutputsOwned.*HaloPlan"):
            torch.ops.jbtest.twice(xh, xh)


def test_construction_errors_name_the_fix(plan, pos):
    with pytest.raises(ValueError, match=r"rank 0 needs n_owned = 12 rows.*shape \(3,\)"):
        ShardTensor.from_local(torch.ones(3), plan)
    with pytest.raises(ValueError, match=r"layout must be one of"):
        ShardTensor.from_local(torch.ones(12), plan, layout="ghosts")
    with pytest.raises(ValueError, match=r"global tensor has shape \(11, 3\) but the plan has 12 atoms"):
        ShardTensor.from_global(torch.tensor(pos[:11]), plan)
    two = HaloPlan.build(pos, np.eye(3) * BOX, cutoff=model.CUTOFF, n_devices=2)
    with pytest.raises(ValueError, match=r"built for 2 devices but this job has 1 process.*launcher"):
        ShardTensor.from_global(torch.tensor(pos), two)


def test_marshaller_runs_on_local_blocks_and_rewraps(plan):
    seen = []

    def f(a, b):
        seen.append((type(a), type(b)))
        return a + b, a.sum()

    x = ShardTensor.from_local(torch.ones(12), plan)
    y, s = make_marshaller(f)(x, 2.0)
    assert seen == [(torch.Tensor, float)]
    assert isinstance(y, ShardTensor) and y.layout == "owned" and type(s) is torch.Tensor


def test_unwrapped_positions_give_wrapped_halo_and_reference_forces():
    # Atoms passed at random periodic images: same energy and forces; a halo-layout block re-gathers to itself.
    box = 6.0
    wrapped = model.system(12, box, 2)
    pos = wrapped + np.random.default_rng(1).integers(-2, 3, wrapped.shape) * box
    plan = HaloPlan.build(pos, np.eye(3) * box, cutoff=model.CUTOFF, n_devices=1)
    x = ShardTensor.from_global(torch.tensor(pos), plan, positions=True, requires_grad=True)
    h = ShardTensor.from_global(torch.tensor(pos), plan, layout="halo", positions=True)
    want = plan.to_halo(pos, positions=True)[: h.shape[0]]
    np.testing.assert_allclose(h.to_local().numpy(), want, rtol=0, atol=1e-12)
    assert np.all((want[: plan.n_owned[0]] >= -1e-12) & (want[: plan.n_owned[0]] < box + 1e-12))  # inside the cell
    with installed(OpAdapter(torch.ops.jbtest.twice, gather_inputs=[0])):
        again = torch.ops.jbtest.twice(h, h, scale=1.0)
    np.testing.assert_allclose(again.to_local().numpy(), want, rtol=0, atol=1e-12)
    with installed(OpAdapter(torch.ops.jbtest.pair_energy, gather_inputs=[0], scatter_outputs=[0])):
        rows = torch.ops.jbtest.pair_energy(x, x.n_owned, model.CUTOFF)
    energy = rows.to_local()[: x.n_owned].sum()
    energy.backward()
    e_ref, f_ref = model.reference(wrapped, box)
    np.testing.assert_allclose(energy.item(), e_ref, rtol=1e-12)
    np.testing.assert_allclose(-x.grad.to_local().numpy(), f_ref[plan.owned_global[0, : x.n_owned]], rtol=1e-9, atol=1e-12)
