"""`spec show`: the compiled plan of a spec on a sample system (mesh, partition specs, collectives, bytes)."""

from __future__ import annotations

import numpy as np

from .op_roles import arg_roles, load_op, op_params
from .report import format_collectives
from .validate import sample_system


def show_spec(spec_path: str, *, devices: int | None = None, system: str | None = None, cells: int | None = None,
              structure: str | None = None, op: str | None = None) -> tuple[str, list[str]]:
    """The compiled plan of a spec on a sample system: mesh, partition specs, collectives with bytes.

    Args:
        spec_path: the spec file.
        devices: mesh size (default 8 CPU devices).
        system: "argon" or "rocksalt" sample (default: rocksalt when an op takes charges).
        cells, structure: the sample's size, or a file to read it from.
        op: `module:attr` to import first (registers or supplies the spec's op); the demo's
            `jaxbridge_demo::` ops are imported automatically.

    Returns:
        (the text, the problems): one line per adapter that could not be shown (its op could not be
        resolved, or has no 'cutoff' default), naming the adapter, the reason and the fix; the CLI exits
        1 when there is any.
    """
    import jax

    from ..kernels import compile as kcompile
    from ..layout import HaloPlan
    from ..lower import make_mesh
    from .report import collectives, hlo_collectives
    from .run_config import configure_jax
    from ..spec import DistributionSpec, load_spec

    devs, _ = configure_jax(devices)
    spec = load_spec(spec_path).distribution
    if op is not None:
        load_op(op)
    if any(isinstance(a.op, str) and a.op.startswith("jaxbridge_demo::") for a in spec.custom_ops):
        from ..demo import torch_ops  # noqa: F401  registers the demo ops
    mesh = make_mesh(len(devs), devices=devs)
    lines = [f"spec {spec_path}", f"  policy: {spec.policy!r}",
             f"  mesh: {len(devs)} x {devs[0].platform} devices, axis {mesh.axis_names[0]!r} (1-D, Auto)"]
    problems: list[str] = []
    for adapter in spec.custom_ops:
        name = str(adapter.describe().target)
        try:
            from ..spec.op_ref import resolve_op

            live = resolve_op(adapter.op) if isinstance(adapter.op, str) else adapter.op
            params = op_params(live)
            roles = arg_roles(params, f"spec show: adapter {name!r}")
        except Exception as e:  # noqa: BLE001 - shown, then the exit status: other adapters still print
            problems.append(f"spec show: adapter {name}: cannot resolve its op ({e}); pass --op module:attr (or "
                            "file.py:attr) that implements or registers it.")
            lines.append("  " + problems[-1])
            continue
        cutoff = next((float(d) for n, has, d in params if n == "cutoff" and has), None)
        if cutoff is None:
            problems.append(f"spec show: adapter {name}: its op has no 'cutoff' default, so no plan can be built "
                            "here; give the op's 'cutoff' parameter a default.")
            lines.append("  " + problems[-1])
            continue
        sample = sample_system(charged="charges" in roles, structure=structure, cells=cells, system=system)
        plan = HaloPlan.build(sample.positions, sample.cell, periodic=sample.periodic, cutoff=cutoff, n_devices=len(devs))
        one = DistributionSpec(policy=spec.policy, custom_ops=(adapter,))
        cs = kcompile(one, mesh, plan, positions={adapter: [roles.index("positions")]})
        dtype = np.float64 if jax.config.jax_enable_x64 else np.float32  # JAX's width: no silent cut
        args = [cs.owned(sample.positions.astype(dtype), positions=True) if r == "positions" else
                cs.owned(sample.charges.astype(dtype)) if r == "charges" else cs.halo_owned_mask() for r in roles]
        compiled = jax.jit(lambda c, *a: c.call(adapter, *a)).lower(cs, *args).compile()
        outs = compiled.output_shardings
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        lines += [f"  adapter {name}  (sample: {sample.n_atoms} atoms, cutoff {cutoff:g} Å)",
                  *("    " + ln for ln in plan.describe(features=3, itemsize=8).splitlines()),
                  "    arguments:"]
        for i, (r, a) in enumerate(zip(roles, args)):
            tr = adapter.arg_transforms.get(i)
            lines.append(f"      {i} {params[i][0]:<12} {tuple(a.shape)} {a.dtype}  {a.sharding.spec}  "
                         f"{type(tr).__name__ if tr else 'no transform'}")
        for i, (n_, has, d) in enumerate(params[len(roles):], start=len(roles)):
            lines.append(f"      {i} {n_:<12} static constant (default {d!r})")
        lines.append("    outputs:")
        for i, s in enumerate(outs):
            tr = adapter.output_transforms.get(i)
            lines.append(f"      {i} {getattr(s, 'spec', s)}  {type(tr).__name__ if tr else 'no transform'}")
        lines.append("    collectives per call (float64 rows):")
        lines += ["  " + ln for ln in format_collectives(collectives(cs, adapter, *args))]
        counts = hlo_collectives(compiled.as_text())
        lines.append("    in the compiled program: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return "\n".join(lines), problems
