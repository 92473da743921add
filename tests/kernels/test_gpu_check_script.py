"""scripts/gpu_kernels_check.py's error checks, run here on the CPU: each failing op (a forward that raises, a
fake that lies about a shape, a backward that raises) in a child process must reach JAX as an error naming
the op's failure, on both call paths. On a GPU machine the script runs the same children on the GPU."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "gpu_kernels_check.py"
CASES = ("raises", "lies", "backward-raises")


@pytest.mark.slow
def test_each_failing_op_reaches_jax_with_its_message_on_both_paths():
    """All cases on both paths in one child (an abort fails the test as well; the GPU run isolates each case)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, str(SCRIPT), "--error-case", ",".join(CASES), "--paths", "ffi,callback"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-1500:]}\n{res.stderr[-1500:]}"


def test_an_unknown_case_is_refused():
    res = subprocess.run([sys.executable, str(SCRIPT), "--error-case", "nope", "--paths", "ffi"],
                         env=dict(os.environ, JAX_PLATFORMS="cpu", TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES=""),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "unknown --error-case 'nope'; the cases are: raises, lies" in res.stderr
