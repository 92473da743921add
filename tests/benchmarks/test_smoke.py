"""The benchmark scripts run end to end on the CPU (`run_all.sh OUTDIR --smoke`), so they do not rot.

run_all.sh runs the four smoke runs in one Python process, each as its script's `__main__`.

Each script checks its own results against an independent path (native torch
call, a torch.distributed reference exchange, the no-bridge MD forces) and marks
a disagreement in its table; this test fails on any failed section or mismatch.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TITLES = {
    "halo_exchange": "Interconnect ceiling and halo exchange",
    "kernel_overhead": "Kernel-call overhead",
    "front_door": "PyTorch front door vs torch.distributed",
    "md_step": "End-to-end MD step",
}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_run_all_smoke_on_cpu(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu", TRITON_INTERPRET="1",
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_all.sh"), str(tmp_path), "--smoke"],
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    for name, title in TITLES.items():
        text = (tmp_path / f"{name}.md").read_text()
        assert title in text and "platform: cpu" in text, name
        assert "FAILED" not in text and "MISMATCH" not in text, f"{name}:\n{text}"
        assert "| " in text.split("**", 2)[-1], f"{name} has no table rows"
    kernel = (tmp_path / "kernel_overhead.md").read_text()
    assert kernel.count("same result") >= 6  # native, bridge and pure_callback for both ops
    md = (tmp_path / "md_step.md").read_text()
    assert md.count(" ok |") == 6 and "FAIL" not in md  # (lj: torch, triton; dsf: torch) x 2 bridge runs
    assert "| yes |" in (tmp_path / "front_door.md").read_text()
    assert (tmp_path / "ALL.md").read_text().count("## ") == 4
