"""Fault handling for one process per device: a failure, a stall or a dead rank ends every rank promptly.

`initialize()` starts a `Watchdog` on every rank of a multi-process job. Its
thread publishes a heartbeat in the key-value store of JAX's coordination
service (`jax.distributed`, on rank 0) every second or so: a counter (proof
that the process still runs Python) and where the rank's program is (its
innermost Python frame, and whether that frame is JAX waiting for a
computation or a collective, or the rank's own code). Rank 0 reads every
heartbeat, the others rank 0's (so the store serves O(world) reads a second,
not O(world^2)); every rank reads the fault records. The job ends, naming the
rank, when

- a rank failed: an uncaught exception on any rank is printed, published as a
  fault record, and that rank leaves with `os._exit` instead of waiting in
  `jax.distributed`'s shutdown barrier (which aborts every rank with SIGABRT
  after its timeout); the others see the record within a second and leave too;
- a rank stalled: its position has not changed for `watchdog_s` seconds in its
  own code (e.g. inside a kernel) while another rank waits in JAX for it;
- a rank's process died: named at once through the lifeline to rank 0
  (`torch/lifeline.py`; rank 0 too, before JAX aborts its peers), or when a
  collective loses its connection (the peer's pid on this host, else its heartbeats);
- a rank went silent: no heartbeat for `watchdog_s` seconds (frozen, or holding
  the GIL in native code: such a rank cannot speak, the others notice; 10 s once
  this rank is in `shutdown()`, where it only waits);
- a rank left early: it reached `shutdown()` (or the end of its script) while
  the others have waited in JAX for `watchdog_s` seconds.

`shutdown()` first waits here until every rank has arrived, so JAX's own
shutdown barrier never waits for a rank that failed; called with an exception in
flight (in a `finally`), it ends the job as an uncaught exception does. A rank
that stops because another failed says where its own program was.

A long computation inside one JAX program (a `lax.scan` over many steps) is not
a stall: every rank then waits in JAX. Under the project's launcher each rank
also writes its fault record to `$NVALCHEMI_JAXBRIDGE_FAULT_DIR`, so the
launcher names the rank that failed first in time, not the first to exit
(records and exit codes: `torch/faults.py`).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import sys
import threading
import time
import traceback
from typing import Any

from .faults import (
    ENV_WATCHDOG,
    FAILED_EXIT,
    PEER_EXIT,
    STALL_EXIT,
    FaultRecord,
    ended_processes,
    is_failure,
    peer_lost,
    process_tag,
    say,
    summary,
    write_fault_file,
)
from .lifeline import Lifeline

_PREFIX = "nvalchemi_jaxbridge/watchdog/"
_DONE_SILENT_S = 10.0  # in shutdown(), a peer silent this long is taken for dead (JAX would abort later)
_LINGER_S = 2.0  # rank 0 hosts the key-value store: it stays this long so the others read its record
_RAISE_LIMIT = f"; if that is expected, raise the limit with initialize(watchdog_s=...) or ${ENV_WATCHDOG}"


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a rank's program is: `waiting` in JAX or not, `where` as 'file:line in function'."""

    waiting: bool
    where: str
    key: tuple  # equal keys in two samples: the program did not move


