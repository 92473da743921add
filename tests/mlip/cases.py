"""The models and structures the model-level tests share (seeded, so every process builds the same)."""

from __future__ import annotations

import functools
import os

from nvalchemi_jaxbridge.mlip import MPNNWrapper
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


@functools.cache
def mpnn_nve_reference():
    """The MPNN on the "small" structure at 300 K: `(wrapper, atoms, masses, velocities, positions per step)` of
    100 velocity-Verlet steps of 1 fs on one device (`reference_nve`), computed once per process."""
    from nvalchemi_jaxbridge.demo.systems import maxwell_boltzmann
    from tests.mlip._reference import reference_nve

    w, atoms = wrapper("mpnn"), structure("small")
    masses = atoms.get_masses()
    v = maxwell_boltzmann(masses, 300.0, seed=1)
    want = reference_nve(w.model, atoms, w.cutoff, w.node_attrs(atoms.numbers), v, masses, steps=100, dt=1.0)
    return w, atoms, masses, v, want


class HostReadingMPNN(MPNNWrapper):
    """The MPNN with a host read in every layer (a synchronisation on a GPU): it cannot be recorded."""

    def interaction(self, i, g, h):
        if float(h.abs().max()) > 1e30:
            h = h / 2
        return super().interaction(i, g, h)


def check_fell_back_once(caplog, graphs, logger: str) -> None:
    """`HostReadingMPNN`'s stages were not recorded: one WARNING line naming the model and the host read."""
    lines = [r.getMessage() for r in caplog.records if r.name == logger]
    assert len(lines) == 1, lines
    assert "fake capture off for model 'mpnn'" in lines[0] and "__float__" in lines[0]
    assert graphs.off is not None and graphs.replays == 0
