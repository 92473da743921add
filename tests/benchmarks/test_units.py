"""The benchmark suite's pure pieces: options, tables, reports, the soak's windows, and scaling's checks."""

from __future__ import annotations

import pathlib

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from benchmarks import common as cm
from benchmarks import host, runner, scaling, soak, tiles_plot
from benchmarks.md_step import cells_for
from nvalchemi_jaxbridge.demo import reference
from nvalchemi_jaxbridge.layout import HaloPlan


def _parse(argv):
    args = runner._parser().parse_args(["run", *argv])
    return runner.options(args)


# ------------------------------------------------------------------ options


def test_sizes_take_units_and_name_what_is_wrong():
    assert [runner.parse_size(s) for s in ("1372", "64K", "16m", "1G")] == [1372, 65536, 16 << 20, 1 << 30]
    with pytest.raises(ValueError, match=r"not a size: '12x'; write an integer, optionally with K, M or G"):
        runner.parse_size("12x")


def test_scoped_values_go_to_their_question_and_the_rest_to_all():
    opt = _parse(["--sizes", "md=10976,42592", "--sizes", "108", "--kernels", "md=lj-cells"])
    assert opt.sizes_for("md", [1]) == [10976, 42592]
    assert opt.sizes_for("mlip", [1]) == [108] and opt.sizes_for("kernel", [1]) == [108]
    assert opt.kernels_for("md", ["lj-triton"], ["lj-cells", "lj-triton"]) == ["lj-cells"]
    assert opt.kernels_for("scaling", ["lj-jax"], ["lj-jax"]) == ["lj-jax"]  # its default: no value given for it
    assert _parse([]).sizes_for("md", [5, 6]) == [5, 6]


@pytest.mark.parametrize("argv, match", [
    (["--sizes", "mdd=1"], r"--sizes 'mdd=1': no question 'mdd'; questions: kernel, exchange"),
    (["--dtype", "float16"], r"--dtype: unknown \['float16'\]; write float32, float64 or float32,float64"),
    (["--devices", "1;2"], r"--devices '1;2': write device counts as a comma list, e.g. 1,2,4,8"),
    (["nope"], r"unknown question\(s\) \['nope'\]; questions: kernel.*python -m benchmarks list"),
    (["--sizes", "md=1,two"], r"not a size: 'two'"),
    (["--memory-budget", "60Q"], r"--memory-budget: not a size: '60Q'; write an integer, optionally with K, M or G"),
    (["--memory-budget", "0"], r"--memory-budget '0': give bytes per device > 0, e.g. 60G"),
])
def test_bad_options_say_what_and_how(argv, match):
    with pytest.raises(ValueError, match=match):
        _parse(argv)


def test_unknown_kernel_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"--kernels md: unknown \['lj-fast'\]; choose from lj-cells, lj-triton"):
        _parse(["--kernels", "md=lj-fast"]).kernels_for("md", [], ["lj-cells", "lj-triton"])


names = st.sampled_from(list(runner.QUESTIONS))
lists = st.lists(st.integers(1, 10**6), min_size=1, max_size=3).map(lambda xs: ",".join(map(str, xs)))


@hypothesis.settings(max_examples=15)
@hypothesis.given(smoke=st.booleans(), device=st.sampled_from(["auto", "cpu", "gpu"]),
                  sizes=st.lists(st.tuples(st.one_of(st.just(""), names), lists), max_size=3),
                  repeats=st.none() | st.integers(1, 99), dtypes=st.none() | st.sampled_from([("float32",),
                                                                                            ("float32", "float64")]),
                  steps=st.none() | st.integers(1, 5000), devices=st.none() | st.lists(st.integers(1, 8), min_size=1,
                                                                                       max_size=4).map(tuple),
                  budget=st.none() | st.floats(1, 1e4), memory=st.none() | st.integers(1, 1 << 40),
                  label=st.text("abc -_", max_size=8))
