"""The force op a run drives, and its scalar parameters bound by name (`run --op`, `--param`).

Block convention (the demo ops' and nvalchemi-toolkit's): the op takes halo rows
`positions (R, 3)`, optionally `charges (R,)`, and `owned_mask (R,)`, recognised by
parameter name, then scalar parameters, and returns `(energy, forces (R, 3))`.

Every scalar is bound by name, never by position: the value of `--param NAME=VALUE`,
else the op's own default (a Python default, or the default in a torch op's schema).
A name the op does not have, a scalar with neither a value nor a default, and a value
that is not a number are errors that list the op's parameters. The op's `cutoff`
scalar is the halo plan's interaction cutoff. The demo potentials go through the same
binding: their ops' defaults are those of `demo/params.py`.

A user's op is checked against itself on one device (`validate.single_device_block`:
every atom owned plus its periodic images as ghosts, the op called directly); the
demo potentials against their numpy references.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .op_roles import load_op, op_params, pick_adapter, role_of

#: The run's description of a user op's check.
SINGLE_DEVICE = ("the same op on one device (every atom owned, periodic images as ghost rows; "
                 "app.validate.single_device_block), same positions as step 1")
DEMO_NUMPY = "numpy all-pairs over periodic images (demo.reference), same positions as step 1"


# ------------------------------------------------------------------ --param


def parse_params(items: Sequence[str] | None) -> dict[str, str]:
    """Repeated `--param NAME=VALUE` as {name: value text}.

    Raises:
        ValueError: an item is not NAME=VALUE, or a name is given twice.
    """
    out: dict[str, str] = {}
    for item in items or ():
        name, eq, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name.isidentifier() or not value:
            raise ValueError(f"run: --param {item!r} must be NAME=VALUE (e.g. --param cutoff=8.5).")
        if name in out:
            raise ValueError(f"run: --param {name} is given twice ({out[name]} and {value}); give each once.")
        out[name] = value
    return out


def _kind(op: Any, name: str, default: Any) -> str:
    """"float", "int", "bool" or another type name (e.g. "Tensor") of a scalar parameter."""
    if hasattr(op, "_schema"):
        t = str(next(a.type for a in op._schema.arguments if a.name == name))
        return t[len("Optional["):-1] if t.startswith("Optional[") else t
    ann = inspect.signature(op).parameters[name].annotation
    if ann in (int, float, bool) or ann in ("int", "float", "bool"):
        return ann if isinstance(ann, str) else ann.__name__
    if isinstance(default, bool):
        return "bool"
    return "int" if isinstance(default, int) else "float"


def describe_params(op: Any) -> str:
    """The op's parameters for a message: arrays by role, then each scalar with its type and default."""
    parts = []
    for name, has, default in op_params(op, keyword_only=True):
        if role_of(name) is not None and not has:
            parts.append(f"{name} (array)")
        else:
            parts.append(f"{name} ({_kind(op, name, default)}" + (f", default {default!r})" if has else ", required)"))
    return ", ".join(parts)


def _convert(value: Any, kind: str, name: str, op_name: str, listing: str) -> Any:
    """A --param value as the parameter's type."""
    text = str(value).strip()
    if kind == "bool":
        if text.lower() in ("1", "true", "0", "false"):
            return text.lower() in ("1", "true")
        raise ValueError(f"run: --param {name}={text}: {name} is a bool parameter of {op_name}; give true or "
                         f"false (its parameters: {listing}).")
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"run: --param {name}={text}: not a number; {name} is a {kind} parameter of {op_name} "
                         f"(its parameters: {listing}).") from None
    if not math.isfinite(v):
        raise ValueError(f"run: --param {name}={text}: must be a finite number (its parameters: {listing}).")
    if kind == "int":
        if v != int(v):
            raise ValueError(f"run: --param {name}={text}: {name} is an int parameter of {op_name}; give a whole "
                             f"number (its parameters: {listing}).")
        return int(v)
    return v


