"""Launcher behaviour and how initialize() reads torchrun / SLURM / explicit settings."""

from __future__ import annotations

import io
import sys
import time

import pytest

from nvalchemi_jaxbridge.torch.distributed import first_host, resolve
from nvalchemi_jaxbridge.torch.launch import launch, main


def test_torchrun_variables_are_read():
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}
    assert resolve(env=env) == ("h0:1234", 4, 1, 1, "torchrun")


def test_slurm_variables_are_read_with_the_first_host():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_STEP_NODELIST": "gpu[07-08,11],cpu3", "SLURM_JOB_ID": "4242"}
    assert resolve(env=env) == ("gpu07:29742", 8, 5, 1, "slurm")
    assert resolve(env=dict(env, MASTER_PORT="999"))[0] == "gpu07:999"


@pytest.mark.parametrize("nodes, host", [("n01", "n01"), ("n01,n02", "n01"), ("a[3-5,7]", "a3"),
                                         ("node-[001-004]", "node-001"), ("x[9],y[1-2]", "x9")])
def test_first_host_of_slurm_node_lists(nodes, host):
    assert first_host(nodes) == host


def test_explicit_arguments_win():
    env = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h0", "MASTER_PORT": "1"}
    got = resolve(coordinator_address="c:2", num_processes=2, process_id=0, env=env)
    assert got == ("c:2", 2, 0, 0, "explicit")
    assert resolve(env={}) == (None, 1, 0, 0, "single")


def test_missing_variables_are_named():
    with pytest.raises(ValueError, match=r"\$MASTER_PORT is not set"):
        resolve(env={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})
    with pytest.raises(ValueError, match=r"\$WORLD_SIZE is not set"):
        resolve(env={"RANK": "0"})
    with pytest.raises(ValueError, match=r"SLURM_STEP_NODELIST nor \$SLURM_NODELIST"):
        resolve(env={"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    with pytest.raises(ValueError, match=r"process id 3 is outside 0..1"):
        resolve(env={"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(ValueError, match=r"num_processes=2 but no coordinator"):
        resolve(num_processes=2, process_id=0, env={})


def _script(tmp_path, body: str) -> str:
    p = tmp_path / "s.py"
    p.write_text("import os, sys, time\nrank = int(os.environ['RANK'])\n" + body)
    return str(p)


def test_launcher_sets_variables_and_prefixes_output(tmp_path):
    s = _script(tmp_path, "print(rank, os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK'], "
                          "os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']) > 0)\n")
    out = io.StringIO()
    assert launch([s], 3, timeout_s=60, out=out) == 0
    lines = sorted(line for line in out.getvalue().splitlines() if line.startswith("[rank"))
    assert lines == [f"[rank {r}] {r} 3 {r} 127.0.0.1 True" for r in range(3)]


def test_launcher_kills_all_on_first_failure(tmp_path):
    s = _script(tmp_path, "if rank == 1: sys.exit(3)\ntime.sleep(60)\n")
    out = io.StringIO()
    t0 = time.monotonic()
    assert launch([s], 3, timeout_s=60, out=out) == 3
    assert time.monotonic() - t0 < 30
    assert "rank 1 exited with 3; stopping the others" in out.getvalue()


def test_launcher_global_timeout(tmp_path):
    s = _script(tmp_path, "time.sleep(60)\n")
    out = io.StringIO()
    assert launch([s], 2, timeout_s=1.0, out=out) == 124
    assert "timeout after 1 s" in out.getvalue()


def test_launcher_cli(tmp_path, capsys):
    s = _script(tmp_path, "sys.exit(0 if sys.argv[1:] == ['a', '--b'] else 5)\n")
    assert main(["-n", "2", "--timeout", "60", s, "a", "--b"]) == 0
    with pytest.raises(ValueError, match=r"-n must be >= 1"):
        launch([s], 0)
    assert sys.executable
