"""OpAdapter: constructor forms, properties, JSON (golden from the 0.2.0 wheel), errors, laziness."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle

import pytest
from hypothesis import given

import nvalchemi_jaxbridge as nb
from nvalchemi_jaxbridge.spec.errors import OpResolutionError

from ._helpers import OP_ADAPTERS, canon, golden

PROPS = ("gather_inputs", "gather_inputs_full", "owned_slice_inputs", "scatter_outputs",
         "all_reduce_outputs", "all_reduce_replicated_outputs", "slice_outputs_owned")


@pytest.fixture(scope="module")
def ops():
    """demo::spread (custom_op) and demo::conv with a default and a `fast` overload."""
    torch = pytest.importorskip("torch")
    libs = []
    if not hasattr(torch.ops.demo, "spread"):
        @torch.library.custom_op("demo::spread", mutates_args=(), schema="(Tensor x, Tensor w) -> (Tensor, Tensor)")
        def spread(x, w):
            return x * w, x.sum(0, keepdim=True)

        lib = torch.library.Library("demo", "FRAGMENT")
        lib.define("conv(Tensor x) -> Tensor")
        lib.define("conv.fast(Tensor x, int k) -> Tensor")
        libs.append(lib)
    return torch.ops.demo.spread, torch.ops.demo.conv, libs


def reference_forms(ops):
    """The constructor forms of scripts/make_golden_fixtures.py, built with our classes.

    Where the reference silently picks one of two conflicting transforms we raise instead,
    so those two forms are written here with the transforms the reference kept.
    """
    spread, conv, _ = ops
    return {
        "packet": nb.OpAdapter(spread, owned_slice_inputs=[0, 1], all_reduce_outputs=[0]),
        "default_overload": nb.OpAdapter(conv.default, gather_inputs=[0], scatter_outputs=[0]),
        "lazy_string": nb.OpAdapter("cuequivariance::uniform_1d"),
        "explicit_dicts": nb.OpAdapter(spread, {0: nb.GatherInputs()}, {0: nb.ScatterOutputs(), 1: nb.AllReduceSum(True)}),
        "explicit_wins": nb.OpAdapter(spread, arg_transforms={0: nb.SliceOwned()}, gather_inputs=[2]),
        "first_role_wins": nb.OpAdapter(spread, scatter_outputs=[0]),
        "numeric_key_order": nb.OpAdapter(spread, owned_slice_inputs=[5, 1, 10]),
        "neighbors_alias": nb.OpAdapter(conv, neighbors_inputs=[1]),
        "sharded_roles": nb.OpAdapter(conv, gather_inputs_full=[0, 2], slice_outputs_owned=[1]),
        "replicated": nb.OpAdapter(spread, owned_slice_inputs=[0, 1], output_transforms={0: nb.AllReduceSum(True)}),
    }


def test_forms_match_reference_json_properties_and_describe(ops):
    want = golden("op_adapters.json")
    for name, a in reference_forms(ops).items():
        assert canon(a.to_dict()) == canon(want[name]["dict"]), name
        assert {p: list(getattr(a, p)) for p in PROPS} == want[name]["properties"], name
        status = a.describe()
        assert {"kind": status.kind, "target": status.target} == want[name]["describe"], name


def test_golden_dicts_load_and_write_back_identically():
    for name, entry in golden("op_adapters.json").items():
        a = nb.OpAdapter.from_dict(entry["dict"])
        assert canon(a.to_dict()) == canon(entry["dict"]), name
        assert {p: list(getattr(a, p)) for p in PROPS} == entry["properties"], name
        assert isinstance(a.op, str)  # loading stays lazy


def test_op_normalisation(ops):
    spread, conv, _ = ops
    assert nb.OpAdapter(spread).op is spread.default
    assert nb.OpAdapter(conv.fast).op is conv.fast
    custom = type("CustomOpDef", (), {"_opoverload": spread.default, "__call__": lambda self: None})()
    assert nb.OpAdapter(custom).op is spread.default
    assert nb.OpAdapter("demo::spread").op == "demo::spread"

    def plain(x):
        return x

    assert nb.OpAdapter(plain).op is plain


def test_live_and_lazy_adapters_are_equal_and_hash_alike(ops):
    spread, conv, _ = ops
    pairs = [
        (nb.OpAdapter(spread, scatter_outputs=[0]), nb.OpAdapter("demo::spread", output_transforms={0: nb.ScatterOutputs()})),
        (nb.OpAdapter(conv.fast), nb.OpAdapter("demo::conv.fast")),
        (nb.OpAdapter(conv.default), nb.OpAdapter("demo::conv.default")),
    ]
    for live, lazy in pairs:
        assert live == lazy and hash(live) == hash(lazy)
    assert nb.OpAdapter(conv.fast) != nb.OpAdapter(conv.default)
    assert nb.OpAdapter("demo::spread", install_site="a") == nb.OpAdapter("demo::spread", install_site="b")


def test_non_default_overload_round_trips(ops):
    _, conv, _ = ops
    a = nb.OpAdapter(conv.fast, gather_inputs=[0])
    d = a.to_dict()
    assert d["op"] == "demo::conv.fast"
    b = nb.OpAdapter.from_dict(json.loads(json.dumps(d)))
    assert b == a and b.live_op() is conv.fast
    assert nb.OpAdapter(conv.default).to_dict()["op"] == "demo::conv"  # default: as the reference writes it


def test_adapters_with_live_ops_pickle_as_lazy_names(ops):
    spread, _, _ = ops
    a = nb.OpAdapter(spread, scatter_outputs=[0], install_site="s:1")
    assert copy.copy(a).op is copy.deepcopy(a).op is spread.default
    b = pickle.loads(pickle.dumps(a))
    assert b == a and b.op == "demo::spread" and b.install_site == "s:1" and b.live_op() is spread.default


def test_arg_transforms_read_like_a_dict_but_are_frozen():
    a = nb.OpAdapter("demo::spread", {3: nb.SliceOwned()}, gather_inputs=[0])
    assert a.arg_transforms == {0: nb.GatherInputs(), 3: nb.SliceOwned()}
    assert a.arg_transforms[3] == nb.SliceOwned() and 3 in a.arg_transforms
    assert list(a.arg_transforms) == [0, 3] and a.arg_transforms.get(9) is None
    assert dict(a.arg_transforms.items()) == {0: nb.GatherInputs(), 3: nb.SliceOwned()}
    with pytest.raises(TypeError):
        a.arg_transforms[1] = nb.SliceOwned()  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.op = "x::y"  # type: ignore[misc]
    given = {0: nb.GatherInputs()}
    b = nb.OpAdapter("demo::spread", given)
    given[1] = nb.SliceOwned()
    assert b.arg_transforms == {0: nb.GatherInputs()}  # a copy, not the caller's dict


def test_role_keywords_accept_iterables_and_aliases_agree():
    assert nb.OpAdapter("a::b", gather_inputs=range(2)).gather_inputs == (0, 1)
    assert nb.OpAdapter("a::b", neighbors_inputs=[1]) == nb.OpAdapter("a::b", gather_inputs=[1])
    assert nb.OpAdapter("a::b", gather_inputs=[1], neighbors_inputs=[1]).gather_inputs == (1,)
    assert nb.OpAdapter("a::b", {1: nb.GatherInputs()}, gather_inputs=[1]).gather_inputs == (1,)


def test_replicated_outputs_are_a_subset_of_all_reduce_outputs():
    a = nb.OpAdapter("a::b", output_transforms={2: nb.AllReduceSum(True), 0: nb.AllReduceSum()}, all_reduce_outputs=[1])
    assert a.all_reduce_outputs == (0, 1, 2) and a.all_reduce_replicated_outputs == (2,)


def test_copy_replace_pickle_keep_equality():
    a = nb.OpAdapter("demo::spread", gather_inputs=[0], scatter_outputs=[0], install_site="here:1")
    for b in (copy.copy(a), copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
        assert b == a and b.install_site == "here:1"
    c = dataclasses.replace(a, install_site="there:2")
    assert c == a and c.install_site == "there:2"


def test_install_site_is_the_declaration_or_the_loading_call():
    a = nb.OpAdapter("demo::spread")
    assert a.install_site.endswith("test_op_adapter.py:" + str(_line_of("a = nb.OpAdapter(\"demo::spread\")")))
    b = nb.OpAdapter.from_dict({"op": "demo::spread"})
    assert "test_op_adapter.py:" in b.install_site
    assert nb.OpAdapter("demo::spread", install_site="x.py:3").describe().install_site == "x.py:3"


def _line_of(text: str) -> int:
    import inspect

    src, start = inspect.getsourcelines(test_install_site_is_the_declaration_or_the_loading_call)
    return start + next(i for i, line in enumerate(src) if text in line)


def test_describe_states():
    a = nb.OpAdapter("demo::spread", install_site="s:1")
    assert a.describe() == nb.AdapterStatus("op", "demo::spread", "pending", "s:1", None)
    assert a.describe("failed", "E()").error == "E()"
    with pytest.raises(nb.SpecError, match=r"unknown state 'done'"):
        a.describe("done")  # type: ignore[arg-type]


@given(OP_ADAPTERS)
def test_round_trip_is_identity_and_json_is_stable(a):
    d = a.to_dict()
    b = nb.OpAdapter.from_dict(json.loads(json.dumps(d)))
    assert b == a and hash(b) == hash(a)
    assert canon(b.to_dict()) == canon(d)
    assert list(d["arg_transforms"]) == [str(k) for k in sorted(a.arg_transforms)]


# ------------------------------------------------------------------ error catalogue


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(arg_transforms={0: nb.AllReduceSum()}), TypeError,
         r"OpAdapter\('demo::spread'\): arg_transforms\[0\] is AllReduceSum\(replicated_consumer=False\), "
         r"which belongs in output_transforms.*Move it: output_transforms=\{0: AllReduceSum"),
        (dict(output_transforms={1: nb.SliceOwned()}), TypeError, r"output_transforms\[1\] is SliceOwned\(\), which belongs in arg_transforms"),
        (dict(arg_transforms={0: nb.GatherInputs}), TypeError, r"is the class GatherInputs; pass an instance: GatherInputs\(\)"),
        (dict(arg_transforms={0: "gather_inputs"}), TypeError, r"arg_transforms\[0\] is str 'gather_inputs', not a transform"),
        (dict(arg_transforms={"0": nb.GatherInputs()}), TypeError, r"arg_transforms position '0' is str; positions are ints"),
        (dict(gather_inputs=[1.0]), TypeError, r"gather_inputs position 1\.0 is float"),
        (dict(gather_inputs=[True]), TypeError, r"gather_inputs position True is bool"),
        (dict(owned_slice_inputs=[-1]), nb.SpecError, r"owned_slice_inputs position -1 is negative; count from 0"),
        (dict(owned_slice_inputs=[3, 1, 3]), nb.SpecError, r"owned_slice_inputs=\[3, 1, 3\] lists position 3 twice"),
        (dict(scatter_outputs=[0], all_reduce_outputs=[0]), nb.SpecError,
         r"position 0 gets AllReduceSum\(.*\) from all_reduce_outputs but already has ScatterOutputs\(\) from scatter_outputs"),
        (dict(arg_transforms={0: nb.SliceOwned()}, gather_inputs=[0, 2]), nb.SpecError,
         r"position 0 gets GatherInputs\(\) from gather_inputs but already has SliceOwned\(\) from the explicit dict"),
        (dict(gather_inputs=0), TypeError, r"gather_inputs must be a list of positions, got int 0; e\.g\. gather_inputs=\[0\]"),
        (dict(arg_transforms=[nb.GatherInputs()]), TypeError, r"arg_transforms must be a dict position -> transform"),
    ],
)
def test_constructor_errors_name_adapter_position_and_fix(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        nb.OpAdapter("demo::spread", **kwargs)


def test_positional_role_keywords_are_rejected():
    with pytest.raises(TypeError, match=r"positional"):
        nb.OpAdapter("demo::spread", {}, {}, (0,))  # type: ignore[misc]


@pytest.mark.parametrize(
    ("op", "exc", "match"),
    [
        ("noqual", nb.SpecError, r"'noqual' is not a qualified op name; write '<namespace>::<name>'"),
        ("a::b.c.d", nb.SpecError, r"not a qualified op name"),
        (None, TypeError, r"op must be a torch op .* got NoneType"),
        (3, TypeError, r"got int 3"),
    ],
)
def test_bad_ops(op, exc, match):
    with pytest.raises(exc, match=match):
        nb.OpAdapter(op)


@pytest.mark.parametrize(
    ("d", "match"),
    [
        ({"op": "demo::spread", "arg_transform": {}}, r"\$\.x\.arg_transform: unknown key 'arg_transform'; did you mean 'arg_transforms'\?"),
        ({"arg_transforms": {}}, r"\$\.x: missing \"op\""),
        ({"op": 5}, r"\$\.x\.op: \"op\" must be a string"),
        ({"op": "demo-spread"}, r"\$\.x\.op: op 'demo-spread' is not a qualified op name"),
        ({"op": "a::b", "arg_transforms": {"01": {"type": "slice_owned"}}}, r'arg_transforms\["01"\]: position key \'01\' is not a decimal position'),
        ({"op": "a::b", "arg_transforms": {"-1": {"type": "slice_owned"}}}, r"position key '-1'"),
        ({"op": "a::b", "arg_transforms": []}, r"arg_transforms must be an object"),
        ({"op": "a::b", "output_transforms": {"0": {"type": "gather_inputs"}}},
         r'output_transforms\["0"\]\.type: \'gather_inputs\' is an argument transform'),
    ],
)
def test_from_dict_errors_give_the_json_path(d, match):
    with pytest.raises(nb.SpecError, match=match):
        nb.OpAdapter.from_dict(d, where="$.x")


def test_plain_callable_cannot_be_written_to_json():
    with pytest.raises(nb.SpecError, match=r"plain callable.*register it as a torch custom op"):
        nb.OpAdapter(len).to_dict()


# ------------------------------------------------------------- lazy resolution at install


def test_lazy_op_resolves_only_when_asked(ops):
    spread, conv, _ = ops
    assert nb.OpAdapter("demo::spread").live_op() is spread.default
    assert nb.OpAdapter("demo::conv.fast").live_op() is conv.fast


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("nosuchns_xyz::op", r"no op is registered in namespace 'nosuchns_xyz'.*Import the extension that registers it"),
        ("demo::sprad", r"unknown op in namespace 'demo': 'sprad'; did you mean 'spread'\?.*Import the extension"),
        ("demo::conv.fats", r"has no such overload; unknown overload 'fats'; did you mean 'fast'\?"),
    ],
)
def test_install_of_an_unregistered_op_names_what_is_missing(ops, name, match):
    a = nb.OpAdapter(name, gather_inputs=[0])  # constructing never resolves
    with pytest.raises(OpResolutionError, match=match):
        a.install()
    with pytest.raises(RuntimeError, match=match):  # the reference raises RuntimeError here
        a.live_op()