class Watchdog:
    """Heartbeats, fault records and stall detection for one rank (see the module docstring).

    Args:
        client: `jax.distributed`'s client (its key-value store is on rank 0).
        rank: this process's rank.
        world: the number of processes.
        watchdog_s: stall and silence limit in seconds (0: only failures end the job).
        host: where the other ranks reach rank 0 (the JAX coordinator's host), for the lifeline
            (`torch/lifeline.py`) that names a rank whose process died at once; None: no lifeline.
    """

    def __init__(self, client: Any, rank: int, world: int, watchdog_s: float, host: str | None = None):
        import jax
        import jaxlib

        self.client, self.rank, self.world, self.limit = client, rank, world, watchdog_s
        self.interval = min(1.0, watchdog_s / 5) if watchdog_s > 0 else 0.5
        self._jax_dirs = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, jaxlib))
        self._stop = threading.Event()
        self._done = False
        self._seq = 0
        self._last: tuple[tuple, float] | None = None  # (position key, since when)
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (heartbeat counter, when it last changed)
        self._started = time.monotonic()
        self._previous_hook = sys.excepthook
        self._thread = threading.Thread(target=self._run, name="jaxbridge-watchdog", daemon=True)
        self._gone: set[int] = set()  # ranks whose process is known to have ended (no record will come)
        self._stopping = threading.Lock()  # one thread says why the rank stops; another waits for its exit
        self._lifeline = None if host is None else Lifeline(
            rank, world, host, lambda text: self._set("lifeline", text), self._lifeline_address, self._peer_gone)

    # ---------------------------------------------------------------- life cycle
    def start(self) -> Watchdog:
        """Install the excepthook and an atexit `finish`, and start the heartbeat thread."""
        sys.excepthook = self._excepthook
        atexit.register(self.finish)  # runs before JAX's own atexit shutdown (registered earlier)
        self._set(f"proc/{self.rank}", process_tag())  # how peers tell it died
        self._thread.start()
        if self._lifeline is not None:
            self._lifeline.start()
        return self

    def _lifeline_address(self) -> str | None:
        try:
            return self.client.blocking_key_value_get(_PREFIX + "lifeline", 30_000)
        except Exception:  # rank 0 never published it: the heartbeats still watch
            return None

    def finish(self) -> None:
        """Mark this rank done and wait until every rank is (a failure meanwhile ends the process).

        Called with an exception in flight (`shutdown()` in a `finally` or `except` block), the rank has
        failed: the exception is printed and the job ends as for an uncaught one, instead of this rank
        waiting, its error unsaid, for ranks that may never come.
        """
        if self._done or not self._thread.is_alive():
            return
        if is_failure(exc := sys.exception()):
            when = time.time()
            traceback.print_exception(exc)
            say(f"[jaxbridge] rank {self.rank} called shutdown() with the exception above in flight")
            self._raised(exc, when)
        self._done = True
        if self._lifeline is not None:
            self._lifeline.bye()
        self._set(f"done/{self.rank}", "1")
        self._count_done()
        while True:
            fails = self._read("fail")
            if fails is None:
                self._lost_coordinator()  # ends the process, except on rank 0 (the store is its own)
                break
            self._check_failures(fails)
            if self._done_count() >= self.world:
                break
            time.sleep(0.1)
        self._stop.set()
        self._thread.join(timeout=5.0)
        sys.excepthook = self._previous_hook

    # ---------------------------------------------------------------- store
    def _set(self, key: str, value: str) -> bool:
        try:
            self.client.key_value_set(_PREFIX + key, value, allow_overwrite=True)
            return True
        except Exception:  # the coordinator is gone; the caller decides
            return False

    def _read(self, kind: str) -> dict[int, str] | None:
        """{rank: value} of the keys `kind/<rank>`; None if the store cannot be reached."""
        try:
            items = self.client.key_value_dir_get(f"{_PREFIX}{kind}/")
        except Exception:
            return None
        return {int(r): v for k, v in items if (r := k.rsplit("/", 1)[-1]).isdigit()}

    def _get(self, key: str) -> str | None:
        try:
            return self.client.key_value_try_get(_PREFIX + key)
        except Exception:  # not there (yet), or the store is gone
            return None

    def _count_done(self) -> None:
        try:
            self.client.key_value_increment(_PREFIX + "done_count", 1)
        except Exception:
            pass

    def _done_count(self) -> int:
        return int(self._get("done_count") or 0)

    # ---------------------------------------------------------------- where the program is
    def _is_jax(self, frame: Any) -> bool:
        return frame.f_code.co_filename.startswith(self._jax_dirs)

    def _frame_of_interest(self) -> Any:
        """The frame that says what this rank does: the main thread's innermost one, unless that is JAX
        waiting and another thread runs the rank's own code on JAX's behalf (a host callback)."""
        frames = sys._current_frames()
        main = frames.get(threading.main_thread().ident)
        if main is None or not self._is_jax(main):
            return main
        for ident, top in frames.items():
            if ident in (threading.main_thread().ident, threading.get_ident()) or self._is_jax(top):
                continue
            f = top
            while f is not None and not self._is_jax(f):
                f = f.f_back
            if f is not None:  # JAX called into this thread's code: a callback (a kernel)
                return top
        return main

    def _position(self) -> tuple[Position, Any]:
        frame = self._frame_of_interest()
        if frame is None:
            return Position(False, "<no Python frame>", ()), None
        code = frame.f_code
        where = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
        key = (id(frame), frame.f_lasti, frame.f_lineno)
        return Position(self._is_jax(frame), where, key), frame

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            pos, frame = self._position()
            now = time.monotonic()
            if self._last is None or self._last[0] != pos.key:
                self._last = (pos.key, now)
            still = now - self._last[1]
            self._seq += 1
            state = "done" if self._done else "waiting" if pos.waiting else "busy"
            beat = json.dumps({"seq": self._seq, "state": state, "where": pos.where, "still_s": still})
            if not self._set(f"hb/{self.rank}", beat) or (fails := self._read("fail")) is None:
                if not self._stop.is_set():
                    self._lost_coordinator()
                return
            self._check_failures(fails, frame)
            # rank 0 judges every rank (O(world) reads in all); the others watch rank 0 alone
            if self.rank == 0:
                entries = {"hb": self._read("hb") or {}, "done": self._read("done") or {}}
            else:
                entries = {"hb": {0: hb0} if (hb0 := self._get("hb/0")) else {}, "done": {}}
            if self._done:  # only waiting now: a peer that stops beating is dead, not busy
                self._check_silent(entries, now, min(self.limit or _DONE_SILENT_S, _DONE_SILENT_S))
            elif self.limit > 0:
                self._check_silent(entries, now, self.limit)
            if self.limit > 0 and self.rank == 0:
                self._check_stalled(entries, frame)

    def _lost_coordinator(self) -> None:
        from jax._src import distributed as jax_distributed

        if self.rank == 0 or jax_distributed.global_state.client is not self.client:
            return  # the store is in this process (JAX reports its own failure), or jax.distributed was left
        self._stop_job(FaultRecord(self.rank, 0, time.time(), "silent",
                                   f"rank {self.rank} lost the JAX coordinator (rank 0's process): rank 0 "
                                   "ended or its host is unreachable; see rank 0's log"), PEER_EXIT)

    def _check_failures(self, fails: dict[int, str], frame: Any = None) -> None:
        """Stop if another rank published a fault (the one that began first, a known culprit preferred)."""
        records = [FaultRecord.from_json(v) for r, v in fails.items() if r != self.rank]
        if not records:
            return
        first = min(records, key=lambda r: (r.blame is None, r.time))
        code = PEER_EXIT
        if first.blame == self.rank and first.kind == "stalled":  # rank 0 judged this rank stalled
            code = STALL_EXIT
            if frame is not None:
                say(f"[jaxbridge] rank {self.rank} has stalled here:\n" + _stack(frame))
        # where the main thread is, seen from another thread (in the excepthook it is where it raised)
        where = self._where() if threading.current_thread() is not threading.main_thread() else ""
        self._stop_job(dataclasses.replace(first, rank=self.rank, where=where), code)

    def _where(self) -> str:
        """Where this rank's program is, for a record, and for how long when a heartbeat has seen it there
        (a peer can fail before this rank's first heartbeat: the place is still worth saying)."""
        pos, _ = self._position()
        what = "waiting in JAX" if pos.waiting else "in its own code"
        if self._last is None or self._last[0] != pos.key:
            return f"{pos.where} ({what})"
        return f"{pos.where} ({what} for {time.monotonic() - self._last[1]:.0f} s)"

    def _peer_gone(self, r: int) -> None:
        """Rank `r`'s process ended without goodbye (`torch/lifeline.py`): name it and end the job."""
        if self._stop.is_set():
            return
        if r != 0:  # rank 0 reads its own store: did `r` leave a record, or finish?
            if r in (fails := self._read("fail") or {}):
                self._check_failures(fails)
            if r in (self._read("done") or {}):
                return
        self._gone.add(r)
        other = "rank 0" if r != 0 else f"rank {self.rank}"
        message = (f"rank {r}'s process is gone: its connection to {other} closed without shutdown() (killed, "
                   f"crashed, out of memory; see rank {r}'s log)")
        self._stop_job(FaultRecord(self.rank, r, time.time(), "silent", message, where=self._where()), PEER_EXIT,
                       publish=r != 0)  # rank 0's store went with it

    def _dead_peers(self) -> list[int]:
        """The other ranks (not done) whose process is gone: by pid on this host (a killed process's sockets
        may close before it ends: looked at for up to a second), else by heartbeats that stopped (about two
        heartbeats). Rank 0 if the store (in rank 0's process) cannot be reached."""
        procs, done = self._read("proc"), self._read("done") or {}
        if procs is None:
            return [0] if self.rank != 0 else []
        tags = {r: v for r, v in procs.items() if r != self.rank and r not in done}
        before = self._read("hb") or {}
        deadline = time.monotonic() + max(1.0, 2.5 * self.interval)
        while True:
            dead, unknown = ended_processes(tags)
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if unknown and not dead:
            after = self._read("hb") or {}
            dead = [r for r in unknown if r in before and after.get(r) == before[r]]
        return sorted(dead)

    def _check_silent(self, entries: dict[str, dict[int, str]], now: float, limit: float) -> None:
        for r in range(self.world) if self.rank == 0 else (0,):
            if r == self.rank or r in entries["done"]:
                continue
            seq = json.loads(entries["hb"][r])["seq"] if r in entries["hb"] else -1
            last = self._seen.get(r)
            if last is None or last[0] != seq:  # a rank never heard from counts from our start
                self._seen[r] = (seq, now if last is not None or seq >= 0 else self._started)
                continue
            if now - last[1] >= limit:
                self._stop_job(FaultRecord(self.rank, r, time.time() - (now - last[1]), "silent",
                                           f"rank {r} sent no heartbeat for {now - last[1]:.0f} s (limit "
                                           f"{limit:g} s): it was killed, is frozen, or holds the GIL in "
                                           f"native code{_RAISE_LIMIT}"), PEER_EXIT)

    def _check_stalled(self, entries: dict[str, dict[int, str]], frame: Any) -> None:
        beats = {r: json.loads(v) for r, v in entries["hb"].items()}
        stalled = sorted(r for r, b in beats.items() if b["state"] == "busy" and b["still_s"] >= self.limit)
        waiting = sorted(r for r, b in beats.items() if b["state"] != "busy")
        if stalled and waiting:
            r, b = stalled[0], beats[stalled[0]]
            message = (f"rank {r} has not moved for {b['still_s']:.0f} s (limit {self.limit:g} s) at {b['where']} "
                       f"while rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} wait"
                       f"{'' if len(waiting) > 1 else 's'} for it in JAX{_RAISE_LIMIT}")
            if r == self.rank and frame is not None:
                say(f"[jaxbridge] rank {r} has stalled here:\n" + _stack(frame))
            code = STALL_EXIT if r == self.rank else PEER_EXIT
            self._stop_job(FaultRecord(self.rank, r, time.time() - b["still_s"], "stalled", message), code)
        done = sorted(r for r, b in beats.items() if b["state"] == "done")
        stuck = sorted(r for r, b in beats.items() if b["state"] == "waiting" and b["still_s"] >= self.limit)
        if done and stuck and len(done) + len(stuck) == self.world:  # the ranks still in wait for ones that left
            r, b = done[0], beats[stuck[0]]
            message = (f"rank {stuck[0]} has waited in JAX for {b['still_s']:.0f} s (limit {self.limit:g} s) at "
                       f"{b['where']} while rank {', '.join(map(str, done))} already left (shutdown() or the end "
                       "of its script): a rank left early (sys.exit on one rank?) or the ranks ran different "
                       f"numbers of steps{_RAISE_LIMIT}")
            code = STALL_EXIT if r == self.rank else PEER_EXIT
            self._stop_job(FaultRecord(self.rank, r, time.time() - b["still_s"], "stalled", message), code)

    # ---------------------------------------------------------------- ending the job
    def _excepthook(self, etype: type[BaseException], value: BaseException, tb: Any) -> None:
        """Print the error as Python does, then end this rank at once and tell the others."""
        when = time.time()
        self._previous_hook(etype, value, tb)
        self._raised(value, when)

    def _raised(self, value: BaseException, when: float) -> None:
        """End the job for an exception this rank raised at `when` (already printed), naming its cause."""
        if (fails := self._read("fail")) is not None:
            self._check_failures(fails)  # this error follows another rank's: name that one
        text = "".join(traceback.format_exception_only(type(value), value)).strip()
        line = summary(text, type(value).__name__)
        if peer_lost(text):  # a consequence: the peer that vanished is at fault
            dead = self._dead_peers()
            self._gone.update(dead)
            if dead:
                who = f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))}"
                message = (f"rank {self.rank} lost its connection to {who}, whose process is gone (killed, "
                           f"crashed, out of memory; see its log) ({line})")
            else:
                message = f"rank {self.rank} lost a peer's connection ({line})"
            self._stop_job(FaultRecord(self.rank, dead[0] if dead else None, when, "silent" if dead else "raised",
                                       message), PEER_EXIT)
        self._stop_job(FaultRecord(self.rank, self.rank, when, "raised", f"rank {self.rank} raised {line}"),
                       FAILED_EXIT)

    def _stop_job(self, record: FaultRecord, code: int, *, publish: bool = True) -> None:
        """Publish `record` (unless the store is gone), leave it for the launcher, say it, and `os._exit(code)`
        (no shutdown barrier). A second caller, on another thread, waits for the first one's exit."""
        if not self._stopping.acquire(blocking=False):
            while True:
                time.sleep(1.0)
        self._stop.set()
        if publish:
            self._set(f"fail/{self.rank}", record.to_json())
        write_fault_file(record)
        here = f"\n[jaxbridge] rank {self.rank} was at {record.where} when it stopped" if record.where else ""
        say(f"[jaxbridge] {record.message}{here}\n[jaxbridge] rank {self.rank} exits with {code} at once: "
             "every rank stops (jax.distributed's shutdown barrier would wait for the failed rank in vain)")
        if self.rank == 0:  # the others read the store in this process: give them a moment
            deadline = time.monotonic() + _LINGER_S
            while time.monotonic() < deadline:
                fails = self._read("fail")
                if fails is None or len(fails.keys() | self._gone) + self._done_count() >= self.world:
                    break
                time.sleep(0.05)
        os._exit(code)


def _stack(frame: Any) -> str:
    return "".join(traceback.format_stack(frame)).rstrip()
