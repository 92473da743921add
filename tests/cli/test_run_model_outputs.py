"""`run --model` as an MD runner: trajectory (ase.io), thermo (csv) and plot (PNG) read back and checked against
an independent one-device reference (ASE's neighbour list + the model's own forward, a numpy BAOAB with the
documented noise), the report's drift, temperature and time with no "nan" for any --steps, and the bar's phases."""

from __future__ import annotations

import csv
import io
import json
import re
import sys

import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.app import model_run, outputs
from nvalchemi_jaxbridge.app.cli import main
from nvalchemi_jaxbridge.demo.units import KB_EV, MVV2E
from nvalchemi_jaxbridge.mlip import MPNN, MPNNWrapper
from tests.mlip._reference import reference

PNG = b"\x89PNG\r\n\x1a\n"


def _independent(model, positions, numbers, cell):
    import ase

    atoms = ase.Atoms(numbers=numbers, positions=positions, cell=cell, pbc=True)
    return reference(model.forward, atoms, model.cutoff, MPNNWrapper(model).node_attrs(numbers))


def _thermo(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(outputs.THERMO_HEADER)
    return {int(r["step"]): {k: float(v) for k, v in r.items()} for r in rows}


def _no_nan(text):
    assert not re.search(r"\bnan\b", text, re.I), text


class _TTY(io.StringIO):
    def isatty(self):
        return True


def test_mpnn_run_writes_trajectory_thermo_and_plot_that_match_the_model(tmp_path, capsys, monkeypatch):
    import ase.io
    import ase.units
    from matplotlib.image import imread

    tty = _TTY()
    monkeypatch.setattr(sys, "stderr", tty)
    traj, thermo, png, rep = (tmp_path / n for n in ("t.extxyz", "t.csv", "t.png", "r.json"))
    rc = main(["run", "--model", "mpnn", "--devices", "2", "--cells", "2", "--steps", "6", "--check-every", "4",
               "--trajectory", str(traj), "--trajectory-every", "3", "--thermo", str(thermo), "--thermo-every", "2",
               "--plot", str(png), "--json-report", str(rep)])
    out = capsys.readouterr().out
    assert rc == 0, out
    _no_nan(out)
    # the bar names its phases in order, then shows T and E_tot per atom at the checks
    bar = tty.getvalue()
    order = [bar.index(p) for p in ("layout", "compiling:", "reference", "compiling MD", "MD: 100%")]
    assert order == sorted(order), bar
    assert re.search(r"MD: 100%.*6/6.*T=\d+\.\d K, E=-?\d+\.\d{6} eV/atom", bar), bar
    r = json.loads(rep.read_text())
    _no_nan(rep.read_text())
    n = r["n_atoms"]
    assert n == 32 and r["thermostat"] == "NVE (velocity Verlet)"

    frames = ase.io.read(traj, ":")
    assert [f.info["step"] for f in frames] == [0, 3, 6] and [f.info["time_fs"] for f in frames] == [0.0, 3.0, 6.0]
    model = MPNN(model_run.SPECIES, seed=0)
    for f in (frames[0], frames[-1]):  # each frame's energy and forces are the model's at its positions
        want = _independent(model, f.positions, f.numbers, f.cell.array)  # positions as written: 8 decimals
        np.testing.assert_allclose(f.get_potential_energy(), want["energy"], rtol=0, atol=1e-7)
        np.testing.assert_allclose(f.get_forces(), want["forces"], rtol=0, atol=1e-7)
    assert abs(frames[-1].get_potential_energy() - frames[0].get_potential_energy()) > 1e-4  # the atoms moved

    rows = _thermo(thermo)
    assert sorted(rows) == [0, 2, 4, 6]
    for f in (frames[0], frames[-1]):  # thermo against the frames: E_kin and T from the velocities, by hand
        row, v = rows[f.info["step"]], f.get_velocities() * ase.units.fs  # Å/fs
        e_kin = 0.5 * MVV2E * np.sum(f.get_masses()[:, None] * v * v)
        np.testing.assert_allclose(row["e_kin_eV"], e_kin, rtol=1e-6)
        np.testing.assert_allclose(row["temperature_K"], 2 * e_kin / ((3 * n - 3) * KB_EV), rtol=1e-6)
        np.testing.assert_allclose(row["e_pot_eV"], f.get_potential_energy(), rtol=1e-10)
        assert row["e_tot_eV"] == pytest.approx(row["e_pot_eV"] + row["e_kin_eV"], rel=1e-14)
        assert row["time_fs"] == f.info["time_fs"]
    assert rows[0]["temperature_K"] == pytest.approx(300.0, rel=1e-9)

    # the report: E_tot drift per atom (NVE: small), temperatures, a time per step, at the checks
    assert set(r["md_steps"]) >= {0, 2, 3, 4, 6}
    e_tot = {s: (rows[s]["e_tot_eV"]) / n for s in rows}
    assert r["energy_change_max_eV_per_atom"] >= max(abs(e - e_tot[0]) for e in e_tot.values()) - 1e-12
    assert 0 < r["energy_change_max_eV_per_atom"] < 1e-4
    assert r["temperature_K"][0] == pytest.approx(300.0, rel=1e-9) and r["time_per_step_s"] > 0
    assert "drift max|E_tot(t)-E_tot(0)|/N" in out and "temperature  initial 300.0 K, final" in out
    assert "ms/step" in out and f"trajectory {traj} (3 frames); thermo {thermo} (4 rows)" in out

    assert png.read_bytes()[:8] == PNG and imread(png).shape[:2] == (700, 1100)


def test_langevin_follows_a_numpy_baoab_with_the_documented_noise(tmp_path):
    import ase.io
    import ase.units
    import jax

    traj = tmp_path / "t.extxyz"
    config = model_run.ModelRunConfig(model="mpnn", devices=2, cells=2, steps=3, check_every=2, langevin=0.05,
                                      temperature=500.0, seed=3, trajectory=str(traj), trajectory_every=1)
    rep = model_run.run_model(config)
    assert rep.ok and rep.thermostat == "Langevin BAOAB, friction 0.05/fs, 500 K" and rep.bath_temperature_K == 500.0
    frames = ase.io.read(traj, ":")
    assert [f.info["step"] for f in frames] == [0, 1, 2, 3]

    # one device, numpy: BAOAB with the noise of atom i at step s = normal(fold_in(fold_in(key(seed), s), i))
    model, s = MPNN(model_run.SPECIES, seed=3), model_run.make_structure(config)
    inv_m = 1.0 / (MVV2E * s.masses[:, None])
    x, v = s.positions.copy(), s.velocities.copy()
    f = _independent(model, x, s.atomic_numbers, s.cell)["forces"]
    c1, dt = np.exp(-0.05 * 1.0), 1.0
    sigma = np.sqrt(KB_EV * 500.0 * inv_m)
    key = jax.random.key(3)
    for step in range(3):
        k = jax.random.fold_in(key, step)
        noise = np.stack([np.asarray(jax.random.normal(jax.random.fold_in(k, i), (3,), dtype=np.float64))
                          for i in range(len(x))])
        v = v + 0.5 * dt * f * inv_m
        x = x + 0.5 * dt * v
        v = c1 * v + np.sqrt(1 - c1 * c1) * sigma * noise
        x = x + 0.5 * dt * v
        f = _independent(model, x, s.atomic_numbers, s.cell)["forces"]
        v = v + 0.5 * dt * f * inv_m
        got = frames[step + 1]
        np.testing.assert_allclose(got.positions, x, rtol=0, atol=1e-7, err_msg=f"step {step + 1}")
        np.testing.assert_allclose(got.get_velocities() * ase.units.fs, v, rtol=0, atol=1e-7)
    assert "change (a thermostat exchanges energy: not a drift)" in __import__(
        "nvalchemi_jaxbridge.app.report", fromlist=["x"]).format_model_run(rep)


def test_checkpoint_runs_report_no_nan_for_zero_steps_or_one_chunk_of_steps(tmp_path, capsys):
    path = tmp_path / "small.pt"
    torch.save(MPNN(model_run.SPECIES, seed=4, features=8, n_layers=2), path)
    for steps, time_words in (("0", "dynamics     none (--steps 0)"), ("10", "compilation included")):
        rep = tmp_path / f"r{steps}.json"
        rc = main(["run", "--checkpoint", str(path), "--steps", steps, "--devices", "2", "--cells", "2", "--quiet",
                   "--json-report", str(rep)])
        out = capsys.readouterr().out
        assert rc == 0, out
        _no_nan(out)
        _no_nan(rep.read_text())  # json.dump writes NaN for a nan: none there
        r = json.loads(rep.read_text())
        assert time_words in out, out
        assert (r["time_per_step_s"] is None) == (steps == "0") and r["steps_done"] == int(steps)
        assert r["energy_change_max_eV_per_atom"] >= 0 and len(r["temperature_K"]) == len(r["md_steps"])


@pytest.mark.slow
def test_mace_run_writes_outputs_that_match_maces_own_forward(tmp_path, capsys):
    pytest.importorskip("mace", reason="needs mace-torch: pip install 'nvalchemi_jaxbridge[mlip]'")
    import ase.io
    from matplotlib.image import imread

    from nvalchemi_jaxbridge.mlip.mace import random_mace
    from tests.mlip._reference import mace_reference

    traj, thermo, png, rep = (tmp_path / n for n in ("t.extxyz", "t.csv", "t.png", "r.json"))
    rc = main(["run", "--model", "mace", "--devices", "2", "--cells", "2", "--steps", "2", "--check-every", "2",
               "--trajectory", str(traj), "--trajectory-every", "2", "--thermo", str(thermo), "--plot", str(png),
               "--json-report", str(rep), "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    _no_nan(out)
    r = json.loads(rep.read_text())
    frames = ase.io.read(traj, ":")
    assert [f.info["step"] for f in frames] == [0, 2]
    model = random_mace(model_run.SPECIES, seed=0, dtype=torch.float64, max_ell=2)  # what --model mace builds
    want = mace_reference(model, frames[-1])
    np.testing.assert_allclose(frames[-1].get_potential_energy(), want["energy"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(frames[-1].get_forces(), want["forces"], rtol=0, atol=1e-7)
    assert sorted(_thermo(thermo)) == [0, 2]
    assert 0 <= r["energy_change_max_eV_per_atom"] < 1e-3 and r["time_per_step_s"] > 0
    assert png.read_bytes()[:8] == PNG and imread(png).shape[:2] == (700, 1100)
