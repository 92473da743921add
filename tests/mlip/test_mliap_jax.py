"""ML-IAP unified models on the JAX front door: `DistributedMLIP(obj)` against references that share no code
with the door (ASE's LennardJones, the model's own whole-structure forward, MACE's own forward), on 1, 2, 4
and 8 CPU devices, with per-layer exchange as the model asks for it.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from nvalchemi_jaxbridge.demo.mliap_models import MLIAPLennardJones, MLIAPMessagePassing
from nvalchemi_jaxbridge.mlip import DistributedMLIP
from tests.mlip._reference import alloy

SHAPES = {"cubic": {}, "triclinic": {"triclinic": True}, "slab": {"slab": True}}


@functools.cache
def small(shape: str, reps: int = 2):
    """32 rattled fcc Cu/Au atoms (a 7.5 Å box): cubic, sheared, or a slab open in z."""
    return alloy(reps=(reps,) * 3, **SHAPES[shape])


def _check(out, want, *, energies: bool = True):
    assert abs(out["energy"] - want["energy"]) <= 1e-9 * abs(want["energy"])
    np.testing.assert_allclose(out["forces"], want["forces"], rtol=0, atol=1e-8)
    if "stress" in want:
        np.testing.assert_allclose(out["stress"], want["stress"], rtol=0, atol=1e-9)
    if energies:
        np.testing.assert_allclose(out["atomic_energies"], want["atomic_energies"], rtol=0, atol=1e-9)


def _evaluate(obj, atoms, n_devices):
    model = DistributedMLIP(obj, n_devices=n_devices)
    return model.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                          stress=bool(all(atoms.pbc)))


@pytest.mark.parametrize("n_devices", [1, 8])
@pytest.mark.parametrize("shape", ["cubic", "triclinic", "slab"])
def test_pair_potential_gives_ases_numbers(shape, n_devices):
    from ase.calculators.lj import LennardJones

    atoms = small(shape).copy()
    atoms.calc = LennardJones(sigma=2.3, epsilon=0.4, rc=5.0)
    want = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(),
            "atomic_energies": atoms.get_potential_energies()}
    if all(atoms.pbc):
        want["stress"] = atoms.get_stress(voigt=False)
    _check(_evaluate(MLIAPLennardJones(), atoms, n_devices), want)


@pytest.mark.parametrize("n_devices", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", ["cubic", "triclinic", "slab"])
def test_message_passing_model_gives_its_own_single_device_numbers(shape, n_devices):
    atoms, model = small(shape), MLIAPMessagePassing()
    want = model.reference(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    if not all(atoms.pbc):
        want.pop("stress", None)
    _check(_evaluate(model, atoms, n_devices), want)


def test_devices_with_no_owned_atoms_take_part_in_every_exchange():
    # 8 devices, atoms in one half of the box: several devices own none, and the model returns early there
    atoms, model = alloy(reps=(3, 3, 3), half_empty=True), MLIAPMessagePassing()
    dm = DistributedMLIP(model, n_devices=8)
    state = dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array)
    assert min(r["owned"] for r in state.rows_per_device()) == 0
    out = dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, state=state)
    _check(out, model.reference(atoms.positions, atoms.numbers, atoms.cell.array))


def _mace_lammps_object():
    pytest.importorskip("mace", reason="needs mace-torch: pip install 'nvalchemi_jaxbridge[mlip]'")
    from mace.calculators.lammps_mliap_mace import LAMMPS_MLIAP_MACE

    from tests.mlip import cases

    return LAMMPS_MLIAP_MACE(cases.wrapper("mace").model)


@pytest.mark.parametrize("name", ["message_passing", "mace"])
def test_stress_is_the_central_finite_difference_of_the_energy(name):
    atoms = small("triclinic")
    model = MLIAPMessagePassing() if name == "message_passing" else _mace_lammps_object()
    dm = DistributedMLIP(model, n_devices=2)
    stress = dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array)["stress"]
    h, volume, fd = 1e-5, atoms.get_volume(), np.zeros((3, 3))
    for a, b in [(0, 0), (1, 1), (2, 2), (0, 1), (0, 2), (1, 2)]:
        e = []
        for sign in (1, -1):
            eps = np.eye(3)
            eps[a, b] += sign * h / (1 if a == b else 2)
            eps[b, a] += 0 if a == b else sign * h / 2
            e.append(dm.evaluate(atoms.positions @ eps, atoms.numbers, atoms.cell.array @ eps)["energy"])
        fd[a, b] = fd[b, a] = (e[0] - e[1]) / (2 * h) / volume
    np.testing.assert_allclose(stress, fd, rtol=0, atol=1e-8)


def test_ase_calculator_over_the_door_on_four_devices():
    from ase.calculators.lj import LennardJones

    from nvalchemi_jaxbridge.integrations.ase_calculator import JaxBridgeCalculator

    atoms = small("triclinic").copy()
    ref = atoms.copy()
    ref.calc = LennardJones(sigma=2.3, epsilon=0.4, rc=5.0)
    atoms.calc = JaxBridgeCalculator(DistributedMLIP(MLIAPLennardJones(), n_devices=4))
    for _ in range(2):  # a moved structure reuses the calculator's layout
        assert abs(atoms.get_potential_energy() - ref.get_potential_energy()) <= 1e-9 * abs(
            ref.get_potential_energy())
        np.testing.assert_allclose(atoms.get_forces(), ref.get_forces(), rtol=0, atol=1e-8)
        np.testing.assert_allclose(atoms.get_stress(), ref.get_stress(), rtol=0, atol=1e-9)
        atoms.positions += 0.01
        ref.positions += 0.01


def test_mace_lammps_object_matches_maces_own_forward():
    pytest.importorskip("mace", reason="needs mace-torch: pip install 'nvalchemi_jaxbridge[mlip]'")
    from mace.calculators.lammps_mliap_mace import LAMMPS_MLIAP_MACE

    from tests.mlip import cases
    from tests.mlip._reference import mace_reference

    model = cases.wrapper("mace").model
    obj = LAMMPS_MLIAP_MACE(model)
    for shape, devices in (("cubic", (1, 2, 4, 8)), ("triclinic", (1, 2, 4, 8)), ("slab", (1, 2, 4, 8))):
        atoms = small(shape)
        want = mace_reference(model, atoms)
        if not all(atoms.pbc):
            want.pop("stress", None)
        for n in devices:
            out = _evaluate(obj, atoms, n)
            _check(out, want, energies=False)
            # MACE's node energies include E0, and so do the eatoms it writes
            np.testing.assert_allclose(out["atomic_energies"], want["atomic_energies"], rtol=0, atol=1e-9)


class _WritesEatomsOnly(MLIAPLennardJones):
    def compute_forces(self, data):
        super().compute_forces(data)
        data._energy, data.energy_set = 0.0, False  # as a model that never sets data.energy


class _Changes(MLIAPMessagePassing):
    calls = 0

    def compute_forces(self, data):
        type(self).calls += 1
        self.layers = 3 if type(self).calls == 1 else 2  # one exchange fewer after the first call
        super().compute_forces(data)


def test_broken_models_are_named():
    atoms = small("cubic")
    args = (atoms.positions, atoms.numbers, atoms.cell.array)
    with pytest.raises(Exception, match="never set data.energy"):  # raised in the program: a JAX error
        DistributedMLIP(_WritesEatomsOnly(), n_devices=2).evaluate(*args)
    with pytest.raises(ValueError, match=r"atomic numbers \[47\] \(Ag\) are not among"):
        DistributedMLIP(MLIAPLennardJones(), n_devices=2).evaluate(atoms.positions, [47] * len(atoms),
                                                                    atoms.cell.array)
    with pytest.raises(ValueError, match="leave exchange='per_layer'"):
        DistributedMLIP(MLIAPLennardJones(), n_devices=2, exchange="deep_halo")
    with pytest.raises(Exception, match="differ from the model's schedule"):
        DistributedMLIP(_Changes(), n_devices=2).evaluate(*args)
