"""`validate`: single-device vs distributed parity of an op under a spec.

Block convention (the demo ops' and nvalchemi-toolkit's): the op takes halo
rows `positions (R, 3)`, optionally per-atom `charges (R,)`, and `owned_mask (R,)`,
then scalars; arguments are matched by parameter name.

"Single-device" means one device holding every atom as owned (positions
wrapped into the cell) plus, as ghost rows, every periodic image of an atom
that lies within the ghost width of the cell; the op runs once on that block,
called directly (torch tensors for a torch op, jax arrays for a JAX callable),
without the bridge. A per-atom output is additive over an atom's copies: its
single-device value for atom i is the sum of the rows of all copies of i
(owned row and image ghosts), which is what ScatterOutputs produces. A scalar
output is compared as is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .op_roles import arg_roles, load_op, op_params, pick_adapter
from .report import Collective, format_collectives

def sample_system(*, charged: bool, structure: str | None = None, cells: int | None = None,
                  system: str | None = None, seed: int = 0) -> Any:
    """The sample: argon FCC (3 cells) or rock salt (2 cells) rattled by 0.05 Å, or a file."""
    from ..demo import systems
    from .run_config import wrap

    if structure is not None:
        s = systems.read_structure(structure)
        if charged and s.charges is None:
            raise ValueError(f"validate: the op takes charges but {structure} has none; add initial charges to the file.")
    elif (system or ("rocksalt" if charged else "argon")) == "rocksalt":
        s = systems.rock_salt(cells or 2)
    else:
        if charged:
            raise ValueError("validate: the op takes charges; use the rocksalt sample or a structure with charges.")
        s = systems.argon_fcc(cells or 3)
    rng = np.random.default_rng(seed)
    pos = s.positions + rng.normal(scale=0.05, size=s.positions.shape)  # off the lattice: non-zero forces
    return s.replace(positions=wrap(pos, s.cell, s.periodic))


def single_device_block(system: Any, width: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions (R, 3), owned_mask (R,), atom of each row): all atoms owned, then image ghosts within `width`."""
    from ..demo.reference import image_shifts

    cell = system.cell
    frac = system.positions @ np.linalg.inv(cell)
    spacing = np.array([abs(np.linalg.det(cell)) / np.linalg.norm(np.cross(cell[(k + 1) % 3], cell[(k + 2) % 3]))
                        for k in range(3)])
    rows, atoms = [system.positions], [np.arange(system.n_atoms)]
    for s in image_shifts(cell, system.periodic, width):
        if not s.any():
            continue
        f = frac + s
        outside = np.maximum(np.maximum(-f, f - 1.0), 0.0) * spacing
        keep = np.flatnonzero(np.all(outside <= width, axis=1))
        rows.append(f[keep] @ cell)
        atoms.append(keep)
    atom = np.concatenate(atoms)
    mask = np.zeros(atom.size, dtype=bool)
    mask[: system.n_atoms] = True
    return np.concatenate(rows), mask, atom


def _call_direct(op: Any, arrays: list[np.ndarray], scalars: dict[str, Any] | None = None) -> list[np.ndarray]:
    """Run the op once on whole arrays (and scalar keyword arguments), without the bridge; outputs as numpy."""
    scalars = scalars or {}
    if hasattr(op, "_schema"):
        import torch

        outs = op(*[torch.from_numpy(np.ascontiguousarray(a)) for a in arrays], **scalars)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        return [o.detach().cpu().numpy() for o in outs]
    import jax.numpy as jnp

    outs = op(*[jnp.asarray(a) for a in arrays], **scalars)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return [np.asarray(o) for o in outs]


# ------------------------------------------------------------------ report


@dataclasses.dataclass(frozen=True)
class OutputCheck:
    """One output compared: max |distributed - single-device| and that over max |single-device|."""

    index: int
    transform: str | None
    kind: str
    max_abs: float
    max_rel: float
    ok: bool


