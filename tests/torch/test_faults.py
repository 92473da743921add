"""Faults in real 2-process CPU jobs (jax.distributed, gloo): every case ends promptly and names the rank.

Each case launches the tiny worker below on 2 ranks with the project's launcher: a
jitted step whose "kernel" is a host callback, then a collective (an all-gather), a
few times, the loop inside `try: ... finally: shutdown()`. One rank misbehaves: its kernel sleeps for ever
(stall), raises, or the process kills itself (rank 1, or rank 0, whose process runs JAX's coordination
service); rank 1 raises in its loop while rank 0 stands still in its own code; or the job cannot form: the
launcher's --port, handed to JAX's coordinator, is taken; a rank (1, or 0) has another world size; a rank
never joins. The watchdog limit is 4 s and the join timeout 15 s, so the module stays fast; the nine
launches run side by side (they mostly wait). Each test checks the exit code, the launcher's verdict (the rank at
fault, by time of fault), the original error in the log, no SIGABRT cascade, and the
time from the fault to the launcher's return (printed with -s).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import pathlib
import re
import socket
import time

import pytest

from nvalchemi_jaxbridge.torch import faults, watchdog
from nvalchemi_jaxbridge.torch.faults import FaultRecord
from nvalchemi_jaxbridge.torch.launch import first_fault
from tests._launch import launch_with_log

WATCHDOG_S, JOIN_S = 4, 15  # a generous join: 14 processes start at once on 2 shared cores
LAUNCHED = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(150)]

# The worker skips the torch package's __init__ (importing torch takes most of a small launch on 2 cores);
# distributed.py, faults.py and watchdog.py import neither torch nor anything from the package's other modules.
WORKER = r'''
import os, pathlib, signal, sys, time, types
root = pathlib.Path(os.environ["PYTHONPATH"].split(os.pathsep)[0])
pkg = types.ModuleType("nvalchemi_jaxbridge.torch")
pkg.__path__ = [str(root / "nvalchemi_jaxbridge" / "torch")]
sys.modules["nvalchemi_jaxbridge.torch"] = pkg
from nvalchemi_jaxbridge.torch import distributed

mode, rank = sys.argv[2], int(os.environ["RANK"])
bad = rank == 1
if mode == "world" and bad or mode == "world0" and rank == 0:
    os.environ["WORLD_SIZE"] = "3"
print("INIT", time.time(), flush=True)
if mode == "join" and bad:
    time.sleep(1000)  # never reaches initialize()
explicit = {}
if mode == "busy":  # the launcher's --port (MASTER_PORT) handed to JAX by hand
    explicit = dict(coordinator_address=f"127.0.0.1:{os.environ['MASTER_PORT']}", num_processes=2, process_id=rank)
distributed.initialize(platform="cpu", timeout_s=int(os.environ["JOIN_S"]),
                       watchdog_s=float(os.environ["WATCHDOG_S"]), **explicit)
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import multihost_utils

def kernel(x):
    if rank == (0 if mode == "kill0" else 1) and step == 2:
        print("FAULT", time.time(), flush=True)
        if mode == "stall":
            time.sleep(1e6)
        if mode == "raise":
            raise RuntimeError("boom in rank 1's kernel")
        if mode in ("kill", "kill0"):
            os.kill(os.getpid(), signal.SIGKILL)
    return np.asarray(x) * 2

op = jax.jit(lambda x: jax.pure_callback(kernel, jax.ShapeDtypeStruct((3,), jnp.float32), x))

def loop():
    global step
    for step in range(4):
        if mode == "raise_stall" and step == 2:  # rank 1 raises in its own code while rank 0 stands still in its own
            print("FAULT", time.time(), flush=True)
            if bad:
                raise RuntimeError("boom in rank 1's loop")
            time.sleep(1e6)
        y = op(jnp.full((3,), float(rank + step), jnp.float32))
        total = multihost_utils.process_allgather(y).sum()
        print("step", step, float(total), flush=True)

try:
    loop()
finally:  # the usual script's shape: leave jax.distributed however the loop ends
    distributed.shutdown()
print("DONE", flush=True)
'''


def _launched(test):
    for mark in LAUNCHED:
        test = mark(test)
    return test


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One launch: exit code, log, seconds from the fault (or from initialize) to the launcher's return."""

    code: int
    log: str
    seconds: float


