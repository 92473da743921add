"""Which op a `module:attr` reference names, which adapter of a spec holds it, and its arguments' roles.

Block convention (the demo ops' and nvalchemi-toolkit's): the op takes halo rows
`positions (R, 3)`, optionally per-atom `charges (R,)`, and `owned_mask (R,)`, then
scalars; arguments are matched by parameter name.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

_POSITIONS = ("positions", "pos", "x", "r")
_CHARGES = ("charges", "q")
_MASKS = ("owned_mask", "mask")


# ------------------------------------------------------------------ the op


def load_op(ref: str) -> Any:
    """The object named by `module:attr` or `path/to/file.py:attr` (importing it registers its torch ops).

    Raises:
        ValueError: not of the form `module:attr` / `file.py:attr`, the file does not exist, or the
            attribute does not exist.
        ImportError: the module (or file) cannot be imported.
    """
    if not isinstance(ref, str) or ":" not in ref or not all(ref.rsplit(":", 1)):
        raise ValueError(
            f"--op must be module:attr or path/to/file.py:attr (e.g. nvalchemi_jaxbridge.demo.torch_ops:"
            f"lj_energy_forces or ./my_ops.py:pair_energy), got {ref!r}."
        )
    mod_name, attr = ref.rsplit(":", 1)
    try:
        obj: Any = _import_file(mod_name, ref) if mod_name.endswith(".py") else importlib.import_module(mod_name)
    except ImportError as e:
        raise ImportError(f"--op {ref}: cannot import module {mod_name!r}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_"))[:20]
            raise ValueError(f"--op {ref}: {getattr(obj, '__name__', obj)!r} has no attribute {part!r}; it has {public}.")
        obj = getattr(obj, part)
    return obj


def _import_file(path: str, ref: str) -> Any:
    """A Python file imported as a module named after its stem (kept in sys.modules, so its ops stay registered)."""
    import importlib.util
    import pathlib
    import sys

    file = pathlib.Path(path).expanduser().resolve()
    if not file.is_file():
        raise ValueError(f"--op {ref}: no file {str(file)!r}; give an existing .py file or an importable module:attr.")
    name = f"_jaxbridge_op_{file.stem}"
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(file):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a syntax error or a failing import inside the user's file
        del sys.modules[name]
        raise ImportError(f"running {str(file)!r} raised {type(e).__name__}: {e}") from e
    return module


def _torch_overload(obj: Any) -> Any | None:
    """The OpOverload of a torch op object (packet, CustomOpDef, overload), else None."""
    from ..spec.op_ref import is_torch_op, normalize_op

    if type(obj).__name__ in ("OpOverloadPacket", "CustomOpDef") or is_torch_op(obj):
        op = normalize_op(obj)
        return op if is_torch_op(op) else None
    return None


def pick_adapter(spec: Any, obj: Any, ref: str, where: str = "validate") -> tuple[Any, Any]:
    """(the adapter to run, the op object to run): the spec's adapter for `obj`; `where` opens messages."""
    from ..spec import OpAdapter
    from ..spec.op_ref import op_key, resolve_op

    adapters = list(spec.custom_ops)
    names = [str(a.describe().target) for a in adapters]
    if not adapters:
        raise ValueError(f"{where}: the spec declares no op adapters (custom_ops is empty); nothing to run.")
    overload = _torch_overload(obj)
    if overload is not None:
        hits = [a for a in adapters if op_key(a.op) == op_key(overload)]
        if not hits:
            raise ValueError(f"{where}: --op {ref} is the torch op {op_key(overload)}, which no adapter of the spec "
                             f"declares; the spec's ops are {names}.")
        return hits[0], overload
    if isinstance(obj, str) and "::" in obj:
        hits = [a for a in adapters if op_key(a.op) == op_key(obj)]
        if hits:
            return hits[0], resolve_op(obj)
    if callable(obj) and not inspect.ismodule(obj) and not isinstance(obj, type):
        qual = {ref, ref.replace(":", ".")}
        hits = [a for a in adapters if isinstance(a.op, str) and a.op in qual] or (adapters if len(adapters) == 1 else [])
        if not hits:
            raise ValueError(f"{where}: --op {ref} is a callable but the spec has {len(adapters)} adapters {names}; "
                             "give a spec with one adapter, or name the op in the spec as module.attr.")
        a = hits[0]
        return OpAdapter(obj, dict(a.arg_transforms), dict(a.output_transforms)), obj
    if len(adapters) != 1:
        raise ValueError(f"{where}: --op {ref} registers ops on import but the spec has {len(adapters)} adapters "
                         f"{names}; pass the op itself (module:op_name).")
    a = adapters[0]
    return a, (resolve_op(a.op) if isinstance(a.op, str) else a.op)


def op_params(op: Any, *, keyword_only: bool = False) -> list[tuple[str, bool, Any]]:
    """(name, has a default, default) of the op's positional parameters (then keyword-only ones if asked)."""
    if hasattr(op, "_schema"):
        return [(p.name, p.default_value is not None, p.default_value) for p in op._schema.arguments
                if keyword_only or not p.kwarg_only]
    sig = inspect.signature(op)
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    kinds += (inspect.Parameter.KEYWORD_ONLY,) if keyword_only else ()
    return [(p.name, p.default is not inspect.Parameter.empty, p.default) for p in sig.parameters.values() if p.kind in kinds]


def role_of(name: str) -> str | None:
    """The block-convention role a parameter name plays ("positions", "charges", "mask"), or None."""
    return "positions" if name in _POSITIONS else "charges" if name in _CHARGES else "mask" if name in _MASKS else None


def arg_roles(params: list[tuple[str, bool, Any]], where: str) -> list[str]:
    """Role of each leading argument: "positions", "charges" or "mask"; stops at the first defaulted scalar."""
    roles = []
    for name, has_default, _ in params:
        if name in _POSITIONS and not roles:
            roles.append("positions")
        elif name in _CHARGES:
            roles.append("charges")
        elif name in _MASKS:
            roles.append("mask")
        elif has_default:
            break
        else:
            raise ValueError(
                f"{where}: cannot supply parameter {name!r} of the op: the sample system provides positions, "
                "charges and owned_mask (block convention); give the other parameters defaults."
            )
    if "positions" not in roles:
        raise ValueError(f"{where}: the op's first parameter must be the positions (got {[p[0] for p in params]}).")
    return roles


# ------------------------------------------------------------------ sample system
