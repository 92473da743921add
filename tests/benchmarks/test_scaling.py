"""benchmarks/scaling.py: its pieces against independent references, a failing parity check, a CPU smoke run."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import scaling  # noqa: E402

from nvalchemi_jaxbridge.demo import reference  # noqa: E402
from nvalchemi_jaxbridge.layout import HaloPlan  # noqa: E402


def test_default_device_counts_are_powers_of_two():
    assert scaling.parse_devices(None, 8) == [1, 2, 4, 8]
    assert scaling.parse_devices(None, 6) == [1, 2, 4]
    assert scaling.parse_devices(None, 1) == [1]
    assert scaling.parse_devices("8, 2,1,2", 8) == [1, 2, 8]


@pytest.mark.parametrize(
    "text, match",
    [("1,16", r"asks for 16 devices but JAX sees 8; drop the larger"), ("0,2", r"positive device counts"),
     ("1;2", r"comma list of ints such as 1,2,4,8, got '1;2'")],
)
def test_bad_device_counts_say_what_and_how(text, match):
    with pytest.raises(SystemExit, match=match):
        scaling.parse_devices(text, 8)


@hypothesis.settings(max_examples=12)
@hypothesis.given(n=st.sampled_from([1, 2, 4, 8]), cells=st.integers(2, 3),
                  system=st.sampled_from(["argon", "rocksalt"]))
def test_weak_system_puts_one_block_on_each_device(n, cells, system):
    # the replicated box's automatic grid is the replica grid, and every domain owns exactly one block
    case = scaling.make_case(system, cells, scaling.block_grid(n))
    assert case.n == n * case.block_atoms == n * scaling.ATOMS_PER_CELL[system] * cells**3
    plan = HaloPlan.build(case.positions, case.cell, cutoff=4.0, skin=0.5, n_devices=n)
    assert plan.grid == scaling.block_grid(n)
    np.testing.assert_array_equal(plan.n_owned, np.full(n, case.block_atoms))
    assert len(set(plan.n_ghost.tolist())) == 1, plan.n_ghost  # same ghost shell on every device


@pytest.mark.parametrize("system", ["argon", "rocksalt"])
def test_replicas_feel_the_block_forces(system):
    # the identity behind the weak-scaling parity check, by the independent numpy all-pairs reference
    block = scaling.make_case(system, 2)
    tiled = scaling.make_case(system, 2, (2, 1, 2))
    p = scaling.params_for(system, 4.5)

    def forces(c):
        if system == "argon":
            return reference.lj_reference(c.positions, c.cell, (True,) * 3, epsilon=p.epsilon, sigma=p.sigma,
                                          cutoff=p.cutoff)[1]
        kw = {k: getattr(p, k) for k in ("alpha", "cutoff", "born_a", "born_rho", "coulomb_constant")}
        return reference.dsf_reference(c.positions, c.charges, c.cell, (True,) * 3, **kw)[1]

    f_block = forces(block)
    assert np.abs(f_block).max() > 1e-3  # displaced atoms: the check is not 0 == 0
    np.testing.assert_allclose(forces(tiled), np.tile(f_block, (4, 1)), rtol=1e-9, atol=1e-9 * np.abs(f_block).max())


def test_grid_names():
    assert [scaling.grid_name(g) for g in [(1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 2, 2)]] == [
        "1 (no split)", "1-D slab 2x1x1", "2-D 2x2x1", "3-D 2x2x2"]


def _fake_result(n: int, forces: np.ndarray) -> scaling.Result:
    return scaling.Result(n_dev=n, grid=scaling.block_grid(n), step_s=0.01 / n, null_s=0.001, forces=forces,
                          owned_max=10, rows_max=20, ghost_rows=10 * n, halo_rows_step=0, halo_bytes_step=0,
                          halo_sent_bytes_step=0, plan_s=0.0, program="-", memory="-")


def test_force_mismatch_fails_the_run(tmp_path, monkeypatch):
    # strong scaling: the 2-device forces are off by 1e-6 relative; the run must say so and exit 1
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")

    def fake_run_case(case, n, a, platform):
        f = np.random.default_rng(0).normal(size=(case.n, 3))
        return _fake_result(n, f * (1 + 1e-6) if n == 2 else f)

    monkeypatch.setattr(scaling, "run_case", fake_run_case)
    rc = scaling.main(["--platform", "cpu", "--smoke", "--devices", "1,2", "--mode", "strong", "--out", str(tmp_path)])
    text = (tmp_path / "scaling.md").read_text()
    assert rc == 1
    assert "1.0e-06 FAIL" in text
    assert "force parity FAILED" in text and "strong 2 dev: max|dF|/max|F| = 1.0e-06 > 1e-09" in text


@pytest.mark.slow
def test_smoke_run_on_cpu(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--smoke", "--devices", "1,2",
                           "--halo", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    text = (tmp_path / "scaling.md").read_text()
    assert "FAILED" not in text and "MISMATCH" not in text, text
    assert text.count(" ok |") == 2  # the 2-device forces of the strong and the weak table
    assert "| 2 | 1-D slab 2x1x1 |" in text and text.count("| yes |") == 1  # halo exchange vs numpy
    assert "Weak scaling" in text and "Strong scaling" in text and "platform: cpu" in text
