"""A plan as this process sees it on the torch front door: rank, counts, mesh, device tables.

Each process owns one JAX device, and the front door's mesh holds the first
local device of every process, by rank (`front_door_mesh`). `context_for(plan)`
checks a `HaloPlan` / `ShardPlan` against that job once and keeps the result
(with the plan's device tables, uploaded on first use) for the most recent plans.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import types
from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..lower.mesh import make_mesh, mesh_axis
from ..lower.tables import device_tables, is_halo_plan, is_shard_plan

# The most recent plans' contexts (device tables included). Bounded, so an MD run that
# rebuilds its plan every few steps does not keep every old plan's tables alive; an
# evicted plan that comes back gets a fresh context (its tables uploaded again).
_CONTEXTS: collections.OrderedDict[int, tuple[Any, PlanContext]] = collections.OrderedDict()
_MAX_CONTEXTS = 8
_MESH: dict[str, Any] = {}


def front_door_mesh() -> jax.sharding.Mesh:
    """The 1-D mesh of the torch front door: the first local device of every process, by rank."""
    if "mesh" not in _MESH:
        first: dict[int, Any] = {}
        for d in jax.devices():
            first.setdefault(d.process_index, d)
        _MESH["mesh"] = make_mesh(devices=[first[p] for p in sorted(first)])
    return _MESH["mesh"]


@dataclasses.dataclass(frozen=True, eq=False)
class PlanContext:
    """A plan as seen by this process: its rank, counts, mesh and device tables."""

    plan: Any
    kind: str  # "halo" or "shard"
    mesh: Any
    axis: str
    rank: int
    n_devices: int
    n_global: int
    n_owned: int
    n_ghost: int
    owned_capacity: int
    halo_rows: int

    @functools.cached_property
    def tables(self) -> Any:
        """The plan's tables as sharded jax arrays (built on first use)."""
        return _device_tables(self.plan, self.mesh, self.device)

    @functools.cached_property
    def shard_tables(self) -> Any:
        """Owner-routing tables (for `full_tensor`), also for a halo plan."""
        if self.kind == "shard":
            return self.tables
        p = self.plan
        view = types.SimpleNamespace(
            n_devices=self.n_devices, n_global=self.n_global, owner=p.owner, local_index=p.local_index,
            owned_global=p.owned_global, n_owned=p.n_owned, owned_capacity=self.owned_capacity,
        )
        return _device_tables(view, self.mesh, self.device)

    @property
    def device(self) -> Any:
        """This process's JAX device."""
        return self.mesh.devices.flat[self.rank]

    @functools.cached_property
    def row_sharding(self) -> NamedSharding:
        """The sharding of a global array of stacked per-rank blocks, `P(axis)`."""
        return NamedSharding(self.mesh, P(self.axis))

    @functools.cached_property
    def memo(self) -> dict[tuple, Any]:
        """Per-context cache: steps by (transform, shape, dtype, flags), zero padding blocks."""
        return {}

    def owned_ids(self) -> np.ndarray:
        """Global ids of this rank's owned rows, in row order."""
        return np.asarray(self.plan.owned_global)[self.rank, : self.n_owned].astype(np.int64)

    def default_policy(self) -> Any:
        """The storage policy the plan implies (when no spec was given)."""
        from ..spec import policies

        return policies.HaloStoragePolicy() if self.kind == "halo" else policies.PlainShard()


def _device_tables(plan: Any, mesh: Any, device: Any) -> Any:
    """`device_tables`, after torch's queued GPU work on this process's device is done (once per plan).

    An upload is not ordered behind torch's stream, and its fresh XLA memory may
    be a JAX output that torch still has queued reads of (see `_call`); waiting
    for torch first costs one host sync per plan, not per transform.
    """
    if device.platform == "gpu":
        torch.cuda.current_stream(device.local_hardware_id).synchronize()
    return device_tables(plan, mesh)


def _make_context(plan: Any) -> PlanContext:
    """Validate `plan` against this job and read this rank's counts."""
    if is_halo_plan(plan):
        kind = "halo"
    elif is_shard_plan(plan):
        kind = "shard"
    else:
        raise TypeError(
            f"ShardTensor: expected a HaloPlan or ShardPlan, got {type(plan).__name__}; build one with "
            "nvalchemi_jaxbridge.layout"
        )
    mesh = front_door_mesh()
    axis = mesh_axis(mesh)
    world = int(mesh.shape[axis])
    if int(plan.n_devices) != world:
        raise ValueError(
            f"ShardTensor: the plan was built for {plan.n_devices} devices but this job has {world} "
            "process(es) with one device each; build the plan with n_devices=jax.process_count() "
            "(start the job with the launcher and call nvalchemi_jaxbridge.torch.initialize() first)"
        )
    rank = jax.process_index()
    n_owned = int(np.asarray(plan.n_owned)[rank])
    oc = int(plan.owned_capacity)
    if kind == "halo":
        n_ghost, hr = int(np.asarray(plan.n_ghost)[rank]), int(plan.halo_rows)
        n_global = int(getattr(plan, "n_atoms", getattr(plan, "n_global", -1)))
    else:
        n_ghost, hr, n_global = 0, oc, int(plan.n_global)
    return PlanContext(plan, kind, mesh, axis, rank, world, n_global, n_owned, n_ghost, oc, hr)


def context_for(plan: Any) -> PlanContext:
    """The (cached) `PlanContext` of `plan` in this process."""
    if isinstance(plan, PlanContext):
        return plan
    hit = _CONTEXTS.get(id(plan))
    if hit is not None and hit[0] is plan:
        _CONTEXTS.move_to_end(id(plan))
        return hit[1]
    ctx = _make_context(plan)
    _CONTEXTS[id(plan)] = (plan, ctx)
    while len(_CONTEXTS) > _MAX_CONTEXTS:
        _CONTEXTS.popitem(last=False)
    return ctx