def _run(tmp: pathlib.Path, mode: str, master_port: int | None = None) -> Outcome:
    worker = tmp / "fault_worker.py"
    worker.write_text(WORKER)
    env = {"WATCHDOG_S": str(WATCHDOG_S), "JOIN_S": str(JOIN_S)}
    code, log = launch_with_log(worker, 2, tmp, [mode], timeout_s=90, env=env, master_port=master_port)
    end = time.time()
    (tmp / "launch.log").write_text(log)
    marks = [float(m) for m in re.findall(r"\] FAULT ([\d.]+)", log)] or \
            [float(m) for m in re.findall(r"\] INIT ([\d.]+)", log)]
    return Outcome(code, log, end - min(marks) if marks else float("nan"))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """All nine launches side by side (each mostly waits for a timeout)."""
    with socket.socket() as taken:  # someone else holds the port given to the launcher's --port
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        cases = {"stall": None, "raise": None, "kill": None, "busy": taken.getsockname()[1], "world": None,
                 "world0": None, "join": None, "raise_stall": None, "kill0": None}
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            futures = {m: pool.submit(_run, tmp_path_factory.mktemp(m), m, port) for m, port in cases.items()}
            got = {m: f.result() for m, f in futures.items()}
    for m, o in got.items():
        print(f"[faults] {m}: exit {o.code} after {o.seconds:.1f} s")
    return got


def _verdict(log: str) -> str:
    lines = [line for line in log.splitlines() if line.startswith("[launch] rank ")]
    assert lines, f"no verdict from the launcher; log:\n{log}"
    return lines[0]


def _no_abort(o: Outcome) -> None:
    assert "Check failure" not in o.log and "SIGABRT" not in o.log and "exited with 134" not in o.log, o.log


@_launched
def test_a_rank_stalled_in_its_kernel_is_named_by_the_watchdog(outcomes):
    o = outcomes["stall"]
    verdict = _verdict(o.log)
    assert re.search(rf"rank 1 failed first: rank 1 has not moved for \d+ s \(limit {WATCHDOG_S} s\) at "
                     r"\S+fault_worker.py:\d+ in kernel while rank 0 waits for it in JAX", verdict), o.log
    assert "[rank 1] [jaxbridge] rank 1 has stalled here:" in o.log and "time.sleep(1e6)" in o.log
    assert o.code in (faults.STALL_EXIT, faults.PEER_EXIT)
    assert o.seconds < WATCHDOG_S + 15, o.seconds
    _no_abort(o)


@_launched
def test_a_rank_that_raises_ends_every_rank_promptly_with_its_error(outcomes):
    o = outcomes["raise"]
    assert "[launch] rank 1 failed first: rank 1 raised RuntimeError: boom in rank 1's kernel" in _verdict(o.log)
    assert "[launch] | RuntimeError: boom in rank 1's kernel" in o.log  # the traceback, repeated
    assert re.search(r"\[rank 0\] \[jaxbridge\] rank 0 exits with 75", o.log) or "rank 0 lost a peer" in o.log
    assert o.code == faults.FAILED_EXIT and o.seconds < 10, (o.code, o.seconds)
    _no_abort(o)


@_launched
def test_a_rank_that_raises_while_its_peer_stands_still_is_named_with_its_error_and_the_peer_with_its_place(
        outcomes):
    """Rank 1 raises in its loop and leaves through shutdown() in a `finally`; rank 0 sleeps in its own code.
    Before: rank 1 waited in shutdown() with its error unsaid, and rank 0 was judged stalled at the limit."""
    o = outcomes["raise_stall"]
    assert "[launch] rank 1 failed first: rank 1 raised RuntimeError: boom in rank 1's loop" in _verdict(o.log), o.log
    assert "[rank 1] RuntimeError: boom in rank 1's loop" in o.log  # its traceback, printed at once
    assert "rank 1 called shutdown() with the exception above in flight" in o.log
    assert re.search(r"\[launch\] rank 0 was at \S+fault_worker.py:\d+ in loop \(in its own code( for \d+ s)?\) when it "
                     "stopped", o.log), o.log
    assert "has not moved" not in o.log  # ended by rank 1's error, not by the stall limit
    assert o.code == faults.FAILED_EXIT and o.seconds < 10, (o.code, o.seconds)
    _no_abort(o)


