"""The models and structures the model-level tests share (seeded, so every process builds the same)."""

from __future__ import annotations

import functools
import os

from tests.mlip._reference import alloy

MACE_FILE = "JAXBRIDGE_TEST_MACE_FILE"  # a torch-saved copy of the test MACE, for worker processes


@functools.cache
def wrapper(name: str):
    """`mpnn` (the project's MPNN, cutoff 4 Å) or `mace` (random MACE, 2 layers, r_max 5 Å, correlation 3).

    The MACE takes edge harmonics to l = 2 (`max_ell=2`, a configuration MACE supports and trains): the
    same code paths as MACE-MP's l = 3, at a fifth of the CPU time for the build, the reference and the
    deep halo's ~1700 rows per device.
    """
    if name == "mpnn":
        from nvalchemi_jaxbridge.mlip import MPNN, MPNNWrapper

        return MPNNWrapper(MPNN([29, 79], cutoff=4.0))
    if name == "mace":
        from nvalchemi_jaxbridge.mlip.mace import MACEWrapper, random_mace

        path = os.environ.get(MACE_FILE)
        if path:  # building MACE takes seconds (its product-basis tables); workers load the test's copy
            import torch

            return MACEWrapper(torch.load(path, weights_only=False))
        return MACEWrapper(random_mace([29, 79], max_ell=2))
    raise KeyError(name)


STRUCTURES = {
    "cubic": dict(reps=(5, 5, 5)),                         # 500 atoms, rattled fcc Cu/Au
    "triclinic": dict(reps=(5, 5, 5), triclinic=True),
    "slab": dict(reps=(5, 5, 5), slab=True),               # periodic in x, y; open in z
    "small": dict(reps=(3, 3, 3), triclinic=True),          # 108 atoms
    "half": dict(reps=(5, 5, 5), half_empty=True),          # 225 atoms in one half of the box: empty domains
}


@functools.cache
def structure(name: str):
    """A fresh copy is not needed: callers only read positions, numbers, cell and pbc."""
    return alloy(**STRUCTURES[name])
