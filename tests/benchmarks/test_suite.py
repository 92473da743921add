"""The whole benchmark suite runs end to end on the CPU (`python -m benchmarks run --smoke`), so it does not rot.

One smoke run of every question, in this process (the suite's own processes: the front door's two ranks),
then each question's tables are read back: every table has its rows and columns, and every number a
benchmark checks for correctness agrees (the bridge against native torch, MACE's own forward, the
torch.distributed reference exchange, the numpy exchange reference, the single-device forces).
"""

from __future__ import annotations

import re

import pytest

from benchmarks import common as cm
from benchmarks import runner

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = runner.main(["run", "--smoke", "--device", "cpu", "--in-process", "--out", str(out)])
    return code, out


def _text(smoke, question: str) -> str:
    return (smoke[1] / f"{question}.md").read_text()


def _table(text: str, title_start: str) -> list[dict[str, str]]:
    titles = [line[2:-2] for line in text.splitlines() if line.startswith(f"**{title_start}")]
    assert len(titles) == 1, f"no single table titled {title_start!r}: {titles}"
    return cm.parse_table(text, titles[0])


def _num(cell: str) -> float:
    return float(re.match(r"[-+0-9.e]+", cell).group(0))


def test_every_question_runs_and_reports(smoke):
    code, out = smoke
    assert code == 0, (out / "ALL.md").read_text()[-4000:]
    all_md = (out / "ALL.md").read_text()
    for name, q in runner.QUESTIONS.items():
        text = _text(smoke, name)
        assert text.startswith(f"## {q.title}"), name
        header = dict(line[2:].split(": ", 1) for line in text.splitlines() if line.startswith("- "))
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", header["date"]), header
        assert header["device"] == "8 x cpu" and "python 3." in header["versions"]
        assert all(f"{m} " in header["versions"] for m in ("jax", "jaxlib", "torch")), header["versions"]
        assert "FAILED" not in text and "MISMATCH" not in text, text
        assert f"## {q.title}" in all_md
    targets = _table(all_md, "Targets in this run")
    assert {t["question"] for t in targets} >= {"kernel", "exchange", "scaling"}
    assert all(t["status"].startswith("no verdict (CPU run") for t in targets)  # GPU targets get no CPU verdict


def test_kernel_call_results_equal_native_torch(smoke):
    text = _text(smoke, "kernel")
    rows = _table(text, "Per call, dispatched")
    runs = {(r["op"], r["run"]) for r in rows}
    for op in ("x*2", "x+x (ATen add)", "x*2, jax.grad of the sum", "LJ"):
        assert {(op, "native torch"), (op, "bridge, ffi path"), (op, "bridge, callback path")} <= runs, op
    assert ("x*2", "pure XLA x * 2 (no torch)") in runs and ("LJ", "jax.pure_callback (host copies)") in runs
    assert all(r["check"] == "same result" for r in rows)
    assert len(_table(text, "Where a dispatched x*2")) == 5
    chain = _table(text, "Inside one program")
    assert [r["check"] for r in chain if r["run"] != "native torch"] == ["same result"] * 4
    grad = {r["run"]: r for r in _table(text, "Energy + forces of an autograd-force")}
    for path in ("ffi", "callback"):
        r = grad[f"bridge ({path})"]
        assert r["forwards per E+F"] == "1" and _num(r["max |dF| / max |F|"]) < 1e-5  # one forward, native's forces
    assert grad["bridge (ffi)"]["token reads per E+F"] == "0"


def test_front_door_agrees_with_all_to_all(smoke):
    rows = _table(_text(smoke, "kernel"), "PyTorch front door")
    assert [r["path"].split(" (")[0] for r in rows] == ["front door", "all_to_all_single"]
    assert all(r["same result"] == "yes" and _num(r["per call, sync each (us)"]) > 0 for r in rows)


def test_exchanges_match_their_references(smoke):
    text = _text(smoke, "exchange")
    rows = _table(text, "Exchanges on 2 devices")
    assert [r["exchange"] for r in rows] == ["ppermute", "GatherInputs", "reverse", "ScatterOutputs"]
    assert all(_num(r["per dispatch (us)"]) > 0 for r in rows)
    assert [r["matches numpy"] for r in _table(text, "Exchanges of a layout HaloPlan")] == ["yes", "-", "-"]
    assert [(r["variant"], r["same rows as default"]) for r in _table(text, "Exchanges under XLA")] == [("default", "yes")]
    model = _table(text, "Per-layer exchange vs deep halo")
    assert [(r["model"], r["exchange"]) for r in model] == [("mpnn", "per_layer"), ("mpnn", "deep_halo")]
    assert _num(model[1]["max |dF| vs per-layer (eV/A)"]) < 1e-12
    assert int(model[1]["max rows/device"]) > int(model[0]["max rows/device"])  # the deep halo holds more rows