@_launched
def test_a_killed_rank_is_named_and_the_survivor_leaves_at_once(outcomes):
    o = outcomes["kill"]
    assert _verdict(o.log).startswith("[launch] rank 1 exited with 137 (killed by SIGKILL) first"), o.log
    assert re.search(r"\[rank 0\] \[jaxbridge\] (rank 0 lost its connection to rank 1, whose process is gone|"
                     r"rank 1's process is gone)", o.log), o.log
    assert o.code == 137 and o.seconds < 10, (o.code, o.seconds)
    _no_abort(o)


@_launched
def test_a_killed_rank_0_is_named_by_the_survivor_before_jax_aborts_it(outcomes):
    """Rank 0's process runs JAX's coordination service: JAX aborted the survivors 0.3 s after it died, naming
    no rank; the lifeline names it first."""
    o = outcomes["kill0"]
    assert _verdict(o.log).startswith("[launch] rank 0 exited with 137 (killed by SIGKILL) first"), o.log
    assert re.search(r"\[rank 1\] \[jaxbridge\] (rank 0's process is gone: its connection to rank 1 closed without "
                     r"shutdown\(\)|rank 1 lost its connection to rank 0, whose process is gone)", o.log), o.log
    assert o.code == 137 and o.seconds < 10, (o.code, o.seconds)
    _no_abort(o)


@_launched
def test_a_busy_coordinator_port_is_a_clear_error_on_rank_0(outcomes):
    """`--port P` with P taken, and P passed to initialize(coordinator_address=...) by hand: rank 0 says so.

    (The launcher's --port alone is torch's MASTER_PORT, never JAX's: a busy one does not stop a job,
    see tests/torch/test_torchrun.py::test_start_with_master_port_already_bound.)"""
    o = outcomes["busy"]
    assert _verdict(o.log) == "[launch] rank 0 exited with 1 first; stopping the others", o.log
    assert re.search(r"\[launch\] \| RuntimeError: initialize\(\): the JAX coordinator port \d+ \(of "
                     r"127.0.0.1:\d+\) is already in use on rank 0's host; set JAX_COORDINATOR_PORT", o.log), o.log
    assert o.code == 1 and "exited with 139" not in o.log and o.seconds < 30, (o.code, o.seconds)


@_launched
def test_a_rank_with_another_world_size_is_named(outcomes):
    o = outcomes["world"]
    assert ("[launch] rank 1 failed first: rank 1 raised RuntimeError: initialize(): rank 1 was started with "
            "world size 3 but rank 0 with 2") in _verdict(o.log), o.log
    assert o.code == 1 and o.seconds < 30, (o.code, o.seconds)
    _no_abort(o)


@_launched
def test_rank_0_with_a_larger_world_size_ends_the_job_after_the_join_timeout(outcomes):
    """Rank 0's coordinator waits for 3 processes, only 2 come: the job cannot form; both ranks say why."""
    o = outcomes["world0"]
    assert re.search(rf"\[launch\] rank [01] failed first: initialize\(\): rank [01] waited {JOIN_S} s for all [23] "
                     "processes to join jax.distributed", _verdict(o.log)), o.log
    # whichever rank's join timer ends first (the launcher then stops the other) names the likely cause
    assert re.search(r"different WORLD_SIZE \(this rank: [23]\)", _verdict(o.log)), o.log
    assert o.code == faults.STALL_EXIT and o.seconds < JOIN_S + 20, (o.code, o.seconds)
    _no_abort(o)


@_launched
def test_a_rank_that_never_joins_is_named_after_the_join_timeout(outcomes):
    o = outcomes["join"]
    assert re.search(rf"\[launch\] rank 1 failed first: initialize\(\): rank 0 waited {JOIN_S} s for all 2 "
                     r"processes to join jax.distributed; rank 1 never joined", _verdict(o.log)), o.log
    assert o.code == faults.STALL_EXIT and o.seconds < JOIN_S + 20, (o.code, o.seconds)
    _no_abort(o)


