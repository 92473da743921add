"""`run` outputs and front matter: trajectory (extended XYZ) and thermo (CSV) read back, output paths checked
before anything runs, species checked against the potential, the progress bar, --version and --help."""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import io
import re
import sys

import numpy as np
import pytest

import nvalchemi_jaxbridge
from nvalchemi_jaxbridge.app import outputs, run_config, simulate
from nvalchemi_jaxbridge.app.cli import _build_parser, main
from nvalchemi_jaxbridge.demo import reference
from nvalchemi_jaxbridge.demo.units import KB_EV

FAST = ["--devices", "2", "--steps", "2", "--quiet"]


def test_trajectory_and_thermo_read_back(tmp_path):
    import ase.io
    import ase.units

    traj, thermo = tmp_path / "t.extxyz", tmp_path / "t.csv"
    calls = []
    cfg = run_config.RunConfig(kernel="jax", cells=2, devices=2, steps=7, check_every=2, temperature=80.0,
                               params={"sigma": "3.3"}, trajectory=str(traj), trajectory_every=3,
                               thermo=str(thermo), thermo_every=2)
    report = simulate.run(cfg, progress=lambda done, **status: calls.append((done, status)))
    assert report.ok and report.params == {"epsilon": 0.0104, "sigma": 3.3, "cutoff": 8.5}

    frames = ase.io.read(traj, ":")
    assert [f.info["step"] for f in frames] == [0, 3, 6, 7]  # every 3 steps, and the last one
    np.testing.assert_allclose(frames[-1].positions, report.final_positions, rtol=0, atol=1e-7)
    np.testing.assert_allclose(frames[-1].get_velocities() * ase.units.fs, report.final_velocities, atol=1e-8)
    # step 0: the demo LJ with sigma bound by name (3.3, not the default 3.4), by the numpy reference
    e0, f0 = reference.lj_reference(frames[0].positions, frames[0].cell.array, (True,) * 3,
                                    epsilon=0.0104, sigma=3.3, cutoff=8.5)
    np.testing.assert_allclose(frames[0].get_potential_energy(), e0, rtol=1e-10)
    np.testing.assert_allclose(frames[0].get_forces(), f0, rtol=0, atol=1e-8)
    assert abs(reference.lj_reference(frames[0].positions, frames[0].cell.array, (True,) * 3,
                                      epsilon=0.0104, sigma=3.4, cutoff=8.5)[0] - e0) > 1e-2 * abs(e0)

    with open(thermo, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(outputs.THERMO_HEADER)
    assert [int(r["step"]) for r in rows] == [0, 2, 4, 6, 7]
    by_step = {int(r["step"]): {k: float(v) for k, v in r.items()} for r in rows}
    for frame in frames:
        s = frame.info["step"]
        if s in by_step:
            np.testing.assert_allclose(by_step[s]["e_pot_eV"], frame.get_potential_energy(), rtol=1e-12)
    for s, r in by_step.items():
        assert r["time_fs"] == s * 5.0
        np.testing.assert_allclose(r["e_tot_eV"], report.energy_per_atom_eV[s] * 32, rtol=1e-12)
        np.testing.assert_allclose(r["e_tot_eV"], r["e_pot_eV"] + r["e_kin_eV"], rtol=1e-14)
        np.testing.assert_allclose(r["temperature_K"], 2 * r["e_kin_eV"] / (93 * KB_EV), rtol=1e-12)
    np.testing.assert_allclose(by_step[0]["temperature_K"], 80.0, rtol=1e-10)  # 3N - 3 degrees of freedom
    assert report.outputs == {"trajectory": (str(traj), 4), "thermo": (str(thermo), 5)}

    assert calls[0] == (0, {"phase": "compiling"}) and (1, {"phase": "MD"}) in calls
    checks = [(d, s) for d, s in calls if "temperature" in s]
    assert [d for d, _ in checks] == [2, 4, 6, 7]  # the host checks and the end
    np.testing.assert_allclose(checks[-1][1]["temperature"], by_step[7]["temperature_K"], rtol=1e-12)
    np.testing.assert_allclose(checks[-1][1]["energy"], by_step[7]["e_tot_eV"] / 32, rtol=1e-12)


@pytest.mark.parametrize("option, path, match", [
    ("--trajectory", "missing/t.extxyz", r"--trajectory .*missing/t.extxyz: the directory .*missing does not exist"),
    ("--thermo", ".", r"--thermo .* is a directory; give a file name inside it"),
    ("--json-report", "afile/r.json", r"--json-report .*afile/r.json: .*afile is a file, not a directory"),
    ("--thermo", "t.extxyz", r"--trajectory and --thermo name the same file"),
])
def test_output_path_errors_raise_before_anything_runs(option, path, match, tmp_path, monkeypatch, capsys):
    (tmp_path / "afile").write_text("")
    started = []
    monkeypatch.setattr(simulate, "configure_jax", lambda *a, **k: started.append(a))
    monkeypatch.setattr(run_config, "configure_jax", lambda *a, **k: started.append(a))
    argv = ["run", "--trajectory", str(tmp_path / "t.extxyz"), option, str(tmp_path / path), *FAST]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: run: ") and re.search(match, err), err
    assert not started  # nothing ran: JAX was never even configured
    if option in ("--trajectory", "--thermo"):
        with pytest.raises(ValueError, match=match):
            simulate.run(run_config.RunConfig(**{"trajectory": str(tmp_path / "t.extxyz"),
                                                 option[2:]: str(tmp_path / path)}))
        assert not started


def test_a_structure_with_species_the_potential_does_not_model_is_refused(tmp_path, capsys):
    import ase.build
    import ase.io

    cu = tmp_path / "cu.extxyz"
    atoms = ase.build.bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)
    atoms.numbers[:3] = 79
    ase.io.write(cu, atoms)
    assert main(["run", "--structure", str(cu), "--kernel", "jax", *FAST]) == 2
    err = capsys.readouterr().err
    assert (f"run: {cu} holds Cu x 29, Au x 3, but the demo Lennard-Jones (argon) potential models Ar (Z=18) "
            "only; give a structure of those species, or run your own potential on it with --op") in err, err
    atoms.set_initial_charges(np.tile([1.0, -1.0], 16))
    ase.io.write(cu, atoms)
    assert main(["run", "--system", "rocksalt", "--structure", str(cu), "--kernel", "jax", *FAST]) == 2
    assert "models Na (Z=11) and Cl (Z=17) only" in capsys.readouterr().err


