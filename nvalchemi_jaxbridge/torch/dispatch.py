"""The project's one explicit global registry: op -> stack of (token, handler).

`OpAdapter.install()` resolves its live op and calls `install_adapter`; the
returned `Memento` goes back to `restore_adapter`. A handler is registered under
the `OpOverload` *and* its `OpOverloadPacket`, so both call forms
(`torch.ops.ns.op(x)` and `torch.ops.ns.op.default(x)`) reach it in
`ShardTensor.__torch_function__`, above autograd.

Unlike nvalchemi-toolkit (one handler per op, last writer wins, restore clears):
installs stack, restoring one adapter removes exactly its entries (the one
below becomes active again), and restoring twice is a no-op.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Mapping
from typing import Any

Handler = Callable[[Any, tuple, tuple, dict], Any]
"""`handler(func, types, args, kwargs)`, as in `__torch_function__`."""

_LOCK = threading.RLock()
_STACKS: dict[Any, list[tuple[int, str, Handler]]] = {}
_TOKENS = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class Memento:
    """What `install_adapter` returns and `restore_adapter` takes back.

    `memento["op"]` / `memento["packet"]` work too (the reference's dict form).
    """

    op: Any
    packet: Any | None
    token: int
    label: str = ""

    def __getitem__(self, key: str) -> Any:
        if key not in ("op", "packet", "token"):
            raise KeyError(f"Memento has keys 'op', 'packet', 'token'; got {key!r}")
        return getattr(self, key)


@dataclasses.dataclass(frozen=True)
class HandlerInfo:
    """One registry entry, as `list_handlers()` reports it."""

    key: str
    label: str
    token: int
    active: bool


def _keys(op: Any, packet: Any | None) -> tuple[Any, ...]:
    """The registry keys of one install: the op, plus its packet if distinct."""
    return (op,) if packet is None or packet is op else (op, packet)


def register(keys: tuple[Any, ...], handler: Handler, *, label: str) -> int:
    """Push `handler` on every key's stack; returns the token that removes it."""
    with _LOCK:
        token = next(_TOKENS)
        for key in keys:
            _STACKS.setdefault(key, []).append((token, label, handler))
        return token


def unregister(keys: tuple[Any, ...], token: int) -> None:
    """Remove the entries of `token` from the keys' stacks; missing entries are fine."""
    with _LOCK:
        for key in keys:
            stack = _STACKS.get(key)
            if stack is None:
                continue
            stack[:] = [e for e in stack if e[0] != token]
            if not stack:
                del _STACKS[key]


def lookup(func: Any) -> Handler | None:
    """The active (top-of-stack) handler for `func`, or None."""
    try:
        stack = _STACKS.get(func)
    except TypeError:  # unhashable callables cannot be registered either
        return None
    return stack[-1][2] if stack else None


def list_handlers() -> list[HandlerInfo]:
    """Every registered entry, bottom of each stack first; the last per key is active."""
    with _LOCK:
        return [
            HandlerInfo(str(key), label, token, i == len(stack) - 1)
            for key, stack in _STACKS.items()
            for i, (token, label, _) in enumerate(stack)
        ]


def _live_op_parts(live_op: Any) -> tuple[Any, Any | None]:
    """(overload, packet) of a torch operator; TypeError for anything dispatch cannot see."""
    import torch

    if isinstance(live_op, torch._ops.OpOverloadPacket):
        return live_op.default, live_op
    if isinstance(live_op, torch._ops.OpOverload):
        return live_op, live_op.overloadpacket
    if (inner := getattr(live_op, "_opoverload", None)) is not None:  # torch.library.CustomOpDef
        return inner, inner.overloadpacket
    raise TypeError(
        f"cannot install an adapter on {live_op!r} ({type(live_op).__name__}): ShardTensor dispatch "
        "only sees torch operators. Register the kernel with torch.library.custom_op / triton_op and "
        "pass torch.ops.<ns>.<name> (or its 'ns::name'), or replace a Python function with a "
        "PythonAdapter instead."
    )


def install_adapter(adapter: Any, live_op: Any) -> Memento:
    """Register `adapter`'s handler on `live_op` and its packet; returns the memento.

    Args:
        adapter: an `OpAdapter` (its transforms are read by the handler at call time).
        live_op: the resolved operator: an `OpOverload`, `OpOverloadPacket` or `CustomOpDef`.

    Returns:
        A `Memento`; pass it to `restore_adapter` (or `adapter.restore`) to undo.

    Raises:
        TypeError: `live_op` is not a torch operator (dispatch would never see it).
    """
    from .handler import make_handler

    op, packet = _live_op_parts(live_op)
    site = getattr(adapter, "install_site", "") or "?"
    label = f"OpAdapter[{op}] declared at {site}"  # install_site: where the adapter was constructed
    handler = make_handler(adapter, op)
    token = register(_keys(op, packet), handler, label=label)
    return Memento(op, packet, token, label)


def _check_memento_dict(memento: Mapping[str, Any]) -> None:
    """A reference-style memento `{"op": OpOverload, "packet": OpOverloadPacket | None}` (+ our "token")."""
    import torch

    op, packet = memento.get("op"), memento.get("packet")
    bad = sorted(str(k) for k in memento if k not in ("op", "packet", "token"))
    if "op" not in memento:
        problem = "it has no 'op'"
    elif not isinstance(op, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        problem = f"'op' is {type(op).__name__} {op!r:.60}, not a torch OpOverload"
    elif packet is not None and not isinstance(packet, torch._ops.OpOverloadPacket):
        problem = f"'packet' is {type(packet).__name__} {packet!r:.60}, not an OpOverloadPacket or None"
    elif "token" in memento and (isinstance(memento["token"], bool) or not isinstance(memento["token"], int)):
        problem = f"'token' is {type(memento['token']).__name__}, not the int install_adapter returned"
    elif bad:
        problem = f"it has the unknown key(s) {bad[:5]}"
    else:
        return
    raise TypeError(
        f"restore_adapter: a memento dict must be {{'op': <OpOverload>, 'packet': <OpOverloadPacket or None>}}, "
        f"but {problem}. Pass the Memento that install() returned, unchanged."
    )


def restore_adapter(memento: Memento | dict) -> None:
    """Remove the entries of one install; the adapter below (if any) is active again.

    Restoring the same memento twice is harmless. A reference-style dict
    `{"op": ..., "packet": ...}` without a token clears every entry of the op; a
    malformed one (no torch op under "op", say) raises TypeError.
    """
    if isinstance(memento, Memento):
        unregister(_keys(memento.op, memento.packet), memento.token)
        return
    if isinstance(memento, Mapping):
        _check_memento_dict(memento)
        keys = _keys(memento["op"], memento.get("packet"))
        if "token" in memento:
            unregister(keys, memento["token"])
            return
        with _LOCK:
            for key in keys:
                _STACKS.pop(key, None)
        return
    raise TypeError(
        f"restore_adapter expects the Memento returned by install_adapter, got {type(memento).__name__}"
    )


def make_marshaller(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` wrapped to run on local blocks: ShardTensors in, plain blocks to `fn`, results re-wrapped.

    Used by `JitAdapter(mode="marshal")` / `MethodAdapter(mode="marshal")`. A
    tensor result gets the metadata of the first ShardTensor argument whose
    leading dimension it shares; other results are returned as `fn` made them.
    """
    import functools

    from .shard_tensor import marshal_call

    @functools.wraps(fn)
    def marshalled(*args: Any, **kwargs: Any) -> Any:
        return marshal_call(fn, args, kwargs)

    return marshalled
