"""Load the compiled library, register its handlers as the XLA FFI target, register plans.

`load()` builds (or finds) the library, opens it with ctypes after torch is
imported (its torch symbols resolve to the torch already loaded), and registers
`TARGET` for the CPU, and for CUDA when the library has the CUDA handler. It
does this once per process; a failure is kept and raised again on each call.
"""

from __future__ import annotations

import ctypes
import dataclasses
import pathlib
import threading

import jax
import numpy as np
import torch  # noqa: F401 - loaded before the library, whose torch symbols resolve to it

from ..torch_op import KernelError
from . import build as _build

TARGET = "nvalchemi_jaxbridge_torch_call"


@dataclasses.dataclass(frozen=True)
class Extension:
    """The loaded library: where it is, whether it has the CUDA handler, its ctypes handle."""

    path: pathlib.Path
    cuda: bool
    lib: ctypes.CDLL

    def register_plan(self, op: str, overload: str, encoded: str, *, where: str) -> int:
        """The id of the plan for `op` (`ns::name`), `overload` ("" for default) and the encoded statics."""
        pid = self.lib.jb_register_plan(op.encode(), overload.encode(), encoded.encode())
        if pid < 0:
            why = self.lib.jb_last_error().decode(errors="replace")
            raise KernelError(
                f"{where}: the FFI call path could not register its plan: {why}. Use "
                f'call_path="callback" for this op, and report the message if the op is a plain torch op.'
            )
        return int(pid)

    def kept_graphs(self, plan: int) -> int:
        """How many torch graphs the differentiated-forward plan `plan` keeps for backwards to come."""
        return int(self.lib.jb_kept_graphs(plan))

    def token_reads(self, plan: int) -> int:
        """How many backwards of `plan`'s graphs read the token back from the device (see graphs.cc)."""
        return int(self.lib.jb_token_reads(plan))

    def call(self, plan: int, result_specs, aliases: dict[int, int]):
        """`f(*arrays)`: the FFI call of `plan` producing `result_specs`, mutated arguments aliased."""
        f = jax.ffi.ffi_call(TARGET, tuple(result_specs), input_output_aliases=aliases or None)
        attr = np.int64(plan)
        return lambda *arrays: f(*arrays, plan=attr)


_lock = threading.Lock()
_loaded: list[Extension] = []
_failed: list[KernelError] = []


def load() -> Extension:
    """The process's extension, built, loaded and registered on first use.

    Raises:
        KernelError: the build, the load or the registration failed (kept: later calls raise it again).
    """
    if _loaded:
        return _loaded[0]
    with _lock:
        if _loaded:
            return _loaded[0]
        if _failed:
            raise _failed[0]
        try:
            ext = _load()
        except KernelError as e:
            _failed.append(e)
            raise
        _loaded.append(ext)
        return ext


def _load() -> Extension:
    path = _build.build()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelError(
            f"the FFI call path library {path} was built but cannot be loaded ({e}); delete "
            f"{path.parent} so it is rebuilt, or {_build.FALLBACK}"
        ) from None
    lib.jb_register_plan.restype = ctypes.c_int64
    lib.jb_register_plan.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p]
    lib.jb_last_error.restype = ctypes.c_char_p
    lib.jb_has_cuda.restype = ctypes.c_int
    lib.jb_kept_graphs.restype = ctypes.c_int64
    lib.jb_kept_graphs.argtypes = [ctypes.c_int64]
    lib.jb_token_reads.restype = ctypes.c_int64
    lib.jb_token_reads.argtypes = [ctypes.c_int64]
    cuda = bool(lib.jb_has_cuda())
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.jb_torch_call_cpu), platform="cpu")
    if cuda:
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.jb_torch_call_cuda), platform="CUDA")
    return Extension(path, cuda, lib)


def loaded_or_failed() -> tuple[Extension | None, KernelError | None]:
    """What `load()` gave so far in this process, without starting a build."""
    return (_loaded[0] if _loaded else None), (_failed[0] if _failed else None)