def test_progress_bar_shows_compiling_then_temperature_and_energy(monkeypatch, capsys):
    class TTY(io.StringIO):
        def isatty(self):
            return True

    tty = TTY()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["run", "--kernel", "jax", "--cells", "1", "--devices", "2", "--steps", "4", "--check-every", "2"]) == 0
    bar = tty.getvalue()
    assert bar.index("compiling") < bar.index("MD:"), bar
    assert re.search(r"MD: 100%.*4/4.*T=\d+\.\d K, E=-?\d+\.\d{6} eV/atom", bar), bar
    assert "result       ok" in capsys.readouterr().out


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"nvalchemi-jaxbridge {importlib.metadata.version('nvalchemi_jaxbridge')}\n"
    assert nvalchemi_jaxbridge.__version__ == importlib.metadata.version("nvalchemi_jaxbridge")


def _parsers(parser):
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_help_says_its_default(capsys):
    missing = []
    for prog, parser in _parsers(_build_parser()):
        for action in parser._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            if "(default" not in action.help and not action.required:
                missing.append(f"{prog} {action.option_strings[0]}")
    assert not missing, missing
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("MD steps (default 100)", "(default 10)", "(default 1e-8 in float64, 1e-4 in float32)",
                  "--param NAME=VALUE", "--op MODULE:ATTR", "--trajectory PATH", "--thermo-every K"):
        assert shown in text, shown
