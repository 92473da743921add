"""One process per device: bring up `jax.distributed` from torchrun / SLURM variables.

The engine is JAX's own multi-controller runtime (gloo on the CPU, NCCL on GPU);
this module only finds the coordinator, the process id and the local device.

Where JAX's coordinator listens (process 0 binds `[::]:port`), first match wins:

1. `coordinator_address=` passed to `initialize`.
2. `$JAX_COORDINATOR_ADDRESS`, then `$JAX_COORDINATOR_PORT` on the job's host
   (`MASTER_ADDR`, or the first SLURM host): the variables JAX itself reads.
3. torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`): torchrun's agent store already
   listens on `MASTER_PORT`, so rank 0 picks a free port and publishes
   `MASTER_ADDR:port` in that store under a key of `TORCHELASTIC_RUN_ID` and
   `TORCHELASTIC_RESTART_COUNT` (a restarted job never reads an old value);
   the other ranks read it. No port is fixed in advance, so none can collide.
4. Other launchers setting `RANK`/`WORLD_SIZE`: `MASTER_ADDR:MASTER_PORT+1`, as
   `MASTER_PORT` is `torch.distributed`'s own. The project's launcher
   (`torch/launch.py`) sets `JAX_COORDINATOR_PORT` to a free port, so 2 applies.
5. SLURM (`srun`, no torchrun variables): what JAX's own SLURM detection gives,
   the first host of `SLURM_STEP_NODELIST` and port 61440 + `SLURM_JOB_ID` % 4096.

Rank 0 test-binds the port first: a busy port is an error naming the fix, not
the segfault gRPC gives. Every rank of a multi-process job then runs a watchdog
(`torch/watchdog.py`): a rank that raises, stalls, dies or never joins ends the
job promptly, and the message names it. Under `srun torchrun` the torchrun variables win, and
JAX's cluster detection is switched off so SLURM's cannot override them.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import inspect
import os
import re
import socket
from collections.abc import Mapping, Sequence

if __package__:
    from . import faults, watchdog
else:  # this file loaded alone, without the torch package (tests/torch/torchrun_worker.py skips importing torch)
    import importlib
    import pathlib
    import sys
    import types

    _siblings = sys.modules.setdefault("_jaxbridge_torch_files", types.ModuleType("_jaxbridge_torch_files"))
    _siblings.__path__ = [str(pathlib.Path(__file__).parent)]  # its siblings by path, the package's __init__ skipped
    faults = importlib.import_module("_jaxbridge_torch_files.faults")
    watchdog = importlib.import_module("_jaxbridge_torch_files.watchdog")

_STATE: dict[str, object] = {}  # "info": this process's ProcessInfo, "watchdog": its Watchdog
SLURM_PORT_BASE = 61440  # JAX's SLURM detector: the top 4096 ports, offset by the job id
_KEY = "nvalchemi_jaxbridge/jax_coordinator"
JOIN_MARGIN_S = 10  # JAX's own join and heartbeat timeouts end this much later than ours, so ours speak first


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Who this process is in the job, as `initialize` resolved it."""

    rank: int
    world_size: int
    local_rank: int
    coordinator_address: str | None
    platform: str  # "cpu" or "gpu"
    source: str  # "explicit", "torchrun", "slurm" or "single"


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'a[3-5,7],b1' -> 'a3', 'n01,n02' -> 'n01'."""
    nodelist = nodelist.strip()
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if m is None or not m.group(1):
        raise ValueError(
            f"cannot read the first host of SLURM node list {nodelist!r}; pass "
            "coordinator_address='host:port' to initialize() instead"
        )
    prefix, ranges = m.group(1), m.group(3)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def slurm_port(job_id: int) -> int:
    """The coordinator port JAX's SLURM detection uses for a job: 61440 + job id mod 4096."""
    return SLURM_PORT_BASE + job_id % 4096


def _int_env(env: Mapping[str, str], name: str, source: str) -> int:
    """An integer environment variable, or a ValueError naming it."""
    if name not in env:
        raise ValueError(
            f"initialize(): {source} launch detected but ${name} is not set; set it, or pass "
            "coordinator_address=, num_processes= and process_id= explicitly"
        )
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"initialize(): ${name}={env[name]!r} is not an integer") from None