def bind_scalars(op: Any, given: Mapping[str, Any], op_name: str) -> tuple[tuple[str, ...], dict[str, Any]]:
    """(roles of the leading array arguments, every scalar by name in signature order) of a call of `op`.

    Raises:
        ValueError: the op does not start with positions, a given name is not a scalar of the op, a
            scalar has neither a value nor a default, a value is not a number, or there is no `cutoff`.
    """
    params = op_params(op, keyword_only=True)
    listing = describe_params(op)
    roles: list[str] = []
    for name, has_default, _ in params:
        role = role_of(name)
        if role is None or has_default or (role == "positions") != (not roles):
            break
        roles.append(role)
    if roles[:1] != ["positions"]:
        raise ValueError(f"run: the first parameter of {op_name} must be the positions (block convention: "
                         f"positions, [charges,] owned_mask, then scalars); its parameters: {listing}.")
    scalars_p = params[len(roles):]
    names = [p[0] for p in scalars_p]
    if unknown := [k for k in given if k not in names]:
        raise ValueError(f"run: --param {', '.join(unknown)}: {op_name} has no such scalar parameter; its "
                         f"parameters: {listing}.")
    scalars: dict[str, Any] = {}
    for name, has_default, default in scalars_p:
        kind = _kind(op, name, default)
        if kind not in ("float", "int", "bool", "SymInt", "SymFloat"):
            raise ValueError(f"run: parameter {name!r} of {op_name} is a {kind}, which the run cannot supply (it "
                             f"passes the block arrays, then scalars by name); give it a default. Its "
                             f"parameters: {listing}.")
        if name in given:
            scalars[name] = _convert(given[name], kind.removeprefix("Sym").lower(), name, op_name, listing)
        elif has_default:
            scalars[name] = default
        else:
            raise ValueError(f"run: {op_name} needs a value for {name!r} (no default); pass --param {name}=VALUE "
                             f"(its parameters: {listing}).")
    if "cutoff" not in scalars:
        raise ValueError(f"run: {op_name} has no 'cutoff' parameter, and the run takes the halo plan's cutoff "
                         f"from it; add one to the op (its parameters: {listing}).")
    if not (isinstance(scalars["cutoff"], (int, float)) and 0 < scalars["cutoff"] < math.inf):
        raise ValueError(f"run: the cutoff of {op_name} must be a positive length in Å, got "
                         f"{scalars['cutoff']!r}; pass --param cutoff=VALUE.")
    return tuple(roles), scalars


# ------------------------------------------------------------------ the user's op, checked against itself


@dataclasses.dataclass(frozen=True)
class UserPotential:
    """A user's op with bound scalars; its reference is the same op on one device. Models any species."""

    name: str
    op: Any
    roles: tuple[str, ...]
    scalars: dict[str, Any]
    species: tuple[int, ...] = ()  # any

    @property
    def charged(self) -> bool:
        """Whether the op takes charges."""
        return "charges" in self.roles

    def reference(self, positions: np.ndarray, charges: np.ndarray | None, system: Any) -> tuple[float, np.ndarray]:
        """Energy and forces of the whole periodic system: the op once on all atoms plus their image ghosts."""
        from .run_config import wrap
        from .validate import _call_direct, single_device_block

        s = system.replace(positions=wrap(positions, system.cell, system.periodic))
        block, mask, atom = single_device_block(s, float(self.scalars["cutoff"]))
        q = None if charges is None else np.asarray(charges, dtype=np.float64)
        arrays = [block if r == "positions" else q[atom] if r == "charges" else mask for r in self.roles]
        outs = _call_direct(self.op, arrays, self.scalars)
        if len(outs) < 2 or outs[1].shape != block.shape:
            raise ValueError(f"run: {self.name} returned {[o.shape for o in outs]} on one device; the MD job needs "
                             "(energy (), forces (R, 3)) (block convention).")
        forces = np.zeros((s.n_atoms, 3))
        np.add.at(forces, atom, outs[1].astype(np.float64))
        return float(outs[0]), forces


# ------------------------------------------------------------------ which op, which adapter


@dataclasses.dataclass(frozen=True)
class ForceOp:
    """What the MD job calls: the one-adapter spec, the op, its argument roles and bound scalars, its check."""

    spec: Any
    spec_path: str
    adapter: Any
    name: str
    kernel: str
    roles: tuple[str, ...]
    scalars: dict[str, Any]
    potential: Any  # run_config.Potential (demo, numpy reference) or UserPotential
    reference: str  # what the parity compares with

    @property
    def cutoff(self) -> float:
        """The plan's interaction cutoff: the op's `cutoff` scalar."""
        return float(self.scalars["cutoff"])

    @property
    def charged(self) -> bool:
        """Whether the op takes charges."""
        return "charges" in self.roles