@dataclasses.dataclass(frozen=True)
class ValidationReport:
    """The result of `validate`; `ok` is False when any output is off or the call failed."""

    spec: str
    op: str
    n_atoms: int
    n_devices: int
    cutoff: float
    ghost_width: float
    rtol: float
    outputs: tuple[OutputCheck, ...]
    fired: tuple[Collective, ...]
    hints: tuple[str, ...]
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the call ran and every output is within tolerance."""
        return self.error is None and all(o.ok for o in self.outputs)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field plus `ok` (`validate --json`)."""
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        return d

    def format(self) -> str:
        """The human report."""
        lines = [
            f"validate {self.spec} with op {self.op}",
            f"  sample: {self.n_atoms} atoms on {self.n_devices} devices; cutoff {self.cutoff:g} Å, ghost width "
            f"{self.ghost_width:g} Å; tolerance max|diff| / max|single-device| <= {self.rtol:g}",
            "  transforms fired:",
            *format_collectives(list(self.fired)),
        ]
        for o in self.outputs:
            lines.append(f"  output {o.index} ({o.kind}, {o.transform or 'no transform'}): max abs diff {o.max_abs:.3e}, "
                         f"max rel diff {o.max_rel:.3e}  {'ok' if o.ok else 'FAIL'}")
        if self.error:
            lines.append(f"  error: {self.error}")
        lines += [f"  hint: {h}" for h in self.hints]
        lines.append("  result: " + ("ok" if self.ok else "FAILED"))
        return "\n".join(lines)


