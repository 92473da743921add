"""benchmarks/md_breakdown.py, md_interleaved.py, dispatch_floor.py, grad_through_op.py and nve_steps.py run end to
end on the CPU, in this process.

Each checks its runs against each other before it times them (dispatch_floor: every row gives 2 x;
md_breakdown: the bridge's and native's steps come from md_step.py, whose forces the smoke test checks;
md_interleaved: the first-step forces of both sides, which it stops on when they differ; grad_through_op:
the bridge's forces against native autograd's, and how many forwards an energy + forces ran; nve_steps: the
total energy of its NVE run, and that a run after the first compiles nothing).
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import dispatch_floor  # noqa: E402
import grad_through_op  # noqa: E402
import md_breakdown  # noqa: E402
import md_interleaved  # noqa: E402
import nve_steps  # noqa: E402


def test_md_breakdown_smoke_has_every_run(tmp_path):
    assert md_breakdown.main(["--platform", "cpu", "--smoke", "--kernels", "torch-cells", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "md_breakdown.md").read_text()
    for run in ("| native |", "| bridge |", "| op alone, native rows |", "| op alone, bridge rows |"):
        assert run in text, run


def test_md_interleaved_smoke_times_both_sides_in_every_way(tmp_path):
    assert md_interleaved.main(["--platform", "cpu", "--smoke", "--kernels", "torch-cells", "--out", str(tmp_path)]) == 0
    rows = [r for r in (tmp_path / "md_interleaved.md").read_text().splitlines() if r.startswith("| - | torch-cells |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert all(float(cells[i]) > 0 for i in (3, 4, 6, 7, 9)) and all(cells[i].endswith("x") for i in (5, 8, 10))
    forces, loop = (float(v) for v in cells[11].split(","))
    assert forces < 1e-4 and loop < 1e-3  # first-step forces against native; the loop against the step program


def test_grad_through_op_smoke_runs_one_forward_and_splits_a_call(tmp_path):
    args = ["--platform", "cpu", "--smoke", "--paths", "ffi", "--timeline", "--out", str(tmp_path)]
    assert grad_through_op.main(args) == 0
    lines = (tmp_path / "grad_through_op.md").read_text().splitlines()
    bridge = [c.strip() for c in next(r for r in lines if "| bridge (ffi) |" in r).split("|")[1:-1]]
    assert bridge[4] == "1" and float(bridge[10]) < 1e-5  # one forward per E+F; forces as native's
    assert float(bridge[7]) > 0 and bridge[8].endswith("x")  # the pipelined time and its ratio
    phases = {r.split("|")[3].strip(): [float(c) for c in r.split("|")[4:9]] for r in lines
              if r.startswith("| - | 200 |") and len(r.split("|")) == 10}
    assert set(phases) == {"native E", "native E+F", "bridge (ffi) E", "bridge (ffi) E+F",
                           "XLA alone: jit((2 * x).sum())"}
    for total, *parts in phases.values():
        assert total > 0 and all(p >= 0 for p in parts)
    assert phases["XLA alone: jit((2 * x).sum())"][2] == 0  # no torch function in it


def test_dispatch_floor_smoke_gives_each_component(tmp_path):
    assert dispatch_floor.main(["--platform", "cpu", "--smoke", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "dispatch_floor.md").read_text()
    assert text.count("), ATen op |") == 2 and text.count("), custom op |") == 2  # ffi and callback
    assert "pure XLA - native ATen" in text and "Target:" in text


def test_xla_kernels_are_told_from_torch_and_triton_kernels():
    assert md_breakdown.is_xla_kernel("loop_add_fusion") and md_breakdown.is_xla_kernel("input_reduce_fusion_1")
    assert not md_breakdown.is_xla_kernel("void at::native::elementwise_kernel<128, 2>")
    assert not md_breakdown.is_xla_kernel("lj_kernel")  # a Triton kernel's own name


def test_nve_steps_smoke_keeps_the_energy_and_compiles_once(tmp_path):
    assert nve_steps.main(["--platform", "cpu", "--smoke", "--out", str(tmp_path)]) == 0
    row = next(r for r in (tmp_path / "nve_steps.md").read_text().splitlines() if r.startswith("| - | 108 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert float(cells[4]) > 0 and cells[5].startswith("0 (")  # the timed run reused the warm-up's programs
    assert float(cells[8]) < 1e-6  # eV per atom over the run
