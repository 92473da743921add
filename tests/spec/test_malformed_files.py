"""Malformed spec files: each ends in a SpecError with its JSON path, and `check_spec_file` agrees with loading.

The first tests are the cases an adversarial trial found (silent, or a raw traceback before the fix); the last
two walk valid fixtures and put a value of every wrong JSON type at every JSON path.
"""

from __future__ import annotations

import copy
import json
import time

import pytest

import nvalchemi_jaxbridge as nb
from nvalchemi_jaxbridge.app.cli import main
from nvalchemi_jaxbridge.spec import SpecError, SpecTypeError, check_spec_file, load_spec
from nvalchemi_jaxbridge.spec.json_guard import MAX_DEPTH

from ._helpers import GOLDEN


def _loads(source):
    """The SpecError that loading raises, or None; any other exception fails the test."""
    try:
        load_spec(source)
    except SpecError as e:
        return e
    return None


def _agree(source, where: str | None = None):
    """load_spec and check_spec_file report the same problem (file paths: the JSON part of e.path)."""
    err = _loads(source)
    problems = check_spec_file(source)
    assert err is not None, f"loaded without error; check said {problems}"
    assert err.path, err
    json_path = err.path.rpartition(": ")[2]
    assert [p.path for p in problems] == [json_path], (problems, err)
    if where is not None:
        assert json_path == where
    assert problems[0].message == err.detail
    return err


def _nested(depth: int):
    x: list = []
    for _ in range(depth - 1):
        x = [x]
    return x


def _deep_text(depth: int) -> str:
    return '{"policy": ' + "[" * depth + "]" * depth + "}"


DEEP_PATH = "$.policy" + "[0]" * (MAX_DEPTH - 1)  # the first container past the limit ($ is level 1)
OP = {"op": "demo::conv"}


# ------------------------------------------------------------------------------------ the trial's cases


def test_a_file_holding_null_is_a_problem_for_check_too(tmp_path, capsys):
    p = tmp_path / "null.json"
    p.write_text("null")
    err = _agree(p, "$")
    assert isinstance(err, SpecTypeError) and "must hold a JSON object, got null" in str(err)
    assert str(p) in err.path  # which file
    assert main(["spec", "check", str(p)]) == 1
    assert "got null" in capsys.readouterr().out


def test_deep_nesting_stops_early_with_the_limit_and_the_path(tmp_path, capsys):
    p = tmp_path / "deep.json"
    p.write_text(_deep_text(10_000))
    t0 = time.perf_counter()
    err = _agree(p, DEEP_PATH)
    assert f"nested deeper than {MAX_DEPTH} levels" in err.detail and f"{p}:1:" in err.detail
    with pytest.raises(SpecError, match="nested deeper than 32 levels"):
        nb.MLIPSpec.load(p)
    # the same as a Python dict (which json.loads could not even have built)
    d = {"policy": _nested(10_000)}
    err = _agree(d, DEEP_PATH)
    with pytest.raises(SpecError, match="nested deeper") as e:
        nb.DistributionSpec.from_dict(d)
    assert e.value.path == DEEP_PATH
    with pytest.raises(SpecError, match="nested deeper") as e:
        nb.MLIPSpec.from_dict({"version": 2, "core": d})
    assert e.value.path == "$.core.policy" + "[0]" * (MAX_DEPTH - 2)
    loop: dict = {"policy": {"kind": "halo"}}
    loop["custom_ops"] = [loop]  # a dict that contains itself
    assert [p.message[:14] for p in check_spec_file(loop)] == ["nested deeper "]
    assert time.perf_counter() - t0 < 2.0
    # CLI: one line, no traceback
    assert main(["spec", "check", str(p)]) == 1
    assert main(["spec", "convert", str(p), str(tmp_path / "out.json"), "--to", "v2"]) == 1
    assert main(["spec", "show", str(p), "--devices", "2"]) == 2
    assert main(["run", "--spec", str(p), "--devices", "2", "--steps", "1"]) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and "RecursionError" not in out.out + out.err
    assert out.err.count("nested deeper than 32 levels") == 3


def test_nesting_up_to_the_limit_is_not_refused_for_depth():
    ok = {"policy": {"kind": "halo", "x": _nested(MAX_DEPTH - 2)}}  # 32 levels: refused for the key, not depth
    assert "unknown field" in _agree(ok, "$.policy.x").detail


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('{"policy": {"kind": "halo", "kind": "local"}}', "$.policy.kind"),
        ('{"policy": {"kind": "local"}, "custom_ops": [{"op": "a::b"}, {"op": "a::b", "op": "a::c"}]}',
         "$.custom_ops[1].op"),
        ('{"policy": {"kind": "local"}, "custom_ops": [{"op": "a::b", "arg_transforms": '
         '{"0": {"type": "slice_owned"}, "0": {"type": "gather_inputs"}}}]}', '$.custom_ops[0].arg_transforms["0"]'),
        ('{"version": 2, "core": {"policy": {"kind": "local"}}, "compile": null, "compile": null}', "$.compile"),
        ('{"policy": {"kind": "local"}, "\\u0070olicy": {"kind": "halo"}}', "$.policy"),  # escapes decoded first
    ],
)
def test_duplicate_keys_are_refused_with_the_path_of_the_second(tmp_path, text, where):
    p = tmp_path / "dup.json"
    p.write_text(text)
    err = _agree(p, where)
    assert "duplicate key" in err.detail and "keeps only the last value" in err.detail


