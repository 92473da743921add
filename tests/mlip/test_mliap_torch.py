"""ML-IAP unified models on the PyTorch front door: 2 and 4 processes (gloo, one CPU device each).

tests/mlip/mliap_worker.py runs on every rank inside the suite's shared front-door job
(tests/torch/all_workers.py); each rank must return the whole structure's energy, forces, stress and
per-atom energies of a reference sharing no code with the door: ASE's LennardJones (the pair potential),
the model's own whole-structure forward (the message-passing model), MACE's own forward (its
LAMMPS_MLIAP_MACE object). The "half" structure leaves ranks without atoms, whose model returns early.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests._launch import front_door_run, read_ranks
from tests.mlip.mliap_worker import ALL_RUNS, RUNS, structure

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ranks(request, tmp_path_factory) -> list[dict]:
    world = request.param
    return read_ranks(front_door_run(world, tmp_path_factory) / "mliap", world)


def _reference(name: str, atoms) -> dict:
    if name == "lj":
        from ase.calculators.lj import LennardJones

        a = atoms.copy()
        a.calc = LennardJones(sigma=2.3, epsilon=0.4, rc=5.0)
        out = {"energy": a.get_potential_energy(), "forces": a.get_forces(),
               "atomic_energies": a.get_potential_energies()}
        if all(a.pbc):
            out["stress"] = a.get_stress(voigt=False)
        return out
    if name == "mp":
        from nvalchemi_jaxbridge.demo.mliap_models import MLIAPMessagePassing

        out = MLIAPMessagePassing().reference(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    else:
        from tests.mlip import cases
        from tests.mlip._reference import mace_reference

        out = mace_reference(cases.wrapper("mace").model, atoms)
    if not all(atoms.pbc):
        out.pop("stress", None)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ranks,case", [(w, c) for w, cs in ALL_RUNS.items() for c in cs], indirect=["ranks"])
def test_every_rank_gets_the_references_numbers(ranks, case):
    if case not in RUNS[len(ranks)]:
        pytest.skip("mace-torch is not installed (pip install 'nvalchemi_jaxbridge[mlip]')")
    name, shape = case.split(":")
    atoms = structure(shape)
    want = _reference(name, atoms)
    for r, res in enumerate(ranks):
        got = res[case]
        assert got["driver"] == "TorchMLIAP", f"rank {r}"
        assert abs(got["energy"] - want["energy"]) <= 1e-9 * abs(want["energy"]), f"rank {r}"
        np.testing.assert_allclose(got["forces"], want["forces"], rtol=0, atol=1e-8, err_msg=f"rank {r}")
        np.testing.assert_allclose(got["atomic_energies"], want["atomic_energies"], rtol=0, atol=1e-9)
        if "stress" in want:
            np.testing.assert_allclose(got["stress"], want["stress"], rtol=0, atol=1e-9, err_msg=f"rank {r}")
        else:
            assert "stress" not in got
    if shape == "half":
        assert min(len(res[case]["owned_ids"]) for res in ranks) == 0  # a rank without atoms took part
