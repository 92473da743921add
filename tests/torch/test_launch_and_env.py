"""Launcher behaviour and how initialize() reads torchrun / SLURM / explicit settings."""

from __future__ import annotations

import functools
import io
import os
import socket
import time

import pytest

from nvalchemi_jaxbridge.torch import distributed
from nvalchemi_jaxbridge.torch.distributed import coordinator_key, first_host, resolve
from nvalchemi_jaxbridge.torch.faults import ENV_FAULT_DIR, FaultRecord, write_fault_file
from nvalchemi_jaxbridge.torch.launch import launch, main

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


def test_torchrun_variables_are_read():
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}
    # no torchrun store (TORCHELASTIC_USE_AGENT_STORE unset): the port after MASTER_PORT, never MASTER_PORT
    assert resolve(env=env) == ("h0:1235", 4, 1, 1, "torchrun")
    assert resolve(env=dict(env, JAX_COORDINATOR_PORT="777")) == ("h0:777", 4, 1, 1, "torchrun")
    assert resolve(env=dict(env, JAX_COORDINATOR_ADDRESS="c:9"))[0] == "c:9"


def _jax_slurm(monkeypatch, env: dict) -> tuple:
    """What JAX's own SLURM detection gives for `env` (an independent reference)."""
    from jax._src.clusters import ClusterEnv, SlurmCluster

    for name in (*SLURM_VARS, "JAX_COORDINATOR_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert SlurmCluster.is_env_present()
    detected = ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, "slurm", 60)
    by_class = (SlurmCluster.get_coordinator_address(60, os.environ.get("JAX_COORDINATOR_PORT")),
                SlurmCluster.get_process_count(), SlurmCluster.get_process_id(),
                [SlurmCluster.get_local_process_id()])
    assert tuple(detected) == by_class
    return by_class


@pytest.mark.parametrize("job, nodes", [("4242", "gpu[07-08,11],cpu3"), ("12345", "n01"), ("0", "n01,n02"),
                                        ("4095", "node-[001-004]"), ("4096", "x[9-10],y[1-2]")])
def test_slurm_mapping_is_jax_own_detection(monkeypatch, job, nodes):
    env = {"SLURM_JOB_ID": job, "SLURM_STEP_NODELIST": nodes, "SLURM_NTASKS": "8", "SLURM_PROCID": "5",
           "SLURM_LOCALID": "1"}
    coord, world, rank, local, source = resolve(env=env)
    assert (coord, world, rank, [local]) == _jax_slurm(monkeypatch, env) and source == "slurm"
    assert int(coord.rsplit(":", 1)[1]) == 61440 + int(job) % 4096
    # JAX honours $JAX_COORDINATOR_PORT under SLURM, and so do we (not $MASTER_PORT: that is torch's)
    env = dict(env, JAX_COORDINATOR_PORT="999")
    host = coord.rsplit(":", 1)[0]
    assert resolve(env=dict(env, MASTER_PORT="1"))[0] == _jax_slurm(monkeypatch, env)[0] == f"{host}:999"


def test_slurm_one_node_in_brackets(monkeypatch):
    """'x[9],y1': the first host is x9. JAX 0.12's parser gives 'x9]' here (a host that does not resolve)."""
    env = {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "x[9],y1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0"}
    assert resolve(env=env)[0] == "x9:61441"
    assert _jax_slurm(monkeypatch, env)[0] in ("x9:61441", "x9]:61441")


def test_slurm_job_12345_uses_port_61497():
    env = {"SLURM_JOB_ID": "12345", "SLURM_STEP_NODELIST": "a[3-5]", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}
    assert resolve(env=env)[0] == "a3:61497"
    with pytest.raises(ValueError, match=r"\$SLURM_JOB_ID is not set"):
        resolve(env={k: v for k, v in env.items() if k != "SLURM_JOB_ID"})


def test_srun_torchrun_torchrun_variables_win():
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "0"}
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
    assert resolve(env={**slurm, **torchrun}) == ("n1:29501", 8, 3, 3, "torchrun")


