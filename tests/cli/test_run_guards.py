"""Blow-up guards of `nvalchemi-jaxbridge run` (`app/guards.py`): the six cases of an adversarial trial.

A time step or temperature that blows the run up, rock salt at 50 fs, a check interval longer than the
run, an overflowing time step and a plan gone stale: each now ends with a non-zero exit and a message
naming the step, the quantity, its value and the limit. Values are checked against independent numbers
(numpy first-step displacement from the numpy reference forces, Maxwell-Boltzmann temperature, a
single-device integrator).
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvalchemi_jaxbridge.app import guards, run_config, simulate
from nvalchemi_jaxbridge.app.cli import main
from nvalchemi_jaxbridge.app.report import format_run
from nvalchemi_jaxbridge.demo import jax_potentials, md, params
from nvalchemi_jaxbridge.demo.reference import lj_reference
from nvalchemi_jaxbridge.demo.units import MVV2E

ARGON = ["run", "--quiet", "--kernel", "jax", "--cells", "2", "--devices", "2"]


def _cli(argv, tmp_path, capsys):
    path = tmp_path / "r.json"
    rc = main([*argv, "--json-report", str(path)])
    out = capsys.readouterr()
    return rc, out, json.loads(path.read_text()) if path.exists() else None


def test_a_huge_time_step_stops_at_step_1_with_the_displacement(tmp_path, capsys):
    rc, out, r = _cli([*ARGON, "--dt", "1000", "--steps", "20"], tmp_path, capsys)
    assert rc == 1 and r["ok"] is False and r["steps_done"] == 0
    assert r["stop"]["step"] == 1 and r["stop"]["limit"] == 0.5  # skin/2 of the default skin 1 Å
    assert re.search(r"error: run stopped at step 1: an atom's displacement in one step from a freshly built halo "
                     r"plan is [\d.]+ Å, past the limit 0.5 Å \(skin/2; --skin\); likely cause: the time step is too "
                     r"large \(--dt\)", out.err), out.err
    assert "STOPPED after 0 of 20 steps" in out.out
    # the value is the first velocity Verlet drift, from numpy forces of the whole periodic system
    system = run_config.make_system(run_config.RunConfig(cells=2))
    p = params.LJParams()
    _, f = lj_reference(system.positions, system.cell, system.periodic, epsilon=p.epsilon, sigma=p.sigma,
                        cutoff=p.cutoff)
    drift = 1000.0 * system.velocities + 0.5 * 1000.0**2 * f / (MVV2E * system.masses[:, None])
    np.testing.assert_allclose(r["stop"]["value"], np.linalg.norm(drift, axis=1).max(), rtol=1e-9)


def test_a_huge_temperature_stops_at_step_0_and_the_limit_is_an_option(tmp_path, capsys):
    rc, out, r = _cli([*ARGON, "--temperature", "1e8", "--steps", "5"], tmp_path, capsys)
    assert rc == 1 and r["stop"]["step"] == 0 and r["stop"]["option"] == "--max-temperature"
    assert "run stopped at step 0: the temperature is 1e+08 K, past the limit 1e+06 K (--max-temperature)" in out.err
    system = run_config.make_system(run_config.RunConfig(cells=2, temperature=1e8))
    want = float(md.temperature(jnp.asarray(system.velocities), jnp.asarray(system.masses)))
    np.testing.assert_allclose(r["stop"]["value"], want, rtol=1e-9)
    # a higher limit lets step 0 pass; the next guard (a step of 12 Å from a fresh plan) stops step 1
    rc, out, r = _cli([*ARGON, "--temperature", "1e8", "--steps", "5", "--max-temperature", "1e9"], tmp_path, capsys)
    assert rc == 1 and r["stop"]["step"] == 1 and "skin/2" in r["stop"]["message"]


def test_rock_salt_at_50_fs_is_stopped_not_reported_ok(tmp_path, capsys):
    rc, out, r = _cli(["run", "--quiet", "--kernel", "jax", "--system", "rocksalt", "--cells", "1", "--devices", "2",
                       "--dt", "50", "--steps", "6", "--check-every", "3"], tmp_path, capsys)
    assert rc == 1 and r["stop"] is not None and r["steps_done"] < 6
    assert re.search(r"^error: run stopped at step \d+: .*likely cause", out.err, re.M), out.err
    assert np.all(np.isfinite(r["energy_per_atom_eV"]))  # no runaway value is kept but the stopping one
    assert max(abs(e) for e in r["energy_per_atom_eV"]) < 1e3


def test_a_check_interval_longer_than_the_run_still_checks_every_step():
    # 300 K argon, skin 0.2 Å: atoms pass skin/2 inside the run, which has no host check before its last step.
    cfg = run_config.RunConfig(kernel="jax", cells=2, devices=2, steps=16, dt=5.0, temperature=300.0, skin=0.2,
                               check_every=1000)
    report = simulate.run(cfg)
    assert report.ok and report.steps_done == 16 and report.late_rebuilds and report.rebuilds
    assert report.host_checks >= 2 and report.max_displacement_A <= 0.1
    text = format_run(report)
    assert "all atoms accounted for after each" in text and "run again on a plan rebuilt there" in text
    # the steps run again give the single-device trajectory
    system = run_config.make_system(cfg)
    p = params.LJParams()
    force = jax_potentials.periodic_energy_forces(jax_potentials.lj_energy_forces, system.cell, system.periodic,
                                                  p.cutoff, epsilon=p.epsilon, sigma=p.sigma)
    masses = jnp.asarray(system.masses)
    state = md.init_state(force, jnp.asarray(system.positions), jnp.asarray(system.velocities))
    e0 = float(state.energy + md.kinetic_energy(state.velocities, masses))
    _, total = jax.jit(md.run_verlet, static_argnums=(0, 3, 4))(force, state, masses, 5.0, 16)
    np.testing.assert_allclose(report.energy_per_atom_eV, np.concatenate([[e0], np.asarray(total)]) / 32, rtol=1e-9)


def test_a_run_without_rebuilds_claims_no_atom_check():
    report = simulate.run(run_config.RunConfig(kernel="jax", cells=2, devices=2, steps=3, check_every=1000))
    text = format_run(report)
    assert report.ok and not report.rebuilds and report.host_checks == 1
    assert "accounted for" not in text and "read at 1 host check(s)" in text


@pytest.mark.parametrize("argv, match", [
    (["--dt", "1e308"], r"--dt 1e\+308 fs moves an atom inf Å in the first step, more than 100 x skin/2 = 0.5 Å"),
    (["--dt", "0"], r"--dt must be a finite number > 0, got 0.0"),
    (["--dt", "nan"], r"--dt must be a finite number > 0, got nan"),
    (["--temperature", "-5"], r"--temperature must be a finite number >= 0, got -5.0"),
    (["--temperature", "inf"], r"--temperature must be a finite number >= 0, got inf"),
    (["--max-energy", "0"], r"--max-energy must be a finite number > 0, got 0.0"),
    (["--model", "mpnn", "--dt", "-1"], r"--dt must be a finite number > 0, got -1.0"),
])
def test_absurd_options_are_refused_up_front_by_name(argv, match, capsys):
    assert main([*ARGON[:2], *(["--cells", "2", "--devices", "2"] if "--model" in argv else ARGON[2:]), *argv,
                 "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err


def test_the_first_step_bound_suggests_a_time_step_that_fits():
    with pytest.raises(ValueError, match=r"--dt 100 fs moves an atom 200 Å.*use --dt 0.25 or less"):
        guards.check_first_step(200.0, 1.0, 100.0)
    guards.check_first_step(40.0, 1.0, 100.0)  # within 100 x skin/2: the in-run flag takes it from here
    with pytest.raises(ValueError, match=r"skin/2 = 0 Å"):
        guards.check_first_step(1e-3, 0.0, 1.0)


def test_check_rows_names_the_first_runaway_step():
    lim = guards.Limits()
    n = 10
    ok = np.array([[-1.0, 0.1], [-1.0, 0.1], [-1.0, 0.1]]) * n
    assert guards.check_rows(ok, 1, n, lim) is None
    nan = ok.copy()
    nan[2, 0] = np.nan
    assert guards.check_rows(nan, 4, n, lim).step == 6
    big = ok.copy()
    big[1, 0] = -2e3 * n  # 2000 eV/atom
    s = guards.check_rows(big, 1, n, lim)
    assert (s.step, s.quantity, s.value) == (2, "|potential energy| per atom", 2e3)
    jump = ok.copy()
    jump[2, 1] = 5.0 * n  # E_tot from -0.9 to +4 eV/atom in one step: 4.9 / 1.1 of the scale
    s = guards.check_rows(jump, 1, n, lim)
    assert s.step == 3 and s.option == "--max-energy-jump" and abs(s.value - 4.9 / 1.1) < 1e-12
    assert guards.check_rows(jump, 1, n, guards.Limits(max_energy_jump=5.0)) is None
    # the jump from the row before the block counts too
    assert guards.check_rows(ok[:1], 7, n, lim, previous=[10.0 * n, 0.0]).step == 7
    hot = guards.temperature(np.array([3 * (n - 1) * 0.5 * 8.617333262e-5 * 2e6]), n)
    np.testing.assert_allclose(hot, 2e6)


def test_watch_stops_a_model_run_at_the_first_bad_check():
    w = guards.Watch(guards.Limits(), 4)
    assert not w(0, -4.0, 0.1) and not w(10, -4.0, 0.1)
    assert w(20, np.inf, 0.1) and w.stop.step == 20 and w(30, -4.0, 0.1) and w.stop.step == 20


def test_a_model_run_stops_on_its_energy_limit_and_refuses_an_overflowing_step(tmp_path, capsys):
    from tests.cli.test_run_model import _atoms, _independent
    from nvalchemi_jaxbridge.app import model_run
    from nvalchemi_jaxbridge.mlip import MPNN

    per_atom = abs(_independent(MPNN(model_run.SPECIES, seed=0), _atoms())["energy"]) / 32
    fast = ["run", "--model", "mpnn", "--devices", "2", "--cells", "2", "--quiet", "--steps", "4", "--check-every", "2"]
    rc, out, r = _cli([*fast, "--max-energy", f"{per_atom / 2!r}"], tmp_path, capsys)
    assert rc == 1 and r["stop"]["step"] == 0 and r["stop"]["option"] == "--max-energy" and r["steps_done"] == 0
    np.testing.assert_allclose(r["stop"]["value"], per_atom, rtol=1e-10)
    assert "error: run stopped at step 0: |potential energy| per atom is" in out.err and "STOPPED" in out.out
    rc, out, r = _cli([*fast, "--dt", "1e308"], tmp_path, capsys)
    assert rc == 2 and "--dt 1e+308 fs moves an atom inf Å in the first step" in out.err


def test_a_state_that_turns_nan_mid_run_stops_at_that_step_with_the_atoms(tmp_path, capsys):
    """The op is Morse until two atoms come closer than `r_nan`, then NaN. The step it first happens comes
    from a plain Morse run's trajectory (closest pair per step, minimum image); the run, checking only every
    5 steps, stops exactly there and reports no energy past the step before."""
    import ase.build
    import ase.io

    atoms = ase.build.bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)
    atoms.positions += np.random.default_rng(7).normal(scale=0.05, size=atoms.positions.shape)
    xyz = tmp_path / "s.extxyz"
    ase.io.write(xyz, atoms)
    common = ["run", "--quiet", "--devices", "2", "--structure", str(xyz), "--temperature", "3000", "--steps", "10",
              "--param", "r0=2.87", "--param", "depth=0.34", "--check-every", "5"]
    traj = tmp_path / "t.extxyz"
    rc, _, r = _cli([*common, "--op", "tests.cli._user_op:morse", "--trajectory", str(traj), "--trajectory-every",
                     "1"], tmp_path, capsys)
    assert rc == 0 and r["steps_done"] == 10
    closest = []
    for frame in ase.io.read(traj, ":"):
        d = frame.get_all_distances(mic=True)
        closest.append(d[~np.eye(len(frame), dtype=bool)].min())
    running = np.minimum.accumulate(closest)
    step = next(s for s in range(2, 10) if closest[s] < running[s - 1])  # a new closest approach
    r_nan = (running[step - 1] + closest[step]) / 2
    rc, out, r = _cli([*common, "--op", "tests.cli._user_op:singular_morse", "--param", f"r_nan={float(r_nan)!r}"],
                      tmp_path, capsys)
    assert rc == 1 and r["stop"]["step"] == step and r["steps_done"] == step - 1, out.err
    assert re.search(rf"error: run stopped at step {step}: the positions, velocities, forces or potential energy "
                     rf"became non-finite \(NaN or inf\); at step \d+ \(the check that found it\) the "
                     rf"(positions|velocities|forces) of atoms \[[\d, ]+\].* are not finite\. The run blew up", out.err), out.err
    assert len(r["energy_per_atom_eV"]) == step  # steps 0 .. step - 1: none computed on non-finite positions
    assert np.isfinite(r["energy_per_atom_eV"]).all()
