"""initialize() under a real `torchrun`: its store holds MASTER_PORT, JAX's coordinator must go elsewhere.

Two 2-process starts of tests/torch/torchrun_worker.py, run side by side to save
wall time: `torchrun --standalone --nproc-per-node 2` (all-gather plus
Lennard-Jones through the JAX front door, compared with the numpy reference),
and the project's launcher with MASTER_PORT already bound by another socket
(the collision case without a store).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from nvalchemi_jaxbridge.torch.launch import launch

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "torch" / "torchrun_worker.py"
TIMEOUT_S = 120

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(TIMEOUT_S + 30)]


@dataclasses.dataclass(frozen=True)
class Run:
    """One start: its exit code, its log, where the ranks wrote, and MASTER_PORT if the test chose it."""

    code: int
    log: str
    out: pathlib.Path
    master_port: int | None = None

    def ranks(self) -> list[dict]:
        assert self.code == 0, f"the run exited with {self.code}; log:\n{self.log[-6000:]}"
        return [json.loads((self.out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    for name in ("XLA_FLAGS", "JAX_COORDINATOR_PORT", "JAX_COORDINATOR_ADDRESS"):
        env.pop(name, None)
    out_t, out_l = tmp_path_factory.mktemp("torchrun"), tmp_path_factory.mktemp("launch")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(WORKER), str(out_t), "lj"]
    deadline = time.monotonic() + TIMEOUT_S  # both starts together, not one after the other
    torchrun = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log = io.StringIO()
        with socket.socket() as taken:  # someone else (e.g. torch.distributed's own store) holds MASTER_PORT
            taken.bind(("0.0.0.0", 0))
            taken.listen()
            port = taken.getsockname()[1]
            code = launch([str(WORKER), str(out_l)], 2, timeout_s=TIMEOUT_S, env=env, out=log, master_port=port)
        launched = Run(code, log.getvalue(), out_l, port)
        try:
            text, _ = torchrun.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _stop(torchrun)
            text = torchrun.communicate()[0] + f"\n[test] torchrun did not finish in {TIMEOUT_S} s"
        return {"torchrun": Run(torchrun.returncode, text, out_t), "launch": launched}
    finally:
        _stop(torchrun)


def _stop(p: subprocess.Popen) -> None:
    """Stop torchrun if still running: SIGTERM first, so its agent stops its workers (own sessions), then kill."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _check_gather(ranks: list[dict]) -> None:
    for r in ranks:
        assert (r["world"], r["process_count"], r["devices"]) == (2, 2, 2)
        assert r["gathered"] == [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]]
        port = int(r["coordinator"].rsplit(":", 1)[1])
        assert port != int(r["master_port"]), "JAX's coordinator must not take MASTER_PORT"
    assert ranks[0]["coordinator"] == ranks[1]["coordinator"]


def test_torchrun_two_ranks_match_single_process_reference(runs):
    from nvalchemi_jaxbridge.demo import argon_fcc
    from nvalchemi_jaxbridge.demo.params import LJParams
    from nvalchemi_jaxbridge.demo.reference import lj_reference

    ranks = runs["torchrun"].ranks()
    _check_gather(ranks)
    assert [r["source"] for r in ranks] == ["torchrun", "torchrun"] and [r["local_rank"] for r in ranks] == [0, 1]
    atoms, p = argon_fcc(2), LJParams()
    for r in ranks:
        pos = np.array(r["lj"]["positions"])
        e_ref, f_ref = lj_reference(pos, atoms.cell, atoms.periodic, epsilon=p.epsilon, sigma=p.sigma, cutoff=5.0)
        assert r["lj"]["n_devices"] == 2 and np.abs(f_ref).max() > 0.01
        np.testing.assert_allclose(r["lj"]["energy"], e_ref, rtol=1e-10)
        np.testing.assert_allclose(np.array(r["lj"]["forces"]), f_ref, rtol=1e-8, atol=1e-12)
    assert ranks[0]["lj"] == ranks[1]["lj"]


def test_start_with_master_port_already_bound(runs):
    ranks = runs["launch"].ranks()
    _check_gather(ranks)
    assert {r["master_port"] for r in ranks} == {str(runs["launch"].master_port)}
