"""`run --op module:attr --param NAME=VALUE`: the user's own op, scalars bound by name, checked against
an independent numpy evaluation; a parity miss exits 1; binding errors name the parameter and list them."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from nvalchemi_jaxbridge.app.cli import main
from nvalchemi_jaxbridge.demo.reference import image_shifts

MORSE = "tests.cli._user_op:morse"
FAST = ["--devices", "2", "--steps", "2", "--quiet"]


def _rattled(tmp_path, symbol="Cu", a=3.61, name="s.extxyz"):
    """32 atoms of fcc `symbol`, rattled by 0.05 Å (non-zero forces), as an extended XYZ file, and read back."""
    import ase.build
    import ase.io

    atoms = ase.build.bulk(symbol, "fcc", a=a, cubic=True).repeat(2)
    atoms.positions += np.random.default_rng(7).normal(scale=0.05, size=atoms.positions.shape)
    path = tmp_path / name
    ase.io.write(path, atoms)
    return path, ase.io.read(path)  # the positions as the file holds them (8 decimals)


def _pairs_numpy(atoms, cutoff, radial):
    """Energy and forces of all pairs over periodic images (own loop), `radial(r) -> (u, -u'(r))`."""
    cell = atoms.cell.array
    frac = atoms.positions @ np.linalg.inv(cell)
    pos = (frac - np.floor(frac)) @ cell
    n = len(pos)
    energy, forces = 0.0, np.zeros((n, 3))
    for s in image_shifts(cell, (True, True, True), cutoff):
        d = pos[:, None, :] - (pos[None, :, :] + s @ cell)  # r_i - r_j(image s)
        r = np.linalg.norm(d, axis=-1)
        inside = (r <= cutoff) & ~(np.eye(n, dtype=bool) & (not s.any()))
        u, minus_du = radial(np.where(inside, r, 1.0))
        energy += 0.5 * np.sum(np.where(inside, u, 0.0))
        forces += np.sum(np.where(inside, minus_du / np.where(inside, r, 1.0), 0.0)[..., None] * d, axis=1)
    return energy, forces


def _morse_numpy(atoms, *, r0, depth, alpha, cutoff):
    def raw(r):
        return depth * ((1.0 - np.exp(-alpha * (r - r0))) ** 2 - 1.0)

    def radial(r):
        ex = np.exp(-alpha * (r - r0))
        return raw(r) - raw(cutoff), -2.0 * depth * alpha * (1.0 - ex) * ex

    return _pairs_numpy(atoms, cutoff, radial)


def _soft_numpy(atoms, *, cutoff, strength):
    return _pairs_numpy(atoms, cutoff, lambda r: (strength * (1 - r / cutoff) ** 2, 2 * strength * (1 - r / cutoff) / cutoff))


def _frame0(traj):
    import ase.io

    frame = ase.io.read(traj, 0)
    return frame, frame.get_potential_energy(), frame.get_forces()


def test_user_jax_op_binds_scalars_by_name_and_matches_numpy(tmp_path, capsys):
    xyz, atoms = _rattled(tmp_path)
    traj, rep = tmp_path / "t.extxyz", tmp_path / "r.json"
    # given in another order than the op's (r0, depth, cutoff, alpha); cutoff keeps its default 6.0
    rc = main(["run", "--op", MORSE, "--param", "depth=0.34", "--param", "alpha=1.36", "--param", "r0=2.87",
               "--structure", str(xyz), "--trajectory", str(traj), "--json-report", str(rep), *FAST])
    out = capsys.readouterr().out
    assert rc == 0, out
    r = json.loads(rep.read_text())
    assert r["params"] == {"r0": 2.87, "depth": 0.34, "cutoff": 6.0, "alpha": 1.36}
    assert r["op"] == MORSE and r["kernel"] == "jax" and r["species"] == {"Cu": 32} and r["ok"]
    assert r["system"] == "Cu32" and r["structure"] == str(xyz)  # the file's own formula, not the demo's "argon"
    assert r["parity_reference"].startswith("the same op on one device")
    assert r["parity_force_max_rel"] < 1e-10 and r["parity_energy_rel"] < 1e-10
    assert "potential    tests.cli._user_op:morse on Cu; scalars r0=2.87, depth=0.34, cutoff=6, alpha=1.36" in out
    assert "system       " + str(xyz) + ": 32 atoms (Cu 32)" in out and "result       ok" in out

    frame, energy, forces = _frame0(traj)  # the run's own step-0 energy and forces
    np.testing.assert_allclose(frame.positions, atoms.positions - np.floor(atoms.get_scaled_positions(wrap=False))
                               @ atoms.cell.array, atol=1e-7)
    e_want, f_want = _morse_numpy(atoms, r0=2.87, depth=0.34, alpha=1.36, cutoff=6.0)
    assert np.max(np.abs(f_want)) > 0.05
    np.testing.assert_allclose(energy, e_want, rtol=1e-10)
    np.testing.assert_allclose(forces, f_want, rtol=0, atol=1e-8)  # extxyz keeps 8 decimals
    # A binding in the order given, or with two values swapped, is a different potential: by name it is.
    for wrong in ({"r0": 0.34, "depth": 1.36, "alpha": 2.87}, {"r0": 0.34, "depth": 2.87, "alpha": 1.36}):
        e_wrong, _ = _morse_numpy(atoms, cutoff=6.0, **wrong)
        assert abs(e_wrong - energy) > 1e-2 * abs(energy)


def test_user_torch_op_takes_its_schema_defaults(tmp_path):
    xyz, atoms = _rattled(tmp_path, "Ar", 5.26)
    traj, rep = tmp_path / "t.extxyz", tmp_path / "r.json"
    assert main(["run", "--op", "tests.cli._user_op:soft_sphere", "--param", "strength=1.5",
                 "--structure", str(xyz), "--trajectory", str(traj), "--json-report", str(rep), *FAST]) == 0
    r = json.loads(rep.read_text())
    assert r["op"] == "tests.cli._user_op:soft_sphere" and r["kernel"] == "torch"
    assert r["params"] == {"cutoff": 4.5, "strength": 1.5}  # cutoff from the op's schema
    _, energy, forces = _frame0(traj)
    e_want, f_want = _soft_numpy(atoms, cutoff=4.5, strength=1.5)
    assert np.max(np.abs(f_want)) > 1e-2
    np.testing.assert_allclose(energy, e_want, rtol=1e-10)
    np.testing.assert_allclose(forces, f_want, rtol=0, atol=1e-8)
    assert r["parity_force_max_rel"] < 1e-10 and r["ok"]


def test_a_parity_miss_prints_failed_and_exits_1(capsys, tmp_path):
    # The op ignores owned_mask: each device counts its ghost-ghost pairs too, unlike one device.
    rep = tmp_path / "r.json"
    rc = main(["run", "--op", "tests.cli._user_op:unmasked_pair", "--cells", "2", "--json-report", str(rep), *FAST])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "result       FAILED: parity outside tolerance" in out and "  FAIL" in out
    r = json.loads(rep.read_text())
    assert not r["ok"] and r["parity_energy_rel"] > 1e-3 and r["rtol"] == 1e-8


def test_rtol_sets_the_demo_tolerance(tmp_path, capsys):
    rep = tmp_path / "r.json"
    assert main(["run", "--kernel", "jax", "--cells", "1", "--rtol", "1e-3", "--json-report", str(rep), *FAST]) == 0
    assert json.loads(rep.read_text())["rtol"] == 1e-3
    assert "tolerance 0.001" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [
    (["--op", MORSE, "--param", "depth=0.3"],
     r"run: tests.cli._user_op:morse needs a value for 'r0' \(no default\); pass --param r0=VALUE \(its "
     r"parameters: positions \(array\), owned_mask \(array\), r0 \(float, required\), depth \(float, required\), "
     r"cutoff \(float, default 6.0\), alpha \(float, default 1.3\)\)"),
    (["--op", MORSE, "--param", "r0=2.9", "--param", "depth=0.3", "--param", "colour=3"],
     r"--param colour: tests.cli._user_op:morse has no such scalar parameter; its parameters: positions"),
    (["--op", MORSE, "--param", "r0=2.9", "--param", "depth=deep"],
     r"--param depth=deep: not a number; depth is a float parameter of tests.cli._user_op:morse"),
    (["--op", MORSE, "--param", "depth"], r"--param 'depth' must be NAME=VALUE"),
    (["--op", MORSE, "--param", "r0=1", "--param", "r0=2"], r"--param r0 is given twice"),
    (["--param", "sigmaa=3"],
     r"--param sigmaa: jaxbridge_demo::lj_energy_forces has no such scalar parameter; its parameters: positions "
     r"\(array\), owned_mask \(array\), epsilon \(float, default 0.0104\), sigma"),
    (["--op", MORSE, "--kernel", "jax"], r"--kernel jax picks a demo op, but --op .* names your own; drop --kernel"),
    (["--op", "tests.cli._user_op:nothing"], r"--op tests.cli._user_op:nothing: .* has no attribute 'nothing'"),
])
def test_binding_errors_name_the_parameter_and_list_the_ops(argv, match, capsys):
    assert main(["run", *argv, *FAST]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(match, err), err
