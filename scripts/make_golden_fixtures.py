"""Golden JSON fixtures for spec compatibility with nvalchemi-toolkit 0.2.0 (PyPI wheel).

Two steps, two interpreters (the wheel is not a dependency of the test suite):

    # 1. our package writes the specs it must be able to hand to the reference
    .venv/bin/python scripts/make_golden_fixtures.py ours
    # 2. the reference wheel writes its golden files and loads ours
    python3.11 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install nvalchemi-toolkit==0.2.0
    /tmp/refvenv/bin/python scripts/make_golden_fixtures.py reference

Step 1 writes tests/fixtures/ours/*.json. Step 2 writes tests/fixtures/nvalchemi_0_2_0/*.json,
including ours_loaded.json: what the reference made of each file of step 1.
"""



import json
import math
import pathlib
import sys
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "fixtures" / "nvalchemi_0_2_0"
OURS = ROOT / "tests" / "fixtures" / "ours"


def dump(path: pathlib.Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def wrap_default(original, self, o):
    """A module-level MethodAdapter replacement (resolves as __main__:wrap_default here)."""
    return original(self, o)


# --------------------------------------------------------------------------- ours


def build_ours() -> dict[str, dict]:
    """The specs our package writes, by file name (imports only our package)."""
    sys.path.insert(0, str(ROOT))
    import nvalchemi_jaxbridge as nb

    demo = [
        nb.OpAdapter("demo::spread", owned_slice_inputs=[0, 1], all_reduce_outputs=[0, 1]),
        nb.OpAdapter("demo::conv", gather_inputs=[0], scatter_outputs=[0]),
        nb.OpAdapter("demo::spread", output_transforms={0: nb.AllReduceSum(replicated_consumer=True)}),
    ]
    helpers = [
        nb.PythonAdapter("aimnet.nbops", "mol_sum"),
        nb.PythonAdapter("json", "dumps", replacement="math:fsum"),
        nb.JitAdapter("mymace.scripts", "envelopes", mode="marshal"),
        nb.MethodAdapter("e3nn.o3", "SphericalHarmonics", "forward", mode="marshal"),
        nb.MethodAdapter("json.encoder", "JSONEncoder", "default", "__main__:wrap_default"),
    ]
    all_kinds = nb.DistributionSpec(nb.HaloStoragePolicy(), adapters=(*demo, *helpers), shard_fields=("positions",))
    files = {
        "spec_all_kinds.json": all_kinds.to_dict(),
        "spec_v2.json": nb.SpecFile(
            all_kinds,
            {
                "system_reductions": True, "node_energy_key": "atomic_energies", "node_virial_key": None,
                "gp_replicate_geometry": False, "owned_only_outputs": ["forces"],
                "all_reduce_outputs": ["stress"],
                "output_kinds": [["energy", "per_graph"], ["forces", "per_node"], ["stress", "per_graph"]],
                "compile": {"static_shapes": True, "force_strategy": "framework_from_node_energy",
                            "stress_via_strain": False},
            },
        ).to_dict(),
        "spec_overload.json": nb.DistributionSpec(
            nb.HaloStoragePolicy(), (nb.OpAdapter("demo::conv.fast", gather_inputs=[0]),)
        ).to_dict(),
        "spec_sharded.json": nb.DistributionSpec(
            nb.GraphParallelPolicy(), (nb.OpAdapter("demo::conv", gather_inputs_full=[0, 2], slice_outputs_owned=[1]),)
        ).to_dict(),
        "spec_lazy_op.json": nb.DistributionSpec(
            None, (nb.OpAdapter("cuequivariance::uniform_1d"),)
        ).to_dict(),
    }
    for policy in (None, nb.PlainShard(), nb.GraphParallelPolicy(), nb.RefreshOnlyHaloPolicy(),
                   nb.HaloStoragePolicy("local", "local")):
        kind = nb.policy_to_dict(policy)["kind"]
        files[f"policy_{kind}{'_local' if kind == 'halo' else ''}.json"] = nb.SpecFile(
            nb.DistributionSpec(policy, shard_fields=())
        ).to_v2().to_dict()
    return files


def write_ours() -> None:
    OURS.mkdir(parents=True, exist_ok=True)
    for name, d in build_ours().items():
        dump(OURS / name, d)
    print(f"wrote {len(list(OURS.glob('*.json')))} files to {OURS}")


# ---------------------------------------------------------------------- reference


def register_demo_ops():
    """demo::spread (custom_op), demo::conv with a default and a `fast` overload."""
    import torch

    @torch.library.custom_op("demo::spread", mutates_args=())
    def spread(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * w, x.sum(0, keepdim=True)

    lib = torch.library.Library("demo", "FRAGMENT")
    lib.define("conv(Tensor x) -> Tensor")
    lib.define("conv.fast(Tensor x, int k) -> Tensor")
    lib.impl("conv", lambda x: 2 * x, "CompositeExplicitAutograd")
    lib.impl("conv.fast", lambda x, k: k * x, "CompositeExplicitAutograd")
    return lib, spread


def write_reference() -> None:
    import torch
    from nvalchemi.distributed import spec as ref_spec
    from nvalchemi.distributed._core import adapter as A
    from nvalchemi.distributed._core import op_transforms as T
    from nvalchemi.distributed._core import storage_policy as P
    from nvalchemi.distributed._core.spec import DistributionSpec
    from nvalchemi.distributed.spec import MLIPSpec

    keep_alive = register_demo_ops()  # noqa: F841
    GOLDEN.mkdir(parents=True, exist_ok=True)
    conv, spread = torch.ops.demo.conv, torch.ops.demo.spread

    # transforms
    dump(GOLDEN / "transforms.json", {
        "arg": [A._arg_transform_to_dict(t) for t in (T.GatherInputs(), T.GatherInputsFull(), T.SliceOwned())],
        "output": [A._output_transform_to_dict(t) for t in (
            T.ScatterOutputs(), T.AllReduceSum(), T.AllReduceSum(replicated_consumer=True), T.SliceOutputsOwned())],
    })

    # policies
    policies = [None, P.HaloStoragePolicy(), P.HaloStoragePolicy("local", "local"),
                P.RefreshOnlyHaloPolicy(), P.RefreshOnlyHaloPolicy(scatter_mode="local"),
                P.PlainShard(), P.GraphParallelPolicy()]
    dump(GOLDEN / "policies.json", {
        "to_dict": [P.policy_to_dict(p) for p in policies],
        # what from_dict makes of records without modes
        "from_sparse": {k: P.policy_to_dict(P.policy_from_dict({"kind": k})) for k in ("halo", "refresh_halo")},
    })

    # op adapters: constructor forms and what they serialize to, with their properties
    forms = {
        "packet": A.OpAdapter(spread, owned_slice_inputs=[0, 1], all_reduce_outputs=[0]),
        "default_overload": A.OpAdapter(conv.default, gather_inputs=[0], scatter_outputs=[0]),
        "non_default_overload": A.OpAdapter(conv.fast, gather_inputs=[0]),
        "lazy_string": A.OpAdapter("cuequivariance::uniform_1d"),
        "explicit_dicts": A.OpAdapter(spread, {0: T.GatherInputs()}, {0: T.ScatterOutputs(), 1: T.AllReduceSum(True)}),
        "explicit_wins": A.OpAdapter(spread, arg_transforms={0: T.SliceOwned()}, gather_inputs=[0, 2]),
        "first_role_wins": A.OpAdapter(spread, scatter_outputs=[0], all_reduce_outputs=[0]),
        "numeric_key_order": A.OpAdapter(spread, owned_slice_inputs=[5, 1, 10]),
        "neighbors_alias": A.OpAdapter(conv, neighbors_inputs=[1]),
        "sharded_roles": A.OpAdapter(conv, gather_inputs_full=[0, 2], slice_outputs_owned=[1]),
        "replicated": A.OpAdapter(spread, owned_slice_inputs=[0, 1],
                                  output_transforms={0: T.AllReduceSum(replicated_consumer=True)}),
    }
    props = ("gather_inputs", "gather_inputs_full", "owned_slice_inputs", "scatter_outputs",
             "all_reduce_outputs", "all_reduce_replicated_outputs", "slice_outputs_owned")
    dump(GOLDEN / "op_adapters.json", {
        name: {
            "dict": a.to_dict(),
            "properties": {p: list(getattr(a, p)) for p in props},
            "describe": {"kind": a.describe().kind, "target": a.describe().target},
        }
        for name, a in forms.items()
    })

    # a spec with every adapter kind (DistributionSpec, bare)
    helpers = (
        A.PythonAdapter("aimnet.nbops", "mol_sum"),
        A.PythonAdapter("json", "dumps", replacement=math.fsum),
        A.JitAdapter("mymace.scripts", "envelopes", mode="marshal"),
        A.JitAdapter("json", "loads", replacement=math.fsum),
        A.MethodAdapter("e3nn.o3", "SphericalHarmonics", "forward", mode="marshal"),
        A.MethodAdapter(json.JSONEncoder, "default", wrap_default),
        A.ModuleForwardAdapter(torch.nn.Linear(2, 2), lambda x: x, label="conv_tp"),
    )
    all_kinds = DistributionSpec(
        policy=P.HaloStoragePolicy(),
        adapters=(forms["packet"], forms["default_overload"], A.OpAdapter("cuequivariance::uniform_1d"), *helpers),
        shard_fields=("positions",),
    )
    dump(GOLDEN / "spec_all_kinds.json", all_kinds.to_dict())
    dump(GOLDEN / "spec_lazy_op.json", DistributionSpec(
        policy=None,
        custom_ops=tuple(A.OpAdapter(f"cuequivariance::{n}") for n in (
            "fused_tensor_product", "uniform_1d", "segmented_transpose")),
    ).to_dict())
    dump(GOLDEN / "spec_sharded.json", DistributionSpec(
        policy=P.GraphParallelPolicy(), custom_ops=(forms["sharded_roles"],), shard_fields=()).to_dict())

    # v2 envelopes: presets and a model-level spec with outputs and a compile policy
    from nvalchemi.distributed.spec import CompilePolicy, ForceStrategy, OutputKind, OutputSpec, Reduce

    dump(GOLDEN / "v2_preset_mpnn_halo.json", ref_spec.SPEC_MPNN_HALO.to_dict())
    dump(GOLDEN / "v2_preset_mpnn_gp.json", ref_spec.SPEC_MPNN_GP.to_dict())
    mlip = MLIPSpec(
        distribution=all_kinds,
        outputs={"energy": OutputSpec(OutputKind.PER_GRAPH), "forces": OutputSpec(OutputKind.PER_NODE),
                 "stress": OutputSpec(OutputKind.PER_GRAPH, Reduce.ALL_REDUCE)},
        node_energy_key="atomic_energies",
        compile=CompilePolicy(force_strategy=ForceStrategy.FRAMEWORK_FROM_NODE_ENERGY),
    )
    dump(GOLDEN / "v2_envelope.json", mlip.to_dict())
    dump(GOLDEN / "v2_default_envelope.json", MLIPSpec(distribution=DistributionSpec()).to_dict())
    write_reference_models()

    # what the reference makes of the files our package wrote (step 1)
    outcomes = {}
    for path in sorted(OURS.glob("*.json")):
        d = json.loads(path.read_text())
        try:
            obj = MLIPSpec.from_dict(d) if "version" in d else DistributionSpec.from_dict(d)
            outcomes[path.name] = {"loaded": True, "error": None, "reserialized": obj.to_dict()}
        except Exception as e:  # recorded: some files are expected not to load there
            outcomes[path.name] = {"loaded": False, "error": f"{type(e).__name__}: {e}", "reserialized": None}
            traceback.print_exc(limit=1)
    dump(GOLDEN / "ours_loaded.json", outcomes)
    import importlib.metadata as md

    dump(GOLDEN / "versions.json", {p: md.version(p) for p in ("nvalchemi-toolkit", "torch")}
         | {"python": sys.version.split()[0]})
    print(f"wrote {len(list(GOLDEN.glob('*.json')))} files to {GOLDEN}")


def write_reference_models() -> None:
    """The MACE specs (built from lazy names: mace and cueq need not be installed) and MLIPSpec facts.

    v2_mace_cueq.json / v2_mace.json: the specs MACEWrapper.distribution_spec() starts from, for a
    cueq-converted and a plain MACE model. mlip_reference_behaviour.json: every preset's JSON, the
    default CompilePolicy, the lowering of an `unknown`-kind output, and whether the reference reloads
    each MACE file.
    """
    import warnings

    from nvalchemi.distributed import spec as ref_spec
    from nvalchemi.distributed._core.spec import DistributionSpec
    from nvalchemi.distributed.spec import CompilePolicy, MLIPSpec, OutputKind, OutputSpec, Reduce
    from nvalchemi.models import mace

    models = {"v2_mace_cueq.json": mace._mace_cueq_spec(), "v2_mace.json": mace._mace_scripted_spec()}
    reload = {}
    for name, spec in models.items():
        dump(GOLDEN / name, spec.to_dict())
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                MLIPSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
            reload[name] = None
        except Exception as e:  # the cueq one names ops that are not registered here
            reload[name] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    presets = sorted(n for n in dir(ref_spec) if n.startswith("SPEC_"))
    unknown_kind = MLIPSpec(distribution=DistributionSpec(), outputs={
        "energy": OutputSpec(OutputKind.PER_GRAPH), "charges": OutputSpec(OutputKind.UNKNOWN, Reduce.ALL_REDUCE)})
    dump(GOLDEN / "mlip_reference_behaviour.json", {
        "presets": {n: getattr(ref_spec, n).to_dict() for n in presets},
        "compile_policy_default": MLIPSpec(distribution=DistributionSpec(), compile=CompilePolicy()).to_dict()["compile"],
        "outputs_unknown_kind": unknown_kind.to_dict(),
        "reload_error": reload,
    })


if __name__ == "__main__":
    step = sys.argv[1] if len(sys.argv) > 1 else ""
    if step == "ours":
        write_ours()
    elif step == "reference":
        write_reference()
    else:
        sys.exit(__doc__)