def test_same_key_in_different_objects_is_fine(tmp_path):
    p = tmp_path / "ok.json"
    p.write_text('{"policy": {"kind": "local"}, "custom_ops": [{"op": "a::b"}, {"op": "a::c"}]}')
    assert check_spec_file(p) == [] and len(load_spec(p).distribution.custom_ops) == 2


def test_a_5000_digit_position_key_is_reported_at_its_path_quickly():
    key = "1" + "0" * 4999
    d = {"policy": {"kind": "halo"}, "custom_ops": [{**OP, "arg_transforms": {key: {"type": "slice_owned"}}}]}
    t0 = time.perf_counter()
    err = _agree(d)
    assert time.perf_counter() - t0 < 0.5
    assert err.path.startswith('$.custom_ops[0].arg_transforms["1000') and "(5000 chars)" in err.path
    assert "(5000 digits) is too large" in err.detail and "2**31 - 1 = 2147483647" in err.detail
    assert len(str(err)) < 400  # the key is not quoted whole


def test_a_huge_integer_literal_is_refused_before_parsing(tmp_path):
    p = tmp_path / "big.json"
    p.write_text('{"version": ' + "9" * 5000 + ', "core": {"policy": {"kind": "local"}}}')
    err = _agree(p, "$.version")
    assert "an integer of 5000 digits" in err.detail
    p.write_text('{"version": 2.' + "0" * 100 + ', "core": {"policy": {"kind": "local"}}}')  # a float: fine
    assert check_spec_file(p) == [] and load_spec(p).version == 2


@pytest.mark.parametrize("slot", ["arg_transforms", "output_transforms"])
def test_a_list_where_the_transform_type_string_goes(slot):
    kind = "gather_inputs" if slot == "arg_transforms" else "scatter_outputs"
    d = {"policy": {"kind": "halo"}, "custom_ops": [{**OP, slot: {"0": {"type": [kind]}}}]}
    err = _agree(d, f'$.custom_ops[0].{slot}["0"].type')
    assert isinstance(err, SpecTypeError) and "unhashable" not in str(err)
    assert "must be a string, one of" in err.detail and f'write the string itself, "type": "{kind}"' in err.detail
    for bad in ({"k": 1}, 3, None, True):
        d["custom_ops"][0][slot]["0"]["type"] = bad
        assert "must be a string" in _agree(d, f'$.custom_ops[0].{slot}["0"].type').detail


def test_non_utf8_bytes_name_the_file_and_offset(tmp_path):
    p = tmp_path / "latin1.json"
    p.write_bytes('{"policy": {"kind": "halo"},\n "shard_fields": ["posições"]}'.encode("latin-1"))
    err = _agree(p, "$")
    assert str(p) in err.detail and "byte 52 (line 2) is 0xe7" in err.detail
    assert "spec files are UTF-8 JSON" in err.detail
    with pytest.raises(SpecError, match="not UTF-8"):
        nb.MLIPSpec.load(p)


@pytest.mark.parametrize("key", ["2147483648", "100000000000000000000"])
def test_positions_are_bounded(key):
    d = {"policy": {"kind": "halo"}, "custom_ops": [{**OP, "output_transforms": {key: {"type": "scatter_outputs"}}}]}
    err = _agree(d, f'$.custom_ops[0].output_transforms["{key}"]')
    assert "is too large" in err.detail and "at most 2**31 - 1" in err.detail


def test_the_largest_position_loads_and_python_positions_are_bounded_too():
    d = {"policy": {"kind": "halo"}, "custom_ops": [{**OP, "arg_transforms": {"2147483647": {"type": "slice_owned"}}}]}
    assert check_spec_file(d) == [] and load_spec(d).distribution.custom_ops[0].owned_slice_inputs == (2**31 - 1,)
    for kwargs in ({"gather_inputs": [10**20]}, {"arg_transforms": {2**31: nb.GatherInputs()}},
                   {"scatter_outputs": [10**5000]}):
        with pytest.raises(SpecError, match=r"is too large; positions index op\(\*args\)") as e:
            nb.OpAdapter("demo::conv", **kwargs)
        assert len(str(e.value)) < 300