# ------------------------------------------------------------------ the rules, without launching (fast)


class _Stopped(Exception):
    pass


def _stop(record: FaultRecord, code: int) -> None:
    raise _Stopped(record, code)


@pytest.mark.parametrize("beats, blamed", [
    ({0: ("waiting", 9.0), 1: ("busy", 4.0)}, 1),  # rank 1's code stood still while rank 0 waited
    ({0: ("done", 1.0), 1: ("busy", 6.0)}, 1),  # a rank in shutdown() waits too
    ({0: ("waiting", 9.0), 1: ("busy", 3.9)}, None),  # under the limit
    ({0: ("waiting", 99.0), 1: ("waiting", 99.0)}, None),  # a long program: every rank waits in JAX
    ({0: ("busy", 99.0), 1: ("busy", 99.0)}, None),  # nobody waits for anybody
    ({0: ("waiting", 5.0), 1: ("done", 5.0)}, 1),  # rank 1 left early: rank 0 waits in vain
    ({0: ("waiting", 3.0), 1: ("done", 5.0)}, None),  # not for long yet
])
def test_a_stall_is_a_rank_standing_still_in_its_own_code_while_another_waits(monkeypatch, beats, blamed):
    dog = watchdog.Watchdog(None, 0, 2, watchdog_s=4.0)
    monkeypatch.setattr(dog, "_stop_job", _stop)
    hb = {r: json.dumps({"seq": 1, "state": st, "where": "k.py:3 in kernel", "still_s": still})
          for r, (st, still) in beats.items()}
    entries = {"hb": hb, "fail": {}, "done": {}}
    if blamed is None:
        dog._check_stalled(entries, None)
        return
    with pytest.raises(_Stopped) as stopped:
        dog._check_stalled(entries, None)
    record, code = stopped.value.args
    assert (record.blame, record.kind, code) == (blamed, "stalled", faults.PEER_EXIT)
    assert "k.py:3 in kernel" in record.message
    assert record.message.startswith(f"rank {blamed} has not moved for") or "already left" in record.message


def test_a_rank_without_heartbeats_for_the_limit_is_named(monkeypatch):
    dog = watchdog.Watchdog(None, 0, 2, watchdog_s=4.0)
    monkeypatch.setattr(dog, "_stop_job", _stop)
    entries = {"hb": {1: json.dumps({"seq": 7})}, "fail": {}, "done": {}}
    dog._check_silent(entries, 100.0, 4.0)  # first sight of counter 7
    dog._check_silent(entries, 103.9, 4.0)
    with pytest.raises(_Stopped) as stopped:
        dog._check_silent(entries, 104.0, 4.0)
    assert stopped.value.args[0].blame == 1 and "rank 1 sent no heartbeat for 4 s" in stopped.value.args[0].message
    entries["done"][1] = "1"  # a rank that finished is not silent
    dog._check_silent(entries, 200.0, 4.0)


def test_the_launcher_names_the_fault_that_began_first_not_the_first_exit():
    stall = FaultRecord(0, 1, 5.0, "stalled", "rank 1 has not moved")
    assert first_fault([(0, 75, 9.0)], [stall]) == (1, "rank 1 has not moved")  # rank 1 still runs
    raised = FaultRecord(1, 1, 3.0, "raised", "rank 1 raised RuntimeError: x")
    copy = dataclasses.replace(raised, rank=0)  # rank 0 stopped because of it and exited first
    assert first_fault([(0, 75, 3.2), (1, 1, 3.5)], [copy, raised]) == (1, raised.message)
    lost = FaultRecord(0, None, 9.99, "raised", "rank 0 lost a peer's connection")  # a consequence
    assert first_fault([(0, 75, 10.5), (1, -9, 10.01)], [lost]) == (1, None)  # the killed rank
    gone = FaultRecord(0, 1, 9.99, "silent", "rank 1's process is gone")  # the survivor named it first
    assert first_fault([(0, 75, 10.5), (1, -9, 10.01)], [gone]) == (1, None)  # its exit says more (the signal)
    assert first_fault([(2, 3, 1.0), (0, 1, 2.0)], []) == (2, None)  # no records: the first exit


