"""benchmarks/scaling.py: its pieces against independent references, the float64 parity check (failing and
passing next to a float32 difference), a CPU smoke run."""

from __future__ import annotations

import pathlib
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


def _fake_result(n: int, forces: np.ndarray, coord_max: float = 21.0) -> scaling.Result:
    return scaling.Result(n_dev=n, grid=scaling.block_grid(n), step_s=0.01 / n, null_s=0.001, forces=forces,
                          owned_max=10, rows_max=20, ghost_rows=10 * n, halo_rows_step=0, halo_bytes_step=0,
                          halo_sent_bytes_step=0, plan_s=0.0, program="-", memory="-", coord_max=coord_max)


def _fake_run(monkeypatch, timed_error: float, parity_error: float) -> list:
    """Replace the timed run and the float64 evaluation: the 2-device forces are off by the given relative errors."""
    calls = []

    def forces(case, n, err):
        f = np.random.default_rng(case.n).normal(size=(case.n, 3))
        return f * (1 + err) if n == 2 else f

    monkeypatch.setattr(scaling, "run_case", lambda case, n, a, platform: _fake_result(n, forces(case, n, timed_error)))

    def fake_first_forces(case, n, a, dtype):
        calls.append((case.n, n, dtype))
        return forces(case, n, parity_error)

    monkeypatch.setattr(scaling, "first_forces", fake_first_forces)
    return calls


def _main(tmp_path, *extra):
    rc = scaling.main(["--platform", "cpu", "--smoke", "--devices", "1,2", "--mode", "strong", "--out", str(tmp_path),
                       *extra])
    return rc, (tmp_path / "scaling.md").read_text()


def test_float64_force_mismatch_fails_the_run(tmp_path, monkeypatch):
    # the timed float32 forces agree, but the float64 2-device forces are off by 1e-6 relative: exit 1
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    calls = _fake_run(monkeypatch, timed_error=0.0, parity_error=1e-6)
    rc, text = _main(tmp_path, "--dtype", "float32")
    assert rc == 1
    assert calls == [(108, 1, "float64"), (108, 2, "float64")]
    assert "1.0e-06 FAIL" in text
    assert "force parity FAILED" in text and "strong 2 dev: float64 max|dF|/max|F| = 1.0e-06 > 1e-09" in text


def test_float64_run_asserts_its_own_forces(tmp_path, monkeypatch):
    # timed in float64 on the parity system: no second evaluation, and a mismatch in the timed forces fails
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    calls = _fake_run(monkeypatch, timed_error=1e-6, parity_error=0.0)
    rc, text = _main(tmp_path, "--dtype", "float64")
    assert rc == 1 and calls == []
    assert "strong 2 dev: float64 max|dF|/max|F| = 1.0e-06 > 1e-09" in text


def test_float32_difference_is_reported_not_asserted(tmp_path, monkeypatch):
    # a 1e-3 float32 difference with exact float64 forces passes, shown with the coordinate resolution
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    _fake_run(monkeypatch, timed_error=1e-3, parity_error=0.0)
    rc, text = _main(tmp_path, "--dtype", "float32")
    assert rc == 0, text
    assert "| 0.0e+00 ok | 1.0e-03 |" in text
    # float32 spacing at 21 A is 2^-19 A (21 lies in [16, 32), 23 mantissa bits)
    assert f"21 A ({2.0**-19:.1e} A)" in text
    assert "max|dF|/max|F| = 1.0e-03 in float32 vs 0.0e+00 in float64" in text
    assert "not the bridge" in text and "FAILED" not in text


def test_reduced_parity_system_is_named(tmp_path, monkeypatch):
    # --parity-cells 2: the float64 check runs on a 2^3-cell argon system (32 atoms) and the table says so
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    calls = _fake_run(monkeypatch, timed_error=0.0, parity_error=0.0)
    rc, text = _main(tmp_path, "--dtype", "float64", "--parity-cells", "2")
    assert rc == 0, text
    assert calls == [(32, 1, "float64"), (32, 2, "float64")]
    assert "REDUCED systems of the same grid and replication, 2^3 cells in all (32 atoms" in text
    assert "0.0e+00 ok (32 atoms)" in text


def test_bad_parity_cells_say_how(tmp_path):
    with pytest.raises(SystemExit, match=r"--parity-cells must be >= 1 cubic cell per axis, got 0; leave it out"):
        scaling.main(["--platform", "cpu", "--smoke", "--parity-cells", "0", "--out", str(tmp_path)])


@hypothesis.settings(max_examples=6, deadline=None)
@hypothesis.given(n=st.sampled_from([1, 2, 4]), cells=st.integers(2, 3))
def test_kernel_coordinates_span_the_wrapped_cell_and_its_ghost_shell(n, cells):
    # independent bound: real halo rows lie in the cell widened by cutoff + skin on every side, and owned
    # rows (wrapped positions) reach at least the largest wrapped coordinate
    case = scaling.make_case("argon", cells, scaling.block_grid(n))
    plan = HaloPlan.build(case.positions, case.cell, cutoff=4.0, skin=0.5, n_devices=n)
    got = scaling.kernel_coord_max(plan, case.positions)
    assert np.abs(case.positions).max() <= got <= np.diag(case.cell).max() + 4.5 + 1e-9


def test_spacing_is_the_gap_to_the_next_number():
    for value, dtype in [(660.0, "float32"), (21.0, "float32"), (660.0, "float64")]:
        x = np.dtype(dtype).type(value)
        assert scaling.spacing(value, dtype) == float(np.nextafter(x, np.dtype(dtype).type(np.inf)) - x)
    assert scaling.spacing(660.0, "float32") == 2.0**-14  # 660 in [512, 1024): 2^9 * 2^-23


@pytest.mark.slow
def test_smoke_run_on_cpu(tmp_path, monkeypatch, capsys):
    # In this process, whose JAX conftest set up as the script's setup() would (8 CPU devices, x64): a child
    # process would import jax, torch and triton again, about as much CPU time as the smoke run's own work.
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # timed in float32, so the asserted float64 parity takes the separate first_forces path with the real kernel
    rc = scaling.main(["--platform", "cpu", "--smoke", "--devices", "1,2", "--dtype", "float32", "--halo",
                       "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr().out[-6000:]
    text = (tmp_path / "scaling.md").read_text()
    assert "FAILED" not in text and "MISMATCH" not in text, text
    assert text.count(" ok |") == 2  # the 2-device float64 forces of the strong and the weak table
    assert text.count("in float32 vs ") == 2 and "not the bridge" in text  # float32 differences, as information
    assert "| 2 | 1-D slab 2x1x1 |" in text and text.count("| yes |") == 1  # halo exchange vs numpy
    assert "Weak scaling" in text and "Strong scaling" in text and "platform: cpu" in text