def test_restore_refuses_a_malformed_memento_dict():
    torch = pytest.importorskip("torch")
    from nvalchemi_jaxbridge.torch.dispatch import restore_adapter

    a = nb.OpAdapter("demo::conv", gather_inputs=[0])
    for memento, problem in [({"op": 1}, "'op' is int 1, not a torch OpOverload"), ({}, "it has no 'op'"),
                             ({"op": torch.ops.aten.add.default, "packet": 3}, "'packet' is int"),
                             ({"op": torch.ops.aten.add.default, "pakket": None}, "unknown key(s) ['pakket']")]:
        with pytest.raises(TypeError, match=r"restore_adapter: a memento dict must be \{'op': <OpOverload>") as e:
            a.restore(memento)
        assert problem in str(e.value)
    restore_adapter({"op": torch.ops.aten.add.default, "packet": torch.ops.aten.add, "token": -1})  # well-formed: no-op
    # third-party adapters check theirs too
    for helper in (nb.PythonAdapter("json", "dumps", "math:fsum"), nb.MethodAdapter("json", "JSONEncoder", "default"),
                   nb.ModuleForwardAdapter(None, declared_target="x.Y.forward")):
        with pytest.raises(SpecTypeError, match=r"restore\(\) expects the memento install\(\) returned") as e:
            helper.restore({"op": 1})
        assert e.value.path.endswith(".restore")
    # AdapterRegistry.restore never raises: a bad memento is recorded as the handle's error
    reg = nb.AdapterRegistry()
    reg.install([nb.PythonAdapter("json", "dumps")])  # declaration only: memento {"deferred": True}
    reg._handles[0].memento = {"op": 1}
    reg.restore()
    assert "restore() expects the memento" in reg.list_active()[0].error


# ------------------------------------------------------------------- every wrong type at every JSON path


WRONG = {  # JSON type -> values of that type
    "null": [None],
    "bool": [True, False],
    "number": [0, 1, -1, 2.5],
    "string": ["", "x"],
    "array": [[], [0], ["x"]],
    "object": [{}, {"x": 1}],
}


def _json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    return {int: "number", float: "number", str: "string", list: "array", dict: "object"}[type(v)]


def _jpath(base: str, key) -> str:
    """The JSON path syntax of the package's messages, written independently."""
    if isinstance(key, int):
        return f"{base}[{key}]"
    if key.isidentifier() and key.isascii():
        return f"{base}.{key}"
    return f"{base}[{json.dumps(key)}]"


def _walk(v, path="$", trail=()):
    yield path, trail, v
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, child in items:
        yield from _walk(child, _jpath(path, k), (*trail, k))


def _replaced(doc, trail, value):
    if not trail:
        return copy.deepcopy(value)
    out = copy.deepcopy(doc)
    parent = out
    for k in trail[:-1]:
        parent = parent[k]
    parent[trail[-1]] = copy.deepcopy(value)
    return out


def _on_line(a: str, b: str) -> bool:
    """a and b are the same JSON path, or one is an ancestor of the other."""
    short, long = sorted((a, b), key=len)
    return long == short or long.startswith(short + ".") or long.startswith(short + "[")


def _mlip(d):
    nb.MLIPSpec.from_dict(d)


def _mlip_via_file(d):
    load_spec(d).mlip


@pytest.mark.parametrize(
    ("fixture", "loaders"),
    [("v2_envelope.json", (_mlip, _mlip_via_file)), ("spec_all_kinds.json", (load_spec, nb.DistributionSpec.from_dict))],
)
def test_every_wrong_json_type_at_every_path_check_and_load_agree(fixture, loaders):
    doc = json.loads((GOLDEN / fixture).read_text())
    assert check_spec_file(doc) == []
    cases = refused = 0
    disagreements = []
    for path, trail, value in list(_walk(doc)):
        for jtype, values in WRONG.items():
            if jtype == _json_type(value):
                continue
            for bad in values:
                if not trail and isinstance(bad, str):
                    continue  # a string given to load_spec / check_spec_file is a file name
                d = _replaced(doc, trail, bad)
                cases += 1
                errors = []
                for load in loaders:
                    try:
                        load(d)
                        errors.append(None)
                    except SpecError as e:  # anything else (TypeError, KeyError, ...) fails the test
                        errors.append(e)
                problems = check_spec_file(d)
                err = errors[0]
                case = f"{path} := {json.dumps(bad)}"
                if len({None if e is None else e.path for e in errors}) > 1:
                    disagreements.append(f"{case}: the loaders differ: {errors}")
                elif err is None:
                    if problems:
                        disagreements.append(f"{case}: loads, but check reports {[str(p) for p in problems]}")
                else:
                    refused += 1
                    if not err.path or not _on_line(err.path, path):
                        disagreements.append(f"{case}: error at {err.path!r}, not on the replaced path: {err}")
                    elif not any(_on_line(p.path, err.path) and err.path.startswith(p.path) for p in problems):
                        disagreements.append(f"{case}: load says {err}; check says {[str(p) for p in problems]}")
    assert not disagreements, f"{len(disagreements)} of {cases}:\n" + "\n".join(disagreements[:40])
    assert cases > 300 and refused > cases // 2


def test_accepted_wrong_types_are_the_reference_s_own():
    """Where a different JSON type is valid, it is the format's choice, e.g. null for no compile policy."""
    doc = json.loads((GOLDEN / "v2_envelope.json").read_text())
    for key, value in [("compile", None), ("node_virial_key", "stress_v"), ("node_energy_key", None),
                       ("output_kinds", {"energy": "per_graph"})]:
        d = {**doc, key: value}
        assert check_spec_file(d) == []
        nb.MLIPSpec.from_dict(d)
