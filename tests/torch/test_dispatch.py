"""Install/restore: stacking, double restore, rollback, context managers, call forms, keywords."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.layout import HaloPlan
from nvalchemi_jaxbridge.spec import AdapterRegistry, DistributionSpec, HaloStoragePolicy, OpAdapter
from nvalchemi_jaxbridge.torch import ShardTensor, ShardTensorMeaningError, installed, list_handlers
from tests.torch import model  # noqa: F401  (registers the jbtest ops)


@pytest.fixture(scope="module")
def plan() -> HaloPlan:
    pos = model.system(12, 6.0, 1)
    return HaloPlan.build(pos, np.eye(3) * 6.0, cutoff=model.CUTOFF, n_devices=1)


@pytest.fixture
def x(plan) -> ShardTensor:
    return ShardTensor.from_local(torch.arange(12.0, dtype=torch.float64), plan)


def _ours() -> list:
    return [h for h in list_handlers() if "jbtest" in h.key]


def _labels(op) -> list[str]:
    return [h.label for h in list_handlers() if h.key == str(op) and h.active]


def test_install_registers_overload_and_packet_and_restore_clears(x):
    before = _ours()
    a = OpAdapter(torch.ops.jbtest.twice, gather_inputs=[0])
    m = a.install()
    keys = {h.key for h in _ours()} - {h.key for h in before}
    assert keys == {str(torch.ops.jbtest.twice.default), str(torch.ops.jbtest.twice)}
    a.restore(m)
    assert _ours() == before


def test_both_call_forms_reach_the_handler_above_autograd(x, plan):
    # GatherInputs turns the owned block (n_owned rows) into the halo block: the handler ran.
    n_pad = int(plan.n_owned[0] + plan.n_ghost[0])
    with installed(OpAdapter(torch.ops.jbtest.twice, gather_inputs=[0])):
        for op in (torch.ops.jbtest.twice, torch.ops.jbtest.twice.default):
            y = op(x, x)
            assert y.shape == (n_pad,) and y.layout == "halo"
    # restored: no adapter declares how the custom op's rows cross ranks, so it is refused (default deny)
    with pytest.raises(ShardTensorMeaningError, match=r"jbtest\.twice \(jbtest::twice\).*no OpAdapter installed"):
        torch.ops.jbtest.twice(x, x)
    assert torch.ops.jbtest.twice(x.to_local(), x.to_local()).shape == (12,)  # plain blocks: plain torch


def test_keyword_arguments_are_found_by_schema_name(x, plan):
    n_pad = int(plan.n_owned[0] + plan.n_ghost[0])
    with installed(OpAdapter(torch.ops.jbtest.twice, gather_inputs=[0], owned_slice_inputs=[1])):
        by_kw = torch.ops.jbtest.twice.default(x=x, y=x, scale=3.0)
        by_pos = torch.ops.jbtest.twice(x, x, 3.0)
    assert by_kw.shape == (n_pad,)
    torch.testing.assert_close(by_kw.to_local(), by_pos.to_local())


def test_second_install_stacks_and_restoring_it_brings_back_the_first(x, plan):
    op = torch.ops.jbtest.twice.default
    first = OpAdapter(torch.ops.jbtest.twice, gather_inputs=[0], install_site="first")
    second = OpAdapter(torch.ops.jbtest.twice, owned_slice_inputs=[0], install_site="second")
    m1 = first.install()
    m2 = second.install()
    try:
        assert _labels(op) == [f"OpAdapter[{op}] declared at second"]
        assert torch.ops.jbtest.twice(x, x).shape == (12,)  # SliceOwned: n_owned rows
        second.restore(m2)
        assert _labels(op) == [f"OpAdapter[{op}] declared at first"]
        assert torch.ops.jbtest.twice(x, x).shape[0] == int(plan.n_owned[0] + plan.n_ghost[0])
        second.restore(m2)  # twice: harmless, the first stays
        assert _labels(op) == [f"OpAdapter[{op}] declared at first"]
    finally:
        first.restore(m1)
    assert _labels(op) == []


def test_registry_rolls_back_on_a_failed_install():
    before = _ours()
    reg = AdapterRegistry()
    good = OpAdapter(torch.ops.jbtest.twice, gather_inputs=[0])
    bad = OpAdapter("jbtest_missing_ns::nothing", gather_inputs=[0])
    with pytest.raises(Exception, match="jbtest_missing_ns"):
        reg.install([good, bad])
    assert _ours() == before
    assert [s.state for s in reg.list_active()] == ["restored", "failed"]


def test_lazy_op_resolves_at_install(x):
    a = OpAdapter("jbtest::twice", gather_inputs=[0])
    with installed(a):
        assert str(torch.ops.jbtest.twice.default) in {h.key for h in _ours()}
    with pytest.raises(Exception, match=r"jbtest_missing_ns.*(import|load|regist)"):
        OpAdapter("jbtest_missing_ns::op").install()


def test_context_managers_restore_when_the_body_raises():
    before = _ours()
    with pytest.raises(RuntimeError, match="boom"):
        with installed(OpAdapter(torch.ops.jbtest.twice, gather_inputs=[0])):
            assert _ours() != before
            raise RuntimeError("boom")
    assert _ours() == before
    spec = DistributionSpec(policy=HaloStoragePolicy(), adapters=(OpAdapter(torch.ops.jbtest.twice),))
    with pytest.raises(RuntimeError, match="boom"):
        with spec.installed():
            assert _ours() != before
            raise RuntimeError("boom")
    assert _ours() == before


def test_install_rejects_what_dispatch_cannot_see_or_reach():
    with pytest.raises(TypeError, match=r"plain.*|only sees torch operators"):
        OpAdapter(lambda t: t, gather_inputs=[0]).install()
    with pytest.raises(ValueError, match=r"arg_transforms\[5\].*takes 3 arguments \(x, y, scale\)"):
        OpAdapter(torch.ops.jbtest.twice, gather_inputs=[5]).install()
    with pytest.raises(ValueError, match=r"argument 'scale' of type float, which is not a tensor"):
        OpAdapter(torch.ops.jbtest.twice, gather_inputs=[2]).install()
    with pytest.raises(ValueError, match=r"output_transforms\[1\].*returns 1 value"):
        OpAdapter(torch.ops.jbtest.twice, scatter_outputs=[1]).install()
    assert _ours() == []
