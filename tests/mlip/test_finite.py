"""Non-finite inputs and outputs at the model level end in a `NonFiniteError` that names what, where and the atoms.

A NaN coordinate used to give a finite energy (its pairs dropped as "beyond the cutoff"); now every front door
checks its inputs (`evaluate` with `state=` included), every result is reduced once with `isfinite`, and a
non-finite result names the wrapper stage (forward or backward) and the atoms. The model here is the MPNN
with a planted fault that a test switches on: an energy term of one atom made NaN in `interaction(1)`, a
gradient made NaN there, or a node energy made NaN once the atom comes closer than a distance to another
(so that an NVE run meets it mid-chunk, at a step known from an independent one-device trajectory).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.layout.finite import NonFiniteError
from nvalchemi_jaxbridge.mlip import MPNN, DistributedMLIP, MPNNWrapper
from nvalchemi_jaxbridge.mlip.dynamics import nve
from nvalchemi_jaxbridge.mlip.guards import explain_wrapper
from tests.mlip._reference import alloy, reference_nve


class Faulty(MPNNWrapper):
    """The MPNN, with `fault` planted when set: `("forward" | "backward", point, cell)` marks the rows at
    `point` (any periodic image) in layer 1; `("closer", r)` makes the Au rows' node energies NaN once an edge
    into them is shorter than `r`."""

    fault: tuple | None = None

    def _rows_at(self, x: torch.Tensor) -> torch.Tensor:
        _, point, cell = self.fault
        frac = (x.detach() - torch.as_tensor(point, dtype=x.dtype)) @ torch.linalg.inv(torch.as_tensor(cell,
                                                                                                     dtype=x.dtype))
        return torch.nonzero((frac - frac.round()).abs().amax(dim=1) < 1e-9)[:, 0]

    def interaction(self, i, g, h):
        h, e = super().interaction(i, g, h)
        if i == 1 and self.fault is not None and self.fault[0] == "forward":
            e = e.index_fill(0, self._rows_at(g.positions), float("nan"))
        if i == 1 and self.fault is not None and self.fault[0] == "backward":
            rows = self._rows_at(g.positions)
            x = g.positions[rows]
            e = e.index_add(0, rows, torch.sqrt(((x - x.detach()) ** 2).sum(1)))  # 0, with an infinite slope
        return h, e

    def node_energies(self, g, layer_energy):
        out = super().node_energies(g, layer_energy)
        if self.fault is not None and self.fault[0] == "closer":
            short = g.edge_index[1][torch.linalg.vector_norm(g.edge_vectors(), dim=1) < self.fault[1]]
            au = g.node_attrs[:, 1] > 0.5
            bad = torch.zeros_like(au).index_fill(0, short, True) & au
            out = torch.where(bad, torch.full_like(out, float("nan")), out)
        return out


@pytest.fixture(scope="module")
def setup():
    atoms = alloy((2, 2, 2), seed=3)
    atoms.numbers = np.where(np.arange(len(atoms)) == 0, 79, 29)  # atom 0 the only Au
    w = Faulty(MPNN([29, 79], cutoff=4.0))
    model = DistributedMLIP(w, n_devices=2, skin=0.5)
    state = model.prepare(atoms.positions, atoms.numbers, atoms.cell.array, True)
    return w, model, atoms, state


@pytest.fixture
def faulty(setup):
    w = setup[0]
    yield setup
    w.fault = None


def _call(model, atoms, positions=None, cell=None, state=None):
    return model.evaluate(atoms.positions if positions is None else positions, atoms.numbers,
                          atoms.cell.array if cell is None else cell, True, state=state)


def test_a_nan_or_inf_coordinate_is_refused_with_the_atom_also_with_a_state(faulty):
    _, model, atoms, state = faulty
    assert np.isfinite(_call(model, atoms, state=state)["forces"]).all()  # legitimate input: accepted
    for value in (np.nan, np.inf):
        bad = atoms.positions.copy()
        bad[[5, 17], 1] = value
        with pytest.raises(NonFiniteError, match=r"DistributedMLIP.evaluate: positions of atoms \[5, 17\] are not "
                                                 r"finite \(NaN or inf\).*fix or remove those atoms") as info:
            _call(model, atoms, bad, state=state)
        assert info.value.name == "positions" and info.value.rows == (5, 17)
    bad = atoms.positions.copy()
    bad[3, 0] = np.nan
    with pytest.raises(NonFiniteError, match=r"mpnn: positions of atoms \[3\]"):  # prepare's own check
        model.prepare(bad, atoms.numbers, atoms.cell.array, True)
    cell = atoms.cell.array.copy()
    cell[1, 2] = np.nan
    with pytest.raises(NonFiniteError, match=r"cell entries \[\(1, 2\)\] \(row = lattice vector"):
        _call(model, atoms, cell=cell, state=state)


def test_a_stage_output_that_is_nan_is_named_with_its_atom(faulty):
    w, model, atoms, state = faulty
    w.fault = ("forward", atoms.positions[11], atoms.cell.array)
    with pytest.raises(NonFiniteError, match=r"DistributedMLIP.evaluate: the model returned a non-finite 'energy'.*"
                                             r"The forward of mpnn's interaction\(1\) \(output 1\) gave NaN or inf "
                                             r"first, on atoms \[11\]") as info:
        _call(model, atoms, state=state)
    assert info.value.name == "energy"


def test_a_backward_that_is_nan_is_named_with_its_atom(faulty):
    w, model, atoms, state = faulty
    w.fault = ("backward", atoms.positions[6], atoms.cell.array)
    with pytest.raises(NonFiniteError, match=r"non-finite 'forces' \(NaN or inf\) on atoms \[6\].*The forward of "
                                             r"every stage is finite, but the backward of mpnn's interaction\(1\) "
                                             r"gave NaN or inf first \(its gradient with respect to its positions\), "
                                             r"on atoms \[6\]") as info:
        _call(model, atoms, state=state)
    assert info.value.rows == (6,)


def test_an_atom_on_another_atoms_periodic_image_is_refused_with_both_ids(faulty):
    """Atom 9 moved onto atom 20's image one lattice vector away (a zero-length edge: MACE's own forward gives
    NaN there, the distributed run gave a finite energy): the layout refuses it before anything runs."""
    from nvalchemi_jaxbridge.layout.coincident import CoincidentAtomsError

    _, model, atoms, _ = faulty
    same = atoms.copy()
    same.positions[9] = same.positions[20] + same.cell.array[0]
    with pytest.raises(CoincidentAtomsError, match=r"HaloPlan.build: coincident atoms, closer than 1e-08 Å: "
                                                   r"atom 9 and atom 20's periodic image shifted by lattice vector "
                                                   r"\[1, 0, 0\]") as info:
        _call(model, same)
    assert info.value.pairs == ((9, 20, (1, 0, 0)),)


def test_the_diagnosis_finds_nothing_in_a_sound_model(faulty):
    w, _, atoms, _ = faulty
    assert explain_wrapper(w, atoms.positions, atoms.numbers, atoms.cell.array, True).startswith("No stage")


@pytest.mark.parametrize("change, error, match", [
    (dict(dt=np.nan), NonFiniteError, r"nve: dt is nan fs, not a finite number"),
    (dict(dt=0.0), ValueError, r"nve: dt must be > 0 fs, got 0.0"),
    (dict(masses={4: 0.0}), ValueError, r"nve: masses of atoms \[4\] are <= 0 \(e.g. 0.0 amu\)"),
    (dict(masses={2: np.nan}), NonFiniteError, r"nve: masses of atoms \[2\] are not finite"),
    (dict(positions={7: np.nan}), NonFiniteError, r"nve: positions of atoms \[7\] are not finite"),
    (dict(velocities={1: np.inf}), NonFiniteError, r"nve: velocities of atoms \[1\] are not finite"),
])
def test_nve_refuses_a_bad_mass_time_step_or_state_before_the_run(faulty, change, error, match):
    _, model, atoms, _ = faulty
    arrays = {"positions": atoms.positions.copy(), "velocities": np.zeros((len(atoms), 3)),
              "masses": atoms.get_masses().copy()}
    for name, rows in change.items():
        if name in arrays:
            for row, value in rows.items():
                arrays[name][row] = value
    with pytest.raises(error, match=match):
        nve(model, arrays["positions"], arrays["velocities"], arrays["masses"], atoms.numbers, atoms.cell.array,
            True, steps=2, dt=change.get("dt", 1.0))


def test_nve_names_the_step_where_the_model_first_returns_nan_inside_a_chunk(faulty):
    """Atom 0 (Au) runs at its nearest neighbour; the fault makes its energy NaN below a distance that an
    independent one-device trajectory (ASE neighbour lists) crosses between steps 2 and 3."""
    w, model, atoms, _ = faulty
    masses = atoms.get_masses()
    d0 = atoms.get_distances(0, range(1, len(atoms)), mic=True)
    k = 1 + int(np.argmin(d0))
    v = np.zeros((len(atoms), 3))
    v[0] = 0.06 * atoms.get_distance(0, k, mic=True, vector=True) / d0[k - 1]  # Å/fs toward atom k
    want = reference_nve(w.model, atoms, w.cutoff, w.node_attrs(atoms.numbers), v, masses, steps=4, dt=1.0)
    gap = []
    for x in want:
        a = atoms.copy()
        a.positions = x
        gap.append(a.get_distances(0, range(1, len(a)), mic=True).min())
    assert gap[0] > gap[1] > gap[2] > gap[3]  # closing in, step after step
    w.fault = ("closer", (gap[2] + gap[3]) / 2)
    with pytest.raises(NonFiniteError, match=r"nve: step 3: the model returned non-finite energy \(NaN or inf\) "
                                             r"at finite positions.*The forward of mpnn's node_energies \(output 0\) "
                                             r"gave NaN or inf first, on atoms \[0\]"):
        nve(model, atoms.positions, v, masses, atoms.numbers, atoms.cell.array, True, steps=6, dt=1.0,
            check_every=4)


def test_an_mliap_model_refuses_a_nan_coordinate_and_names_itself_for_a_nan_result():
    from nvalchemi_jaxbridge.demo.mliap_models import MLIAPLennardJones

    atoms = alloy((2, 2, 2))
    model = DistributedMLIP(MLIAPLennardJones(), n_devices=2)
    state = model.prepare(atoms.positions, atoms.numbers, atoms.cell.array, True)
    assert np.isfinite(_call(model, atoms, state=state)["energy"])
    bad = atoms.positions.copy()
    bad[30, 2] = np.nan
    with pytest.raises(NonFiniteError, match=r"DistributedMLIP.evaluate: positions of atoms \[30\] are not finite"):
        _call(model, atoms, bad, state=state)
    broken = DistributedMLIP(MLIAPLennardJones(epsilon=float("nan")), n_devices=2)  # the model returns NaN
    with pytest.raises(NonFiniteError, match=r"the model returned a non-finite 'energy'.*It came from the ML-IAP "
                                             r"model .*compute_forces"):
        _call(broken, atoms)