def _compare(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(max abs diff, max abs diff / max |want|)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return float("inf"), float("inf")
    err = float(np.max(np.abs(got - want), initial=0.0))
    return err, err / max(float(np.max(np.abs(want), initial=0.0)), np.finfo(np.float64).tiny)


# ------------------------------------------------------------------ validate


def validate(spec_path: str, op_ref: str, *, devices: int | None = None, structure: str | None = None,
             cells: int | None = None, cutoff: float | None = None, skin: float = 0.0,
             rtol: float = 1e-8) -> ValidationReport:
    """Run an op single-device and distributed under a spec and compare every output.

    Args:
        spec_path: the spec file.
        op_ref: `module:attr`: a torch op, a JAX callable, or an attribute of a module that registers the op.
        devices: devices to distribute over (default 8 on the CPU).
        structure: sample system file (default: argon FCC, or rock salt when the op takes charges).
        cells: cubic cells of the generated sample.
        cutoff: interaction cutoff (default: the op's `cutoff` parameter default).
        skin: extra ghost width beyond the cutoff.
        rtol: tolerance on max |diff| / max |single-device| per output.

    Returns:
        A `ValidationReport`; when it fails, `hints` names a recognised cause and its fix.
    """
    from .run_config import configure_jax
    from ..spec import load_spec

    devs, _ = configure_jax(devices)
    spec = load_spec(spec_path).distribution
    obj = load_op(op_ref)
    adapter, op = pick_adapter(spec, obj, op_ref)
    params = op_params(op)
    roles = arg_roles(params, "validate")
    if cutoff is None:
        found = [d for n, has, d in params if n == "cutoff" and has]
        if not found:
            raise ValueError("validate: the op has no 'cutoff' parameter with a default; pass --cutoff.")
        cutoff = float(found[0])
    system = sample_system(charged="charges" in roles, structure=structure, cells=cells)
    hints: list[str] = []
    for i, role in enumerate(roles):
        if role in ("positions", "charges") and type(adapter.arg_transforms.get(i)).__name__ != "GatherInputs":
            hints.append(f"argument {i} ({params[i][0]!r}) is per-atom and read on ghost rows; declare "
                         f"GatherInputs for argument {i}.")
    base = dict(spec=spec_path, op=op_ref, n_atoms=system.n_atoms, n_devices=len(devs), cutoff=cutoff, rtol=rtol)
    if hints:
        return ValidationReport(**base, ghost_width=cutoff + skin, outputs=(), fired=(), hints=tuple(hints),
                                error="a per-atom input has no GatherInputs")
    width = cutoff + skin
    checks, fired, error, folded_ok = _run_pair(spec, adapter, op, roles, system, devs, cutoff, width, rtol)
    if error is None and all(c.ok for c in checks):
        return ValidationReport(**base, ghost_width=width, outputs=checks, fired=fired, hints=())
    for c in checks:
        if not c.ok and folded_ok.get(c.index):
            hints.append(f"output {c.index} is per-atom and ghost rows hold partial values: declare ScatterOutputs "
                         f"for output {c.index} (scatter_outputs=[{c.index}]).")
    if not hints and error is None:
        for hops in (2, 3):
            wide = hops * cutoff + skin
            checks2, _, err2, _ = _run_pair(spec, adapter, op, roles, system, devs, cutoff, wide, rtol)
            if err2 is None and all(c.ok for c in checks2):
                hints.append(
                    f"the halo is too thin: the op reaches beyond one cutoff (e.g. {hops} message-passing hops); "
                    f"build the plan with a ghost width of {wide:g} Å = {hops} x cutoff"
                    + (" + skin" if skin else "") + f" (HaloPlan.build(..., cutoff={cutoff:g}, "
                    f"skin={wide - cutoff:g}); validate --skin {wide - cutoff:g}).")
                break
    return ValidationReport(**base, ghost_width=width, outputs=checks, fired=fired, hints=tuple(hints), error=error)


def _run_pair(spec: Any, adapter: Any, op: Any, roles: list[str], system: Any, devs: list[Any], cutoff: float,
              width: float, rtol: float):
    """Run single-device and distributed at ghost width `width`; (checks, fired, error, {output: folded ok})."""
    from ..kernels import compile as kcompile
    from ..layout import HaloPlan
    from ..lower import make_mesh
    from .report import collectives
    from ..spec import DistributionSpec

    dtype = np.float64
    block_pos, block_mask, atom = single_device_block(system, width)
    charges = system.charges.astype(dtype) if system.charges is not None else None
    arrays = [block_pos if r == "positions" else charges[atom] if r == "charges" else block_mask for r in roles]
    ref = _call_direct(op, arrays)
    ref_atom = []
    for o in ref:
        if o.ndim >= 1 and o.shape[0] == atom.size:
            acc = np.zeros((system.n_atoms, *o.shape[1:]), dtype=np.float64)
            np.add.at(acc, atom, o)
            ref_atom.append(acc)
        else:
            ref_atom.append(o)

    plan = HaloPlan.build(system.positions, system.cell, periodic=system.periodic, cutoff=cutoff,
                          skin=width - cutoff, n_devices=len(devs))
    dist_spec = DistributionSpec(policy=spec.policy, custom_ops=(adapter,))
    fired: tuple[Collective, ...] = ()
    try:
        gathered = [i for i, r in enumerate(roles) if r == "positions"]
        cs = kcompile(dist_spec, make_mesh(len(devs), devices=devs), plan, positions={adapter: gathered})
        import jax

        # the distributed run at JAX's width: float32 where x64 is off (the front door refuses a silent cut)
        run_dtype = np.float64 if jax.config.jax_enable_x64 else np.float32
        args = []
        for r in roles:
            if r == "positions":
                args.append(cs.owned(system.positions.astype(run_dtype), positions=True))
            elif r == "charges":
                args.append(cs.owned(charges.astype(run_dtype)))
            else:
                args.append(cs.halo_owned_mask())
        outs = cs.call(adapter, *args)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        fired = tuple(collectives(cs, adapter, *args))
    except Exception as e:  # noqa: BLE001 - reported with the op's own message
        return (), fired, f"{type(e).__name__}: {e}", {}
    d, hr, oc = plan.n_devices, plan.halo_rows, plan.owned_capacity
    checks, folded_ok = [], {}
    for i, (o, want) in enumerate(zip(outs, ref_atom)):
        tr = adapter.output_transforms.get(i)
        o = np.asarray(o)
        if o.ndim >= 1 and o.shape[0] == d * hr:
            blocks = o.reshape(d, hr, *o.shape[1:])
            got = plan.from_owned(blocks[:, :oc].reshape(d * oc, *o.shape[1:]))
            kind = "per-atom"
            if tr is None:  # would ScatterOutputs fix it? fold every row of every copy into its atom
                acc = np.zeros_like(got, dtype=np.float64)
                valid = plan.halo_global >= 0
                np.add.at(acc, plan.halo_global[valid], blocks[valid])
                folded_ok[i] = _compare(acc, want)[1] <= rtol
        else:
            got, kind = o, "scalar"
        max_abs, max_rel = _compare(got, want)
        checks.append(OutputCheck(i, type(tr).__name__ if tr is not None else None, kind, max_abs, max_rel,
                                  max_rel <= rtol))
    if len(outs) != len(ref_atom):
        return tuple(checks), fired, f"the distributed call returned {len(outs)} outputs, single-device {len(ref_atom)}", folded_ok
    return tuple(checks), fired, None, folded_ok
