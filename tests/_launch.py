"""Launch a test worker on several CPU processes and collect what each rank wrote.

The project's launcher starts a job, or real torchrun (`shared_run(..., torchrun=True)`).
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Mapping, Sequence

import pytest

from nvalchemi_jaxbridge.torch.launch import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
FRONT_DOOR = ROOT / "tests" / "torch" / "all_workers.py"  # every worker of the PyTorch front door, in one job
# XLA:CPU's backend (LLVM) optimisation off in the ranks: each rank compiles dozens of small programs that run
# once or twice, and compiling them was a quarter of a front-door rank's CPU time (measured on the 4-rank job:
# -21 % CPU). The programs are the same HLO and the checks the same; only the machine code is less optimised.
# Not the suite's XLA_FLAGS: its Eigen setting is for 8 devices in one process (no gain measured for ranks).
RANK_XLA_FLAGS = "--xla_backend_optimization_level=0"


def rank_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for the ranks of a CPU job: JAX on the CPU, this checkout importable,
    `RANK_XLA_FLAGS`; `env` on top."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "XLA_FLAGS": RANK_XLA_FLAGS, **(env or {})}


def run_ranks(worker: pathlib.Path, world: int, out_dir: pathlib.Path, args: Sequence[str] = (), *,
              result: str = "rank{rank}.json", timeout_s: float = 240, env: Mapping[str, str] | None = None
              ) -> list[dict]:
    """`worker OUT_DIR *args` on `world` processes (JAX on the CPU); the JSON each rank wrote to `result`.

    A non-zero exit fails the test with the end of the launcher's log.
    """
    code, log = _launch(worker, world, out_dir, args, timeout_s, env)
    if code != 0:
        pytest.fail(f"{world}-process run exited with {code}; log:\n{log}")
    return read_ranks(out_dir, world, result)


def _launch(worker: pathlib.Path, world: int, out_dir: pathlib.Path, args: Sequence[str], timeout_s: float,
            env: Mapping[str, str] | None) -> tuple[int, str]:
    """(exit code, the end of the launcher's log) of `worker OUT_DIR *args` on `world` CPU processes."""
    log = io.StringIO()
    code = launch([str(worker), str(out_dir), *args], world, timeout_s=timeout_s, env=rank_env(env), out=log)
    return code, log.getvalue()[-6000:]


def _torchrun(worker: pathlib.Path, world: int, out_dir: pathlib.Path, args: Sequence[str], timeout_s: float,
              env: Mapping[str, str] | None) -> tuple[int, str]:
    """(exit code, the end of its log) of `torchrun --standalone --nproc-per-node world worker OUT_DIR *args`.

    JAX's coordinator is left to initialize() (rank 0 publishes it in torchrun's store), as in a user's job.
    """
    full_env = rank_env(env)
    for name in ("JAX_COORDINATOR_PORT", "JAX_COORDINATOR_ADDRESS"):
        full_env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "--log-dir", str(out_dir / "torchrun-logs"), "--tee", "3", str(worker), str(out_dir), *args]
    p = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log = p.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        _stop(p)
        log = p.communicate()[0] + f"\n[test] torchrun did not finish in {timeout_s:g} s"
    finally:
        _stop(p)
    return p.returncode, log[-6000:]


def _stop(p: subprocess.Popen) -> None:
    """Stop torchrun if still running: SIGTERM first, so its agent stops its workers (own sessions), then kill."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def shared_run(worker: pathlib.Path, world: int, tmp_path_factory, args: Sequence[str] = (), *,
               timeout_s: float = 240, env: Mapping[str, str] | None = None, torchrun: bool = False
               ) -> pathlib.Path:
    """The output folder of ONE launch of `worker OUT_DIR *args` on `world` processes, shared by every test
    module and every pytest-xdist worker of this session (a file lock in the session's shared temp folder:
    the first caller launches, the others wait and read). A failed launch fails every caller with its log.
    The project's launcher starts it, or real `torchrun --standalone` if `torchrun`; the callers of one job
    pass the same arguments (see `front_door_run`).
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # .../pytest-N/popen-gwK: pytest-N is this run's, for all workers
        root = root.parent
    out = root / f"shared-{worker.stem}-{world}"
    with open(root / f"shared-{worker.stem}-{world}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "DONE").exists() and not (out / "FAILED").exists():
            out.mkdir(exist_ok=True)
            code, log = (_torchrun if torchrun else _launch)(worker, world, out, args, timeout_s, env)
            (out / ("DONE" if code == 0 else "FAILED")).write_text(f"exit {code}\n{log}")
    if (out / "FAILED").exists():
        pytest.fail(f"{world}-process run of {worker.name} failed; log:\n{(out / 'FAILED').read_text()}")
    return out


def front_door_run(world: int, tmp_path_factory) -> pathlib.Path:
    """The output folder of the suite's one job of tests/torch/all_workers.py on `world` processes (every
    multi-process check of the PyTorch front door and the model level; tests/torch/test_multiprocess.py,
    tests/mlip/test_torch_door.py and tests/torch/test_torchrun.py judge it). Real torchrun starts the
    2-process job (the acceptance run of torchrun, and the launch users run), the project's launcher the others.
    """
    return shared_run(FRONT_DOOR, world, tmp_path_factory, timeout_s=280, torchrun=world == 2)


def read_ranks(folder: pathlib.Path, world: int, result: str = "rank{rank}.json") -> list[dict]:
    """The JSON each rank wrote into `folder`."""
    return [json.loads((folder / result.format(rank=r)).read_text()) for r in range(world)]


def launch_with_log(worker: pathlib.Path, world: int, out_dir: pathlib.Path, args: Sequence[str] = (), *,
                    timeout_s: float = 240, env: Mapping[str, str] | None = None,
                    master_port: int | None = None) -> tuple[int, str]:
    """(exit code, the launcher's whole log) of `worker OUT_DIR *args` on `world` CPU processes; never fails the
    test, for tests that judge a failing run."""
    log = io.StringIO()
    code = launch([str(worker), str(out_dir), *args], world, timeout_s=timeout_s, env=rank_env(env), out=log,
                  master_port=master_port)
    return code, log.getvalue()
