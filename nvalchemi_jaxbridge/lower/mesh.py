"""The 1-D device mesh that atoms are spread over, and shardings of per-atom fields."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DEFAULT_AXIS = "atoms"


def make_mesh(
    n_devices: int | None = None,
    *,
    devices: Sequence[Any] | None = None,
    axis_name: str = DEFAULT_AXIS,
) -> Mesh:
    """A 1-D mesh of `n_devices` devices with one `Auto` axis named `axis_name`.

    The axis is `AxisType.Auto`, so `jax.grad` of a compiled program works
    without entering `jax.set_mesh` (an `Explicit` axis would require it).
    Under `jax.distributed`, `jax.devices()` lists every process's devices and
    the mesh spans them all; device `d` of the mesh is rank `d` of the plan.

    Args:
        n_devices: how many devices to use (optional, default all of
            `devices`). The first `n_devices` are taken.
        devices: the devices to choose from (optional, default
            `jax.devices()`, all processes included).
        axis_name: the name of the mesh axis (optional, default `"atoms"`).

    Returns:
        A `jax.sharding.Mesh` of shape `(n_devices,)`.

    Raises:
        ValueError: `n_devices` is not positive or exceeds the devices given.

    Example:
        >>> mesh = make_mesh(2)
        >>> mesh.shape
        {'atoms': 2}
    """
    pool = list(jax.devices() if devices is None else devices)
    if not pool:
        raise ValueError("make_mesh: `devices` is empty; pass at least one device or leave it out.")
    n = len(pool) if n_devices is None else n_devices
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"make_mesh: n_devices must be a positive int, got {n_devices!r}.")
    if n > len(pool):
        raise ValueError(
            f"make_mesh: asked for {n} devices but only {len(pool)} are available "
            f"({pool[0].platform}); lower n_devices, or on the CPU set "
            f"jax.config.update('jax_num_cpu_devices', {n}) before JAX starts."
        )
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"make_mesh: axis_name must be a non-empty str, got {axis_name!r}.")
    return Mesh(np.array(pool[:n], dtype=object), (axis_name,), axis_types=(AxisType.Auto,))


def mesh_axis(mesh: Mesh) -> str:
    """The single axis name of a 1-D mesh; raises if the mesh is not 1-D."""
    if len(mesh.axis_names) != 1:
        raise ValueError(
            f"expected a 1-D mesh (one axis that atoms are spread over), got axes "
            f"{mesh.axis_names} of shape {dict(mesh.shape)}; pass a mesh with one axis over the same "
            f"devices, e.g. jax.make_mesh(({mesh.devices.size},), ('atoms',)) or "
            f"nvalchemi_jaxbridge.make_mesh({mesh.devices.size})."
        )
    return mesh.axis_names[0]


def auto_mesh(mesh: Mesh) -> Mesh:
    """`mesh` with its axis typed `Auto`: a `jax.make_mesh` mesh (`Explicit` by default) becomes usable.

    The compiled programs place their own inputs (`owned`, `halo`) on this mesh
    and take `jax.grad` without `jax.set_mesh`, which an `Explicit` axis would need.
    """
    mesh_axis(mesh)
    if tuple(mesh.axis_types) == (AxisType.Auto,):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,))


def field_shardings(
    spec: Any, mesh: Mesh, *, extra_fields: Iterable[str] = ()
) -> dict[str, NamedSharding]:
    """Shardings of the spec's per-atom fields (`spec.shard_fields`) and any `extra_fields`.

    Every per-atom field is split row-wise over the mesh axis: each device holds
    its block of owned (or halo) rows, `P(axis)`.

    Args:
        spec: a `DistributionSpec` (anything with a `shard_fields` tuple of names).
        mesh: a 1-D mesh from `make_mesh`.
        extra_fields: further names to shard the same way, e.g. declared kernel
            inputs such as `"halo_owned_mask"` (optional).

    Returns:
        `{field name: NamedSharding(mesh, P(axis))}`.
    """
    axis = mesh_axis(mesh)
    names = tuple(getattr(spec, "shard_fields", ())) + tuple(extra_fields)
    if bad := [n for n in names if not isinstance(n, str)]:
        raise TypeError(f"field_shardings: field names must be str, got {bad!r}.")
    sharding = NamedSharding(mesh, P(axis))
    return {name: sharding for name in names}