@pytest.fixture
def agent_store():
    """A TCPStore server standing in for torchrun's agent store; yields (store, torchrun-like env)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "run-a", "TORCHELASTIC_RESTART_COUNT": "0"}
    yield store, env


def test_torchrun_rank0_publishes_a_free_port_through_the_store(agent_store):
    store, env = agent_store
    coord0 = resolve(env=dict(env, RANK="0", LOCAL_RANK="0"))[0]
    host, port = coord0.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) != store.port
    assert store.get(coordinator_key(env)).decode() == coord0
    assert resolve(env=dict(env, RANK="1", LOCAL_RANK="1")) == (coord0, 2, 1, 1, "torchrun")
    # a restarted job reads its own key, never the value of the attempt before
    with pytest.raises(RuntimeError, match=r"rank 1 waited 1 s for rank 0 to publish .*timeout_s="):
        resolve(env=dict(env, RANK="1", TORCHELASTIC_RESTART_COUNT="1"), timeout_s=1)
    assert coordinator_key(dict(env, TORCHELASTIC_RESTART_COUNT="1")) != coordinator_key(env)
    assert coordinator_key(dict(env, TORCHELASTIC_RUN_ID="run-b")) != coordinator_key(env)


def test_torchrun_store_unreachable_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with pytest.raises(RuntimeError, match=r"cannot reach torchrun's store at 127.0.0.1:\d+ .*JAX_COORDINATOR_PORT"):
        resolve(env=env, timeout_s=1)


def test_busy_coordinator_port_is_an_error_not_a_segfault():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        with pytest.raises(RuntimeError, match=r"port \d+ .* already in use .*JAX_COORDINATOR_PORT"):
            distributed._check_port_free(f"127.0.0.1:{s.getsockname()[1]}")
    distributed._check_port_free(f"127.0.0.1:{distributed.free_port()}")


def test_initialize_under_srun_torchrun_passes_local_rank_and_switches_detection_off(agent_store, monkeypatch):
    """GPU, rank 1 of torchrun inside a SLURM step: LOCAL_RANK's device, not SLURM_LOCALID's, and no auto-detect."""
    import jax
    import torch
    from jax._src import xla_bridge

    store, env = agent_store
    store.set(coordinator_key(env), "127.0.0.1:4321")  # what rank 0 published
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0"}
    for name, value in {**slurm, **env, "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    for name in ("JAX_COORDINATOR_PORT", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    calls = []
    fake = functools.wraps(jax.distributed.initialize)(lambda **kw: calls.append(kw))  # keeps its signature
    monkeypatch.setattr(jax.distributed, "initialize", fake)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append({"set_device": i}))
    monkeypatch.setattr(distributed, "_STATE", {})
    info = distributed.initialize(platform="gpu", timeout_s=5)
    assert calls[0] == {"set_device": 1}
    kw = calls[1]
    assert kw["coordinator_address"] == "127.0.0.1:4321" and kw["num_processes"] == 2 and kw["process_id"] == 1
    assert kw["local_device_ids"] == [1] and kw["cluster_detection_method"] == "deactivate"
    assert (info.rank, info.world_size, info.local_rank, info.source) == (1, 2, 1, "torchrun")


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
    assert "rank 1 exited with 3 first; stopping the others" in out.getvalue()


def test_the_job_exits_with_the_culprits_code_when_a_peer_exits_before_it(tmp_path):
    """Rank 1 has recorded its own fault but takes a moment to exit; rank 0 leaves at once with the peer
    code: the job still exits with rank 1's code, not the bystander's."""
    faults_dir = tmp_path / "faults"
    faults_dir.mkdir()
    env = {**os.environ, ENV_FAULT_DIR: str(faults_dir)}
    write_fault_file(FaultRecord(rank=1, blame=1, time=time.time(), kind="raised",
                                 message="rank 1 raised ValueError: bad block"), env)
    s = _script(tmp_path, "if rank == 1:\n    time.sleep(1.5)\n    sys.exit(7)\nsys.exit(75)\n")
    out = io.StringIO()
    assert launch([s], 2, timeout_s=60, env=env, out=out) == 7, out.getvalue()
    assert "[launch] rank 1 failed first: rank 1 raised ValueError: bad block; stopping the others" in out.getvalue()


def test_launcher_names_the_rank_that_failed_first_in_time(tmp_path):
    """Rank 1 raises at once; rank 0 fails later (lower number, later in time): rank 1 is named, with its log."""
    s = _script(tmp_path, "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                          "if rank == 1:\n    print('rank one starting')\n    raise RuntimeError('boom in rank 1')\n"
                          "time.sleep(1)\nsys.exit(3)\n")
    out = io.StringIO()
    assert launch([s], 2, timeout_s=60, out=out) == 1
    log = out.getvalue()
    assert "[launch] rank 1 exited with 1 first; stopping the others" in log
    report = log[log.index("[launch] rank 1 exited"):]
    assert "[launch] | rank one starting" in report and "[launch] | RuntimeError: boom in rank 1" in report
    assert "rank 0 exited" not in log


def test_launcher_gives_jax_its_own_port(tmp_path):
    s = _script(tmp_path, "print('ports', os.environ['MASTER_PORT'], os.environ['JAX_COORDINATOR_PORT'])\n")
    out = io.StringIO()
    assert launch([s], 2, timeout_s=60, out=out, env={k: v for k, v in os.environ.items()
                                                     if not k.startswith("JAX_COORDINATOR")}) == 0
    ports = {tuple(line.split()[-2:]) for line in out.getvalue().splitlines() if " ports " in line}
    assert len(ports) == 1 and len(set(next(iter(ports)))) == 2  # same on every rank; JAX's != MASTER_PORT
    out = io.StringIO()
    assert launch([s], 1, timeout_s=60, out=out, env=dict(os.environ, JAX_COORDINATOR_PORT="5555")) == 0
    assert out.getvalue().split()[-1] == "5555"


def test_launcher_global_timeout(tmp_path):
    s = _script(tmp_path, "time.sleep(60)\n")
    out = io.StringIO()
    assert launch([s], 2, timeout_s=1.0, out=out) == 124
    assert "timeout after 1 s" in out.getvalue()


def test_launcher_cli(tmp_path, capsys):
    s = _script(tmp_path, "sys.exit(0 if sys.argv[1:] == ['a', '--b'] else 5)\n")
    assert main(["-n", "2", "--timeout", "60", s, "a", "--b"]) == 0
    assert main(["-n", "1", s, "-m", "x"]) == 5  # a -m after the script is the script's own argument
    with pytest.raises(ValueError, match=r"-n must be >= 1"):
        launch([s], 0)


def test_launcher_runs_a_module_with_dash_m(tmp_path, monkeypatch):
    (tmp_path / "jb_launch_probe.py").write_text(
        "import os, sys\nsys.exit(0 if sys.argv[1:] == ['--out', 'x'] and os.environ['WORLD_SIZE'] == '2' else 5)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert main(["-n", "2", "--timeout", "60", "-m", "jb_launch_probe", "--out", "x"]) == 0
    with pytest.raises(SystemExit):
        main(["-n", "2", "-m"])
