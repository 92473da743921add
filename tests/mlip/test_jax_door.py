"""Model level, JAX front door: MPNN and MACE on 2, 4 and 8 devices against one device.

References share no code with the bridge: the MPNN runs on the whole periodic
system with ASE's neighbour list (tests/mlip/_reference.py), MACE through its own
`forward` and data pipeline (matscipy neighbour list). Tolerances are the
acceptance's: energy 1e-9 relative, forces 1e-8 eV/Å, stress 1e-9 eV/Å³.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from nvalchemi_jaxbridge.mlip import DistributedMLIP
from tests.mlip import cases
from tests.mlip._reference import finite_difference_stress, mace_reference, reference


@functools.cache
def model(name: str, n_devices: int, exchange: str) -> DistributedMLIP:
    return DistributedMLIP(cases.wrapper(name), n_devices=n_devices, exchange=exchange)


@functools.cache
def expected(name: str, structure: str) -> dict:
    w, atoms = cases.wrapper(name), cases.structure(structure)
    if name == "mace":
        return mace_reference(w.model, atoms)
    return reference(w.model, atoms, w.cutoff, w.node_attrs(atoms.numbers))


def check(out: dict, want: dict) -> None:
    assert abs(out["energy"] - want["energy"]) <= 1e-9 * abs(want["energy"])
    np.testing.assert_allclose(out["forces"], want["forces"], rtol=0, atol=1e-8)
    np.testing.assert_allclose(out["stress"], want["stress"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(out["atomic_energies"], want["atomic_energies"], rtol=0, atol=1e-9)


def run(name: str, structure: str, n_devices: int, exchange: str) -> tuple[dict, object]:
    atoms = cases.structure(structure)
    dm = model(name, n_devices, exchange)
    state = dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    return dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc, state=state), state


MPNN_CASES = [(s, d, "per_layer") for s in ("cubic", "triclinic", "slab") for d in (1, 2, 4, 8)] + [
    ("triclinic", 1, "deep_halo"), ("triclinic", 2, "deep_halo"), ("slab", 4, "deep_halo"), ("cubic", 8, "deep_halo")]


@pytest.mark.parametrize("structure,n_devices,exchange", MPNN_CASES)
def test_mpnn_matches_one_device(structure, n_devices, exchange):
    out, state = run("mpnn", structure, n_devices, exchange)
    check(out, expected("mpnn", structure))
    rows = state.rows_per_device()
    assert sum(r["owned"] for r in rows) == len(cases.structure(structure))
    if n_devices == 1:  # every image is one of the device's own atoms: edge shifts, no ghost rows
        assert rows[0]["ghost"] == 0 and len(state.plan.own_images[0]) > 0
    print(f"mpnn {structure} {exchange} rows per device (owned, ghost, edges):",
          [(r["owned"], r["ghost"], r["edges"]) for r in rows])


MACE_CASES = [("mace", "triclinic", 1, "per_layer"), ("mace", "cubic", 2, "per_layer"),
              ("mace", "triclinic", 4, "per_layer"), ("mace", "slab", 8, "per_layer"),
              ("mace", "triclinic", 2, "deep_halo")]  # a 10.5 Å halo: ~1700 rows per device, every row computed


@pytest.mark.slow
@pytest.mark.parametrize("name,structure,n_devices,exchange", MACE_CASES)
def test_mace_matches_its_own_forward(name, structure, n_devices, exchange):
    pytest.importorskip("mace", reason="needs mace-torch: pip install 'nvalchemi_jaxbridge[mlip]'")
    out, state = run(name, structure, n_devices, exchange)
    check(out, expected(name, structure))
    print(f"mace {structure} {exchange} rows per device:", state.rows_per_device())


def test_halo_is_one_cutoff_plus_skin_with_per_layer_exchange():
    atoms = cases.structure("triclinic")
    w = cases.wrapper("mpnn")
    per_layer = model("mpnn", 4, "per_layer").prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    deep = model("mpnn", 4, "deep_halo").prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    assert per_layer.plan.cutoff == w.cutoff and deep.plan.cutoff == w.n_layers * w.cutoff
    assert per_layer.plan.skin == deep.plan.skin == 0.5
    ghosts = [r["ghost"] for r in per_layer.rows_per_device()]
    deep_ghosts = [r["ghost"] for r in deep.rows_per_device()]
    assert all(a < b for a, b in zip(ghosts, deep_ghosts))
    # Only owned atoms receive messages with per-layer exchange; every real row with the deep halo.
    e = per_layer.edges
    for dev in range(4):
        recv = e.edges[dev, : e.n_edges[dev], 1]
        assert recv.max() < per_layer.plan.n_owned[dev]


def test_stress_matches_finite_difference_of_the_energy():
    w, atoms = cases.wrapper("mpnn"), cases.structure("triclinic")
    out, _ = run("mpnn", "triclinic", 4, "per_layer")

    def energy(a):
        return reference(w.model, a, w.cutoff, w.node_attrs(a.numbers))["energy"]

    fd = finite_difference_stress(energy, atoms, h=1e-4)
    np.testing.assert_allclose(out["stress"], fd, rtol=1e-5, atol=1e-5 * np.abs(fd).max())


def test_a_device_with_no_atoms_works():
    out, state = run("mpnn", "half", 8, "per_layer")
    assert min(r["owned"] for r in state.rows_per_device()) == 0
    check(out, expected("mpnn", "half"))


def test_prepare_with_previous_keeps_the_program_on_a_strained_cell():
    """A cell filter's step: the strained structure laid out with previous=state equals a fresh layout
    (MPNN), keeps the capacities and the compiled spec, and runs the program already compiled."""
    atoms = cases.structure("triclinic")
    dm = model("mpnn", 4, "per_layer")
    state = dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc, state=state)
    compiled = dm._value_and_grad._cache_size()
    strain = np.eye(3) + np.array([[0.006, 0.002, 0.0], [0.002, -0.004, 0.001], [0.0, 0.001, 0.003]])
    pos, cell = atoms.positions @ strain, atoms.cell.array @ strain
    kept = dm.prepare(pos, atoms.numbers, cell, atoms.pbc, previous=state)
    got = dm.evaluate(pos, atoms.numbers, cell, atoms.pbc, state=kept)
    assert dm._value_and_grad._cache_size() == compiled, "a new cell with previous= must not retrace"
    assert kept.plan.grown == () and kept.edges.edge_capacity == state.edges.edge_capacity
    assert kept.cs.tables.static_key == state.cs.tables.static_key and np.array_equal(kept.cell, cell)
    fresh = dm.evaluate(pos, atoms.numbers, cell, atoms.pbc, state=dm.prepare(pos, atoms.numbers, cell, atoms.pbc))
    assert abs(got["energy"] - fresh["energy"]) <= 1e-12 * abs(fresh["energy"])
    for key in ("forces", "stress", "atomic_energies"):
        np.testing.assert_allclose(got[key], fresh[key], rtol=0, atol=1e-12)
    with pytest.raises(TypeError, match=r"previous must be a ModelState"):
        dm.prepare(pos, atoms.numbers, cell, atoms.pbc, previous=kept.plan)
