"""A small torchrun-style launcher: `python -m nvalchemi_jaxbridge.torch.launch -n N script.py args...`.

Sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
`MASTER_PORT` (a free port) and `JAX_COORDINATOR_PORT` (another free port: it
has no store to publish one in, unlike torchrun), starts N processes of
`script.py` and prefixes their output with `[rank k]`. On the first failure it
names the rank that failed first in time, repeats that rank's last lines and
kills the others; on the global timeout it kills all of them.

"First in time" is the time of the fault, not of the exit: each rank's watchdog
(`torch/watchdog.py`) leaves a record in `$NVALCHEMI_JAXBRIDGE_FAULT_DIR` (a
folder the launcher makes) saying which rank is at fault and since when, so a
rank that stalled, or that raised while another rank exited first, is named;
a rank that died without a record (killed, segfault) counts from its exit.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from .distributed import free_port
from .faults import ENV_FAULT_DIR, FaultRecord, read_fault_files

TIMEOUT_EXIT = 124
OWN_EXIT_S = 5.0  # how long a rank that recorded its own fault may take to exit before it is stopped
OTHERS_S = 3.0  # how long the other ranks may take to stop by themselves (their records say where they were)
TAIL_LINES = 20


def _pump(stream: TextIO, prefix: str, out: TextIO, lock: threading.Lock, tail: collections.deque) -> None:
    """Copy lines from a child to `out`, each with the rank prefix; keep the last ones in `tail`."""
    for line in iter(stream.readline, ""):
        line = line.rstrip("\n")
        tail.append(line)
        with lock:
            out.write(prefix + line + "\n")
            out.flush()
    stream.close()


def _wait(p: subprocess.Popen, rank: int, exits: list[tuple[int, int, float]], cond: threading.Condition) -> None:
    """Record (rank, exit code, when) in `exits` when the child ends, so `exits` is in order of time."""
    code = p.wait()
    with cond:
        exits.append((rank, code, time.time()))
        cond.notify_all()


def _exit_code(code: int) -> int:
    """A shell-style exit code: 128 + N for a child killed by signal N."""
    return 128 - code if code < 0 else code


def _describe(code: int) -> str:
    """'exited with 1', or 'exited with 137 (killed by SIGKILL)'."""
    if code >= 0:
        return f"exited with {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"exited with {_exit_code(code)} (killed by {name})"


def first_fault(exits: Sequence[tuple[int, int, float]], records: Sequence[FaultRecord]) -> tuple[int, str | None]:
    """(rank at fault, its record's message or None) of the fault that began first.

    Records that name a culprit and exits of ranks that left no record (killed, segfault,
    a script without the watchdog) compete by time; records that only say a peer's
    connection dropped count when nothing else is known.
    """
    recorded = {r.rank for r in records}
    died = {rank for rank, code, _ in exits if code != 0 and rank not in recorded}
    events = [(r.time, r.blame, r.message) for r in records if r.blame is not None]
    events += [(t, rank, None) for rank, code, t in exits if rank in died]
    if not events:
        events = [(r.time, r.rank, r.message) for r in records] or [(t, rank, None) for rank, _, t in exits]
    _, rank, message = min(events, key=lambda e: e[0])
    return rank, None if rank in died else message  # a rank that died says most by its exit (signal, code)


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
        master_port: `MASTER_PORT` (default: a free one). JAX's coordinator gets another
            free port through `JAX_COORDINATOR_PORT`, unless `env` sets it or
            `JAX_COORDINATOR_ADDRESS`.

    Returns:
        0 if every process exited 0; the exit code of the rank that failed first
        in time otherwise (of the rank that noticed, if that one was still running,
        e.g. stalled; `124` on timeout).
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
    if not base.get("JAX_COORDINATOR_PORT") and not base.get("JAX_COORDINATOR_ADDRESS"):
        jax_port = free_port()
        while jax_port == port:  # MASTER_PORT is torch.distributed's, never JAX's
            jax_port = free_port()
        base["JAX_COORDINATOR_PORT"] = str(jax_port)
    own_dir = None if base.get(ENV_FAULT_DIR) else tempfile.mkdtemp(prefix="jaxbridge-faults-")
    if own_dir is not None:
        base[ENV_FAULT_DIR] = own_dir
    try:
        return _run(argv, nprocs, timeout_s, base, out)
    finally:
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)


def _run(argv: Sequence[str], nprocs: int, timeout_s: float, base: Mapping[str, str], out: TextIO) -> int:
    """Start the ranks, watch them, report the first fault; the launcher's exit code."""
    lock, cond = threading.Lock(), threading.Condition()
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    pumps: list[threading.Thread] = []
    tails = [collections.deque(maxlen=TAIL_LINES) for _ in range(nprocs)]
    exits: list[tuple[int, int, float]] = []  # (rank, code, when) in the order the children ended
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
        pump = threading.Thread(target=_pump, args=(p.stdout, f"[rank {rank}] ", out, lock, tails[rank]),
                                daemon=True)
        waiter = threading.Thread(target=_wait, args=(p, rank, exits, cond), daemon=True)
        pump.start()
        waiter.start()
        pumps.append(pump)
        threads += [pump, waiter]
    deadline = time.monotonic() + timeout_s
    code = 0
    try:
        while True:
            with cond:
                cond.wait_for(lambda: len(exits) == nprocs or any(c != 0 for _, c, _ in exits),
                              timeout=max(0.0, min(0.5, deadline - time.monotonic())))
                done = list(exits)
            failed = [(r, c) for r, c, _ in done if c != 0]
            if failed:
                code = _report(failed, done, pumps, tails, procs, base[ENV_FAULT_DIR], out, lock)
                break
            if len(done) == nprocs:
                break
            if time.monotonic() > deadline:
                code = TIMEOUT_EXIT
                with lock:
                    out.write(f"[launch] timeout after {timeout_s:g} s; killing all {nprocs} processes "
                              "(a rank hangs or waits for one that never started: see the log above; "
                              "give it longer with --timeout)\n")
                break
    finally:
        _kill(procs)
        for t in threads:
            t.join(timeout=5.0)
    return code


def _report(failed, done, pumps, tails, procs, fault_dir: str, out: TextIO, lock: threading.Lock) -> int:
    """Name the rank at fault and repeat its last lines; the exit code to return (the culprit's if it exited)."""
    pumps[failed[0][0]].join(timeout=2.0)  # the first to exit: its record is written, its last lines read
    records = read_fault_files(fault_dir)
    rank, message = first_fault(done, records)
    codes = dict(failed)
    own = any(r.rank == rank for r in records)
    if rank not in codes:
        try:  # on its way out (a peer noticed first): its code is the job's; a rank without a record of its
            # own that died (killed) a moment ago says most by its exit
            codes[rank] = procs[rank].wait(timeout=OWN_EXIT_S if own else 0.5)
            message = message if own or codes[rank] == 0 else None
        except subprocess.TimeoutExpired:
            pass
    if rank not in codes and procs[rank].poll() is None:  # stalled and still running: stop it, so its
        _kill([procs[rank]])  # last lines are complete
    pumps[rank].join(timeout=2.0)
    code = _exit_code(codes.get(rank, failed[0][1]))
    deadline = time.monotonic() + OTHERS_S  # the others stop by themselves within a second: their records
    for p in procs:  # say where each was
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    records = read_fault_files(fault_dir)
    if message is None:
        head = f"[launch] rank {rank} {_describe(codes.get(rank, failed[0][1]))} first; stopping the others\n"
    else:
        head = f"[launch] rank {rank} failed first: {message}; stopping the others\n"
    tail = "".join(f"[launch] | {line}\n" for line in tails[rank])
    others = "".join(f"[launch] rank {r.rank} was at {r.where} when it stopped\n"
                     for r in sorted(records, key=lambda r: r.rank) if r.rank != rank and r.where)
    with lock:
        out.write(f"{head}[launch] last {len(tails[rank])} lines of rank {rank}:\n{tail}{others}")
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: `-n N script.py args...` or `-n N -m package.module args...`."""
    p = argparse.ArgumentParser(
        prog="python -m nvalchemi_jaxbridge.torch.launch",
        description="Start N local processes with torchrun-style RANK/WORLD_SIZE/MASTER_* variables.",
        usage="%(prog)s -n N [--timeout S] [--port P] (script.py | -m module) [args ...]",
    )
    p.add_argument("-n", "--nprocs", type=int, required=True, help="number of processes")
    p.add_argument("--timeout", type=float, default=600.0, help="global timeout in seconds (default 600)")
    p.add_argument("--port", type=int, default=None, help="MASTER_PORT (default: a free one)")
    p.add_argument("script", help="the Python script to run, or -m and a module name as with python -m")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    argv = list(sys.argv[1:] if argv is None else argv)
    if (i := _module_flag(argv)) is not None:  # `-m module args...`: the rest belongs to the module
        if i + 1 >= len(argv):
            p.error("-m needs a module name, e.g. -m nvalchemi_jaxbridge.demo.pair_energy")
        a = p.parse_args([*argv[:i], *argv[i + 1:]])  # the module name in the script slot
        return launch(["-m", a.script, *a.args], a.nprocs, timeout_s=a.timeout, master_port=a.port)
    a = p.parse_args(argv)
    return launch([a.script, *a.args], a.nprocs, timeout_s=a.timeout, master_port=a.port)


def _module_flag(argv: Sequence[str]) -> int | None:
    """Index of a `-m` that comes before the script (launcher options skipped), else None."""
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "-m":
            return i
        if tok in ("-n", "--nprocs", "--timeout", "--port"):
            i += 2
        elif tok.startswith("-"):
            i += 1  # -n4, --timeout=9, -h
        else:
            return None  # the script: a later -m is its own argument
    return None


if __name__ == "__main__":
    sys.exit(main())
