"""Where a rank's model runs on the PyTorch door: the rank's torch device, and the devices of a wrapper's modules."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ..torch import functions as F


def rank_device() -> torch.device:
    """This process's device on the torch front door, as a torch device (`cuda:K` or `cpu`).

    The front door's JAX device of this rank (`front_door_mesh`: GPU `LOCAL_RANK` after
    `initialize()` on a GPU machine). Queries JAX's devices, so call it after `initialize()`.
    """
    import jax

    return torch_device(F.front_door_mesh().devices.flat[jax.process_index()])


def torch_device(device: Any) -> torch.device:
    """The torch device of a JAX device (`cuda:<local id>` for a GPU, else `cpu`)."""
    if device.platform == "gpu":
        return torch.device("cuda", device.local_hardware_id)
    return torch.device("cpu")


def wrapper_modules(wrapper: Any) -> list[torch.nn.Module]:
    """The torch modules of a wrapper, whose parameters and buffers must be on the rank's device.

    The wrapper itself if it is a `torch.nn.Module`, else each of its attributes (`vars(wrapper)`)
    that is one (`MPNNWrapper.model`, `MACEWrapper.model`, a user wrapper's `self.net`). Modules
    kept elsewhere (in a list, a dict, a closure) are not found, and nothing of them is checked.
    """
    if isinstance(wrapper, torch.nn.Module):
        return [wrapper]
    return [v for v in vars(wrapper).values() if isinstance(v, torch.nn.Module)]


def weights(wrapper: Any) -> list[torch.Tensor]:
    """The parameters and buffers of the wrapper's modules, in a fixed order (what its stages read)."""
    return [t for m in wrapper_modules(wrapper) for t in itertools.chain(m.parameters(), m.buffers())]


def first_weight(wrapper: Any) -> torch.Tensor | None:
    """The first of `weights(wrapper)`, found without walking the others (None if it has none)."""
    for m in wrapper_modules(wrapper):
        for t in itertools.chain(m.parameters(), m.buffers()):
            return t
    return None


def model_devices(wrapper: Any) -> set[torch.device]:
    """The devices of the wrapper's parameters and buffers (empty if it has none that are found)."""
    return {t.device for t in weights(wrapper)}


def normalized_device(device: Any) -> torch.device:
    """`device` as a torch device with its index (`"cuda"` is the current CUDA device)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d