def test_options_round_trip_through_the_command_line(smoke, device, sizes, repeats, dtypes, steps, devices, budget,
                                                     memory, label):
    # what a question's own process gets (`Options.argv`) parses back to the same options
    opt = runner.Options(smoke=smoke, device=device, out=pathlib.Path("/tmp/x"), sizes=tuple(sizes), repeats=repeats,
                         dtypes=dtypes, steps=steps, devices=devices, budget_s=budget, memory_budget=memory,
                         label=label.strip() or "")
    assert _parse(opt.argv()) == opt


# ------------------------------------------------------------------ tables and reports

cells = st.text(st.sampled_from("ab |-.x1"), min_size=1, max_size=6).map(str.strip).filter(bool)


@hypothesis.given(cols=st.lists(cells, min_size=1, max_size=4, unique=True), data=st.data())
def test_a_markdown_table_reads_back(cols, data):
    rows = data.draw(st.lists(st.lists(cells, min_size=len(cols), max_size=len(cols)), max_size=4))
    text = "\n".join(["intro", ""] + cm.markdown_table("T | 1", cols, rows) + ["", "after"])
    assert cm.parse_table(text, "T | 1") == [dict(zip(cols, r)) for r in rows]


def test_a_row_of_the_wrong_width_names_the_table(tmp_path):
    rep = cm.Report("q", "Q", tmp_path, {"date": "d"})
    t = rep.table("Times", ["a", "b"])
    with pytest.raises(ValueError, match=r"table 'Times': a row of 1 cells for 2 columns"):
        t.add("1")


def test_targets_get_a_verdict_on_a_gpu_only(tmp_path):
    gpu = cm.Report("q", "Q", tmp_path, {"date": "d", "GPU": "NVIDIA H200"})
    gpu.target("t1", "1.2x", True)
    gpu.target("t2", "0.8x", False)
    gpu.target("t3", "-", None)
    cpu = cm.Report("c", "C", tmp_path, {"date": "d", "device": "8 x cpu"})
    cpu.target("t1", "1.2x", True)
    assert [t["verdict"] for t in gpu.targets] == ["met", "NOT met", "not measured"]
    assert cpu.targets[0]["verdict"] == "no verdict (CPU run; met here)"


def test_a_failing_section_is_recorded_and_the_rest_runs(tmp_path):
    rep = cm.Report("q", "Q", tmp_path, {"date": "d"})
    with rep.section("first"):
        raise RuntimeError("broken\nsecond line")
    with rep.section("second"):
        rep.table("Rows", ["x"]).add(1)
    assert rep.finish() == 1 and rep.failures == ["first: RuntimeError: broken"]
    text = (tmp_path / "q.md").read_text()
    assert "**FAILED** - first: RuntimeError: broken" in text and cm.parse_table(text, "Rows") == [{"x": "1"}]


def test_the_summary_gathers_every_target(tmp_path):
    for name, verdict in (("kernel", True), ("md", False)):
        rep = cm.Report(name, name.upper(), tmp_path, {"date": "d", "GPU": "H200"})
        rep.target(f"{name} target", "fig", verdict)
        rep.finish()
    text = runner.summary(tmp_path, ["kernel", "md", "mlip"], {"kernel": 0, "md": 1, "mlip": 124}, "cmd")
    rows = cm.parse_table(text, "Targets in this run")
    assert [(r["target"], r["status"], r["question"]) for r in rows] == [("kernel target", "met", "kernel"),
                                                                        ("md target", "NOT met", "md")]
    assert "Exit status: kernel 0, md 1, mlip 124" in text and "(no report: see mlip.log)" in text


# ------------------------------------------------------------------ the main job's soak


def test_soak_windows_find_a_steady_and_a_growing_job():
    steps = np.arange(0, 1001, 5)
    flat = [(0.0, int(s), 1000.0 + (30.0 if s % 10 else 0.0)) for s in steps]  # a trim at every check
    row, win = soak.summarise("torch", flat, 0, 1000, 0.1, 100)
    assert [w[:2] for w in win] == [(100 + 100 * i, 200 + 100 * i) for i in range(9)]
    assert row[:4] == ["torch", "0", "0", "9"] and row[4] == "1030 / 1030" and abs(float(row[6])) < 0.05
    growing = [(0.0, int(s), 1000.0 + 0.2 * s) for s in steps]  # 0.2 MB per step: 200 MB per 1000 steps
    s = soak.summary(soak.windows(growing, 1000, 0.1, 100))
    assert s["max_slope"] == pytest.approx(200.0, rel=0.05) and s["min_slope"] == pytest.approx(200.0, rel=0.05)
    assert s["med_slope"] == pytest.approx(200.0, rel=0.05)
    assert row[7].startswith("1015 /") and float(row[8]) <= 15  # a window's median: between the trim's two levels


