"""The same compiled program under jax.distributed: 2 CPU processes x 2 devices, gloo."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 150


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_match_numpy_reference():
    port = free_port()
    # XLA's backend optimisation off, as in tests/_launch.py's ranks: compiling the LJ programs is most of a
    # process's own work and they run once (measured: -14 % CPU for the two processes).
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": "--xla_backend_optimization_level=0"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.lower.mp_worker", str(i), "2", str(port)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT_S)
            assert p.returncode == 0, f"worker exited with {p.returncode}:\n{err[-3000:]}"
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r in outs:
        assert r["devices"] == 4 and r["local"] == 2
        assert r["energy"] == pytest.approx(r["energy_ref"], rel=1e-9)
        assert r["force_err"] <= 1e-9 * r["force_scale"]
        assert r["grad_err"] <= 1e-9 * r["force_scale"]
    assert outs[0]["energy"] == outs[1]["energy"]
