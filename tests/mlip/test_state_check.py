"""A state passed to a model must hold for the call: exact results, or an error naming the field and the fix.

Every door that takes a state (`DistributedMLIP`, its ML-IAP driver, `TorchDistributedMLIP` in this
process's one-rank world, `TorchMLIAP`) compares it with the call: re-wrapped atoms (ASE's `wrap()`) are the
same positions and give the reference's numbers with the old state; an atom past skin/2, other atomic
numbers, another cell or pbc, another atom count, another model, or a model changed since `prepare` raise
`StaleStateError` naming what differs; `update` re-plans. References share no code with the bridge: the
MPNN on the whole periodic system with ASE's neighbour list, ASE's own Lennard-Jones.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from nvalchemi_jaxbridge.mlip import MPNN, DistributedMLIP, MPNNWrapper
from nvalchemi_jaxbridge.mlip.state_check import StaleStateError
from tests.mlip._reference import alloy, reference

SKIN = 0.5


def _mpnn(cutoff: float = 4.0) -> MPNNWrapper:
    return MPNNWrapper(MPNN([29, 79], cutoff=cutoff, features=6, n_layers=2))


@functools.cache
def _atoms():
    return alloy(reps=(3, 3, 3), triclinic=True)  # 108 atoms, sheared cell


def _args(atoms):
    return atoms.numbers, atoms.cell.array, atoms.pbc


def _want(w, atoms) -> dict:
    return reference(w.model, atoms, w.cutoff, w.node_attrs(atoms.numbers))


def _check(out: dict, want: dict, *, stress: bool = True) -> None:
    assert abs(out["energy"] - want["energy"]) <= 1e-9 * abs(want["energy"])
    np.testing.assert_allclose(out["forces"], want["forces"], rtol=0, atol=1e-8)
    if stress:
        np.testing.assert_allclose(out["stress"], want["stress"], rtol=0, atol=1e-9)


def _wrapped(atoms, n: int = 30, seed: int = 0):
    """`atoms` with `n` atoms shifted by random lattice vectors, then wrapped back by ASE (`Atoms.wrap`)."""
    rng = np.random.default_rng(seed)
    out = atoms.copy()
    idx = rng.choice(len(out), n, replace=False)
    out.positions[idx] += rng.integers(-2, 3, (n, 3)) @ out.cell.array
    far = out.positions.copy()
    out.wrap()
    return far, out.positions.copy()


@pytest.fixture(scope="module")
def jax_door():
    w = _mpnn()
    dm = DistributedMLIP(w, n_devices=4, skin=SKIN)
    atoms = _atoms()
    return w, dm, atoms, dm.prepare(atoms.positions, *_args(atoms))


def test_atoms_shifted_by_lattice_vectors_are_exact_with_the_old_state(jax_door):
    w, dm, atoms, state = jax_door
    want = _want(w, atoms)
    _check(dm.evaluate(atoms.positions, *_args(atoms), state=state), want)
    for pos in _wrapped(atoms):  # shifted far out, and wrapped back into the cell by ASE
        assert not dm.needs_rebuild(state, pos) and dm.update(state, pos) is state  # the same positions
        _check(dm.evaluate(pos, *_args(atoms), state=state), want)


def test_an_atom_past_half_the_skin_is_refused_and_update_replans(jax_door):
    w, dm, atoms, state = jax_door
    moved = atoms.copy()
    moved.positions[5] += [0.6, 0.0, 0.0]
    with pytest.raises(StaleStateError, match=r"DistributedMLIP.evaluate\(state=...\): 1 atom\(s\) moved more than "
                                              r"skin/2 = 0.25 Å.*atoms 5 \(0.6 Å\).*state = model.update\(state, "
                                              r"positions\)"):
        dm.evaluate(moved.positions, *_args(atoms), state=state)
    new = dm.update(state, moved.positions)
    assert new is not state
    _check(dm.evaluate(moved.positions, *_args(atoms), state=new), _want(w, moved))
    with pytest.raises(StaleStateError, match=r"update: positions have shape \(107, 3\), the state is for \(108, 3\)"):
        dm.update(state, moved.positions[1:])
    near = atoms.copy()
    near.positions[5] += [0.2, 0.0, 0.0]  # within skin/2: the old state holds
    _check(dm.evaluate(near.positions, *_args(atoms), state=state), _want(w, near))


def _other_structure(field: str, atoms):
    z, cell, pbc = _args(atoms)
    pos = atoms.positions
    if field == "numbers":
        z = z.copy()
        z[[3, 7]] = np.where(z[[3, 7]] == 29, 79, 29)
    elif field == "cell":
        cell = cell * (1 + 1e-6)
    elif field == "pbc":
        pbc = (True, True, False)
    elif field == "count":
        pos, z = pos[:-1], z[:-1]
    return pos, z, cell, pbc


@pytest.mark.parametrize("field,message", [
    ("numbers", r"atomic numbers differ at 2 atom\(s\) \(atom: state's -> given: 3: \d+ -> \d+, 7: "),
    ("cell", r"the cell differs from the state's by up to 1\.\d+e-05 Å"),
    ("pbc", r"pbc is \(True, True, False\), the state's is \(True, True, True\)"),
    ("count", r"positions have shape \(107, 3\), the state is for \(108, 3\)"),
])
def test_a_state_of_another_structure_is_refused_naming_the_field(jax_door, field, message):
    _, dm, atoms, state = jax_door
    with pytest.raises(StaleStateError, match=r"the state is for another structure: " + message +
                       r".*state = model.prepare\(positions, numbers, cell, pbc, previous=state\)"):
        dm.evaluate(*_other_structure(field, atoms), state=state)


def test_a_state_of_another_model_is_refused(jax_door):
    w, dm, atoms, _ = jax_door
    other = DistributedMLIP(w, n_devices=4, skin=SKIN).prepare(atoms.positions, *_args(atoms))
    with pytest.raises(StaleStateError, match=r"the state was made by another model driver object"):
        dm.evaluate(atoms.positions, *_args(atoms), state=other)
    with pytest.raises(StaleStateError, match=r"energy_fn: the state does not hold for this model"):
        dm.energy_fn(other, other.cs.owned(atoms.positions, positions=True), np.zeros((3, 3)))
    assert dm.needs_rebuild(other, atoms.positions)


def test_a_model_changed_after_prepare_is_followed_by_the_calculator_and_refused_with_an_old_state():
    """The model's and wrapper's cutoff go from 4 to 5 Å under a live ASE calculator, a state and a layout."""
    from nvalchemi_jaxbridge.integrations import halo_energy_fn
    from nvalchemi_jaxbridge.integrations.ase_calculator import JaxBridgeCalculator

    w = _mpnn()
    dm = DistributedMLIP(w, n_devices=2, skin=SKIN)
    atoms = alloy(reps=(2, 2, 2), triclinic=True)  # 32 atoms
    calc_atoms = atoms.copy()
    calc_atoms.calc = JaxBridgeCalculator(dm)
    calc_atoms.get_forces()
    for pos in _wrapped(atoms, n=10):  # re-wrapped atoms: the calculator's layout holds, exactly
        calc_atoms.positions = pos
        _check(_calculated(calc_atoms), _want(w, atoms))
    engine = calc_atoms.calc.engine
    assert engine.prepares == 1 and engine.rebuilds == 0
    calc_atoms.positions = atoms.positions
    state = dm.prepare(atoms.positions, *_args(atoms))
    neighbor_fn, energy_fn = halo_energy_fn(dm, *_args(atoms))
    nbrs = neighbor_fn.allocate(atoms.positions)

    w.model.cutoff = w.cutoff = 5.0
    want = _want(w, atoms)
    assert abs(want["energy"] - _want(_mpnn(), atoms)["energy"]) > 1e-3  # the change matters
    calc_atoms.calc.reset()  # ASE keeps results of unchanged atoms: ask again
    _check(_calculated(calc_atoms), want)
    assert engine.prepares == 2  # the calculator saw the change and laid the structure out anew
    with pytest.raises(StaleStateError, match=r"cutoff was 4.0 when the state was made, now 5.0.*model.prepare"):
        dm.evaluate(atoms.positions, *_args(atoms), state=state)
    with pytest.raises(StaleStateError, match=r"energy_fn: the layout does not hold for the model any more: cutoff "
                                              r"was 4.0 .* now 5.0; re-allocate: nbrs = neighbor_fn.allocate"):
        energy_fn(atoms.positions, neighbor=nbrs)
    assert neighbor_fn.allocate(atoms.positions, nbrs).state.plan.cutoff == 5.0
    _check(dm.evaluate(atoms.positions, *_args(atoms), state=dm.update(state, atoms.positions)), want)


def _calculated(atoms) -> dict:
    return {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(),
            "stress": atoms.get_stress(voigt=False)}


# ------------------------------------------------------------------ the ML-IAP driver (JAX door)


def _ase_lj(atoms, rc: float) -> dict:
    from ase.calculators.lj import LennardJones

    ref = atoms.copy()
    ref.calc = LennardJones(sigma=2.3, epsilon=0.4, rc=rc)
    return {"energy": ref.get_potential_energy(), "forces": ref.get_forces(),
            "stress": ref.get_stress(voigt=False)}


def test_the_mliap_driver_checks_its_state_and_follows_its_objects_cutoff():
    from nvalchemi_jaxbridge.demo.mliap_models import MLIAPLennardJones

    obj = MLIAPLennardJones()
    dm = DistributedMLIP(obj, n_devices=2, skin=SKIN)
    atoms = alloy(reps=(2, 2, 2), triclinic=True)
    state = dm.prepare(atoms.positions, *_args(atoms))
    far, wrapped = _wrapped(atoms, n=10)
    _check(dm.evaluate(wrapped, *_args(atoms), state=state), _ase_lj(atoms, 5.0))
    moved = atoms.positions.copy()
    moved[2] += [0.0, 0.7, 0.0]
    with pytest.raises(StaleStateError, match=r"atoms 2 \(0.7 Å\).*state = model.update\(state, positions\)"):
        dm.evaluate(moved, *_args(atoms), state=state)
    obj.rcutfac, obj.cutoff = 3.0, 6.0
    with pytest.raises(StaleStateError, match=r"cutoff was 5.0 when the state was made, now 6.0"):
        dm.evaluate(far, *_args(atoms), state=state)
    _check(dm.evaluate(far, *_args(atoms), state=dm.update(state, far)), _ase_lj(atoms, 6.0))


# ------------------------------------------------------------------ the PyTorch front door (a world of one rank)


def test_the_torch_door_checks_its_state_and_follows_a_changed_wrapper():
    from nvalchemi_jaxbridge.mlip.torch_model import TorchDistributedMLIP

    w = _mpnn()
    dm = TorchDistributedMLIP(w, skin=SKIN)
    atoms = _atoms()
    state = dm.prepare(atoms.positions, *_args(atoms))
    for pos in _wrapped(atoms):
        _check(dm.evaluate(pos, *_args(atoms), state=state), _want(w, atoms))
    moved = atoms.positions.copy()
    moved[9] -= [0.0, 0.0, 0.6]
    with pytest.raises(StaleStateError, match=r"TorchDistributedMLIP.evaluate\(state=...\): 1 atom\(s\).*atoms 9 "
                                              r"\(0.6 Å\).*state = model.update\(state, positions\)"):
        dm.evaluate(moved, *_args(atoms), state=state)
    with pytest.raises(StaleStateError, match=r"atomic numbers differ"):
        dm.evaluate(*_other_structure("numbers", atoms), state=state)
    w.model.cutoff = w.cutoff = 5.0
    with pytest.raises(StaleStateError, match=r"cutoff was 4.0 when the state was made, now 5.0"):
        dm.evaluate(atoms.positions, *_args(atoms), state=state)
    _check(dm.evaluate(atoms.positions, *_args(atoms), state=dm.update(state, atoms.positions)), _want(w, atoms))


def test_the_torch_mliap_driver_checks_its_state():
    from nvalchemi_jaxbridge.demo.mliap_models import MLIAPLennardJones
    from nvalchemi_jaxbridge.mlip.torch_model import TorchDistributedMLIP

    dm = TorchDistributedMLIP(MLIAPLennardJones(), skin=SKIN)
    atoms = alloy(reps=(2, 2, 2), triclinic=True)
    state = dm.prepare(atoms.positions, *_args(atoms))
    for pos in _wrapped(atoms, n=10):
        _check(dm.evaluate(pos, *_args(atoms), state=state), _ase_lj(atoms, 5.0))
    with pytest.raises(StaleStateError, match=r"pbc is \(True, True, False\)"):
        dm.evaluate(*_other_structure("pbc", atoms), state=state)
