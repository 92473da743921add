"""A 100-step NVE run of the MPNN on 8 devices follows the one-device trajectory (float64).

The reference integrates the same velocity Verlet on one device with the torch
model and a fresh ASE neighbour list every step; the bridge runs the steps
between two checks as one program (model, exchanges and integrator in a
`lax.fori_loop`), redoes a stretch that left the skin in halves, and rebuilds
its layout on the skin criterion.
"""

from __future__ import annotations

import numpy as np
import pytest

from nvalchemi_jaxbridge.demo.systems import maxwell_boltzmann
from nvalchemi_jaxbridge.mlip import DistributedMLIP
from nvalchemi_jaxbridge.mlip.dynamics import nve
from tests.compile_events import backend_compiles
from tests.mlip import cases


@pytest.mark.slow
def test_nve_follows_the_one_device_trajectory():
    w, atoms, masses, v, want = cases.mpnn_nve_reference()
    seen = []
    out = nve(DistributedMLIP(w, n_devices=8, skin=1.0), atoms.positions, v, masses, atoms.numbers,
              atoms.cell.array, atoms.pbc, steps=100, dt=1.0, check_every=25,
              on_step=lambda step, x, e: seen.append(step))
    assert seen[-1] == 100 and sorted(out["positions"]) == [0, *seen]
    assert out["rebuilds"] >= 2  # the run crossed the skin at least once
    for step, x in out["positions"].items():
        np.testing.assert_allclose(x, want[step], rtol=0, atol=1e-8, err_msg=f"step {step}")
    from nvalchemi_jaxbridge.demo.units import MVV2E

    assert out["kinetic"][0] == pytest.approx(0.5 * MVV2E * np.sum(masses[:, None] * v * v), rel=1e-12)
    total = {k: out["energy"][k] + out["kinetic"][k] for k in out["energy"]}
    assert abs(total[100] - total[0]) < 1e-3 * len(atoms)  # NVE: the total energy is kept


def test_a_step_too_long_for_the_skin_is_refused():
    w, atoms = cases.wrapper("mpnn"), cases.structure("small")
    masses = atoms.get_masses()
    v = maxwell_boltzmann(masses, 300.0, seed=1) * 50  # ~0.3 Å per fs
    with pytest.raises(ValueError, match="moved more than skin/2"):
        nve(DistributedMLIP(w, n_devices=2, skin=0.1), atoms.positions, v, masses, atoms.numbers,
            atoms.cell.array, atoms.pbc, steps=5, dt=1.0, check_every=5)


def test_a_second_run_on_the_same_model_compiles_nothing_and_repeats_the_first():
    w, atoms = cases.wrapper("mpnn"), cases.structure("small")
    masses = atoms.get_masses()
    v = maxwell_boltzmann(masses, 300.0, seed=1)
    model = DistributedMLIP(w, n_devices=2, skin=1.0)

    def run():
        return nve(model, atoms.positions, v, masses, atoms.numbers, atoms.cell.array, atoms.pbc, steps=4,
                   dt=1.0, check_every=2)

    with backend_compiles() as first:
        a = run()
    with backend_compiles() as second:
        b = run()
    assert len(first) >= 1 and second == []  # the chunk programs stay with the model; layouts share a spec
    for step in a["positions"]:
        np.testing.assert_array_equal(b["positions"][step], a["positions"][step])
    with backend_compiles() as again:  # evaluate, prepared afresh each call, reuses its program too
        e1 = model.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
        e2 = model.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    assert len(again) >= 1 and e2["energy"] == e1["energy"]
    with backend_compiles() as third:
        model.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    assert third == []
