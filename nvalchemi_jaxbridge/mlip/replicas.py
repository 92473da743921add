"""A wrapper's weights on every device its stage ops run on (the JAX door drives several GPUs).

One process runs the JAX front door for all its devices, and each device's stage op
receives its block on its own torch device (`cuda:K`), while the user's model lives
on one device (or on the host). `WrapperReplicas.on(device)` hands a stage the
wrapper whose weights are on `device`: the wrapper itself where its weights are
already there (one GPU, or the CPU), else a copy made once per device
(`copy.deepcopy`, then every module of the copy and every tensor the wrapper holds
directly moved to `device`).

A copy follows the original: where a stage asks with `check=True` (the first op of
each evaluation), the original's parameters and buffers are compared with what the
copy last took (each tensor's storage and in-place version counter), and any change
(`load_state_dict`, an optimiser step, `param.data = ...` of the same shape and
dtype) is copied into the copy's tensors in place, so a stage recorded as a CUDA
graph on that device keeps reading the right storage. The wrapper's own other attributes (a
cutoff, a scale, a tensor it holds) are followed when set again or, for a tensor,
changed in place; a container changed in place (a list appended to) is not seen.
Adding, removing or reshaping parameters (or changing their dtype) under a live model is refused with
an error (build a new `DistributedMLIP`); a change of the wrapper's cutoff, layer
count or dtype gives new stages, and new copies (`DistributedMLIP._sync`).
Calls come from XLA's per-device threads at once, so the copies are made and
refreshed under a lock.
"""

from __future__ import annotations

import copy
import itertools
import threading
from typing import Any

import torch

from .torch_device import first_weight, normalized_device, weights, wrapper_modules


def _stamp(tensors: list[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    """What a copy must match: each tensor's storage and in-place version."""
    return tuple((t.data_ptr(), t._version) for t in tensors)


def _settings(wrapper: Any) -> dict[str, Any]:
    """The wrapper's own attributes other than its modules (a cutoff, a scale, a table, a tensor it holds);
    for a wrapper that is itself a module, its public ones (not torch's bookkeeping)."""
    module = isinstance(wrapper, torch.nn.Module)
    return {k: v for k, v in vars(wrapper).items()
            if not isinstance(v, torch.nn.Module) and not (module and k.startswith("_"))}


def _settings_stamp(values: dict[str, Any]) -> tuple:
    """Each attribute's object (and a tensor's version): an attribute set again, or a tensor changed in place."""
    return tuple((k, id(v), v._version if isinstance(v, torch.Tensor) else None) for k, v in values.items())


def copy_to(wrapper: Any, device: torch.device) -> Any:
    """A deep copy of `wrapper` with its modules and the tensors it holds directly on `device`."""
    with torch.no_grad():
        replica = copy.deepcopy(wrapper)
        for m in wrapper_modules(replica):
            m.to(device)
        if not isinstance(replica, torch.nn.Module):
            for name, value in vars(replica).items():
                if isinstance(value, torch.Tensor):
                    setattr(replica, name, value.to(device))
    return replica


def _set(wrapper: Any, replica: Any, names: list[str], device: torch.device) -> None:
    """The original's attributes `names` set again on `replica`: tensors moved to `device`, the rest deep-copied
    with the original's modules, parameters and buffers standing for the copy's own (a list of layers stays
    a list of the copy's layers)."""
    memo: dict[int, Any] = {}
    for mine, theirs in zip(wrapper_modules(wrapper), wrapper_modules(replica)):
        for a, b in zip(itertools.chain(mine.modules(), mine.parameters(), mine.buffers()),
                        itertools.chain(theirs.modules(), theirs.parameters(), theirs.buffers())):
            memo[id(a)] = b
    with torch.no_grad():
        for name in names:
            value = getattr(wrapper, name)
            setattr(replica, name, memo[id(value)] if id(value) in memo else
                    value.detach().to(device, copy=True) if isinstance(value, torch.Tensor) else
                    copy.deepcopy(value, memo))


class WrapperReplicas:
    """The wrapper as each device's stages need it (itself, or a copy on that device kept in step)."""

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self._lock = threading.Lock()
        self._copies: dict[torch.device, tuple[Any, tuple]] = {}  # device -> (copy, stamp it took)
        self._current: dict[torch.device, Any] = {}  # device -> what `on` hands out until the next check
        self._probe: torch.Tensor | None = None  # a weight of a wrapper whose weights are on one device

    def on(self, device: torch.device, *, check: bool = True) -> Any:
        """The wrapper for stages on `device`; `check`: compare with the original's weights first.

        Where the weights were all on `device` at the last full check, a check looks at the first of
        them only (a model moved with `.to()` moves or replaces it too); elsewhere it walks every
        parameter and buffer.
        """
        device = normalized_device(device)
        if not check and device in self._current:
            return self._current[device]
        probe = self._probe
        if probe is not None and probe.device == device and self._current.get(device) is self.wrapper \
                and first_weight(self.wrapper) is probe:
            return self.wrapper
        with self._lock:
            own = weights(self.wrapper)
            homes = {t.device for t in own}
            self._probe = own[0] if len(homes) == 1 else None
            if not own or homes == {device}:
                self._current[device] = self.wrapper
                return self.wrapper
            settings = _settings(self.wrapper)
            stamp = (_stamp(own), _settings_stamp(settings))
            held = self._copies.get(device)
            if held is None:
                held = self._copies[device] = (copy_to(self.wrapper, device), stamp)
            elif held[1] != stamp:
                if held[1][0] != stamp[0]:
                    self._refresh(held[0], own, device)
                if held[1][1] != stamp[1]:
                    _set(self.wrapper, held[0], [k for k, *rest in stamp[1] if (k, *rest) not in held[1][1]], device)
                held = self._copies[device] = (held[0], stamp)
            self._current[device] = held[0]
            return held[0]

    def _refresh(self, replica: Any, own: list[torch.Tensor], device: torch.device) -> None:
        mine = weights(replica)
        if [(t.shape, t.dtype) for t in mine] != [(t.shape, t.dtype) for t in own]:
            raise RuntimeError(
                f"model {getattr(self.wrapper, 'name', type(self.wrapper).__name__)!r}: its parameters and buffers "
                f"changed in number, shape or dtype ({len(mine)} -> {len(own)} tensors) since its copy on "
                f"{device} was made for the stages there; build a new DistributedMLIP for the changed model.")
        with torch.no_grad():
            for dst, src in zip(mine, own):
                dst.copy_(src)

    def copies(self) -> dict[torch.device, Any]:
        """The copies made so far, by device (for reports and tests)."""
        return {d: held[0] for d, held in self._copies.items()}
