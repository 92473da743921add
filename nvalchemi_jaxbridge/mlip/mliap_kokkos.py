"""The ML-IAP `data` of a GPU block: LAMMPS' Kokkos flavour (device arrays) of `mliap_data.BlockData`.

LAMMPS hands a model device arrays only in its Kokkos build, and models tell the two
apart by the data's class: MACE's `LAMMPS_MLIAP_MACE` runs on the device of `data.elems`
when the data's module is a Kokkos one, and on the CPU otherwise. A block on a GPU is
therefore this class, whose module says so; its arrays are torch tensors on the block's
device. `block_data` picks the class by the block's device.
"""

from __future__ import annotations

from typing import Any

import torch

from .mliap_data import BlockData


class KokkosBlockData(BlockData):
    """`BlockData` of a GPU block: every array is a torch tensor on the block's device."""


def block_data(rij: torch.Tensor, pair_i: torch.Tensor, pair_j: torch.Tensor, elems: torch.Tensor, nlocal: int,
               **kwargs: Any) -> BlockData:
    """The ML-IAP data of a block: `BlockData` (numpy views) on the CPU, `KokkosBlockData` on a GPU."""
    cls = BlockData if rij.device.type == "cpu" else KokkosBlockData
    return cls(rij, pair_i, pair_j, elems, nlocal, **kwargs)