def test_watchdog_limit_from_argument_environment_or_default():
    assert faults.watchdog_seconds(None, {}) == faults.DEFAULT_WATCHDOG_S <= 60
    assert faults.watchdog_seconds(None, {faults.ENV_WATCHDOG: "7.5"}) == 7.5
    assert faults.watchdog_seconds(0, {faults.ENV_WATCHDOG: "7.5"}) == 0
    with pytest.raises(ValueError, match=r"\$NVALCHEMI_JAXBRIDGE_WATCHDOG_S='soon' is not a number of seconds"):
        faults.watchdog_seconds(None, {faults.ENV_WATCHDOG: "soon"})
    with pytest.raises(ValueError, match=r"watchdog_s=-1\) must be >= 0 seconds"):
        faults.watchdog_seconds(-1)


def test_a_rank_that_finds_no_coordinator_names_a_world_size_mismatch_too():
    """Rank 0 started with a larger WORLD_SIZE gives up waiting at about the time a peer does; the peer then
    finds no coordinator, so its record must name that cause too (which record the launcher shows is a race)."""
    from nvalchemi_jaxbridge.torch.faults import join_failure

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rec = join_failure(f"127.0.0.1:{port}", world=2, rank=1, timeout_s=15.0)
    assert rec.blame == 0
    assert "does not answer" in rec.message and "different WORLD_SIZE (this rank: 2)" in rec.message


def _wait_for(cond, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_the_lifeline_names_a_rank_whose_connection_ends_without_goodbye_and_drops_strangers():
    """Rank 0's end: a rank whose connection closes without bye() is lost, one that said bye() is not, and a
    connection without the published token is never taken for a rank."""
    from nvalchemi_jaxbridge.torch.lifeline import Lifeline

    store, lost, lost_here = {}, [], []
    fetch = lambda: store.get("addr")  # noqa: E731
    zero = Lifeline(0, 3, "127.0.0.1", lambda t: store.__setitem__("addr", t), fetch, lost.append).start()
    stranger = socket.create_connection(("127.0.0.1", int(store["addr"].split()[0])))
    stranger.sendall(b"\0" * 20)  # the wrong token, then "rank 0"
    one = Lifeline(1, 3, "127.0.0.1", None, fetch, lost_here.append).start()
    two = Lifeline(2, 3, "127.0.0.1", None, fetch, lambda r: None).start()  # its own end is cut below
    assert _wait_for(lambda: one._sock is not None and two._sock is not None)
    time.sleep(0.3)  # rank 0 has read both hellos
    one.bye()
    one._sock.close()  # rank 1 leaves normally
    stranger.close()
    two._sock.shutdown(socket.SHUT_RDWR)  # rank 2's process "dies"
    assert _wait_for(lambda: lost == [2]), lost
    time.sleep(0.3)
    assert lost == [2] and lost_here == [], (lost, lost_here)  # rank 1 said goodbye: nobody lost
    zero._sock.close()


def test_a_rank_names_rank_0_when_rank_0_s_end_closes():
    from nvalchemi_jaxbridge.torch.lifeline import Lifeline

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        lost = []
        one = Lifeline(1, 2, "127.0.0.1", None, lambda: f"{server.getsockname()[1]} {'ab' * 16}", lost.append)
        one.start()
        conn, _ = server.accept()
        assert conn.recv(20)[:16] == bytes.fromhex("ab" * 16)
        conn.close()  # rank 0's process ends
        assert _wait_for(lambda: lost == [0]), lost


def test_which_exceptions_carried_into_shutdown_are_failures_and_process_liveness():
    assert faults.is_failure(RuntimeError("x")) and faults.is_failure(KeyboardInterrupt())
    assert faults.is_failure(SystemExit(2)) and not faults.is_failure(SystemExit(0))
    assert not faults.is_failure(None) and not faults.is_failure(StopIteration())
    import os
    import subprocess
    import sys

    assert faults.process_alive(os.getpid()) is True
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # reaped: gone
    assert faults.process_alive(p.pid) is False