def test_md_steps_follow_native_torch(smoke):
    text = _text(smoke, "md")
    one = {r["kernel"]: r for r in _table(text, "MD step on one device")}
    assert set(one) == {"lj-cells", "lj-triton", "dsf-torch"}
    for kernel, r in one.items():
        forces, loop = r["first-step max |dF| / max |F|; loop max |dx| (A)"].split("; ")
        assert float(forces) < 1e-4, kernel
        assert all(_num(r[c]) > 0 for c in ("native synced ms", "bridge synced ms", "native pipelined ms"))
    assert float(one["lj-cells"]["first-step max |dF| / max |F|; loop max |dx| (A)"].split("; ")[1]) < 1e-3
    two = {r["kernel"]: r for r in _table(text, "MD step on 2 devices")}
    assert set(two) == set(one) and all(float(r["2-device first-step max |dF| / max |F|"]) < 1e-4 for r in two.values())
    (nve,) = _table(text, "The MD driver nve")
    assert nve["compiles per run (s)"].startswith("0 (")  # a run after the first reuses its programs
    assert float(nve["|E_tot drift| / atom (eV)"]) < 1e-6


def test_mace_through_the_bridge_equals_its_own_forward(smoke):
    text = _text(smoke, "mlip")
    rows = _table(text, "MACE energy + forces per call")
    assert [(r["kernels"], r["dtype"]) for r in rows] == [("e3nn", "float32"), ("e3nn", "float64")]
    for r in rows:
        de, rest = r["parity dE/E [node sums], max dF (eV/A)"].split(" [")
        de_nodes, df = rest.split("], ")
        tol = {"float32": (1e-4, 1e-3), "float64": (1e-9, 1e-8)}[r["dtype"]]
        assert float(de_nodes) <= tol[0] and float(df) <= tol[1], r
        assert _num(r["native E+F ms"]) > 0 and _num(r["bridge E+F ms"]) > 0
        assert re.search(r"JAX program [0-9.]+ (B|KiB|MiB)", r["peak memory: native / bridge (torch + JAX program)"])
    (md,) = _table(text, "MACE MD step")
    assert float(md["final max |dx| (A)"]) < 1e-3 and _num(md["nve ms/step"]) > 0  # nve follows the torch loop


def test_memory_loops_run_on_both_paths(smoke):
    text = _text(smoke, "memory")
    rows = _table(text, "Host RSS over a loop")
    assert {(r["path"], r["forces"]) for r in rows} == {(p, f) for p in ("ffi", "callback")
                                                           for f in ("op forces", "jax.grad")}
    assert all(float(r["RSS at end (MB)"]) > 0 for r in rows)
    assert "Main job: not run in a smoke run" in text


def test_scaling_forces_equal_the_single_device_forces(smoke):
    text = _text(smoke, "scaling")
    for mode in ("Strong", "Weak"):
        rows = _table(text, f"{mode} scaling")
        assert [r["devices"] for r in rows] == ["1", "2"]
        assert rows[1]["float64 force parity (asserted)"].endswith(" ok")
        assert float(rows[1]["float64 force parity (asserted)"].split()[0]) <= 1e-9
    (halo,) = _table(text, "Halo exchanges on device grids")
    assert halo["grid"] == "1-D slab 2x1x1" and halo["matches numpy"] == "yes"