def _port_override(env: Mapping[str, str], host: str) -> str | None:
    """`host:$JAX_COORDINATOR_PORT` if that is set, else None."""
    port = env.get("JAX_COORDINATOR_PORT")
    if not port:
        return None
    if not port.isdigit():
        raise ValueError(f"initialize(): $JAX_COORDINATOR_PORT={port!r} is not an integer")
    return f"{host}:{port}"


def coordinator_key(env: Mapping[str, str]) -> str:
    """The torchrun-store key for this run and restart (`TORCHELASTIC_RUN_ID`, `..._RESTART_COUNT`)."""
    run = env.get("TORCHELASTIC_RUN_ID", "none")
    return f"{_KEY}/{run}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def free_port() -> int:
    """A TCP port free on every local address a moment ago (what JAX's `[::]:port` bind needs)."""
    with _wildcard_socket(0) as s:
        return s.getsockname()[1]


def _wildcard_socket(port: int) -> socket.socket:
    """A socket bound to `port` on all addresses (IPv6 dual-stack where there is IPv6); OSError if busy."""
    try:
        return _bound(socket.AF_INET6, "::", port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise
    return _bound(socket.AF_INET, "0.0.0.0", port)  # a host without IPv6


def _bound(family: socket.AddressFamily, addr: str, port: int) -> socket.socket:
    """A TCP socket of `family` bound to (addr, port), SO_REUSEADDR as gRPC sets it (TIME_WAIT is free)."""
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind((addr, port))
    except OSError:
        s.close()
        raise
    return s


def _check_port_free(coord: str) -> None:
    """On rank 0: the coordinator's port can be bound here, else a RuntimeError naming the fix."""
    port = coord.rsplit(":", 1)[-1]
    if not port.isdigit():
        return  # not ours to judge; JAX reports a malformed address
    port = int(port)
    try:
        _wildcard_socket(port).close()
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            return  # not a conflict we can diagnose; let JAX report it
        raise RuntimeError(
            f"initialize(): the JAX coordinator port {port} (of {coord}) is already in use on rank 0's "
            "host; set JAX_COORDINATOR_PORT to a free port (the same on every rank) or pass "
            "coordinator_address='host:port'"
        ) from None


def _torchrun_store(env: Mapping[str, str], timeout_s: float):
    """A client of torchrun's agent store at MASTER_ADDR:MASTER_PORT."""
    from torch.distributed import TCPStore

    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    try:
        return TCPStore(host, port, is_master=False, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise RuntimeError(
            f"initialize(): cannot reach torchrun's store at {host}:{port} ($MASTER_ADDR:$MASTER_PORT) to "
            f"share the JAX coordinator address ({str(e).splitlines()[0]}); check that MASTER_ADDR "
            "resolves on this node, or skip the store: set JAX_COORDINATOR_PORT to a free port (the same "
            "on every rank) or pass coordinator_address='host:port'"
        ) from None


def _torchrun_coordinator(env: Mapping[str, str], rank: int, timeout_s: float) -> str:
    """Rank 0 publishes MASTER_ADDR:<free port> in torchrun's store; the others read it."""
    store, key = _torchrun_store(env, timeout_s), coordinator_key(env)
    if rank == 0:
        coord = f"{env['MASTER_ADDR']}:{free_port()}"
        store.set(key, coord)
        return coord
    try:
        return store.get(key).decode()
    except RuntimeError:
        raise RuntimeError(
            f"initialize(): rank {rank} waited {timeout_s:g} s for rank 0 to publish the JAX coordinator "
            f"address in torchrun's store ({env['MASTER_ADDR']}:{env['MASTER_PORT']}, key {key!r}); rank 0 "
            "failed or has not reached initialize(): check rank 0's log first, call initialize() on every "
            "rank, or give it longer with initialize(timeout_s=...)"
        ) from None


def resolve(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_rank: int | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60,
) -> tuple[str | None, int, int, int, str]:
    """(coordinator, world_size, rank, local_rank, source); explicit arguments win over the environment.

    The coordinator follows the order in the module docstring; under torchrun
    this talks to torchrun's store (rank 0 writes, the others wait up to `timeout_s`).
    """
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env or "RANK" in env:  # torchrun, also under srun: its variables win
        source = "torchrun"
        get_world = lambda: _int_env(env, "WORLD_SIZE", source)  # noqa: E731
        get_rank = lambda: _int_env(env, "RANK", source)  # noqa: E731
        get_local = lambda: int(env.get("LOCAL_RANK", "0"))  # noqa: E731

        def get_coord(rank: int) -> str:
            for name in ("MASTER_ADDR", "MASTER_PORT"):
                if name not in env:
                    raise ValueError(
                        f"initialize(): torchrun launch detected but ${name} is not set; set it, or "
                        "pass coordinator_address='host:port'"
                    )
            if (coord := _port_override(env, env["MASTER_ADDR"])) is not None:
                return coord
            if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                return _torchrun_coordinator(env, rank, timeout_s)
            return f"{env['MASTER_ADDR']}:{_int_env(env, 'MASTER_PORT', source) + 1}"

    elif "SLURM_PROCID" in env or "SLURM_NTASKS" in env:
        source = "slurm"
        get_world = lambda: _int_env(env, "SLURM_NTASKS", source)  # noqa: E731
        get_rank = lambda: _int_env(env, "SLURM_PROCID", source)  # noqa: E731
        get_local = lambda: int(env.get("SLURM_LOCALID", "0"))  # noqa: E731

        def get_coord(rank: int) -> str:
            nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST")
            if not nodes:
                raise ValueError(
                    "initialize(): SLURM launch detected but neither $SLURM_STEP_NODELIST nor "
                    "$SLURM_NODELIST is set; pass coordinator_address='host:port'"
                )
            host = first_host(nodes)
            override = _port_override(env, host)
            return override or f"{host}:{slurm_port(_int_env(env, 'SLURM_JOB_ID', source))}"

    else:
        source = "single"
        get_world = lambda: 1  # noqa: E731
        get_rank = lambda: 0  # noqa: E731
        get_local = lambda: 0  # noqa: E731
        get_coord = lambda rank: None  # noqa: E731

    explicit = [coordinator_address, num_processes, process_id]
    if any(v is not None for v in explicit):
        source = "explicit" if all(v is not None for v in explicit) else source
    world = num_processes if num_processes is not None else get_world()
    rank = process_id if process_id is not None else get_rank()
    local = local_rank if local_rank is not None else get_local()
    if world < 1 or not 0 <= rank < world:
        raise ValueError(
            f"initialize(): process id {rank} is outside 0..{world - 1} (world size {world}); "
            "check RANK/WORLD_SIZE (or SLURM_PROCID/SLURM_NTASKS)"
        )
    coord = coordinator_address
    if coord is None and world > 1:
        coord = env.get("JAX_COORDINATOR_ADDRESS") or None
    if coord is None and world > 1:
        if source == "single":
            raise ValueError(
                f"initialize(): num_processes={world} but no coordinator: pass "
                "coordinator_address='host:port' (or set $JAX_COORDINATOR_ADDRESS), or launch with "
                "torchrun / srun, whose variables name one"
            )
        coord = get_coord(rank)
    return coord, world, rank, local, source


def _platform(platform: str | None) -> str:
    """'cpu' or 'gpu': explicit, else from $JAX_PLATFORMS, else whether torch sees a GPU."""
    if platform is not None:
        if platform not in ("cpu", "gpu"):
            raise ValueError(f"initialize(platform=...) must be 'cpu' or 'gpu', got {platform!r}")
        return platform
    want = os.environ.get("JAX_PLATFORMS", "").lower()
    if want:
        return "cpu" if want.split(",")[0] == "cpu" else "gpu"
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def initialize(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    timeout_s: int = 60,
    platform: str | None = None,
    watchdog_s: float | None = None,
) -> ProcessInfo:
    """Bring up `jax.distributed` for one process per device.

    Call once, before any JAX computation. Sources, explicit arguments first:
    torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`), then SLURM
    (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`). The coordinator port is
    never `MASTER_PORT` (torch's store holds it): `$JAX_COORDINATOR_PORT` if set,
    under torchrun a free port rank 0 publishes through torchrun's store, under
    SLURM JAX's own choice (first host of `SLURM_STEP_NODELIST`, 61440 +
    `SLURM_JOB_ID` % 4096); see the module docstring for the full order. With
    world size 1 nothing is started and the same API works.

    On the CPU each process gets one device and gloo collectives; on GPU process
    `LOCAL_RANK` gets GPU `LOCAL_RANK` (passed explicitly, also under `srun
    torchrun`; torch's current device is set to match).

    Args:
        coordinator_address: "host:port" of process 0's coordinator.
        num_processes: world size.
        process_id: this process's rank.
        local_device_ids: GPU ids this process drives (default `[LOCAL_RANK]`).
        timeout_s: how long to wait for all processes to join (and for rank 0's address).
        platform: "cpu" or "gpu" (default: `$JAX_PLATFORMS`, else GPU if torch sees one).
        watchdog_s: a rank whose program has not moved for this long in its own code while
            another waits for it, or that sent no heartbeat for this long, ends the job naming
            it (default `$NVALCHEMI_JAXBRIDGE_WATCHDOG_S`, else 60; 0 turns stall detection
            off). Whatever the limit, an uncaught exception on any rank ends every rank within
            about a second (see `torch/watchdog.py`).

    Returns:
        The resolved `ProcessInfo`; calling again returns it unchanged.

    Raises:
        ValueError: a needed variable is missing or inconsistent (the message names it).
        RuntimeError: JAX already ran a computation in this process; the coordinator
            port is busy; torchrun's store is unreachable or rank 0 never published; this
            rank's world size differs from rank 0's. A rank that cannot join within
            `timeout_s` prints why and exits with code 124 (JAX would abort it later).

    Example:
        >>> info = initialize()   # under `torchrun --nproc-per-node 2 train.py`
    """
    if "info" in _STATE:
        return _STATE["info"]
    import jax
    from jax._src import distributed as jax_distributed
    from jax._src import xla_bridge

    coord, world, rank, local, source = resolve(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
        timeout_s=timeout_s,
    )
    plat = _platform(platform)
    if world > 1 and xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "initialize() must run before any JAX computation or device query in this process "
            "(jax.distributed cannot join a running backend); move it to the top of the script"
        )
    if plat == "cpu":
        if not xla_bridge.backends_are_initialized():
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", 1)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        ids = None
    else:
        import torch

        ids = list(local_device_ids) if local_device_ids is not None else [local]
        torch.cuda.set_device(ids[0])
    if world > 1:
        if rank == 0:
            _check_port_free(coord)
        extra = {}
        if "cluster_detection_method" in inspect.signature(jax.distributed.initialize).parameters:
            extra["cluster_detection_method"] = "deactivate"  # our values stand; SLURM's must not fill in
        limit = faults.watchdog_seconds(watchdog_s)
        timer = faults.exit_after(timeout_s, lambda: faults.join_failure(coord, world, rank, timeout_s),
                                  faults.STALL_EXIT)
        try:
            jax.distributed.initialize(
                coordinator_address=coord,
                num_processes=world,
                process_id=rank,
                local_device_ids=ids,
                initialization_timeout=timeout_s + JOIN_MARGIN_S,  # ours ends the rank first, with a reason
                # JAX aborts every rank on a missed heartbeat: later than the watchdog, which names the rank
                heartbeat_timeout_seconds=max(10, timeout_s // 2, int(limit) + JOIN_MARGIN_S),
                shutdown_timeout_seconds=max(10, timeout_s // 2),
                **extra,
            )
        finally:
            timer.cancel()
        client = jax_distributed.global_state.client
        if client is not None:  # None only where a test stands in for jax.distributed
            _STATE["watchdog"] = watchdog.Watchdog(client, rank, world, limit,
                                                          host=coord.rsplit(":", 1)[0].strip("[]")).start()
            faults.check_world_size(client, world, rank, timeout_s)
    info = ProcessInfo(rank, world, local, coord, plat, source)
    _STATE["info"] = info
    return info


def process_info() -> ProcessInfo:
    """This process's `ProcessInfo`; world size 1 if `initialize` was never called."""
    if "info" in _STATE:
        return _STATE["info"]
    import jax

    return ProcessInfo(jax.process_index(), jax.process_count(), 0, None, "cpu", "single")


def shutdown() -> None:
    """Leave `jax.distributed` (a no-op for world size 1).

    This rank first waits until every rank has arrived here; if another rank fails,
    stalls or dies meanwhile, the process exits at once (code 75, see `torch/faults.py`)
    instead of waiting in JAX's shutdown barrier for a rank that will never come.
    """
    info = _STATE.pop("info", None)
    guard = _STATE.pop("watchdog", None)
    if guard is not None:
        guard.finish()
    if info is not None and info.world_size > 1:
        import jax

        jax.distributed.shutdown()
