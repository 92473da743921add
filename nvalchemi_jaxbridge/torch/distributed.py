"""One process per device: bring up `jax.distributed` from torchrun / SLURM variables.

The engine is JAX's own multi-controller runtime (gloo on the CPU, NCCL on GPU);
this module only finds the coordinator, the process id and the local device.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence

_STATE: dict[str, "ProcessInfo"] = {}


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


def resolve(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_rank: int | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[str | None, int, int, int, str]:
    """(coordinator, world_size, rank, local_rank, source); explicit arguments win over the environment."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env or "RANK" in env:
        source = "torchrun"
        get_world = lambda: _int_env(env, "WORLD_SIZE", source)  # noqa: E731
        get_rank = lambda: _int_env(env, "RANK", source)  # noqa: E731
        get_local = lambda: int(env.get("LOCAL_RANK", "0"))  # noqa: E731

        def get_coord() -> str:
            for name in ("MASTER_ADDR", "MASTER_PORT"):
                if name not in env:
                    raise ValueError(
                        f"initialize(): torchrun launch detected but ${name} is not set; set it, or "
                        "pass coordinator_address='host:port'"
                    )
            return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"

    elif "SLURM_PROCID" in env or "SLURM_NTASKS" in env:
        source = "slurm"
        get_world = lambda: _int_env(env, "SLURM_NTASKS", source)  # noqa: E731
        get_rank = lambda: _int_env(env, "SLURM_PROCID", source)  # noqa: E731
        get_local = lambda: int(env.get("SLURM_LOCALID", "0"))  # noqa: E731

        def get_coord() -> str:
            nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST")
            if not nodes:
                raise ValueError(
                    "initialize(): SLURM launch detected but neither $SLURM_STEP_NODELIST nor "
                    "$SLURM_NODELIST is set; pass coordinator_address='host:port'"
                )
            if "MASTER_PORT" in env:
                port = int(env["MASTER_PORT"])
            else:  # a job-specific port, so two jobs sharing a node do not collide
                port = 29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000
            return f"{first_host(nodes)}:{port}"

    else:
        source = "single"
        get_world = lambda: 1  # noqa: E731
        get_rank = lambda: 0  # noqa: E731
        get_local = lambda: 0  # noqa: E731
        get_coord = lambda: None  # noqa: E731

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
        if source == "single":
            raise ValueError(
                f"initialize(): num_processes={world} but no coordinator: set MASTER_ADDR and "
                "MASTER_PORT, or pass coordinator_address='host:port'"
            )
        coord = get_coord()
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
) -> ProcessInfo:
    """Bring up `jax.distributed` for one process per device.

    Call once, before any JAX computation. Sources, explicit arguments first:
    torchrun (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `LOCAL_RANK`),
    then SLURM (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the first host of
    `SLURM_STEP_NODELIST`/`SLURM_NODELIST`, port `MASTER_PORT` or 29500 + job id
    mod 1000). With world size 1 nothing is started and the same API works.

    On the CPU each process gets one device and gloo collectives; on GPU process
    `LOCAL_RANK` gets GPU `LOCAL_RANK` (torch's current device is set to match).

    Args:
        coordinator_address: "host:port" of process 0's coordinator.
        num_processes: world size.
        process_id: this process's rank.
        local_device_ids: GPU ids this process drives (default `[LOCAL_RANK]`).
        timeout_s: how long to wait for all processes to join.
        platform: "cpu" or "gpu" (default: `$JAX_PLATFORMS`, else GPU if torch sees one).

    Returns:
        The resolved `ProcessInfo`; calling again returns it unchanged.

    Raises:
        ValueError: a needed variable is missing or inconsistent (the message names it).
        RuntimeError: JAX already ran a computation in this process.

    Example:
        >>> info = initialize()   # under `python -m nvalchemi_jaxbridge.torch.launch -n 2 train.py`
    """
    if "info" in _STATE:
        return _STATE["info"]
    import jax
    from jax._src import xla_bridge

    coord, world, rank, local, source = resolve(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
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
        jax.distributed.initialize(
            coordinator_address=coord,
            num_processes=world,
            process_id=rank,
            local_device_ids=ids,
            initialization_timeout=timeout_s,
            heartbeat_timeout_seconds=max(10, timeout_s // 2),
            shutdown_timeout_seconds=max(10, timeout_s // 2),
        )
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
    """Leave `jax.distributed` (a no-op for world size 1)."""
    info = _STATE.pop("info", None)
    if info is not None and info.world_size > 1:
        import jax

        jax.distributed.shutdown()
