"""Launch a test worker on several CPU processes (the project's launcher) and collect what each rank wrote."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pathlib
from collections.abc import Mapping, Sequence

import pytest

from nvalchemi_jaxbridge.torch.launch import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
    full_env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **(env or {}))
    full_env.pop("XLA_FLAGS", None)
    log = io.StringIO()
    code = launch([str(worker), str(out_dir), *args], world, timeout_s=timeout_s, env=full_env, out=log)
    return code, log.getvalue()[-6000:]


def shared_run(worker: pathlib.Path, world: int, tmp_path_factory, args: Sequence[str] = (), *,
               timeout_s: float = 240, env: Mapping[str, str] | None = None) -> pathlib.Path:
    """The output folder of ONE launch of `worker OUT_DIR *args` on `world` processes, shared by every test
    module and every pytest-xdist worker of this session (a file lock in the session's shared temp folder:
    the first caller launches, the others wait and read). A failed launch fails every caller with its log.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # .../pytest-N/popen-gwK: pytest-N is this run's, for all workers
        root = root.parent
    out = root / f"shared-{worker.stem}-{world}"
    with open(root / f"shared-{worker.stem}-{world}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "DONE").exists() and not (out / "FAILED").exists():
            out.mkdir(exist_ok=True)
            code, log = _launch(worker, world, out, args, timeout_s, env)
            (out / ("DONE" if code == 0 else "FAILED")).write_text(f"exit {code}\n{log}")
    if (out / "FAILED").exists():
        pytest.fail(f"{world}-process run of {worker.name} failed; log:\n{(out / 'FAILED').read_text()}")
    return out


def read_ranks(folder: pathlib.Path, world: int, result: str = "rank{rank}.json") -> list[dict]:
    """The JSON each rank wrote into `folder`."""
    return [json.loads((folder / result.format(rank=r)).read_text()) for r in range(world)]


def launch_with_log(worker: pathlib.Path, world: int, out_dir: pathlib.Path, args: Sequence[str] = (), *,
                    timeout_s: float = 240, env: Mapping[str, str] | None = None,
                    master_port: int | None = None) -> tuple[int, str]:
    """(exit code, the launcher's whole log) of `worker OUT_DIR *args` on `world` CPU processes; never fails the
    test, for tests that judge a failing run."""
    full_env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **(env or {}))
    full_env.pop("XLA_FLAGS", None)
    log = io.StringIO()
    code = launch([str(worker), str(out_dir), *args], world, timeout_s=timeout_s, env=full_env, out=log,
                  master_port=master_port)
    return code, log.getvalue()
