"""initialize() under a real `torchrun`: its store holds MASTER_PORT, JAX's coordinator must go elsewhere.

Two 2-process starts of tests/torch/torchrun_worker.py: under `torchrun --standalone --nproc-per-node 2`
(all-gather plus Lennard-Jones through the JAX front door, compared with the numpy reference), inside the
front door's shared 2-process job, which real torchrun starts (tests/_launch.py: front_door_run; one start
of torch and JAX per rank for the whole suite); and the project's launcher with MASTER_PORT already bound
by another socket (the collision case without a store).
"""

from __future__ import annotations

import dataclasses
import io
import json
import pathlib
import socket

import numpy as np
import pytest

from nvalchemi_jaxbridge.torch.launch import launch
from tests._launch import front_door_run, rank_env, read_ranks

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "torch" / "torchrun_worker.py"
TIMEOUT_S = 120

pytestmark = pytest.mark.multiprocess


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
def launched(tmp_path_factory: pytest.TempPathFactory) -> Run:
    env = rank_env()
    for name in ("JAX_COORDINATOR_PORT", "JAX_COORDINATOR_ADDRESS"):
        env.pop(name, None)
    out, log = tmp_path_factory.mktemp("launch"), io.StringIO()
    with socket.socket() as taken:  # someone else (e.g. torch.distributed's own store) holds MASTER_PORT
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = launch([str(WORKER), str(out)], 2, timeout_s=TIMEOUT_S, env=env, out=log, master_port=port)
    return Run(code, log.getvalue(), out, port)


@pytest.fixture(scope="module")
def torchrun_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What torchrun_worker.py wrote on both ranks of the front door's shared job (real torchrun starts it)."""
    return read_ranks(front_door_run(2, tmp_path_factory) / "torchrun", 2)


def _check_gather(ranks: list[dict]) -> None:
    for r in ranks:
        assert (r["world"], r["process_count"], r["devices"]) == (2, 2, 2)
        assert r["gathered"] == [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]]
        port = int(r["coordinator"].rsplit(":", 1)[1])
        assert port != int(r["master_port"]), "JAX's coordinator must not take MASTER_PORT"
    assert ranks[0]["coordinator"] == ranks[1]["coordinator"]


def test_torchrun_two_ranks_match_single_process_reference(torchrun_ranks):
    from nvalchemi_jaxbridge.demo import argon_fcc
    from nvalchemi_jaxbridge.demo.params import LJParams
    from nvalchemi_jaxbridge.demo.reference import lj_reference

    ranks = torchrun_ranks
    _check_gather(ranks)
    assert [r["source"] for r in ranks] == ["torchrun", "torchrun"] and [r["local_rank"] for r in ranks] == [0, 1]
    assert all(r["torchelastic"] for r in ranks), "the shared 2-process job must be started by real torchrun"
    atoms, p = argon_fcc(2), LJParams()
    for r in ranks:
        pos = np.array(r["lj"]["positions"])
        e_ref, f_ref = lj_reference(pos, atoms.cell, atoms.periodic, epsilon=p.epsilon, sigma=p.sigma, cutoff=5.0)
        assert r["lj"]["n_devices"] == 2 and np.abs(f_ref).max() > 0.01
        np.testing.assert_allclose(r["lj"]["energy"], e_ref, rtol=1e-10)
        np.testing.assert_allclose(np.array(r["lj"]["forces"]), f_ref, rtol=1e-8, atol=1e-12)
    assert ranks[0]["lj"] == ranks[1]["lj"]


def test_start_with_master_port_already_bound(launched):
    ranks = launched.ranks()
    _check_gather(ranks)
    assert {r["master_port"] for r in ranks} == {str(launched.master_port)}
    assert not any(r["torchelastic"] for r in ranks)
