"""MLIPSpec (the version 2 model-level spec): reference JSON, validation, merge, checker, import hygiene."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nvalchemi_jaxbridge as nb
from nvalchemi_jaxbridge import CompilePolicy, ForceStrategy, MLIPSpec, OutputKind, Reduce
from nvalchemi_jaxbridge.spec import SpecTypeError

from ._helpers import GOLDEN, SPECS, canon, golden

V2_FIXTURES = sorted(GOLDEN.glob("v2_*.json"))
BEHAVIOUR = golden("mlip_reference_behaviour.json")
CORE = {"policy": {"kind": "local"}, "custom_ops": [], "third_party_helpers": []}


def env(**keys):
    """A version 2 dict with a local core and the given envelope keys."""
    return {"version": 2, "core": CORE, **keys}


# ----------------------------------------------------------------------------- golden


def test_the_mace_fixtures_are_there():
    assert {"v2_mace_cueq.json", "v2_mace.json"} <= {p.name for p in V2_FIXTURES}


@pytest.mark.parametrize("path", V2_FIXTURES, ids=lambda p: p.name)
def test_golden_v2_files_load_and_write_back_identically(path, tmp_path):
    d = json.loads(path.read_text())
    spec = MLIPSpec.from_dict(d)
    assert canon(spec.to_dict()) == canon(d)
    assert nb.load_spec(path).mlip == spec == MLIPSpec.load(path)
    assert MLIPSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    hash(spec)
    spec.save(tmp_path / "a.json")
    nb.save_spec(spec, tmp_path / "b.json")
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()
    assert canon(json.loads((tmp_path / "a.json").read_text())) == canon(d)
    assert spec.to_spec_file() == nb.load_spec(path)


def test_presets_equal_the_reference():
    assert canon(nb.SPEC_MPNN_HALO.to_dict()) == canon(golden("v2_preset_mpnn_halo.json"))
    assert canon(nb.SPEC_MPNN_GP.to_dict()) == canon(golden("v2_preset_mpnn_gp.json"))
    for name, d in BEHAVIOUR["presets"].items():
        assert canon(getattr(nb, name).to_dict()) == canon(d), name


def test_compile_policy_default_is_the_reference_default():
    assert CompilePolicy().to_dict() == BEHAVIOUR["compile_policy_default"]
    assert CompilePolicy().force_strategy is ForceStrategy.MODEL_INTERNAL


def test_outputs_with_an_unknown_kind_record_only_the_reduce_as_in_the_reference():
    spec = MLIPSpec(nb.DistributionSpec(), outputs={"energy": "per_graph", "charges": ("unknown", "all_reduce")})
    assert canon(spec.to_dict()) == canon(BEHAVIOUR["outputs_unknown_kind"])


def test_the_mace_specs_rebuilt_from_our_api_match_the_reference():
    mace_compile = CompilePolicy(static_shapes=True, force_strategy="framework_from_node_energy", stress_via_strain=True)
    marshal = nb.MethodAdapter("e3nn.o3", "SphericalHarmonics", "forward", mode="marshal")
    plain = (nb.SPEC_MPNN_HALO.with_adapters(marshal).with_compile(mace_compile)
             .with_outputs({"stress": ("per_graph", "all_reduce")}))
    assert canon(plain.to_dict()) == canon(golden("v2_mace.json"))
    ops = [nb.OpAdapter(f"cuequivariance::{n}") for n in (
        "fused_tensor_product", "fused_tensor_product_bwd", "fused_tensor_product_bwd_bwd", "uniform_1d",
        "indexed_linear_B", "indexed_linear_C", "segmented_transpose")]
    product = nb.MethodAdapter("mace.modules.blocks", "EquivariantProductBasisBlock", "forward",
                               "nvalchemi.models.mace:_mace_product_block_static_index_forward")
    cueq = plain.with_adapters(*ops, product)
    assert canon(cueq.to_dict()) == canon(golden("v2_mace_cueq.json"))
    assert cueq.force_strategy is ForceStrategy.FRAMEWORK_FROM_NODE_ENERGY and cueq.compile.energy_output == "atomic_energies"
    assert cueq.reduce_of("stress") is Reduce.ALL_REDUCE and cueq.kind_of("stress") is OutputKind.PER_GRAPH


def test_the_reference_cannot_reload_the_cueq_spec_but_we_can():
    assert "cuequivariance" in BEHAVIOUR["reload_error"]["v2_mace_cueq.json"]
    assert BEHAVIOUR["reload_error"]["v2_mace.json"] is None
    spec = MLIPSpec.load(GOLDEN / "v2_mace_cueq.json")
    assert [a.to_dict()["op"] for a in spec.distribution.custom_ops][3] == "cuequivariance::uniform_1d"


# ------------------------------------------------------------------------ construction


def test_outputs_form_equals_the_canonical_form_and_is_normalised():
    core = nb.DistributionSpec(nb.HaloStoragePolicy())
    a = MLIPSpec(core, outputs={"stress": ("per_graph", "all_reduce"), "energy": "per_graph",
                                "forces": (OutputKind.PER_NODE, Reduce.OWNED_ONLY)})
    b = MLIPSpec(core, ["forces"], {"stress"}, [("stress", "per_graph"), ("forces", "per_node"), ("energy", "per_graph")])
    c = MLIPSpec(core, ("forces",), ("stress",), {"energy": OutputKind.PER_GRAPH, "forces": "per_node",
                                                   "stress": "per_graph"})
    assert a == b == c and hash(a) == hash(b)
    assert a.output_kinds == {"energy": "per_graph", "forces": "per_node", "stress": "per_graph"}
    assert list(a.output_kinds) == ["energy", "forces", "stress"]
    assert a.outputs is None  # lowered, not stored
    assert MLIPSpec(core, outputs=a.output_specs()) == a


def test_compile_takes_part_in_equality():
    core = nb.DistributionSpec()
    assert MLIPSpec(core) != MLIPSpec(core, compile=CompilePolicy())
    assert MLIPSpec(core, compile=CompilePolicy(force_strategy="model_internal")) != MLIPSpec(core, compile=CompilePolicy(False))
    assert len({MLIPSpec(core), MLIPSpec(core, compile=CompilePolicy()), MLIPSpec(core)}) == 2


def test_helpers():
    spec = nb.SPEC_MPNN_GP
    assert spec.force_strategy is ForceStrategy.FRAMEWORK_FROM_GLOBAL_ENERGY and spec.compile.forces_via_autograd
    assert nb.SPEC_MPNN_HALO.force_strategy is ForceStrategy.MODEL_INTERNAL
    assert spec.kind_of("forces") is OutputKind.PER_NODE and spec.kind_of("nope") is OutputKind.UNKNOWN
    assert spec.reduce_of("forces") is Reduce.OWNED_ONLY and spec.reduce_of("energy") is Reduce.NONE
    assert spec.compile.energy_output == "energy"
    assert OutputKind.PER_NODE == "per_node" and json.dumps(Reduce.ALL_REDUCE) == '"all_reduce"'


def test_with_outputs_redeclares_the_named_outputs_only():
    spec = nb.SPEC_MPNN_GP.with_outputs({"forces": ("per_node", "all_reduce")})
    assert spec.all_reduce_outputs == ("forces",) and spec.owned_only_outputs == ("atomic_energies",)
    assert spec.output_kinds == nb.SPEC_MPNN_GP.output_kinds


_DIST = nb.DistributionSpec()
CONSTRUCTION_ERRORS = [
    (dict(distribution={"policy": {"kind": "local"}}), SpecTypeError, r"MLIPSpec.distribution must be a DistributionSpec"),
    (dict(owned_only_outputs=["forces"], all_reduce_outputs=["stress", "forces"]), nb.SpecError,
     r"MLIPSpec.all_reduce_outputs\[1\]: \['forces'\] listed in both owned_only_outputs and all_reduce_outputs"),
    (dict(outputs={"forces": ("per_node", "owned_only")}, all_reduce_outputs=["forces"]), nb.SpecError, r"listed in both"),
    (dict(owned_only_outputs="forces"), SpecTypeError, r"owned_only_outputs: must be a list, tuple or set"),
    (dict(owned_only_outputs=["forces", "forces"]), nb.SpecError, r"owned_only_outputs\[1\]: 'forces' is listed twice"),
    (dict(all_reduce_outputs=[""]), SpecTypeError, r"all_reduce_outputs\[0\]: output names must be non-empty strings"),
    (dict(output_kinds={"energy": "per_grpah"}), nb.SpecError,
     r"output_kinds.energy: unknown output kind for 'energy': 'per_grpah'; did you mean 'per_graph'\? expected one of "
     r"\['global', 'per_graph', 'per_node', 'unknown'\]"),
    (dict(output_kinds=[("energy", "per_graph"), ("energy", "per_node")]), nb.SpecError,
     r"output_kinds\[1\]\[0\]: output 'energy' is declared twice"),
    (dict(output_kinds=[("energy",)]), SpecTypeError, r"output_kinds\[0\]: must be a pair"),
    (dict(output_kinds={"energy": "per_node"}, outputs={"energy": "per_graph"}), nb.SpecError,
     r"outputs.energy: output 'energy' is 'per_graph' here but 'per_node' in output_kinds"),
    (dict(outputs={"stress": ("per_graph", "sum")}), nb.SpecError,
     r"outputs.stress.reduce: unknown reduction 'sum'; expected one of \['all_reduce', 'none', 'owned_only'\]"),
    (dict(outputs={"stress": 3}), SpecTypeError, r"outputs.stress: an output is declared as a kind"),
    (dict(outputs=[("energy", "per_graph")]), SpecTypeError, r"MLIPSpec.outputs: must be a mapping"),
    (dict(system_reductions=1), SpecTypeError, r"MLIPSpec.system_reductions: must be a bool"),
    (dict(node_energy_key=""), SpecTypeError, r"MLIPSpec.node_energy_key: output keys must be non-empty strings"),
    (dict(compile={"force_strategy": "model_internal"}), SpecTypeError,
     r"MLIPSpec.compile must be a CompilePolicy or None, got dict; build it with CompilePolicy.from_dict"),
]


@pytest.mark.parametrize(("kwargs", "exc", "match"), CONSTRUCTION_ERRORS)
def test_construction_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        MLIPSpec(**{"distribution": _DIST, **kwargs})


def test_compile_policy_and_output_spec_errors():
    with pytest.raises(nb.SpecError, match=r"CompilePolicy.force_strategy: unknown force strategy 'framework'; expected "
                                           r"one of \['framework_from_global_energy', 'framework_from_node_energy', 'model_internal'\]"):
        CompilePolicy(force_strategy="framework")
    with pytest.raises(SpecTypeError, match=r"CompilePolicy.force_strategy: force strategy must be a string"):
        CompilePolicy(force_strategy=1)
    with pytest.raises(SpecTypeError, match=r"CompilePolicy.stress_via_strain: must be a bool .*got 'no' \(str\)"):
        CompilePolicy(stress_via_strain="no")
    with pytest.raises(nb.SpecError, match=r"OutputSpec.kind: unknown output kind 'node'"):
        nb.OutputSpec("node")


# ------------------------------------------------------------------------------ from_dict

DICT_ERRORS = [
    ({"core": CORE}, nb.SpecError, "$", r'has "core" but no "version"'),
    ({"version": 99, "core": CORE}, nb.SpecError, "$.version", r"unsupported spec file version 99; this build reads version 2"),
    ({"version": True, "core": CORE}, nb.SpecError, "$.version", r"unsupported spec file version True"),
    (CORE, nb.SpecError, "$", r'missing "version": an MLIPSpec is the version 2 envelope'),
    ([], SpecTypeError, "$", r"an MLIPSpec must be a JSON object, got list"),
    (env(system_reduction=True), nb.SpecError, "$.system_reduction",
     r"unknown envelope key 'system_reduction'; did you mean 'system_reductions'\?.*Fix the name or remove the key"),
    (env(output_kinds=[["a", "per_node"], ["b", "per_graph"], ["c", "per_atom"]]), nb.SpecError, "$.output_kinds[2][1]",
     r"unknown output kind for 'c': 'per_atom'"),
    (env(output_kinds={"c": "per_atom"}), nb.SpecError, "$.output_kinds.c", r"unknown output kind for 'c'"),
    (env(output_kinds="energy"), SpecTypeError, "$.output_kinds", r'must be a list of \["<output>", "<kind>"\] pairs'),
    (env(output_kinds=[["a", "per_node"], ["a", "per_node"]]), nb.SpecError, "$.output_kinds[1][0]", r"declared twice"),
    (env(output_kinds=[["", "per_node"]]), SpecTypeError, "$.output_kinds[0][0]", r"non-empty strings"),
    (env(compile={"force_strategy": "framework_from_forces"}), nb.SpecError, "$.compile.force_strategy",
     r"unknown force strategy 'framework_from_forces'; did you mean 'framework_from_node_energy'\?"),
    (env(compile={}), nb.SpecError, "$.compile", r"an empty compile policy \{\} declares nothing; write null"),
    (env(compile={"static_shapes": True}), nb.SpecError, "$.compile", r'missing "force_strategy"; one of'),
    (env(compile={"force_strategy": "model_internal", "static_shape": True}), nb.SpecError, "$.compile.static_shape",
     r"unknown compile key 'static_shape'; did you mean 'static_shapes'\?"),
    (env(compile={"force_strategy": "model_internal", "static_shapes": "yes"}), SpecTypeError,
     "$.compile.static_shapes", r"must be a bool \(true/false in JSON\), got 'yes'"),
    (env(compile=[]), SpecTypeError, "$.compile", r"a compile policy must be an object or null"),
    (env(system_reductions="yes"), SpecTypeError, "$.system_reductions", r"must be a bool"),
    (env(node_virial_key=3), SpecTypeError, "$.node_virial_key", r"output keys must be non-empty strings"),
    (env(owned_only_outputs={"forces": 1}), SpecTypeError, "$.owned_only_outputs", r"must be a list of output names"),
    (env(owned_only_outputs=["forces"], all_reduce_outputs=["energy", "forces"]), nb.SpecError,
     "$.all_reduce_outputs[1]", r"listed in both owned_only_outputs and all_reduce_outputs.*Remove it from one"),
    (env(all_reduce_outputs=["stress", "stress"]), nb.SpecError, "$.all_reduce_outputs[1]", r"listed twice"),
    ({"version": 2, "core": {"policy": {"kind": "hallo"}}}, nb.SpecError, "$.core.policy.kind", r"unknown policy kind"),
]


@pytest.mark.parametrize(("d", "exc", "path", "match"), DICT_ERRORS)
def test_from_dict_errors_carry_the_json_path(d, exc, path, match):
    with pytest.raises(exc, match=match) as info:
        MLIPSpec.from_dict(d)
    assert info.value.path == path
    assert str(info.value).startswith(f"{path}: ")


@pytest.mark.parametrize(("d", "exc", "path", "match"), [e for e in DICT_ERRORS if isinstance(e[0], dict) and "version" in e[0]])
def test_the_checker_and_the_schema_reject_what_from_dict_rejects(d, exc, path, match):
    problems = nb.check_spec_file(d)
    assert problems, d
    assert path in {p.path for p in problems}


def test_load_names_the_file(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(env(compile={"force_strategy": "x"})))
    with pytest.raises(nb.SpecError, match=rf"^{p}: \$\.compile\.force_strategy: unknown force strategy 'x'"):
        MLIPSpec.load(p)
    p.write_text("{")
    with pytest.raises(nb.SpecError, match=r"not valid JSON"):
        MLIPSpec.load(p)


def test_graph_padder_is_dropped_with_a_warning():
    d = env(compile={"force_strategy": "model_internal", "graph_padder": {"kind": "coo"}})
    with pytest.warns(UserWarning, match=r"\$\.compile\.graph_padder: dropped; nvalchemi-toolkit never writes it"):
        spec = MLIPSpec.from_dict(d)
    assert spec.compile == CompilePolicy()
    assert [p.path for p in nb.check_spec_file(d)] == ["$.compile.graph_padder"]


def test_spec_files_and_mlip_specs():
    bare = nb.load_spec(CORE)
    assert canon(bare.mlip.to_dict()) == canon(golden("v2_default_envelope.json"))
    assert MLIPSpec.from_spec_file(bare) == MLIPSpec(bare.distribution)
    kept = nb.load_spec(env(future_key=1))  # load_spec keeps unknown keys verbatim; .mlip refuses them
    with pytest.raises(nb.SpecError, match=r"\$\.future_key: unknown envelope key 'future_key'"):
        kept.mlip  # noqa: B018
    with pytest.raises(SpecTypeError, match=r"MLIPSpec.from_spec_file expects a SpecFile"):
        MLIPSpec.from_spec_file(CORE)
    with pytest.raises(SpecTypeError, match=r"save_spec expects a SpecFile, MLIPSpec or DistributionSpec, got dict"):
        nb.save_spec(CORE, "unused.json")


# ----------------------------------------------------------------------------- property

NAMES = st.sampled_from(["energy", "forces", "stress", "atomic_energies", "charges", "virials", "dipole"])
DECLS = st.one_of(
    st.sampled_from(list(OutputKind)),
    st.tuples(st.sampled_from([k.value for k in OutputKind]), st.sampled_from([r.value for r in Reduce])),
)
COMPILES = st.one_of(st.none(), st.builds(CompilePolicy, st.booleans(), st.sampled_from(list(ForceStrategy)), st.booleans()))
MLIP_SPECS = st.builds(
    lambda core, outputs, flags, keys, compile_: MLIPSpec(
        core, outputs=outputs, system_reductions=flags[0], gp_replicate_geometry=flags[1],
        node_energy_key=keys[0], node_virial_key=keys[1], compile=compile_),
    SPECS,
    st.dictionaries(NAMES, DECLS, max_size=5),
    st.tuples(st.booleans(), st.booleans()),
    st.tuples(st.one_of(st.none(), NAMES), st.one_of(st.none(), NAMES)),
    COMPILES,
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(MLIP_SPECS)
def test_to_dict_and_from_dict_are_mirrors(spec):
    d = spec.to_dict()
    back = MLIPSpec.from_dict(json.loads(json.dumps(d)))
    assert back == spec and hash(back) == hash(spec)
    assert canon(back.to_dict()) == canon(d)
    assert list(d) == ["version", "core", "system_reductions", "node_energy_key", "node_virial_key",
                       "gp_replicate_geometry", "owned_only_outputs", "all_reduce_outputs", "output_kinds", "compile"]
    assert d["output_kinds"] == sorted(d["output_kinds"]) and d["owned_only_outputs"] == sorted(d["owned_only_outputs"])
    assert [p for p in nb.check_spec_file(d) if not p.path.startswith("$.core")] == []  # core: storage-kind notes
    assert MLIPSpec(spec.distribution, outputs=spec.output_specs(), system_reductions=spec.system_reductions,
                    node_energy_key=spec.node_energy_key, node_virial_key=spec.node_virial_key,
                    gp_replicate_geometry=spec.gp_replicate_geometry, compile=spec.compile).to_dict()["output_kinds"] \
        == [[k, v] for k, v in d["output_kinds"] if v != "unknown"]


# --------------------------------------------------------------------------------- merge


def test_merge_keeps_output_kinds_and_gp_replicate_geometry():
    halo = nb.DistributionSpec(nb.HaloStoragePolicy("local", "halo_read"), shard_fields=("positions",))
    a = MLIPSpec(halo, outputs={"energy": "per_graph", "forces": "per_node"}, node_energy_key="atomic_energies")
    b = MLIPSpec(nb.DistributionSpec(nb.HaloStoragePolicy("halo_correction", "local"),
                                     (nb.OpAdapter("demo::spread", all_reduce_outputs=[0]),), shard_fields=("charges",)),
                 outputs={"charges": "per_node", "stress": ("per_graph", "all_reduce"), "energy": "unknown"},
                 system_reductions=False, gp_replicate_geometry=True)
    m = a.merge(b)
    assert m.output_kinds == {"energy": "per_graph", "forces": "per_node", "charges": "per_node", "stress": "per_graph"}
    assert m.gp_replicate_geometry and m.system_reductions and m.all_reduce_outputs == ("stress",)
    assert m.node_energy_key == "atomic_energies"
    assert m.distribution.policy == nb.HaloStoragePolicy("halo_correction", "halo_read")
    assert m.distribution.shard_fields == ("positions", "charges") and len(m.distribution.custom_ops) == 1
    assert nb.SPEC_MPNN_HALO.merge(nb.SPEC_MPNN_HALO) == nb.SPEC_MPNN_HALO


@pytest.mark.parametrize(("other", "match"), [
    (MLIPSpec(_DIST, outputs={"energy": "per_node"}), r"output 'energy' is 'per_graph' in one spec and 'per_node'"),
    (MLIPSpec(_DIST, outputs={"forces": ("per_node", "all_reduce")}), r"listed in both"),
    (MLIPSpec(_DIST, node_energy_key="e"), r"node_energy_key is 'atomic_energies' in one spec and 'e'"),
    (MLIPSpec(_DIST, compile=CompilePolicy()), r"the compile policies differ .*with_compile"),
    (MLIPSpec(nb.DistributionSpec(nb.RefreshOnlyHaloPolicy())), r"cannot merge storage policies HaloStoragePolicy and "
                                                                 r"RefreshOnlyHaloPolicy"),
    (nb.SPEC_MPNN_GP, r"cannot merge storage policies"),
])
def test_merge_conflicts_raise(other, match):
    a = nb.SPEC_MPNN_HALO.with_outputs({"forces": ("per_node", "owned_only")})
    a = dataclasses.replace(a, node_energy_key="atomic_energies")
    with pytest.raises(nb.SpecError, match=match):
        a.merge(other)


# ------------------------------------------------------------------------------- checker


def test_spec_check_lists_every_envelope_problem_with_its_path():
    d = env(
        owned_only_outputs=["forces", "forces", ""],
        all_reduce_outputs=["forces"],
        output_kinds=[["energy", "per_graph"], ["energy", "per_node"], ["stress", "per_grpah"]],
        node_energy_key="",
        compile={},
    )
    got = [str(p) for p in nb.check_spec_file(d)]
    assert got == [
        "$.owned_only_outputs[1]: 'forces' is listed twice; list each output once.",
        "$.owned_only_outputs[2]: output names must be non-empty strings, got ''.",
        "$.output_kinds[1][0]: output 'energy' is declared twice; give each output one kind.",
        "$.output_kinds[2][1]: unknown output kind for 'stress': 'per_grpah'; did you mean 'per_graph'? expected one of "
        "['global', 'per_graph', 'per_node', 'unknown'].",
        "$.node_energy_key: must be a non-empty string or null, got ''.",
        "$.compile: an empty compile policy {} declares nothing; write null for no policy.",
        "$.all_reduce_outputs[0]: 'forces' is also in owned_only_outputs; an output is either already correct on its "
        "owner's rows (owned_only) or a per-rank partial summed over ranks (all_reduce). Remove it from one.",
    ]


def test_cli_spec_check_on_a_bad_envelope(tmp_path, capsys):
    from nvalchemi_jaxbridge.app.cli import main

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(env(compile={"force_strategy": "framework_from_forces"}, system_reductions="yes")))
    assert main(["spec", "check", str(bad)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[1] for line in out] == ["$.compile.force_strategy", "$.system_reductions"]


# ---------------------------------------------------------------------- import hygiene


def test_loading_an_mlip_spec_imports_neither_jax_nor_torch():
    code = (
        "import sys, warnings, nvalchemi_jaxbridge as nb\n"
        f"s = nb.MLIPSpec.load({str(GOLDEN / 'v2_mace_cueq.json')!r})\n"
        f"f = nb.load_spec({str(GOLDEN / 'v2_envelope.json')!r}).mlip\n"
        f"nb.check_spec_file({str(GOLDEN / 'v2_mace_cueq.json')!r})\n"
        "hash(s); s.to_dict(); s.merge(s); nb.SPEC_MPNN_GP.force_strategy\n"
        "print(sorted(m for m in ('jax', 'torch', 'numpy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_exports():
    import nvalchemi_jaxbridge.spec as spec_layer

    for name in ("MLIPSpec", "CompilePolicy", "OutputKind", "OutputSpec", "Reduce", "ForceStrategy", "SPEC_MPNN_HALO",
                 "SPEC_MPNN_GP", "SPEC_UMA_HALO", "SPEC_LJ_HALO", "SPEC_EWALD_HALO", "SPEC_PME_HALO", "SPEC_DFTD3_HALO"):
        assert getattr(nb, name) is getattr(spec_layer, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MLIPSpec.from_dict(golden("v2_mace_cueq.json"))  # no warning on the reference's own files
