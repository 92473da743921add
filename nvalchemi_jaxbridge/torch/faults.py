"""What the ranks and the launcher say when a multi-process job goes wrong: fault records and exit codes.

A `FaultRecord` says which rank stops, which rank is at fault and since when. The
ranks' watchdog (`torch/watchdog.py`) publishes records in JAX's key-value store
and, under the project's launcher, leaves them in `$NVALCHEMI_JAXBRIDGE_FAULT_DIR`,
where the launcher (`torch/launch.py`) reads them to name the rank that failed
first in time. Also here: the checks `initialize()` makes while the job forms (a
rank that cannot join in time exits with a reason before JAX aborts it; every
rank's world size is rank 0's). Importing this module imports neither jax nor torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping

ENV_WATCHDOG = "NVALCHEMI_JAXBRIDGE_WATCHDOG_S"
ENV_FAULT_DIR = "NVALCHEMI_JAXBRIDGE_FAULT_DIR"
DEFAULT_WATCHDOG_S = 60.0
FAILED_EXIT = 1  # this rank raised (Python's own code for an uncaught exception)
PEER_EXIT = 75  # this rank stopped because another rank failed, stalled or died
STALL_EXIT = 124  # this rank stalled, or timed out waiting for the others to join
_WORLD_KEY = "nvalchemi_jaxbridge/world_size"
# gloo's words when the peer's socket closed: the error is a consequence, the peer is the cause
_PEER_LOST = ("reset by peer", "closed by peer", "Broken pipe", "Connection refused")


@dataclasses.dataclass(frozen=True)
class FaultRecord:
    """Why a rank stops: `blame` is the rank at fault (None: unknown), `time` when the fault began."""

    rank: int
    blame: int | None
    time: float
    kind: str  # "raised", "stalled", "silent" or "join"
    message: str
    where: str = ""  # where this rank's program was when it stopped because of another rank ("": not known)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FaultRecord:
        return cls(**json.loads(text))


def watchdog_seconds(value: float | None, env: Mapping[str, str] | None = None) -> float:
    """The stall limit: `value`, else `$NVALCHEMI_JAXBRIDGE_WATCHDOG_S`, else 60 s; 0 turns stall detection off."""
    env = os.environ if env is None else env
    if value is None and env.get(ENV_WATCHDOG):
        try:
            value = float(env[ENV_WATCHDOG])
        except ValueError:
            raise ValueError(
                f"$NVALCHEMI_JAXBRIDGE_WATCHDOG_S={env[ENV_WATCHDOG]!r} is not a number of seconds; set it to "
                "e.g. 60, or 0 to turn stall detection off"
            ) from None
    value = DEFAULT_WATCHDOG_S if value is None else float(value)
    if value < 0:
        raise ValueError(f"initialize(watchdog_s={value:g}) must be >= 0 seconds (0 turns stall detection off)")
    return value


def write_fault_file(record: FaultRecord, env: Mapping[str, str] | None = None) -> None:
    """Leave `record` for the launcher in `$NVALCHEMI_JAXBRIDGE_FAULT_DIR` (nothing if unset); the first one stays."""
    folder = (os.environ if env is None else env).get(ENV_FAULT_DIR)
    if not folder:
        return
    path = pathlib.Path(folder) / f"rank{record.rank}.json"
    if path.exists():
        return
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(record.to_json())
        tmp.replace(path)
    except OSError:
        pass  # the record only improves the launcher's message


def read_fault_files(folder: str | os.PathLike) -> list[FaultRecord]:
    """The records ranks left in `folder`, earliest fault first."""
    records = []
    for path in pathlib.Path(folder).glob("rank*.json"):
        try:
            records.append(FaultRecord.from_json(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(records, key=lambda r: r.time)


def peer_lost(message: str) -> bool:
    """Whether an error only says a peer's connection dropped (the peer is the cause)."""
    return any(words in message for words in _PEER_LOST)


