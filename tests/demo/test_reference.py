"""The numpy references against ASE, the Madelung constant and finite differences."""

import hypothesis
import hypothesis.strategies as st
import numpy as np
from ase.calculators.lj import LennardJones

from nvalchemi_jaxbridge.demo import DSFParams, argon_fcc, rock_salt
from nvalchemi_jaxbridge.demo.reference import dsf_reference, lj_reference
from nvalchemi_jaxbridge.demo.units import COULOMB_EV_A

EPS, SIG = 0.0104, 3.40


def ase_lj(system, positions, cutoff):
    """ASE's LennardJones(smooth=False) energy and forces."""
    atoms = system.to_ase()
    atoms.positions = positions
    atoms.calc = LennardJones(epsilon=EPS, sigma=SIG, rc=cutoff, smooth=False)
    return atoms.get_potential_energy(), atoms.get_forces()


@hypothesis.settings(max_examples=6)
@hypothesis.given(seed=st.integers(0, 999), cutoff=st.floats(5.0, 9.0), shake=st.floats(0.01, 0.3))
def test_lj_reference_matches_ase(seed, cutoff, shake):
    s = argon_fcc((2, 2, 1))
    pos = s.positions + np.random.default_rng(seed).normal(scale=shake, size=s.positions.shape)
    e, f = lj_reference(pos, s.cell, s.periodic, epsilon=EPS, sigma=SIG, cutoff=cutoff)
    e_ase, f_ase = ase_lj(s, pos, cutoff)
    np.testing.assert_allclose(e, e_ase, rtol=1e-10)
    np.testing.assert_allclose(f, f_ase, rtol=1e-10, atol=1e-10 * np.abs(f_ase).max())


def test_dsf_recovers_madelung_energy():
    a = 5.64
    s = rock_salt(2, lattice_constant=a)
    e, f = dsf_reference(s.positions, s.charges, s.cell, s.periodic, alpha=0.25, cutoff=15.0,
                         born_a=1e-300, born_rho=1.0)
    madelung = -1.747564594633 * COULOMB_EV_A / (a / 2)  # energy per ion pair
    np.testing.assert_allclose(e / (s.n_atoms / 2), madelung, rtol=1e-5)
    np.testing.assert_allclose(f, 0.0, atol=1e-12)  # perfect lattice: forces vanish by symmetry


def test_dsf_reference_forces_are_minus_energy_gradient():
    s = rock_salt(1)
    rng = np.random.default_rng(0)
    pos = s.positions + rng.normal(scale=0.15, size=s.positions.shape)
    kw = dict(zip(["alpha", "cutoff", "born_a", "born_rho", "coulomb_constant"], DSFParams().args()))
    _, f = dsf_reference(pos, s.charges, s.cell, s.periodic, **kw)
    h = 1e-5
    for atom, k in [(0, 0), (3, 1), (6, 2)]:
        dp = np.zeros_like(pos)
        dp[atom, k] = h
        ep = dsf_reference(pos + dp, s.charges, s.cell, s.periodic, **kw)[0]
        em = dsf_reference(pos - dp, s.charges, s.cell, s.periodic, **kw)[0]
        np.testing.assert_allclose(f[atom, k], -(ep - em) / (2 * h), rtol=1e-6, atol=1e-8)


def test_default_dsf_rock_salt_is_near_equilibrium_at_5_64():
    e = []
    for a in (5.54, 5.64, 5.74):
        s = rock_salt(1, lattice_constant=a)
        kw = dict(zip(["alpha", "cutoff", "born_a", "born_rho", "coulomb_constant"], DSFParams().args()))
        e.append(dsf_reference(s.positions, s.charges, s.cell, s.periodic, **kw)[0])
    assert e[1] < e[0] and e[1] < e[2]