def test_the_rss_at_the_host_checks_gets_its_own_columns():
    steps = np.arange(0, 1001, 5)
    noisy = [(0.0, int(s), 1000.0 + (300.0 if s % 10 else 0.0)) for s in steps]  # calls in flight half the time
    checks = [(0.0, int(s), 900.0 + 0.05 * s) for s in range(10, 1001, 10)]  # resting size: +50 MB / 1000 steps
    row, _ = soak.summarise("torch", noisy, 0, 1000, 0.1, 100, checks)
    assert row[4] == "1300 / 1300" and row[13] == "907 / 948"
    assert float(row[14]) == pytest.approx(41, abs=1) and float(row[15]) == pytest.approx(50.0, rel=0.01)
    assert soak.summarise("torch", noisy, 0, 1000, 0.1, 100)[0][13:] == ["-"] * 3  # no checks recorded


def test_a_short_soak_has_no_windows_to_compare():
    row, win = soak.summarise("jax", [(0.5, 10, 900.0)], 0, 20, 0.1, 0)
    assert len(win) <= 1 and row[4:] == ["-"] * 12


# ------------------------------------------------------------------ scaling and MD sizes


def test_sizes_become_the_nearest_cubic_system():
    assert [cells_for(n, "lj") for n in (4, 10976, 42592, 171500)] == [1, 14, 22, 35]
    assert cells_for(64, "dsf") == 2 and scaling.cubic_cells(1_000_000, "argon") == 63


def test_default_device_counts_are_powers_of_two():
    assert scaling.parse_devices(None, 8) == [1, 2, 4, 8] and scaling.parse_devices(None, 6) == [1, 2, 4]
    assert scaling.parse_devices((8, 2, 1, 2), 8) == [1, 2, 8]
    with pytest.raises(ValueError, match=r"asks for 16 devices but JAX sees 8; drop the larger counts"):
        scaling.parse_devices((1, 16), 8)


@hypothesis.settings(max_examples=8)
@hypothesis.given(n=st.sampled_from([1, 2, 4, 8]), cells=st.integers(2, 3), system=st.sampled_from(["argon", "rocksalt"]))
def test_weak_system_puts_one_block_on_each_device(n, cells, system):
    case = scaling.make_case(system, cells, scaling.block_grid(n))
    assert case.n == n * case.block_atoms == n * scaling.ATOMS_PER_CELL[system] * cells**3
    plan = HaloPlan.build(case.positions, case.cell, cutoff=4.0, skin=0.5, n_devices=n)
    assert plan.grid == scaling.block_grid(n)
    np.testing.assert_array_equal(plan.n_owned, np.full(n, case.block_atoms))
    assert len(set(plan.n_ghost.tolist())) == 1, plan.n_ghost


@pytest.mark.parametrize("system", ["argon", "rocksalt"])
def test_replicas_feel_the_block_forces(system):
    # the identity behind the weak-scaling parity check, by the independent numpy all-pairs reference
    block, tiled = scaling.make_case(system, 2), scaling.make_case(system, 2, (2, 1, 2))
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


def test_grid_names_and_spacing():
    assert [scaling.grid_name(g) for g in [(1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 2, 2)]] == [
        "1 (no split)", "1-D slab 2x1x1", "2-D 2x2x1", "3-D 2x2x2"]
    assert scaling.spacing(660.0, "float32") == 2.0**-14  # 660 in [512, 1024): 2^9 * 2^-23
    assert scaling.spacing(21.0, "float64") == float(np.nextafter(21.0, np.inf) - 21.0)


