"""Transforms and storage policies: JSON kinds (golden, from the 0.2.0 wheel), equality, errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given

import nvalchemi_jaxbridge as nb
from nvalchemi_jaxbridge.spec import policies
from nvalchemi_jaxbridge.spec.transforms import (
    arg_transform_from_dict,
    output_transform_from_dict,
    transform_to_dict,
)

from ._helpers import ARG_TRANSFORMS, OUTPUT_TRANSFORMS, POLICIES, golden

ARGS = [nb.GatherInputs(), nb.GatherInputsFull(), nb.SliceOwned()]
OUTS = [nb.ScatterOutputs(), nb.AllReduceSum(), nb.AllReduceSum(replicated_consumer=True), nb.SliceOutputsOwned()]


def test_transform_json_matches_reference():
    want = golden("transforms.json")
    assert [transform_to_dict(t) for t in ARGS] == want["arg"]
    assert [transform_to_dict(t) for t in OUTS] == want["output"]
    assert [arg_transform_from_dict(d) for d in want["arg"]] == ARGS
    assert [output_transform_from_dict(d) for d in want["output"]] == OUTS


def test_transforms_compare_by_class_and_fields_and_hash():
    assert nb.GatherInputs() == nb.GatherInputs() != nb.GatherInputsFull()
    assert nb.AllReduceSum() == nb.AllReduceSum(False) != nb.AllReduceSum(True)
    assert len({*ARGS, *OUTS, nb.AllReduceSum(False)}) == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        nb.AllReduceSum().replicated_consumer = True  # type: ignore[misc]
    assert all(isinstance(t, nb.ArgTransform) for t in ARGS)
    assert all(isinstance(t, nb.OutputTransform) for t in OUTS)
    assert not any(isinstance(t, nb.ArgTransform) for t in OUTS)


def test_legacy_transform_dicts_without_fields_load():
    assert output_transform_from_dict({"type": "all_reduce_sum"}) == nb.AllReduceSum(False)


@given(ARG_TRANSFORMS, OUTPUT_TRANSFORMS)
def test_transform_round_trip(a, o):
    assert arg_transform_from_dict(json.loads(json.dumps(transform_to_dict(a)))) == a
    assert output_transform_from_dict(json.loads(json.dumps(transform_to_dict(o)))) == o


@pytest.mark.parametrize(
    ("decode", "d", "exc", "match"),
    [
        (arg_transform_from_dict, {"type": "gather_input"}, nb.SpecError,
         r"\.type: unknown transform 'gather_input'; did you mean 'gather_inputs'\?"),
        (arg_transform_from_dict, {"type": "scatter_outputs"}, nb.SpecError,
         r"'scatter_outputs' is an output transform and belongs in output_transforms"),
        (output_transform_from_dict, {"type": "slice_owned"}, nb.SpecError,
         r"'slice_owned' is an argument transform and belongs in arg_transforms"),
        (arg_transform_from_dict, {"kind": "slice_owned"}, nb.SpecError, r"has no \"type\""),
        (arg_transform_from_dict, "slice_owned", nb.SpecError, r"must be an object"),
        (arg_transform_from_dict, {"type": "slice_owned", "foo": 1}, TypeError,
         r"unknown field\(s\) \['foo'\] for transform 'slice_owned'; allowed: none"),
        (output_transform_from_dict, {"type": "all_reduce_sum", "replicated_consumer": "yes"}, TypeError,
         r"\.replicated_consumer: transform 'all_reduce_sum': \"replicated_consumer\" must be true or false, got "
         r"str \"yes\"; write false \(the default\) or true, unquoted"),
        (output_transform_from_dict, {"type": "all_reduce_sum", "replicated_consumer": 1}, TypeError,
         r"must be true or false, got int 1;"),
    ],
)
def test_transform_decoding_errors(decode, d, exc, match):
    with pytest.raises(exc, match=match):
        decode(d, "$.x")


# --------------------------------------------------------------------------- policies


REF_POLICIES = [None, nb.HaloStoragePolicy(), nb.HaloStoragePolicy("local", "local"), nb.RefreshOnlyHaloPolicy(),
                nb.RefreshOnlyHaloPolicy(scatter_mode="local"), nb.PlainShard(), nb.GraphParallelPolicy()]


def test_policy_json_matches_reference():
    want = golden("policies.json")
    assert [nb.policy_to_dict(p) for p in REF_POLICIES] == want["to_dict"]
    assert [nb.policy_from_dict(d) for d in want["to_dict"]] == REF_POLICIES
    # Records without modes: the reference's loader defaults, including refresh_halo's "local".
    for kind, d in want["from_sparse"].items():
        assert nb.policy_to_dict(nb.policy_from_dict({"kind": kind})) == d


@given(POLICIES)
def test_policy_round_trip(p):
    assert nb.policy_from_dict(json.loads(json.dumps(nb.policy_to_dict(p)))) == p


def test_policies_compare_by_class():
    assert nb.HaloStoragePolicy() != nb.RefreshOnlyHaloPolicy()
    assert nb.PlainShard() != nb.GraphParallelPolicy()
    assert isinstance(nb.RefreshOnlyHaloPolicy(), nb.HaloStoragePolicy)
    assert isinstance(nb.HaloStoragePolicy(), nb.StoragePolicy)
    assert len(set(REF_POLICIES)) == len(REF_POLICIES)


@pytest.mark.parametrize(
    ("d", "match"),
    [
        ({"kind": "hallo"}, r"\$\.policy\.kind: unknown policy kind 'hallo'; did you mean 'halo'\?"),
        ({"scatter_mode": "local"}, r"has no \"kind\""),
        ({"kind": "halo", "scatter_mode": "halo_corection"}, r"scatter_mode: unknown mode 'halo_corection'; did you mean 'halo_correction'"),
        ({"kind": "shard", "scatter_mode": "local"}, r"unknown field\(s\) \['scatter_mode'\] for policy kind 'shard'"),
        (["halo"], r"must be an object"),
    ],
)
def test_policy_decoding_errors(d, match):
    with pytest.raises(nb.SpecError, match=match):
        nb.policy_from_dict(d, "$.policy")


def test_policy_modes_are_validated_at_construction():
    with pytest.raises(nb.SpecError, match=r"HaloStoragePolicy\(gather_mode=\.\.\.\): unknown mode 'bogus'"):
        nb.HaloStoragePolicy(gather_mode="bogus")
    with pytest.raises(TypeError, match=r"expected a storage policy or None, got str"):
        nb.policy_to_dict("halo")  # type: ignore[arg-type]


@pytest.fixture
def policy_registry():
    saved = dict(policies._POLICY_KINDS)
    yield
    policies._POLICY_KINDS.clear()
    policies._POLICY_KINDS.update(saved)


@dataclasses.dataclass(frozen=True)
class Slabs:
    width: float
    kind = "slabs"

    def to_dict(self):
        return {"kind": self.kind, "width": self.width}


def test_register_policy_kind_round_trips_a_custom_kind(policy_registry):
    with pytest.raises(nb.SpecError, match=r"unknown policy kind 'slabs'.*register_policy_kind"):
        nb.policy_from_dict({"kind": "slabs", "width": 2.0})
    nb.register_policy_kind("slabs", lambda d: Slabs(d["width"]))
    p = nb.policy_from_dict({"kind": "slabs", "width": 2.0})
    assert p == Slabs(2.0) and nb.policy_to_dict(p) == {"kind": "slabs", "width": 2.0}
    spec = nb.load_spec({"policy": {"kind": "slabs", "width": 2.0}})
    assert spec.distribution.policy == Slabs(2.0)


def test_register_policy_kind_errors(policy_registry):
    with pytest.raises(nb.SpecError, match=r"'halo' is a built-in policy kind"):
        nb.register_policy_kind("halo", lambda d: None)
    with pytest.raises(TypeError, match=r"builder must be callable"):
        nb.register_policy_kind("x", 3)  # type: ignore[arg-type]
    nb.register_policy_kind("broken", lambda d: 42)
    with pytest.raises(TypeError, match=r"builder registered for policy kind 'broken' returned int"):
        nb.policy_from_dict({"kind": "broken"})
