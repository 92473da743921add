"""torch <-> JAX conversion through DLPack, with no copy and no silent change of dtype.

The pitfalls handled (see the mechanisms reference, section 3):

- the current CUDA device is set to the tensor's device around the export, so
  DLPack's stream handshake uses that device's current stream;
- strided or broadcast tensors cannot be shared; dense permuted layouts (`t.T`) can;
- buffers must start on a 64-byte (CPU) or 16-byte (GPU) boundary, otherwise JAX
  copies silently (CPU) or the first kernel fails (GPU);
- tensors that require grad are detached (autograd does not cross this boundary:
  the kernels' custom_vjp and the torch front door carry gradients);
- with `jax_enable_x64` off, JAX would cut int64/float64/complex128 to 32 bits;
  that raises here instead;
- multi-device arrays are exported shard by shard.

Each error names the tensor (the `name` argument), what was wrong and the fix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
import torch

CPU_ALIGNMENT = 64
GPU_ALIGNMENT = 16

_WIDE_TORCH = {torch.int64: "int32", torch.float64: "float32", torch.complex128: "complex64"}
if hasattr(torch, "uint64"):
    _WIDE_TORCH[torch.uint64] = "uint32"
_WIDE_NUMPY = {"int64", "uint64", "float64", "complex128"}


class DLPackError(ValueError):
    """A buffer cannot be shared between torch and JAX as asked."""


def x64_enabled() -> bool:
    """Whether JAX keeps 64-bit types (`jax_enable_x64`)."""
    return bool(jax.config.read("jax_enable_x64"))


def _x64_message(name: str, dtype: object, narrow: str) -> str:
    return (
        f"{name} has dtype {dtype}, but jax_enable_x64 is off, so JAX would silently cut it "
        f"to {narrow} (values past the 32-bit range would change). Turn 64-bit types on "
        f'before any JAX computation with jax.config.update("jax_enable_x64", True), or '
        f"convert {name} to a 32-bit dtype yourself if that is intended."
    )


def check_x64_torch(dtype: torch.dtype, name: str) -> None:
    """Raise if a 64-bit torch dtype would be cut to 32 bits by JAX."""
    if dtype in _WIDE_TORCH and not x64_enabled():
        raise DLPackError(_x64_message(name, dtype, _WIDE_TORCH[dtype]))


def check_x64_numpy(dtype: Any, name: str) -> None:
    """Raise if a 64-bit numpy/JAX dtype would be cut to 32 bits by JAX."""
    dt = np.dtype(dtype)
    if dt.name in _WIDE_NUMPY and not x64_enabled():
        narrow = {"int64": "int32", "uint64": "uint32", "float64": "float32"}.get(dt.name, "complex64")
        raise DLPackError(_x64_message(name, dt.name, narrow))


def alignment_for(device: torch.device) -> int:
    """Bytes a buffer's start must be a multiple of to be shared without a copy."""
    return CPU_ALIGNMENT if device.type == "cpu" else GPU_ALIGNMENT


