"""Kernel level: positions given to a compiled program are checked against its plan (`CompiledSpec.owned`).

An atom more than skin/2 from the plan's positions (minimum image) raises `StaleLayoutError` naming the atom
and `cs.rebuild`; atoms moved by lattice vectors (ASE's `wrap()`) are the same positions and give ASE's own
Lennard-Jones numbers with the old plan; `check=False` passes positions through unchecked, as given.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ase", reason="the reference is ASE's LennardJones: pip install ase")

from nvalchemi_jaxbridge.layout import HaloPlan  # noqa: E402
from nvalchemi_jaxbridge.layout.displacement import StaleLayoutError  # noqa: E402
from nvalchemi_jaxbridge.lower import compile, make_mesh  # noqa: E402
from tests.integrations._common import EPSILON, RC, SIGMA, argon, ase_lj, lj_spec  # noqa: E402

SKIN = 0.3


@pytest.fixture(scope="module")
def program():
    atoms = argon(rattle=0.1, triclinic=True, seed=4)  # 108 atoms, sheared cell
    spec = lj_spec()
    adapter = spec.custom_ops[0]
    plan = HaloPlan.build(atoms.positions, atoms.cell.array, cutoff=RC, skin=SKIN, n_devices=2)
    cs = compile(spec, make_mesh(2), plan, positions={adapter: [0]})
    return atoms, cs, adapter


def _run(cs, adapter, positions, **kw):
    energy, f_halo = cs.call(adapter, cs.owned(positions, positions=True, **kw), cs.halo_owned_mask(), EPSILON,
                             SIGMA, RC)
    return float(energy), cs.halo_to_global(f_halo)


def _ase(atoms, positions):
    ref = atoms.copy()
    ref.positions = positions
    ref.calc = ase_lj()
    return ref.get_potential_energy(), ref.get_forces()


def test_wrapped_positions_give_ases_numbers_with_the_old_plan(program):
    atoms, cs, adapter = program
    e_ref, f_ref = _ase(atoms, atoms.positions)
    rng = np.random.default_rng(1)
    shifted = atoms.positions.copy()
    idx = rng.choice(len(shifted), 30, replace=False)
    shifted[idx] += rng.integers(-2, 3, (30, 3)) @ atoms.cell.array
    wrapped = atoms.copy()
    wrapped.positions = shifted
    wrapped.wrap()
    for pos in (atoms.positions, shifted, wrapped.positions):
        e, f = _run(cs, adapter, pos)
        assert abs(e - e_ref) <= 1e-10 * abs(e_ref)
        np.testing.assert_allclose(f, f_ref, rtol=0, atol=1e-12)
    want = np.asarray(cs.halo(atoms.positions, positions=True))  # the halo block a kernel sees: the plan's
    np.testing.assert_allclose(np.asarray(cs.halo(wrapped.positions, positions=True)), want, rtol=0, atol=1e-12)
    # what the check prevents: the shifted atoms taken as given, with the image shifts of their old frame
    _, f_raw = _run(cs, adapter, shifted, check=False)
    assert np.abs(f_raw - f_ref).max() > 1e-3


def test_a_stale_plan_is_refused_naming_the_atom_and_rebuild(program):
    atoms, cs, adapter = program
    moved = atoms.positions.copy()
    moved[17] += [0.1, 0.15, -0.1]  # 0.206 Å > skin/2 = 0.15 Å
    with pytest.raises(StaleLayoutError, match=r"CompiledSpec.owned\(positions=True\): 1 atom\(s\) moved more than "
                                               r"skin/2 = 0.15 Å.*atoms 17 \(0.2062 Å\).*cs = cs.rebuild\(positions\)"):
        _run(cs, adapter, moved)
    e_ref, f_ref = _ase(atoms, moved)
    e, f = _run(cs.rebuild(moved), adapter, moved)  # re-planned: ASE's numbers
    assert abs(e - e_ref) <= 1e-10 * abs(e_ref)
    np.testing.assert_allclose(f, f_ref, rtol=0, atol=1e-12)
    # unchecked, the positions go in as given (for callers that check inside their program)
    x = cs.owned(moved, positions=True, check=False)
    np.testing.assert_array_equal(cs.to_global(x), moved)
