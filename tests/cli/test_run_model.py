"""`nvalchemi-jaxbridge run --model`: the parity report against an independent single-device reference (ASE's
neighbour list, `tests/mlip/_reference.py`), rows per device, checkpoints, a tolerance miss exits 1."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.app import model_reference, model_run
from nvalchemi_jaxbridge.app.cli import main
from nvalchemi_jaxbridge.mlip import MPNN, MessagePassingWrapper, MPNNWrapper
from tests.mlip._reference import reference

FAST = ["--devices", "4", "--cells", "2", "--quiet"]


def _run(tmp_path, capsys, *argv):
    path = tmp_path / "report.json"
    rc = main(["run", *argv, *FAST, "--json-report", str(path)])
    out = capsys.readouterr().out
    return rc, out, (json.loads(path.read_text()) if path.exists() else None)


def _atoms(cells=2, seed=0):
    s = model_run.alloy(cells, seed=seed)
    ase = pytest.importorskip("ase")
    return ase.Atoms(numbers=s.atomic_numbers, positions=s.positions, cell=s.cell, pbc=True)


def _independent(model, atoms):
    w = MPNNWrapper(model)
    return reference(model.forward, atoms, model.cutoff, w.node_attrs(atoms.numbers))


@pytest.mark.parametrize("exchange", ["per_layer", "deep_halo"])
def test_mpnn_run_matches_an_independent_single_device_reference(tmp_path, capsys, exchange):
    rc, out, rep = _run(tmp_path, capsys, "--model", "mpnn", "--exchange", exchange, "--steps", "4",
                        "--check-every", "2")
    assert rc == 0, out
    assert rep["ok"] and rep["n_atoms"] == 32 and rep["n_devices"] == 4 and rep["exchange"] == exchange
    p = rep["parity"]
    for key in ("energy_rel", "forces_rel", "stress_rel", "atomic_energies_rel"):
        assert p[key] < 1e-10, (key, p[key])
    # the CLI's reference and its distributed energy against ASE's neighbour list + MPNN.forward, here
    want = _independent(MPNN(model_run.SPECIES, seed=0), _atoms())
    np.testing.assert_allclose(rep["energy_reference"], want["energy"], rtol=1e-12)
    np.testing.assert_allclose(rep["energy"], want["energy"], rtol=1e-10)
    # rows per device: every atom owned once; the deep halo holds n_layers cutoffs of ghosts
    rows, other = rep["rows_per_device"], rep["other_rows_per_device"]
    assert sum(r["owned"] for r in rows) == sum(r["owned"] for r in other) == 32
    deep, thin = (rows, other) if exchange == "deep_halo" else (other, rows)
    assert sum(r["ghost"] for r in deep) > 3 * sum(r["ghost"] for r in thin)
    assert rep["halo_depth"] == (4.0 if exchange == "per_layer" else 12.0)
    assert "8+" in out or "9+" in out  # owned+ghost printed per device
    assert f"exchange     {exchange}" in out and "result       ok" in out
    # the NVE run: energies at steps 0, 2, 4; finite, and moving (the structure is rattled)
    e = dict(zip(rep["md_steps"], rep["potential_energy_eV"]))
    assert sorted(e) == [0, 2, 4] and np.all(np.isfinite(list(e.values()))) and e[4] != e[0]
    np.testing.assert_allclose(e[0], want["energy"], rtol=1e-10)


def test_a_tolerance_miss_exits_nonzero(tmp_path, capsys, monkeypatch):
    real = model_run.single_device_reference

    def off(*args, **kwargs):
        out = real(*args, **kwargs)
        return {**out, "forces": out["forces"] + 1e-3}

    monkeypatch.setattr(model_run, "single_device_reference", off)
    rc, out, rep = _run(tmp_path, capsys, "--model", "mpnn", "--steps", "0")
    assert rc == 1
    assert not rep["ok"] and rep["parity"]["forces_max_abs"] == pytest.approx(1e-3, rel=1e-6)
    assert "FAIL" in out and "result       FAILED" in out


def test_checkpoint_runs_the_saved_model(tmp_path, capsys):
    model = MPNN(model_run.SPECIES, seed=7, features=8, n_layers=2)
    path = tmp_path / "mpnn.pt"
    torch.save(model, path)
    rc, out, rep = _run(tmp_path, capsys, "--checkpoint", str(path), "--steps", "0")
    assert rc == 0, out
    assert rep["source"] == str(path) and rep["n_layers"] == 2
    np.testing.assert_allclose(rep["energy"], _independent(model, _atoms())["energy"], rtol=1e-10)
    rc = main(["run", "--checkpoint", str(path), "--model", "mace", *FAST])
    assert rc == 2 and "holds a mpnn model but --model mace" in capsys.readouterr().err
    torch.save(model.state_dict(), path)
    rc = main(["run", "--checkpoint", str(path), *FAST])
    assert rc == 2 and "holds a state_dict" in capsys.readouterr().err


def test_model_takes_a_file_and_a_missing_one_lists_both_forms(tmp_path, capsys):
    model = MPNN(model_run.SPECIES, seed=5, features=8, n_layers=2)
    path = tmp_path / "mpnn.pt"
    torch.save(model, path)
    rc, out, rep = _run(tmp_path, capsys, "--model", str(path), "--steps", "0")
    assert rc == 0, out
    assert rep["source"] == str(path) and rep["model"] == "mpnn" and rep["n_layers"] == 2
    np.testing.assert_allclose(rep["energy"], _independent(model, _atoms())["energy"], rtol=1e-10)
    assert main(["run", "--model", str(tmp_path / "nope.model"), *FAST]) == 2
    err = capsys.readouterr().err
    assert "nope.model: no such file; --model takes mpnn or mace" in err and "path of a model file" in err
    assert main(["run", "--model", str(path), "--checkpoint", str(path), *FAST]) == 2
    assert "both name a model file; give it once" in capsys.readouterr().err


def test_an_mliap_file_runs_and_matches_its_own_single_device_forward(tmp_path, capsys):
    from nvalchemi_jaxbridge.demo.mliap_models import MLIAPMessagePassing

    import ase.io

    path = tmp_path / "model-mliap_lammps.pt"
    torch.save(MLIAPMessagePassing(), path)
    traj, thermo, png = tmp_path / "t.extxyz", tmp_path / "t.csv", tmp_path / "t.png"
    rc, out, rep = _run(tmp_path, capsys, "--model", str(path), "--steps", "20", "--trajectory", str(traj),
                        "--thermo", str(thermo), "--plot", str(png))
    assert rc == 0, out
    assert rep["model"] == "MLIAPMessagePassing" and rep["n_layers"] == 3  # two forward exchanges
    assert rep["reference"] == "the ML-IAP model's own compute_forces on one device"
    assert abs(rep["energy"] - rep["energy_reference"]) <= 1e-9 * abs(rep["energy_reference"])
    # the outputs of an ML-IAP file: step 0's energy is the model's own on one device
    frames = ase.io.read(traj, ":")
    assert [f.info["step"] for f in frames] == [0, 10, 20]
    np.testing.assert_allclose(frames[0].get_potential_energy(), rep["energy_reference"], rtol=1e-9)
    rows = list(csv.DictReader(open(thermo, newline="")))
    assert [int(r["step"]) for r in rows] == [0, 10, 20]
    np.testing.assert_allclose(float(rows[-1]["e_pot_eV"]), frames[-1].get_potential_energy(), rtol=1e-9)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "drift max|E_tot(t)-E_tot(0)|/N" in out


@pytest.mark.slow
def test_a_mace_model_file_runs_and_matches_maces_own_forward(tmp_path, capsys):
    pytest.importorskip("mace", reason="needs mace-torch: pip install 'nvalchemi_jaxbridge[mlip]'")
    from nvalchemi_jaxbridge.mlip.mace import random_mace
    from tests.mlip._reference import mace_reference

    model = random_mace(model_run.SPECIES, hidden_irreps="4x0e + 4x1o", max_ell=2, correlation=2, seed=2)
    path = tmp_path / "small.model"
    torch.save(model, path)  # what MACE's training writes
    rc, out, rep = _run(tmp_path, capsys, "--model", str(path), "--steps", "0")
    assert rc == 0, out
    assert rep["model"] == "mace" and rep["source"] == str(path) and rep["reference"].startswith("MACE's own forward")
    for key in ("energy_rel", "forces_rel", "stress_rel"):
        assert rep["parity"][key] < 1e-10, (key, rep["parity"][key])
    np.testing.assert_allclose(rep["energy"], mace_reference(model, _atoms())["energy"], rtol=1e-9)


def test_options_of_the_other_kind_of_run_are_refused(capsys):
    assert main(["run", "--model", "mpnn", "--kernel", "jax", *FAST]) == 2
    assert "--kernel apply to the demo potentials" in capsys.readouterr().err
    assert main(["run", "--exchange", "deep_halo", *FAST]) == 2
    assert "--exchange apply to a model run" in capsys.readouterr().err


def test_periodic_graph_matches_ase_on_a_sheared_unwrapped_cell():
    neighborlist = pytest.importorskip("ase.neighborlist")
    atoms = _atoms(seed=3)
    cell = atoms.cell.array.copy()
    cell[1] += 0.3 * cell[0]
    atoms.set_cell(cell, scale_atoms=True)
    atoms.positions += np.random.default_rng(0).integers(-2, 3, (len(atoms), 1)) * cell[2]  # unwrapped images
    ei, unit = model_reference.periodic_graph(atoms.positions, cell, (True, True, True), 4.0)
    vec = atoms.positions[ei[1]] - atoms.positions[ei[0]] + unit @ cell
    i, j, d = neighborlist.neighbor_list("ijD", atoms, 4.0)  # D = pos[j] - pos[i] + S @ cell
    ours = sorted(zip(ei[0], ei[1], *np.round(vec, 8).T))
    theirs = sorted(zip(i, j, *np.round(d, 8).T))
    assert len(ours) == len(theirs) and ours == theirs


def test_the_reference_of_any_wrapper_runs_its_stages_on_the_whole_system():
    model = MPNN(model_run.SPECIES, seed=1)

    class Delegate(MessagePassingWrapper):  # not an MPNNWrapper: the generic path
        cutoff, n_layers, dtype, name = model.cutoff, model.n_layers, torch.float64, "delegate"
        inner = MPNNWrapper(model)

        def node_attrs(self, numbers):
            return self.inner.node_attrs(numbers)

        def embed(self, g):
            return self.inner.embed(g)

        def interaction(self, i, g, h):
            return self.inner.interaction(i, g, h)

        def node_energies(self, g, e):
            return self.inner.node_energies(g, e)

    atoms = _atoms(seed=2)
    got = model_reference.single_device_reference(Delegate(), atoms.positions, atoms.numbers, atoms.cell.array)
    want = _independent(model, atoms)
    assert got["how"].startswith("Delegate stages")
    for key in ("energy", "forces", "stress", "atomic_energies"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_mace_run_matches_maces_own_forward(tmp_path, capsys):
    pytest.importorskip("mace", reason="needs mace-torch: pip install 'nvalchemi_jaxbridge[mlip]'")
    rc, out, rep = _run(tmp_path, capsys, "--model", "mace", "--steps", "0")
    assert rc == 0, out
    assert rep["model"] == "mace" and rep["reference"].startswith("MACE's own forward")
    for key in ("energy_rel", "forces_rel", "stress_rel"):
        assert rep["parity"][key] < 1e-10, (key, rep["parity"][key])