def is_compact(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True if the strides describe a dense layout (a permutation of row-major) with no gaps."""
    dims = sorted((st, sz) for sz, st in zip(shape, strides) if sz != 1)
    if any(sz == 0 for sz in shape):
        return True
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


@contextlib.contextmanager
def on_device_of(t: torch.Tensor) -> Iterator[None]:
    """Make `t`'s CUDA device current (no-op on CPU), so DLPack syncs the right stream."""
    if t.device.type == "cuda":
        with torch.cuda.device(t.device):
            yield
    else:
        yield


def _zero_copy_problem(t: torch.Tensor, name: str) -> str | None:
    """Why `t` cannot be shared as it is, or None if it can."""
    if t.is_conj():
        return (
            f"{name} has its conjugate bit set (a lazy .conj() view), which DLPack cannot carry; "
            f"call {name}.resolve_conj() first (that copies), or pass copy=True."
        )
    if t.is_neg():
        return f"{name} has its negative bit set; call {name}.resolve_neg() first, or pass copy=True."
    if not is_compact(t.shape, t.stride()):
        return (
            f"{name} is not stored densely (shape {tuple(t.shape)}, strides {tuple(t.stride())}: "
            f"a slice with a step, a broadcast or an expand), so it cannot be shared without a copy; "
            f"call {name}.contiguous() first, or pass copy=True."
        )
    align = alignment_for(t.device)
    if t.numel() and t.data_ptr() % align:
        return (
            f"{name} starts at address {t.data_ptr():#x}, which is not a multiple of {align} bytes "
            f"(JAX needs {align}-byte alignment on {t.device.type}; a view such as t[1:] shifts the "
            f"start), so it cannot be shared without a copy; call {name}.clone() first, or pass copy=True."
        )
    return None


def torch_to_jax(t: torch.Tensor, *, name: str = "tensor", copy: bool = False) -> jax.Array:
    """Share a torch tensor with JAX through DLPack.

    Args:
        t: the tensor (CPU or CUDA). A tensor that requires grad is detached.
        name: how errors refer to the tensor, e.g. "argument 'positions' of demo::energy".
        copy: if False (default) the result aliases `t`'s memory and anything that
            would need a copy raises; if True a dense, aligned copy is made when needed.

    Returns:
        A single-device `jax.Array` on `t`'s device, with `t`'s dtype.

    Raises:
        DLPackError: the tensor is 64-bit while `jax_enable_x64` is off, or cannot be
            shared without a copy and `copy` is False.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    check_x64_torch(t.dtype, name)
    t = t.detach()
    problem = _zero_copy_problem(t, name)
    if problem is not None:
        if not copy:
            raise DLPackError(problem)
        t = t.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
    with on_device_of(t):
        return jax.dlpack.from_dlpack(t, copy=False if problem is None else None)


def _single_device_array(a: jax.Array, name: str) -> None:
    """Raise if `a` spans several devices (DLPack exports one buffer)."""
    if len(a.sharding.device_set) > 1:
        raise DLPackError(
            f"{name} is spread over {len(a.sharding.device_set)} devices "
            f"(sharding {a.sharding}); DLPack exports one device buffer. Use "
            f"jax_to_torch_shards({name}) to get one tensor per addressable shard."
        )


def jax_to_torch(a: jax.Array, *, name: str = "array") -> torch.Tensor:
    """Share a single-device JAX array with torch through DLPack (no copy).

    The tensor aliases JAX's buffer: JAX assumes its arrays never change, so do
    not write into the result (torch ignores DLPack's read-only flag).

    Raises:
        DLPackError: `a` is spread over several devices (use `jax_to_torch_shards`).
    """
    if not isinstance(a, jax.Array):
        raise TypeError(f"{name} must be a jax.Array, got {type(a).__name__}.")
    _single_device_array(a, name)
    (device,) = a.sharding.device_set
    if device.platform == "gpu":
        with torch.cuda.device(device.local_hardware_id):
            return torch.from_dlpack(a)
    return torch.from_dlpack(a)


def jax_to_torch_shards(a: jax.Array, *, name: str = "array") -> list[torch.Tensor]:
    """One torch tensor per addressable shard of `a`, in the order of `a.addressable_shards`.

    Replicated arrays give one tensor per device holding a copy. No data is copied.
    """
    if not isinstance(a, jax.Array):
        raise TypeError(f"{name} must be a jax.Array, got {type(a).__name__}.")
    return [jax_to_torch(s.data, name=f"{name} (shard on {s.device})") for s in a.addressable_shards]


def torch_shards_to_jax(
    tensors: Sequence[torch.Tensor],
    sharding: jax.sharding.Sharding,
    global_shape: Sequence[int],
    *,
    name: str = "tensor",
    copy: bool = False,
) -> jax.Array:
    """Assemble per-device torch tensors into one global sharded `jax.Array` (no copy).

    `tensors[i]` is the block of the i-th addressable device of `sharding`, in the
    order of `sharding.addressable_devices_indices_map(global_shape)`. A CUDA
    tensor must already live on its block's GPU. CPU tensors carry no device
    index, so with several (virtual) CPU devices in one process the blocks of
    devices other than the one DLPack lands on are copied in host memory.
    """
    devices = list(sharding.addressable_devices_indices_map(tuple(global_shape)))
    if len(tensors) != len(devices):
        raise DLPackError(
            f"{name}: got {len(tensors)} tensors for a sharding with {len(devices)} addressable "
            f"devices; pass one tensor per device, in device order."
        )
    arrays = []
    for i, (t, dev) in enumerate(zip(tensors, devices)):
        a = torch_to_jax(t, name=f"{name}[{i}]", copy=copy)
        (have,) = a.sharding.device_set
        if have != dev and have.platform == dev.platform == "cpu":
            a = jax.device_put(a, dev)
        elif have != dev:
            raise DLPackError(
                f"{name}[{i}] lives on {have} but the sharding puts block {i} on {dev}; move it "
                f"with .to(...) first, or reorder the list to match the sharding's devices."
            )
        arrays.append(a)
    return jax.make_array_from_single_device_arrays(tuple(global_shape), sharding, arrays)


def buffer_to_torch(buf: Any) -> torch.Tensor:
    """A torch view of a `buffer_callback` Buffer (inside the callback; no copy)."""
    # Through the capsule: given the Buffer itself, torch.from_dlpack would look up
    # torch's current CUDA stream for every buffer to pass as `stream=`, which
    # Buffer.__dlpack__ ignores (the callback orders work on ctx.stream instead).
    return torch.from_dlpack(buf.__dlpack__())
