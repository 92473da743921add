"""`nvalchemi-jaxbridge validate`: passes on the shipped specs, fails with the documented hints."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nvalchemi_jaxbridge.app import validate as V
from nvalchemi_jaxbridge.app.cli import main
from nvalchemi_jaxbridge.demo import params, reference

SPECS = "nvalchemi_jaxbridge/app/specs"
LJ_OP = "nvalchemi_jaxbridge.demo.torch_ops:lj_energy_forces"


def _spec(tmp_path, op, args, outs, name="s.json"):
    path = tmp_path / name
    path.write_text(json.dumps({
        "policy": {"kind": "halo", "scatter_mode": "halo_correction", "gather_mode": "halo_read"},
        "custom_ops": [{"op": op, "arg_transforms": {str(k): {"type": v} for k, v in args.items()},
                        "output_transforms": {str(k): v for k, v in outs.items()}}],
        "third_party_helpers": []}))
    return str(path)


def test_single_device_block_matches_the_numpy_reference():
    # Independent check of what validate calls "single-device": the op on all atoms owned plus image ghosts.
    from nvalchemi_jaxbridge.demo import torch_ops

    system = V.sample_system(charged=False)
    p = params.LJParams()
    pos, mask, atom = V.single_device_block(system, p.cutoff)
    assert mask.sum() == system.n_atoms and np.array_equal(atom[: system.n_atoms], np.arange(system.n_atoms))
    energy, rows = V._call_direct(torch_ops.lj_energy_forces._opoverload, [pos, mask])
    forces = np.zeros((system.n_atoms, 3))
    np.add.at(forces, atom, rows)
    e_ref, f_ref = reference.lj_reference(system.positions, system.cell, system.periodic,
                                          epsilon=p.epsilon, sigma=p.sigma, cutoff=p.cutoff)
    np.testing.assert_allclose(float(energy), e_ref, rtol=1e-12)
    np.testing.assert_allclose(forces, f_ref, atol=1e-12)


def test_validate_passes_on_the_shipped_spec(capsys):
    assert main(["validate", f"{SPECS}/lj_argon.json", "--op", LJ_OP]) == 0
    out = capsys.readouterr().out
    assert "result: ok" in out and "GatherInputs" in out and "ScatterOutputs" in out and "7 x ppermute" in out


def test_validate_charged_op_through_a_registering_module_attribute():
    # The attribute is the namespace string: importing the module registers the spec's op.
    r = V.validate(f"{SPECS}/dsf_rocksalt.json", "nvalchemi_jaxbridge.demo.torch_ops:NAMESPACE", devices=4)
    assert r.ok, r.format()
    assert [o.kind for o in r.outputs] == ["scalar", "per-atom"] and r.n_atoms == 64


def test_validate_fails_without_scatter_outputs_with_the_hint(tmp_path, capsys):
    spec = _spec(tmp_path, "jaxbridge_demo::lj_energy_forces", {0: "gather_inputs"},
                 {0: {"type": "all_reduce_sum", "replicated_consumer": False}})
    assert main(["validate", spec, "--op", LJ_OP]) == 1
    out = capsys.readouterr().out
    assert "hint: output 1 is per-atom and ghost rows hold partial values: declare ScatterOutputs for output 1" in out
    assert "result: FAILED" in out
    r = V.validate(spec, LJ_OP)
    assert not r.ok and [o.ok for o in r.outputs] == [True, False] and r.outputs[1].max_rel > 1e-3


def test_validate_suggests_the_ghost_width_for_a_two_hop_kernel(tmp_path):
    spec = _spec(tmp_path, "test::two_hop", {0: "gather_inputs"},
                 {0: {"type": "all_reduce_sum", "replicated_consumer": False}})
    thin = V.validate(spec, "tests.cli._twohop:two_hop", devices=4)
    assert not thin.ok
    assert any("halo is too thin" in h and "ghost width of 9 Å = 2 x cutoff" in h and "--skin 4.5" in h
               for h in thin.hints), thin.hints
    assert V.validate(spec, "tests.cli._twohop:two_hop", devices=4, skin=4.5).ok


def test_validate_missing_gather_on_charges(tmp_path):
    spec = _spec(tmp_path, "jaxbridge_demo::dsf_energy_forces", {0: "gather_inputs"},
                 {0: {"type": "all_reduce_sum", "replicated_consumer": False}, 1: {"type": "scatter_outputs"}})
    r = V.validate(spec, "nvalchemi_jaxbridge.demo.torch_ops:dsf_energy_forces", devices=2)
    assert not r.ok and r.hints == ("argument 1 ('charges') is per-atom and read on ghost rows; declare "
                                    "GatherInputs for argument 1.",)


@pytest.mark.parametrize("op, match", [
    ("nvalchemi_jaxbridge.demo.torch_ops", r"--op must be module:attr or path/to/file.py:attr \(e\.g\."),
    ("nvalchemi_jaxbridge.demo.torch_ops:nope", r"has no attribute 'nope'"),
    ("no_such_module_xyz:f", r"cannot import module 'no_such_module_xyz'"),
    ("nvalchemi_jaxbridge.demo.torch_ops:dsf_energy_forces",
     r"torch op jaxbridge_demo::dsf_energy_forces, which no adapter of the spec declares; the spec's ops are "
     r"\['jaxbridge_demo::lj_energy_forces'\]"),
])
def test_validate_op_errors(op, match, capsys):
    with pytest.raises((ValueError, ImportError), match=match):
        V.validate(f"{SPECS}/lj_argon.json", op)
    assert main(["validate", f"{SPECS}/lj_argon.json", "--op", op]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_validate_and_spec_check_print_json(tmp_path, capsys):
    assert main(["validate", f"{SPECS}/lj_argon.json", "--op", LJ_OP, "--devices", "2", "--cells", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] and r["n_devices"] == 2 and r["outputs"] and all(o["ok"] for o in r["outputs"])
    assert main(["spec", "check", f"{SPECS}/lj_argon.json", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"file": f"{SPECS}/lj_argon.json", "ok": True, "problems": []}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"policy": {"kind": "nope"}, "custom_ops": []}))
    assert main(["spec", "check", str(bad), "--json"]) == 1
    r = json.loads(capsys.readouterr().out)
    assert not r["ok"] and r["problems"][0]["path"].startswith("$") and r["problems"][0]["message"]


def test_validate_takes_an_op_from_a_python_file(tmp_path, capsys):
    ops = tmp_path / "my_ops.py"
    ops.write_text("from nvalchemi_jaxbridge.demo.jax_potentials import lj_energy_forces as lj\n")
    assert main(["validate", f"{SPECS}/lj_argon.json", "--op", f"{ops}:lj", "--devices", "2", "--cells", "2"]) == 0
    assert "result: ok" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"no file .*missing\.py.*existing \.py file"):
        V.load_op(f"{tmp_path}/missing.py:lj")
    broken = tmp_path / "broken.py"
    broken.write_text("def oops(:\n")
    with pytest.raises(ImportError, match=r"broken\.py.*raised SyntaxError"):
        V.load_op(f"{broken}:oops")
