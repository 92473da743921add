"""A small torchrun-style launcher: `python -m nvalchemi_jaxbridge.torch.launch -n N script.py args...`.

Sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and
`MASTER_PORT` (a free port), starts N processes of `script.py`, prefixes their
output with `[rank k]`, kills all of them on the first failure or when the
global timeout expires, and exits non-zero if any process failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

TIMEOUT_EXIT = 124


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream: TextIO, prefix: str, out: TextIO, lock: threading.Lock) -> None:
    """Copy lines from a child to `out`, each with the rank prefix."""
    for line in iter(stream.readline, ""):
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()
    stream.close()


def _kill(procs: Sequence[subprocess.Popen]) -> None:
    """Terminate, then kill, the process groups of the children still running."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5.0
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def launch(
    argv: Sequence[str],
    nprocs: int,
    *,
    timeout_s: float = 600.0,
    env: Mapping[str, str] | None = None,
    out: TextIO | None = None,
    master_port: int | None = None,
) -> int:
    """Run `python argv...` in `nprocs` processes with torchrun-style variables.

    Args:
        argv: the script and its arguments (`["train.py", "--steps", "3"]`), or
            `["-m", "module", ...]`.
        nprocs: number of processes (ranks 0..nprocs-1 on this host).
        timeout_s: global wall-clock limit; all processes are killed when it expires.
        env: base environment (default: this process's).
        out: where the prefixed output goes (default: stdout).
        master_port: coordinator port (default: a free one).

    Returns:
        0 if every process exited 0; the first failing exit code otherwise
        (`124` on timeout).
    """
    if nprocs < 1:
        raise ValueError(f"launch: -n must be >= 1, got {nprocs}")
    if not argv:
        raise ValueError("launch: give the script to run, e.g. `-n 2 train.py`")
    out = sys.stdout if out is None else out
    port = master_port or free_port()
    base = dict(os.environ if env is None else env)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nprocs))
    base.update(LOCAL_WORLD_SIZE=str(nprocs), PYTHONUNBUFFERED="1")
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    for rank in range(nprocs):
        child_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        p = subprocess.Popen(
            [sys.executable, *argv],
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, so _kill reaches grandchildren
        )
        procs.append(p)
        t = threading.Thread(target=_pump, args=(p.stdout, f"[rank {rank}] ", out, lock), daemon=True)
        t.start()
        pumps.append(t)
    deadline = time.monotonic() + timeout_s
    code = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                code = 128 - code if code < 0 else code  # killed by a signal
                with lock:
                    out.write(f"[launch] rank {rank} exited with {code}; stopping the others\n")
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                code = TIMEOUT_EXIT
                with lock:
                    out.write(f"[launch] timeout after {timeout_s:g} s; killing all {nprocs} processes\n")
                break
            time.sleep(0.05)
    finally:
        _kill(procs)
        for t in pumps:
            t.join(timeout=5.0)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(
        prog="python -m nvalchemi_jaxbridge.torch.launch",
        description="Start N local processes with torchrun-style RANK/WORLD_SIZE/MASTER_* variables.",
    )
    p.add_argument("-n", "--nprocs", type=int, required=True, help="number of processes")
    p.add_argument("--timeout", type=float, default=600.0, help="global timeout in seconds")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    a = p.parse_args(argv)
    return launch([a.script, *a.args], a.nprocs, timeout_s=a.timeout, master_port=a.port)


if __name__ == "__main__":
    sys.exit(main())