def _fake_scaling(monkeypatch, tmp_path, dtype: str, timed_error: float, parity_error: float):
    """scaling.run with the timed run and the float64 evaluation replaced: on 2 devices the forces are off by the
    given relative errors. Returns the report and the float64 evaluations asked for."""
    calls = []

    def forces(case, n, err):
        f = np.random.default_rng(case.n).normal(size=(case.n, 3))
        return f * (1 + err) if n == 2 else f

    def fake_run(case, n, kernel, dt, cutoff, iters, twin=True):
        return scaling.Result(0.01 / n, 0.001, forces(case, n, timed_error), scaling.block_grid(n), 10, 20, 0, "-", "-")

    def fake_first(case, n, kernel, dt, cutoff):
        calls.append((case.n, n, dt))
        return forces(case, n, parity_error)

    monkeypatch.setattr(scaling, "run_case", fake_run)
    monkeypatch.setattr(scaling, "first_forces", fake_first)
    rep = cm.Report("scaling", "S", tmp_path, {"date": "d"})
    opt = runner.Options(smoke=True, device="cpu", platform="cpu", dtypes=(dtype,), devices=(1, 2),
                         sizes=(("scaling", "108,0,0"),))
    scaling.run(rep, opt)
    return rep, calls


def test_a_float64_force_mismatch_fails_the_run(monkeypatch, tmp_path):
    # the timed float32 forces agree, but the float64 2-device forces are off by 1e-6: a failure
    rep, calls = _fake_scaling(monkeypatch, tmp_path, "float32", timed_error=0.0, parity_error=1e-6)
    assert calls == [(108, 1, "float64"), (108, 2, "float64")]
    assert rep.failures == ["strong 2 dev: float64 max|dF|/max|F| = 1.0e-06 > 1e-09 (vs 1 dev)"]
    assert "| 1.0e-06 FAIL |" in rep.markdown()


def test_a_float64_run_checks_its_own_forces(monkeypatch, tmp_path):
    rep, calls = _fake_scaling(monkeypatch, tmp_path, "float64", timed_error=1e-6, parity_error=0.0)
    assert calls == [] and len(rep.failures) == 1  # timed in float64: no second evaluation


def test_a_float32_difference_is_reported_not_asserted(monkeypatch, tmp_path):
    rep, _ = _fake_scaling(monkeypatch, tmp_path, "float32", timed_error=1e-3, parity_error=0.0)
    assert rep.failures == [] and "| 0.0e+00 ok | 1.0e-03 |" in rep.markdown()


# ------------------------------------------------------------------ the tiles question's plot


def _points(atoms, per_s, peaks, native_s):
    return [tiles_plot.Point(a, 1, a / r, 0.9 * m, m, 0.0, 1.0, n, 2 * m) for a, r, m, n in zip(atoms, per_s, peaks,
                                                                                              native_s)]


def _polylines(text):
    import xml.etree.ElementTree as ET

    ns = "{http://www.w3.org/2000/svg}"
    root = ET.fromstring(text)
    return [[tuple(map(float, xy.split(","))) for xy in line.get("points").split()]
            for line in root.iter(f"{ns}polyline")]


def test_the_hand_drawn_plot_is_log_log():
    nan = float("nan")
    pts = _points([10**3, 10**4, 10**5], [1e3, 1e4, 1e5], [1 << 30, 4 << 30, 16 << 30], [0.5, 5.0, nan])
    lines = _polylines(tiles_plot.svg(pts, "t & <t>"))
    # panel 0: the bridge (3 sizes), native (2: NaN left out); panel 1: measured, predicted, native peaks
    assert [len(line) for line in lines] == [3, 2, 3, 3, 3]
    bridge, native, measured = lines[0], lines[1], lines[2]
    dx, dy = np.diff([p[0] for p in bridge]), np.diff([p[1] for p in bridge])
    np.testing.assert_allclose(dx, dx[0])  # decades equally spaced on both axes
    np.testing.assert_allclose(dy, dy[0])
    assert dx[0] > 0 and dy[0] < 0  # right and up (SVG's y grows downwards)
    assert native[:2] == [(bridge[0][0], native[0][1]), (bridge[1][0], native[1][1])] and native[0][1] < bridge[0][1]
    my = np.diff([p[1] for p in measured])
    np.testing.assert_allclose(my[0], my[1])  # peaks 1, 4, 16 GiB: equal steps on a log axis