def test_host_time_accounting_adds_up(smoke):
    # not timings: identities between the clocks (rounded cells: 0.1 us, 3 significant digits of ms)
    text = _text(smoke, "host")
    weak = _table(text, "Host time per device per MD step")
    assert [r["devices"] for r in weak] == ["1", "2"]
    for r in weak:
        d, step = int(r["devices"]), _num(r["step ms"]) * 1e3
        calls, ops = re.fullmatch(r"(\d+) \((\d+) x (\d+)\)", r["stage-op calls/step (ops x devices)"]).group(1, 2)
        assert int(ops) == 2 and int(calls) == 2 * d  # the smoke MPNN's two layers, once per device per step
        assert {op.rsplit(" ", 1)[0] for op in r["CPU us per call, by op"].split(", ")} == {"layer_0", "layer_1"}
        cpu_cell = re.fullmatch(r"([\d.]+) \(([\d.]+)\)",
                                r["stage-op host CPU us/step (all devices; on the dispatching thread)"])
        cpu, inline = float(cpu_cell.group(1)), float(cpu_cell.group(2))
        wall = _num(r["stage-op wall us/step (all devices)"])
        d_wall, d_cpu = map(float, r["dispatch us/step (wall / CPU)"].split(" / "))
        assert 0 < cpu <= wall + 0.2 and wall <= d * step * 1.01  # D devices' bodies fit in D x the step
        assert 0 <= inline <= min(cpu, d_cpu) + 0.2  # what ran on the dispatching thread is in both clocks
        assert 0 <= d_cpu <= d_wall + 0.2 and d_wall <= _num(r["program ms/step"]) * 1e3 * 1.01 <= step * 1.02
        host = _num(r["host per device us/step"])
        assert host == pytest.approx((cpu - inline + d_cpu) / d, abs=0.3)
        share = 100 * host / step
        assert _num(r["host per device / step"]) == pytest.approx(share, abs=0.06 + 0.01 * share)
        assert int(r["steps timed"]) >= 2
    strong = _table(text, "Strong scaling")
    assert [r["devices"] for r in strong] == ["1", "2"] and strong[0]["speed-up vs the first"] == "1.00x"
    assert all(float(r["final max |dx| vs the first (A)"]) <= 1e-3 for r in strong)  # nve on 2 follows nve on 1


def test_first_call_reports_its_phases(smoke):
    from benchmarks.first_call import ORDER

    rows = {r["phase"]: r for r in _table(_text(smoke, "first-call"), "The first single point")}
    assert [p.removeprefix("- ") for p in rows] == [p.strip() for p in ORDER]
    assert float(rows["first single point"]["cold (first process, empty cache)"]) > 0


def test_tiles_follow_native_and_the_memory_model(smoke):
    text = _text(smoke, "tiles")
    rows = _table(text, "MACE energy + forces in tiles")
    assert [(r["kernels"], r["dtype"], r["atoms"]) for r in rows] == [("e3nn", "float64", "32"),
                                                                      ("e3nn", "float64", "108")]
    for r in rows:
        de, rest = r["parity dE/E [node sums], max dF (eV/A)"].split(" [")
        de_nodes, df = rest.split("], ")
        assert float(de_nodes) <= 1e-9 and float(df) <= 1e-8, r  # tiles="auto" against MACE's own forward
        assert abs(float(r["measured / predicted"]) - 1) <= 0.1, r  # the memory model on a real block
        assert float(r["NVE step vs closed form (A)"]) <= 1e-9, r  # one nve step is velocity Verlet's
        assert all(_num(r[c]) > 0 for c in ("E+F s", "native E+F s", "NVE step s (whole call s)")), r
        assert r["largest tile rows / edges"].startswith(f"{r['atoms']} / ")  # one tile: the box is one halo wide
    svg = (smoke[1] / "tiles_e3nn_float64.svg").read_text()
    assert "<svg" in svg and "atom-steps" in svg


def test_tile_ways_agree_with_native(smoke):
    """Per-layer tiles (the prototype) and the deep-halo tiles give native MACE's numbers, at the smoke's 2 tiles."""
    rows = _table(_text(smoke, "tile-ways"), "MACE energy + forces three ways")
    assert [(r["atoms"], r["tiles"], r["way"]) for r in rows] == [("32", "2", w) for w in
                                                                  ("native", "deep halo", "per layer")]
    for r in rows[1:]:
        de, rest = r["parity dE/E [node sums], max dF (eV/A)"].split(" [")
        de_nodes, df = rest.split("], ")
        assert float(de_nodes) <= 1e-9 and float(df) <= 1e-8, r  # float64, against MACE's own forward
        assert _num(r["E+F s"]) > 0 and r["x native time (same rounds)"].endswith("x"), r
    edges = [int(r["largest tile rows / edges"].split(" / ")[1].replace(",", "")) for r in rows[1:]]
    assert edges[1] < edges[0]  # a per-layer tile takes its own atoms' edges; the deep halo's spans the tiny box
