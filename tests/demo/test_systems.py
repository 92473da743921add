"""Demo systems against ASE's builders, units against ase.units, velocities against closed forms."""

import subprocess
import sys

import ase.build
import ase.io
import ase.units
import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from nvalchemi_jaxbridge.demo import System, argon_fcc, maxwell_boltzmann, read_structure, rock_salt
from nvalchemi_jaxbridge.demo import units


def _same_sites(a, b, cell):
    """Whether two position sets are equal up to order and lattice translations."""
    frac = lambda p: np.round((p @ np.linalg.inv(cell)) % 1.0, 9) % 1.0  # noqa: E731
    return sorted(map(tuple, frac(a))) == sorted(map(tuple, frac(b)))


# ASE uses CODATA 2014 constants, we use CODATA 2018: they agree to ~1e-7 relative.
CODATA = 5e-7


def test_units_match_ase():
    assert units.MVV2E == pytest.approx(1.0 / ase.units.fs**2, rel=CODATA)
    assert units.KB_EV == pytest.approx(ase.units.kB, rel=CODATA)
    assert units.COULOMB_EV_A == pytest.approx(ase.units.Bohr * ase.units.Hartree, rel=CODATA)


@hypothesis.settings(max_examples=8)
@hypothesis.given(reps=st.tuples(*[st.integers(1, 3)] * 3), a=st.floats(4.0, 6.0))
def test_argon_and_rock_salt_match_ase_builders(reps, a):
    ar = argon_fcc(reps, lattice_constant=a)
    ref = ase.build.bulk("Ar", "fcc", a=a, cubic=True).repeat(reps)
    assert ar.n_atoms == len(ref) and _same_sites(ar.positions, ref.positions, ref.cell[:])
    np.testing.assert_allclose(ar.cell, ref.cell[:], atol=1e-12)
    assert set(ar.atomic_numbers) == {18} and np.allclose(ar.masses, ref.get_masses(), rtol=1e-4)
    nacl = rock_salt(reps, lattice_constant=a)
    ref = ase.build.bulk("NaCl", "rocksalt", a=a, cubic=True).repeat(reps)
    for z in (11, 17):
        sel, rsel = nacl.atomic_numbers == z, ref.numbers == z
        assert _same_sites(nacl.positions[sel], ref.positions[rsel], ref.cell[:])
        np.testing.assert_allclose(nacl.masses[sel], ref.get_masses()[rsel], rtol=1e-4)
    assert np.all(nacl.charges == np.where(nacl.atomic_numbers == 11, 1.0, -1.0))
    assert nacl.charges.sum() == 0


@hypothesis.given(n=st.integers(2, 40), t=st.floats(1.0, 2000.0), seed=st.integers(0, 99))
def test_maxwell_boltzmann_zero_momentum_exact_temperature(n, t, seed):
    m = np.random.default_rng(seed).uniform(1.0, 200.0, n)
    v = maxwell_boltzmann(m, t, seed=seed)
    np.testing.assert_allclose((m[:, None] * v).sum(0), 0.0, atol=1e-12 * np.abs(m[:, None] * v).sum())
    ke = 0.5 * units.MVV2E * np.sum(m[:, None] * v * v)
    np.testing.assert_allclose(ke, 0.5 * (3 * n - 3) * units.KB_EV * t, rtol=1e-10)
    ke_ase = 0.5 * np.sum(m[:, None] * v * v) / ase.units.fs**2  # through ASE's units
    np.testing.assert_allclose(ke_ase, 0.5 * (3 * n - 3) * ase.units.kB * t, rtol=CODATA)


def test_maxwell_boltzmann_spread_scales_with_mass():
    m = np.concatenate([np.full(2000, 4.0), np.full(2000, 100.0)])
    v = maxwell_boltzmann(m, 300.0, seed=3)
    ratio = v[:2000].std() / v[2000:].std()
    assert ratio == pytest.approx(5.0, rel=0.05)  # sqrt(100 / 4)


def test_to_ase_kinetic_energy_and_velocities_round_trip(tmp_path):
    s = rock_salt((2, 1, 1), temperature=500.0, seed=4)
    atoms = s.to_ase()
    from nvalchemi_jaxbridge.demo.units import KB_EV

    want = 0.5 * (3 * s.n_atoms - 3) * KB_EV * 500.0
    assert atoms.get_kinetic_energy() == pytest.approx(want, rel=CODATA)
    path = tmp_path / "nacl.extxyz"
    ase.io.write(path, atoms)
    back = read_structure(path)
    np.testing.assert_allclose(back.positions, s.positions, atol=1e-7)
    np.testing.assert_allclose(back.velocities, s.velocities, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(back.charges, s.charges)
    assert back.periodic == (True, True, True) and np.allclose(back.cell, s.cell)
    assert list(back.atomic_numbers) == list(s.atomic_numbers)


def test_read_structure_without_cell(tmp_path):
    path = tmp_path / "mol.xyz"
    path.write_text("2\n\nAr 0 0 0\nAr 0 0 3.8\n")
    mol = read_structure(path)
    assert mol.periodic == (False, False, False) and mol.charges is None and mol.velocities is None
    with pytest.raises(ValueError, match=r"no cell vector along lattice directions \[0, 1, 2\].*periodic=False"):
        read_structure(path, periodic=True)
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_structure(tmp_path / "missing.xyz")


def test_read_structure_without_ase_says_how_to_install(tmp_path):
    code = (
        "import sys; sys.modules['ase'] = None\n"
        "from nvalchemi_jaxbridge.demo import read_structure\n"
        "try:\n    read_structure('x.xyz')\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "read_structure needs ASE" in out.stdout and "pip install ase" in out.stdout


def test_system_validation_errors():
    good = argon_fcc(1)
    with pytest.raises(ValueError, match=r"positions must have shape \(N, 3\)"):
        good.replace(positions=np.zeros((4, 2)))
    with pytest.raises(ValueError, match=r"masses must be positive; atoms \[1\]"):
        good.replace(masses=np.array([1.0, -1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match=r"charges must have shape \(4,\)"):
        good.replace(charges=np.ones(3))
    with pytest.raises(ValueError, match=r"cell\[2\] is zero"):
        good.replace(cell=np.diag([1.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="periodic must be three bools"):
        good.replace(periodic=(True, True))
    with pytest.raises(ValueError, match="n_cells must be a positive int"):
        argon_fcc(0)
    with pytest.raises(ValueError, match="lattice_constant must be a positive length"):
        rock_salt(1, lattice_constant=-1.0)
    with pytest.raises(ValueError, match="N >= 2"):
        maxwell_boltzmann(np.ones(1), 10.0)
    with pytest.raises(ValueError, match="read-only"):
        good.positions[0, 0] = 1.0
    assert good.positions.dtype == np.float64 and good.atomic_numbers.dtype == np.int64


def test_zero_cell_row_error_names_the_axis():
    cell = np.diag([5.0, 5.0, 0.0])
    with pytest.raises(ValueError, match=r"set periodic\[2\] = False"):
        System(
            positions=np.zeros((1, 3)), cell=cell, periodic=(True, True, True),
            masses=np.ones(1), atomic_numbers=np.ones(1, dtype=int),
        )