def test_without_matplotlib_the_plot_is_drawn_by_hand(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    pts = _points([100, 1000], [50.0, 400.0], [1 << 20, 1 << 23], [1.0, 1.0])
    path = tiles_plot.write_plot(pts, tmp_path / "tiles.svg", "MACE")
    assert path.read_text() == tiles_plot.svg(pts, "MACE")


# ------------------------------------------------------------------ host time per device


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("per_device", [32, 108])
def test_host_weak_system_gives_every_device_one_cube(n, per_device):
    atoms = host.weak_system(per_device, n)
    plan = HaloPlan.build(atoms.positions, atoms.cell.array, cutoff=4.0, skin=0.5, n_devices=n)
    np.testing.assert_array_equal(plan.n_owned, np.full(n, per_device))  # 32 and 108 are 4 b^3


def _chunk(n, start, step, *, compiles=0, calls=2, cpu=1e-3, backwards=0, inline=0.0):
    """A chunk of `n` steps whose every step takes `step` s (program 0.8, dispatch 0.1 of it); `inline`: the
    share of the stage ops' CPU run on the dispatching thread."""
    import collections

    per_op = collections.Counter({"m_layer_0": calls * n})
    if backwards:
        per_op[host.BACKWARD] = backwards * n
    cost = collections.Counter({k: cpu * v / (calls + backwards) for k, v in per_op.items()})
    wall = collections.Counter({k: 2 * v for k, v in cost.items()})
    return host.Chunk(n, start, start + 0.1 * step * n, start + 0.8 * step * n, 0.05 * step * n, compiles,
                      per_op, wall, cost, collections.Counter({k: inline * v for k, v in cost.items()}))


@hypothesis.settings(max_examples=20)
@hypothesis.given(ns=st.lists(st.integers(1, 10), min_size=1, max_size=6), step=st.floats(1e-4, 1.0),
                  devices=st.integers(1, 8), backwards=st.sampled_from([0, 2]))
def test_host_summary_takes_the_chunks_that_compiled_nothing(ns, step, devices, backwards):
    chunks, t = [_chunk(1, 0.0, 50.0, compiles=1)], 50.0  # the start's forces: left out, whatever they took
    chunks.append(_chunk(3, t, 9.0, compiles=2))  # a chunk that compiled: left out
    t += 27.0
    for n in ns:
        chunks.append(_chunk(n, t, step, calls=2 * devices, backwards=backwards))
        t += n * step
    r = host.summarise(chunks, t, devices, 10, 2, np.zeros((10, 3)))
    assert r.steps == sum(ns) and r.step == pytest.approx(step) and r.program == pytest.approx(0.8 * step)
    assert r.dispatch == pytest.approx(0.1 * step) and r.dispatch_cpu == pytest.approx(0.05 * step)
    assert r.calls == pytest.approx(2 * devices) and r.backwards == pytest.approx(backwards)
    assert r.op_cpu == pytest.approx(1e-3) and r.op_wall == pytest.approx(2e-3)
    assert r.host == pytest.approx((1e-3 + 0.05 * step) / devices) and r.op_inline == 0
    # bodies run on the dispatching thread are inside its CPU time already: counted once
    half = [chunks[0], chunks[1]] + [_chunk(c.n, c.start, step, calls=2 * devices, backwards=backwards, inline=0.5)
                                     for c in chunks[2:]]
    r2 = host.summarise(half, t, devices, 10, 2, np.zeros((10, 3)))
    assert r2.op_inline == pytest.approx(0.5e-3) and r2.host == pytest.approx((0.5e-3 + 0.05 * step) / devices)
    with pytest.raises(RuntimeError, match=r"every chunk of the run on 3 devices compiled; give more --steps"):
        host.summarise(chunks[:2], 77.0, 3, 10, 2, np.zeros((10, 3)))