def _one_adapter(path: str) -> Any:
    """The spec file's distribution, which must declare exactly one op adapter."""
    from ..spec import load_spec

    spec = load_spec(path).distribution
    if len(spec.custom_ops) != 1:
        raise ValueError(
            f"run: {path} declares {len(spec.custom_ops)} op adapters; the MD job runs one force op "
            "(positions[, charges], owned_mask, scalars) -> (energy, forces)."
        )
    return spec


def _as_op(obj: Any, ref: str) -> Any:
    """The callable `--op` names: a torch op as its OpOverload, or a JAX callable."""
    from .op_roles import _torch_overload

    overload = _torch_overload(obj)
    if overload is not None:
        return overload
    if callable(obj) and not inspect.ismodule(obj) and not isinstance(obj, type):
        return obj
    raise ValueError(f"run: --op {ref} is a {type(obj).__name__}, not an op; name the op itself "
                     "(module:function or module:torch_op), or give a --spec that names the op it registers.")


def _default_spec(op: Any, roles: tuple[str, ...]) -> Any:
    """The demo specs' transforms for an op of the block convention: gather per-atom inputs, sum the
    energy, scatter the forces."""
    from ..spec import AllReduceSum, DistributionSpec, GatherInputs, HaloStoragePolicy, OpAdapter, ScatterOutputs

    gathered = {i: GatherInputs() for i, r in enumerate(roles) if r in ("positions", "charges")}
    adapter = OpAdapter(op, gathered, {0: AllReduceSum(replicated_consumer=False), 1: ScatterOutputs()})
    return DistributionSpec(policy=HaloStoragePolicy(), custom_ops=(adapter,))


def resolve(config: Any) -> ForceOp:
    """The force op of a `RunConfig`: the user's (`op`, or a `spec` naming a non-demo op) or the demo's."""
    from ..spec import DistributionSpec, OpAdapter
    from ..spec.op_ref import resolve_op
    from .run_config import potential_for

    given = dict(config.params or {})
    if config.op is not None:
        obj = load_op(config.op)
        if config.spec is None:
            op = _as_op(obj, config.op)
            roles, scalars = bind_scalars(op, given, config.op)
            spec, spec_path = _default_spec(op, roles), "(none: GatherInputs on per-atom inputs, AllReduceSum on " \
                                                         "the energy, ScatterOutputs on the forces)"
        else:
            spec_path, spec = config.spec, _one_adapter(config.spec)
            adapter, op = pick_adapter(spec, obj, config.op, "run")
            roles, scalars = bind_scalars(op, given, config.op)
            spec = DistributionSpec(policy=spec.policy, custom_ops=(adapter,))
        return _user(spec, spec_path, op, config.op, roles, scalars)

    spec_path = config.spec_path()
    spec = _one_adapter(spec_path)
    adapter = spec.custom_ops[0]
    if config.kernel == "jax":
        demo = potential_for(config.system or "argon")
        op = demo.jax_block()
        adapter = OpAdapter(op, dict(adapter.arg_transforms), dict(adapter.output_transforms))
        spec = DistributionSpec(policy=spec.policy, custom_ops=(adapter,))
        name = f"{op.__module__}.{op.__name__}"
    elif isinstance(adapter.op, str):
        if adapter.op.startswith("jaxbridge_demo::"):
            from ..demo import torch_ops  # noqa: F401  registers the jaxbridge_demo:: ops
        op, name = resolve_op(adapter.op), adapter.op
    else:
        op, name = adapter.op, getattr(adapter.op, "__name__", str(adapter.op))
    roles, scalars = bind_scalars(op, given, name)
    if config.kernel != "jax" and not name.startswith("jaxbridge_demo::"):
        return _user(spec, spec_path, op, name, roles, scalars)
    pot = potential_for("rocksalt" if "charges" in roles else "argon").with_scalars(scalars)
    kernel = config.kernel or "torch"
    return ForceOp(spec, spec_path, adapter, name, kernel, roles, scalars, pot, DEMO_NUMPY)


def _user(spec: Any, spec_path: str, op: Any, name: str, roles: tuple[str, ...], scalars: dict[str, Any]) -> ForceOp:
    """A ForceOp of the user's op, checked against itself on one device."""
    kernel = "torch" if hasattr(op, "_schema") else "jax"
    pot = UserPotential(name, op, roles, scalars)
    return ForceOp(spec, spec_path, spec.custom_ops[0], name, kernel, roles, scalars, pot, SINGLE_DEVICE)
