"""Non-finite inputs through the ASE calculator and the functional API end in a `NonFiniteError` naming the
input, the atoms and the fix (they used to return a finite energy); legitimate inputs still match ASE."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("ase", reason="the references use ASE's LennardJones: pip install ase")

from nvalchemi_jaxbridge.integrations import KernelPotential, halo_energy_fn  # noqa: E402
from nvalchemi_jaxbridge.integrations.ase_calculator import JaxBridgeCalculator  # noqa: E402
from nvalchemi_jaxbridge.layout.finite import NonFiniteError  # noqa: E402
from tests.integrations._common import EPSILON, RC, SIGMA, argon, ase_lj, lj_potential  # noqa: E402


def test_ase_calculator_refuses_a_nan_coordinate_on_the_first_call_and_after_a_good_one():
    atoms = argon()
    atoms.calc = JaxBridgeCalculator(lj_potential(2))
    ref = atoms.copy()
    ref.calc = ase_lj()
    assert atoms.get_potential_energy() == pytest.approx(ref.get_potential_energy(), rel=1e-10)
    atoms.positions[3, 1] = np.nan  # the layout is cached: this call used to return a finite energy
    with pytest.raises(NonFiniteError, match=r"JaxBridgeCalculator: positions of atoms \[3\] are not finite "
                                             r"\(NaN or inf\)"):
        atoms.get_potential_energy()
    fresh = argon()
    fresh.positions[[40, 9]] = np.inf
    fresh.calc = JaxBridgeCalculator(lj_potential(2))
    with pytest.raises(NonFiniteError, match=r"JaxBridgeCalculator: positions of atoms \[9, 40\]"):
        fresh.get_forces()
    fresh = argon()
    fresh.cell[2, 0] = np.nan
    fresh.calc = JaxBridgeCalculator(lj_potential(2))
    with pytest.raises(NonFiniteError, match=r"JaxBridgeCalculator: cell entries \[\(2, 0\)\]"):
        fresh.get_potential_energy()


def nan_lj(positions, owned_mask, epsilon, sigma, cutoff):
    """The demo Lennard-Jones with its energy made NaN (a broken kernel)."""
    from nvalchemi_jaxbridge.demo import jax_potentials

    e, f = jax_potentials.lj_energy_forces(positions, owned_mask, epsilon, sigma, cutoff)
    return e * jnp.nan, f


def test_a_kernel_that_returns_nan_is_named():
    from nvalchemi_jaxbridge import DistributionSpec, HaloStoragePolicy, OpAdapter

    op = OpAdapter(nan_lj, gather_inputs=[0], all_reduce_outputs=[0], scatter_outputs=[1])
    pot = KernelPotential(DistributionSpec(policy=HaloStoragePolicy(), adapters=(op,)),
                          args=("positions", "owned_mask", EPSILON, SIGMA, RC), cutoff=RC, skin=0.3, n_devices=2)
    atoms = argon()
    atoms.calc = JaxBridgeCalculator(pot)
    with pytest.raises(NonFiniteError, match=r"JaxBridgeCalculator: the model returned a non-finite 'energy' "
                                             r"\(NaN or inf\).*It came from the kernel .*nan_lj"):
        atoms.get_potential_energy()


def test_functional_api_refuses_nan_eagerly_and_gives_nan_under_jit():
    atoms = argon()
    neighbor_fn, energy_fn = halo_energy_fn(lj_potential(2), atoms.numbers, atoms.cell.array, atoms.pbc)
    r = jnp.asarray(atoms.positions)
    nbrs = neighbor_fn.allocate(r)
    ref = atoms.copy()
    ref.calc = ase_lj()
    assert float(energy_fn(r, neighbor=nbrs)) == pytest.approx(ref.get_potential_energy(), rel=1e-10)
    bad = r.at[21, 2].set(jnp.nan)
    with pytest.raises(NonFiniteError, match=r"energy_fn: positions of atoms \[21\] are not finite"):
        energy_fn(bad, neighbor=nbrs)
    with pytest.raises(NonFiniteError, match=r"HaloNeighborFn.allocate: positions of atoms \[21\]"):
        neighbor_fn.allocate(bad)
    # under jit nothing can raise: the energy is NaN (never a finite number) and the layout flags itself
    e = jax.jit(lambda x, nb: energy_fn(x, neighbor=nb))(bad, nbrs)
    assert np.isnan(float(e))
    assert bool(jax.jit(lambda x, nb: nb.update(x).did_buffer_overflow)(bad, nbrs))
