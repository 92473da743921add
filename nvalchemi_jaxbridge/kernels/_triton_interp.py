"""Fake evaluation of `triton_op`s under Triton's CPU interpreter (TRITON_INTERPRET=1).

A `triton_op`'s fake implementation is its own Python body. On a GPU, the
`wrap_triton(kernel)[grid](...)` launch inside it is recorded as a no-op under
FakeTensorMode. In interpreter mode `wrap_triton` hands back the interpreted
kernel itself, which then tries to read fake tensors' memory and fails. A
kernel launch only writes data, never shapes, so skipping launches whose
arguments are fake tensors gives the same output specs as the GPU path.

The interpreter also keeps per-launch state in globals (it patches
`triton.language` for the running kernel), so two launches from two threads
corrupt each other ("Did you forget to add @triton.jit ?"). XLA runs one
callback per device on its own thread, so interpreted launches are serialized.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

_lock = threading.Lock()
_launch_lock = threading.RLock()
_installed = False


def interpreter_on() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _has_fake(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(v, FakeTensor) for v in (*args, *kwargs.values()))


def patch_interpreter() -> None:
    """Once: interpreted launches on fake tensors become no-ops; real ones run one at a time."""
    global _installed
    if _installed or not interpreter_on():
        return
    with _lock:
        if _installed:
            return
        try:
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError:  # no triton: nothing to patch
            _installed = True
            return
        original = InterpretedFunction.run

        @functools.wraps(original)
        def run(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
            if _has_fake(args, kwargs):
                return None
            with _launch_lock:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run  # type: ignore[method-assign]
        _installed = True
