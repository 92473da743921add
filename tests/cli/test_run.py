"""`nvalchemi-jaxbridge run` / `simulate.run`: energy conservation against an independent single-device
integrator, atoms kept across plan rebuilds, Langevin against single-device BAOAB, the CLI report."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvalchemi_jaxbridge.app import run_config, simulate
from nvalchemi_jaxbridge.app.cli import main
from nvalchemi_jaxbridge.app.report import describe_capacity, format_run
from nvalchemi_jaxbridge.demo import jax_potentials, md, params, systems
from nvalchemi_jaxbridge.layout import HaloPlan


def _single_device_force(system):
    p = params.LJParams()
    return jax_potentials.periodic_energy_forces(
        jax_potentials.lj_energy_forces, system.cell, system.periodic, p.cutoff, epsilon=p.epsilon, sigma=p.sigma)


def _pairwise_lj_force(system):
    """Shifted Lennard-Jones over the central atoms' pairs with every atom's 27 nearest cell images.

    Independent of the block kernels: N x 27N pairs (the cutoff is under one cell length, so the
    images of a wrapped atom within reach of another are among its 27 nearest), forces by `jax.grad`.
    """
    p = params.LJParams()
    cell = jnp.asarray(system.cell)
    grid = np.stack(np.meshgrid(*[[-1, 0, 1] if per else [0] for per in system.periodic], indexing="ij"), -1)
    translations = jnp.asarray(grid.reshape(-1, 3) @ system.cell)
    assert p.cutoff < np.min(np.linalg.norm(system.cell, axis=1))
    sr6_cut = (p.sigma / p.cutoff) ** 6

    def energy(positions):
        frac = positions @ jnp.linalg.inv(cell)
        wrapped = (frac - jnp.floor(frac)) @ cell
        d = wrapped[None, :, None, :] + translations[None, None, :, :] - wrapped[:, None, None, :]
        r2 = jnp.sum(d * d, axis=-1)
        self_pair = r2 < 1e-12
        inside = (r2 < p.cutoff**2) & ~self_pair
        sr6 = (p.sigma**2 / jnp.where(inside, r2, 1.0)) ** 3
        u = 4.0 * p.epsilon * (sr6 * sr6 - sr6 - (sr6_cut * sr6_cut - sr6_cut))
        return 0.5 * jnp.sum(jnp.where(inside, u, 0.0))

    grad = jax.grad(energy)
    return lambda positions: (energy(positions), -grad(positions))


def test_energy_drift_matches_single_device_over_1000_steps_and_no_atom_is_lost():
    # 32 argon atoms on 2 devices, JAX kernel; a thin skin forces many rebuilds (each asserts every atom).
    cfg = run_config.RunConfig(kernel="jax", cells=2, devices=2, steps=1000, dt=5.0, temperature=60.0, skin=0.8,
                             check_every=10)
    report = simulate.run(cfg)
    assert len(report.rebuilds) >= 5 and report.n_atoms == 32
    assert sum(report.owned_per_device) == 32

    system = run_config.make_system(cfg)
    force = _pairwise_lj_force(system)
    masses = jnp.asarray(system.masses)
    state = md.init_state(force, jnp.asarray(system.positions), jnp.asarray(system.velocities))
    e0 = float(state.energy + md.kinetic_energy(state.velocities, masses))
    _, total = jax.jit(md.run_verlet, static_argnums=(0, 3, 4))(force, state, masses, 5.0, 1000)
    single = np.concatenate([[e0], np.asarray(total)]) / 32

    dist = np.asarray(report.energy_per_atom_eV)
    assert dist.shape == single.shape
    drift_single = np.max(np.abs(single - single[0]))
    drift_dist = np.max(np.abs(dist - dist[0]))
    assert drift_single > 0
    assert drift_dist <= 1.2 * drift_single
    np.testing.assert_allclose(report.energy_change_max_eV_per_atom, drift_dist, rtol=1e-12)
    np.testing.assert_allclose(dist[:100], single[:100], rtol=1e-9)  # the same trajectory early on


def test_langevin_matches_single_device_baoab_with_the_same_noise():
    cfg = run_config.RunConfig(kernel="jax", cells=2, devices=4, steps=30, dt=5.0, temperature=80.0, langevin=0.01,
                             seed=3, skin=0.4, check_every=5)
    report = simulate.run(cfg)
    system = run_config.make_system(cfg)
    force = _single_device_force(system)
    masses = jnp.asarray(system.masses)
    state = md.init_state(force, jnp.asarray(system.positions), jnp.asarray(system.velocities))
    key = jax.random.key(3)
    want = []
    step = jax.jit(md.baoab_step, static_argnums=(0,), static_argnames=("temperature", "friction"))
    for i in range(30):
        state = step(force, state, masses, 5.0, jax.random.fold_in(key, i), temperature=80.0, friction=0.01)
        want.append(float(state.energy + md.kinetic_energy(state.velocities, masses)))
    np.testing.assert_allclose(np.asarray(report.energy_per_atom_eV[1:]), np.asarray(want) / 32, rtol=1e-9)
    text = format_run(report)  # a thermostat exchanges energy: the report does not call the change a drift
    assert "not a drift" in text and "drift max" not in text
    t0 = float(md.temperature(jnp.asarray(system.velocities), masses))
    assert f"initial {t0:.1f} K" in text and abs(report.initial_temperature_K - t0) < 1e-9


def test_rebuild_keeps_every_atom_when_atoms_cross_the_cell(monkeypatch):
    # Hot gas-like argon: atoms leave the cell between rebuilds; positions are wrapped at each rebuild.
    seen = []
    real = HaloPlan.rebuild

    def spy(self, positions, **kw):
        frac = np.asarray(positions) @ np.linalg.inv(self.cell)
        seen.append(bool(np.all((frac >= 0) & (frac < 1))))
        return real(self, positions, **kw)

    monkeypatch.setattr(HaloPlan, "rebuild", spy)
    cfg = run_config.RunConfig(kernel="jax", cells=2, devices=8, steps=40, dt=5.0, temperature=3000.0, skin=0.5,
                             check_every=2)
    report = simulate.run(cfg)
    assert seen and all(seen) and len(report.rebuilds) == len(seen)
    assert sorted(report.owned_per_device) and sum(report.owned_per_device) == 32


def test_cli_run_torch_kernel_report(tmp_path, capsys):
    path = tmp_path / "r.json"
    png = tmp_path / "r.png"
    rc = main(["run", "--steps", "3", "--cells", "3", "--devices", "8", "--temperature", "50", "--quiet",
               "--json-report", str(path), "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    for word in ("parity", "ms/step", "drift", "imbalance", "ghost rows", "ppermute", "psum", "rebuilds"):
        assert word in out
    r = json.loads(path.read_text())
    assert r["n_atoms"] == 4 * 27 and r["n_devices"] == 8 and r["kernel"] == "torch" and r["steps"] == 3
    # units in the keys (eV, K, fs, s, bytes), no plan field names in the words
    for key in ("dt_fs", "energy_per_atom_eV", "energy_change_max_eV_per_atom", "initial_temperature_K",
                "final_temperature_K", "parity_force_max_abs_eV_per_A", "time_per_step_s", "halo_bytes_per_step"):
        assert key in r, key
    assert "drift max" in out and "initial 50.0 K" in out
    # the path the torch op's calls took, as TorchOpKernel reports it for the same call
    from nvalchemi_jaxbridge.kernels import resolve_kernel
    from nvalchemi_jaxbridge.kernels.ffi import target

    ext, failed = target.loaded_or_failed()
    assert r["call_path"] == ("ffi" if ext is not None else resolve_kernel(r["op"]).paths_taken()[0])
    assert f"kernel torch, {r['call_path']} call path" in out
    assert r["parity_force_max_rel"] < 1e-10 and r["parity_energy_rel"] < 1e-10
    assert sum(r["owned_per_device"]) == 108 and len(r["owned_per_device"]) == 8
    assert r["owned_min"] == min(r["owned_per_device"]) and r["owned_max"] == max(r["owned_per_device"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # bytes per step: positions forward (1 exchange) + forces scatter (2 exchanges) of 3 float64 + one psum
    ghosts_from_other_ranks = r["collectives"][0]["rows"]
    assert r["halo_bytes_per_step"] == 3 * ghosts_from_other_ranks * 24 + 8 * 8


def test_cli_run_triton_kernel_matches_numpy(tmp_path):
    # The Triton interpreter (CPU) is slow: one step, 32 atoms, 2 devices, a 4.5 Å cutoff (a quarter of the
    # 8.5 Å cutoff's halo rows).
    path = tmp_path / "r.json"
    assert main(["run", "--kernel", "triton", "--cells", "2", "--devices", "2", "--steps", "1", "--quiet",
                 "--param", "cutoff=4.5", "--json-report", str(path)]) == 0
    r = json.loads(path.read_text())
    assert r["op"] == "jaxbridge_demo::lj_energy_forces_triton" and r["n_atoms"] == 32
    assert r["parity_force_max_rel"] < 1e-10


def test_rocksalt_torch_kernel_matches_numpy():
    report = simulate.run(run_config.RunConfig(system="rocksalt", cells=1, devices=2, steps=2))
    assert report.op == "jaxbridge_demo::dsf_energy_forces" and report.n_atoms == 8
    assert report.parity_force_max_rel < 1e-10 and report.parity_energy_rel < 1e-10


@pytest.mark.parametrize("argv, match", [
    (["--kernel", "triton", "--spec", "x.json"], r"--kernel triton picks the default spec file.*drop --kernel"),
    (["--steps", "0"], r"steps must be a positive int, got 0"),
    (["--devices", "9"], r"asked for 9 devices but JAX has 8 cpu device\(s\).*jax_num_cpu_devices"),
    (["--system", "rocksalt", "--structure", "STRUCT"], r"no charges; add initial charges"),
])
def test_cli_run_errors_name_the_option(argv, match, tmp_path, capsys):
    import ase.io

    xyz = tmp_path / "ar.xyz"
    ase.io.write(xyz, systems.argon_fcc(2).to_ase())
    argv = [str(xyz) if a == "STRUCT" else a for a in argv]
    assert main(["run", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert __import__("re").search(match, err), err


def test_run_reads_a_structure_file(tmp_path):
    import ase.io

    xyz = tmp_path / "ar.extxyz"
    atoms = systems.argon_fcc(2).to_ase()
    atoms.positions += np.random.default_rng(0).normal(scale=0.05, size=atoms.positions.shape)
    ase.io.write(xyz, atoms)
    report = simulate.run(run_config.RunConfig(structure=str(xyz), devices=2, steps=2, kernel="jax"))
    assert report.n_atoms == 32 and report.parity_force_max_rel < 1e-10
    assert report.call_path == "-"  # a JAX kernel has no torch call path


def test_energy_drift_definition():
    e = np.array([1.0, 1.5, 0.25, 1.0]) * 4
    drift, slope = simulate.energy_drift(e, 4, 1000.0)  # 1 ps per step
    assert drift == 0.75
    np.testing.assert_allclose(slope, abs(np.polyfit([0, 1, 2, 3], e / 4, 1)[0]))


def test_grown_capacities_are_named_in_words():
    assert describe_capacity("ghost_capacity") == "ghost rows per device"
    assert describe_capacity("pair_capacities[3]") == "rows per halo message from each device to the one 3 ranks after it"
    assert describe_capacity("pair_capacities[1]") == "rows per halo message from each device to the one 1 rank after it"
    assert "[" not in describe_capacity("owned_capacity")