def process_alive(pid: int) -> bool | None:
    """Whether process `pid` on this host still runs (a zombie does not); None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[-1].split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return None
    return state not in ("Z", "X")


def process_tag() -> str:
    """'host pid' of this process, which peers on the same host read to tell whether it still runs."""
    return f"{socket.gethostname()} {os.getpid()}"


def ended_processes(tags: Mapping[int, str]) -> tuple[list[int], list[int]]:
    """(ranks whose process has ended, ranks that cannot be told from here: another host, or no /proc) of
    `{rank: process_tag()}`."""
    host, ended, unknown = socket.gethostname(), [], []
    for r, tag in sorted(tags.items()):
        name, _, pid = tag.partition(" ")
        alive = process_alive(int(pid)) if name == host and pid.isdigit() else None
        if alive is not True:
            (ended if alive is False else unknown).append(r)
    return ended, unknown


def is_failure(exc: BaseException | None) -> bool:
    """Whether an exception a rank carries into `shutdown()` (in a `finally` or `except` block) is a failure:
    an `Exception` or `KeyboardInterrupt`, or `SystemExit` with an error code; not the end of an iteration."""
    if exc is None or isinstance(exc, (StopIteration, StopAsyncIteration)):
        return False
    if isinstance(exc, SystemExit):
        return exc.code not in (None, 0)
    return isinstance(exc, (Exception, KeyboardInterrupt))


def say(text: str) -> None:
    """One line on stderr, flushed with stdout (the process may `os._exit` right after)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        sys.stderr.write(text.rstrip("\n") + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def summary(text: str, outer: str) -> str:
    """The error's line that names it: the innermost 'SomeError: ...' line of a wrapped traceback (a kernel's
    error inside JAX's callback error), with the wrapper's type; else the first line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return outer
    named = [line for line in lines[1:] if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b:?", line)]
    return f"{named[-1]} (inside {outer})" if named else lines[0]


def exit_after(seconds: float, record: Callable[[], FaultRecord], code: int) -> threading.Timer:
    """A started timer that, unless cancelled within `seconds`, says `record()`, leaves it for the launcher
    and ends the process with `code` (before JAX's own timeout aborts it with SIGABRT)."""

    def expire() -> None:
        r = record()
        write_fault_file(r)
        say(f"[jaxbridge] {r.message}\n[jaxbridge] rank {r.rank} exits with {code}")
        os._exit(code)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer


def check_world_size(client, world: int, rank: int, timeout_s: float) -> None:
    """Every rank's world size is rank 0's (the size JAX's coordinator serves), else a RuntimeError."""
    if rank == 0:
        client.key_value_set(_WORLD_KEY, str(world), allow_overwrite=True)
        return
    theirs = int(client.blocking_key_value_get(_WORLD_KEY, int(timeout_s * 1000)))
    if theirs != world:
        raise RuntimeError(
            f"initialize(): rank {rank} was started with world size {world} but rank 0 with {theirs} "
            f"(jax.distributed serves {theirs} processes); start every rank with the same WORLD_SIZE "
            "(or num_processes=)"
        )


def join_failure(coord: str, world: int, rank: int, timeout_s: float) -> FaultRecord:
    """Why `rank` is still not in the job `timeout_s` after calling jax.distributed.initialize()."""
    blame = None
    if rank == 0:
        others = "rank 1" if world == 2 else f"some of ranks 1..{world - 1}"
        blame = 1 if world == 2 else None
        why = (f"{others} never joined: it failed or is slow before initialize() (see its log), was started with "
               f"a different WORLD_SIZE (this rank: {world}), or cannot reach {coord}")
    elif not _reachable(coord):
        # Rank 0 may also have come and gone: started with another WORLD_SIZE, it waited for ranks that
        # never came and gave up at about the time this rank does.
        blame, why = 0, (f"rank 0's coordinator at {coord} does not answer: rank 0 failed before initialize() "
                         "or has not reached it (see rank 0's log), or it gave up waiting, having been started "
                         f"with a different WORLD_SIZE (this rank: {world})")
    else:
        why = (f"rank 0's coordinator at {coord} answers but not every rank joined: one failed or is slow before "
               f"initialize() (see its log), or rank 0 was started with a different WORLD_SIZE (this rank: {world})")
    return FaultRecord(
        rank, blame, time.time() - timeout_s, "join",
        f"initialize(): rank {rank} waited {timeout_s:g} s for all {world} processes to join jax.distributed; "
        f"{why}; give it longer with initialize(timeout_s=...)")


def _reachable(coord: str) -> bool:
    """Whether something accepts TCP connections at 'host:port'."""
    host, _, port = coord.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
        return True
    except (OSError, ValueError):
        return False
