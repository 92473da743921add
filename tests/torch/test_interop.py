"""from_nvalchemi: declarations built with nvalchemi-toolkit's classes, converted via their JSON."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest

from nvalchemi_jaxbridge.spec import (
    AllReduceSum,
    DistributionSpec,
    GatherInputs,
    HaloStoragePolicy,
    OpAdapter,
    PythonAdapter,
    ScatterOutputs,
)
from nvalchemi_jaxbridge.torch import from_nvalchemi

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "nvalchemi_0_2_0"

# Literal to_dict() output of the reference (semantics reference, sections 1.7 and 2.5).
PME_OP = json.loads(
    '{"op":"nvalchemiops::spline_spread","arg_transforms":{"0":{"type":"slice_owned"},'
    '"1":{"type":"slice_owned"}},"output_transforms":{"0":{"type":"all_reduce_sum","replicated_consumer":true}}}'
)
SPEC = json.loads(
    '{"policy":{"kind":"halo","scatter_mode":"halo_correction","gather_mode":"halo_read"},'
    '"custom_ops":[{"op":"demo::conv","arg_transforms":{"0":{"type":"gather_inputs"}},'
    '"output_transforms":{"0":{"type":"scatter_outputs"}}}],'
    '"third_party_helpers":[{"kind":"python","module_path":"aimnet.nbops","attr_name":"mol_sum",'
    '"replacement":null}],"shard_fields":["positions"]}'
)


class _Mimic:
    """Stands in for an nvalchemi object: only `to_dict()` (a fresh copy each call)."""

    def __init__(self, d: dict, module: str = "nvalchemi.distributed._core.adapter") -> None:
        self._d = d
        type(self).__module__ = module

    def to_dict(self) -> dict:
        return copy.deepcopy(self._d)


class AllReduceSumMarker:  # noqa: D101 - a transform marker of the reference has no to_dict
    replicated_consumer = True


AllReduceSumMarker.__name__ = "AllReduceSum"


def test_op_adapter_from_reference_json():
    got = from_nvalchemi(_Mimic(PME_OP))
    want = OpAdapter("nvalchemiops::spline_spread", owned_slice_inputs=[0, 1],
                     output_transforms={0: AllReduceSum(replicated_consumer=True)})
    assert got == want
    assert got.to_dict() == PME_OP


def test_distribution_spec_and_mlip_envelope_from_reference_json():
    want = DistributionSpec(
        policy=HaloStoragePolicy(),
        adapters=(OpAdapter("demo::conv", arg_transforms={0: GatherInputs()}, output_transforms={0: ScatterOutputs()}),
                  PythonAdapter("aimnet.nbops", "mol_sum")),
        shard_fields=("positions",),
    )
    assert from_nvalchemi(_Mimic(SPEC)) == want
    assert from_nvalchemi({"version": 2, "core": SPEC, "system_reductions": True}) == want
    assert from_nvalchemi(_Mimic(SPEC["policy"])) == HaloStoragePolicy()


def test_transform_marker_by_class_name():
    assert from_nvalchemi(AllReduceSumMarker()) == AllReduceSum(replicated_consumer=True)


def test_unconvertible_objects_say_what_is_accepted():
    with pytest.raises(TypeError, match=r"has no to_dict\(\); pass an nvalchemi OpAdapter"):
        from_nvalchemi(object())
    with pytest.raises(ValueError, match=r"cannot tell what .* keys \['foo'\]"):
        from_nvalchemi({"foo": 1})


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_reference_op_adapters_keep_their_roles():
    cases = _fixture("op_adapters.json")
    assert len(cases) >= 10
    for name, case in cases.items():
        ours = from_nvalchemi(_Mimic(case["dict"]))
        for prop, want in case["properties"].items():
            assert list(getattr(ours, prop)) == want, (name, prop)
        assert ours.to_dict() == case["dict"], name


@pytest.mark.parametrize("name", ["spec_all_kinds.json", "spec_lazy_op.json", "spec_sharded.json"])
def test_reference_specs_round_trip(name):
    d = _fixture(name)
    ours = from_nvalchemi(_Mimic(d))
    assert isinstance(ours, DistributionSpec)
    assert ours.to_dict() == d


@pytest.mark.parametrize("name", ["v2_envelope.json", "v2_preset_mpnn_halo.json", "v2_preset_mpnn_gp.json"])
def test_reference_v2_envelopes_give_their_core(name):
    d = _fixture(name)
    assert from_nvalchemi(_Mimic(d)).to_dict() == d["core"]


def test_real_nvalchemi_classes():
    nv = pytest.importorskip("nvalchemi.distributed", reason="nvalchemi-toolkit is not installed in this venv")
    a = nv.OpAdapter("demo::conv", gather_inputs=[0], scatter_outputs=[0])
    assert from_nvalchemi(a) == OpAdapter("demo::conv", gather_inputs=[0], scatter_outputs=[0])
