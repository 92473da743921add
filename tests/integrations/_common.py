"""Shared potentials and structures of the integration tests (cached: each compiles once per capacity set).

Lennard-Jones argon with the demo JAX kernel. Its functional form is ASE's
`LennardJones(smooth=False)`: each pair energy is shifted to zero at the cutoff
(`u(r) - u(rc)` for `r <= rc`, nothing beyond) and the forces are those of the
unshifted `u`, so with equal epsilon, sigma and rc the two give identical
energies and forces (no shift to account for). The cutoff is 6 Å rather than the
demo's 8.5 Å (2.5 sigma) to keep the halo blocks, and the tests, small.
"""

from __future__ import annotations

import functools

import numpy as np

EPSILON, SIGMA, RC = 0.0104, 3.40, 6.0


def ase_lj():
    """ASE's own Lennard-Jones with the same parameters (the independent reference)."""
    from ase.calculators.lj import LennardJones

    return LennardJones(epsilon=EPSILON, sigma=SIGMA, rc=RC, smooth=False)


def lj_spec():
    from nvalchemi_jaxbridge import DistributionSpec, HaloStoragePolicy, OpAdapter
    from nvalchemi_jaxbridge.demo import jax_potentials

    lj = OpAdapter(jax_potentials.lj_energy_forces, gather_inputs=[0], all_reduce_outputs=[0], scatter_outputs=[1])
    return DistributionSpec(policy=HaloStoragePolicy(), adapters=(lj,))


@functools.cache
def lj_potential(n_devices: int = 8, skin: float = 0.3, headroom: float = 1.5):
    from nvalchemi_jaxbridge.integrations import KernelPotential

    return KernelPotential(lj_spec(), args=("positions", "owned_mask", EPSILON, SIGMA, RC), cutoff=RC,
                           skin=skin, headroom=headroom, species=(18,), n_devices=n_devices)


def argon(rattle: float = 0.05, *, temperature: float | None = None, triclinic: bool = False, seed: int = 0,
          n_cells: int = 3):
    """Rattled fcc argon, 4 n_cells^3 atoms (108 by default; a = 5.26 Å), optionally in a sheared cell."""
    from nvalchemi_jaxbridge.demo import argon_fcc

    atoms = argon_fcc(n_cells, temperature=temperature, seed=seed).to_ase()
    if triclinic:
        cell = atoms.cell.array.copy()
        cell[1] += 0.2 * cell[0]
        cell[2] += 0.1 * cell[0] - 0.15 * cell[1]
        atoms.set_cell(cell, scale_atoms=True)
    atoms.positions += np.random.default_rng(seed).normal(scale=rattle, size=atoms.positions.shape)
    return atoms
