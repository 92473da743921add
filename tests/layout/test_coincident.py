"""Coincident atoms (an atom on another, or on a periodic image of another or of itself) are refused at plan
build, with the atom ids; legitimate structures, however close their atoms, are not (checked against a brute
force over lattice images that shares no code with the hash search)."""

from __future__ import annotations

import itertools

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from nvalchemi_jaxbridge.layout import HaloPlan
from nvalchemi_jaxbridge.layout.coincident import COINCIDENT_DISTANCE, CoincidentAtomsError, coincident_pairs

TRICLINIC = np.array([[5.0, 0.0, 0.0], [1.2, 4.6, 0.0], [0.7, -0.9, 4.8]])


def brute_pairs(pos: np.ndarray, cell: np.ndarray, periodic, tol: float) -> set[tuple[int, int]]:
    """Every `(i, j)`, `i < j`, with some image `pos[j] + n @ cell` (|n_k| <= 2 on periodic axes) within `tol`."""
    ranges = [range(-2, 3) if p else range(1) for p in periodic]
    out = set()
    for i, j in itertools.combinations(range(len(pos)), 2):
        for n in itertools.product(*ranges):
            if np.linalg.norm(pos[j] + np.asarray(n) @ cell - pos[i]) < tol:
                out.add((i, j))
    return out


def _build(pos, cell=TRICLINIC, periodic=(True, True, True), cutoff=3.0, n_devices=2):
    return HaloPlan.build(pos, cell, periodic=periodic, cutoff=cutoff, skin=0.5, n_devices=n_devices)


def _random(n: int, seed: int, cell=TRICLINIC) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.0, 1.0, (n, 3)) @ cell


def test_two_atoms_at_one_point_are_refused_with_their_ids():
    pos = _random(12, 0)
    pos[9] = pos[4]
    with pytest.raises(CoincidentAtomsError, match=r"HaloPlan.build: coincident atoms.*atom 4 and atom 9 \(0 Å "
                                                   r"apart\).*Remove the duplicate atoms") as info:
        _build(pos)
    assert info.value.pairs == ((4, 9, (0, 0, 0)),)


def test_an_atom_one_lattice_vector_from_another_is_refused_with_the_vector():
    pos = _random(12, 1)
    pos[7] = pos[2] + TRICLINIC[1] - TRICLINIC[2]  # what ASE's repeat leaves at fractional 0 and 1
    with pytest.raises(CoincidentAtomsError, match=r"atom 2 and atom 7's periodic image shifted by lattice vector "
                                                   r"\[0, -1, 1\]"):
        _build(pos)


def test_an_image_across_a_corner_of_a_small_cell_is_refused():
    """A cell thinner than 2 x cutoff (many images of each atom); the atoms at two opposite corners."""
    pos = _random(6, 2)
    pos[0] = [1e-14, 0.0, 0.0]
    pos[5] = TRICLINIC.sum(axis=0) - [1e-13, 0.0, 1e-13]
    with pytest.raises(CoincidentAtomsError, match=r"atom 0 and atom 5's periodic image shifted by lattice vector "
                                                   r"\[-1, -1, -1\]"):
        _build(pos, cutoff=6.0)


def test_a_slab_compares_images_along_periodic_axes_only():
    pos = _random(10, 3)
    pos[8] = pos[1] + TRICLINIC[2]  # one lattice vector apart along the open axis: two distinct atoms
    plan = _build(pos, periodic=(True, True, False))
    assert plan.n_atoms == 10
    pos[8] = pos[1] + TRICLINIC[0]  # along a periodic one: the same point
    with pytest.raises(CoincidentAtomsError, match=r"atom 1 and atom 8's periodic image shifted by lattice vector "
                                                   r"\[-1, 0, 0\]"):
        _build(pos, periodic=(True, True, False))


def test_an_atom_on_its_own_image_along_a_vanishing_axis_is_refused():
    cell = np.diag([5.0, 5.0, 1e-9])
    pos = np.array([[0.0, 0.0, 0.0], [2.0, 2.0, 0.0]])
    with pytest.raises(CoincidentAtomsError, match=r"periodic lattice vector 2 leaves a perpendicular width of "
                                                   r"1e-09 Å.*own periodic image"):
        _build(pos, cell=cell)


def test_atoms_just_beyond_the_distance_are_accepted_and_just_within_refused():
    pos = _random(8, 4)
    pos[6] = pos[3] + TRICLINIC[0] + [3 * COINCIDENT_DISTANCE, 0.0, 0.0]
    assert _build(pos).n_atoms == 8
    pos[6] = pos[3] + TRICLINIC[0] + [0.3 * COINCIDENT_DISTANCE, 0.0, 0.0]
    with pytest.raises(CoincidentAtomsError, match="atom 3 and atom 6"):
        _build(pos)


@hypothesis.given(n=st.integers(2, 30), seed=st.integers(0, 2**31 - 1),
                  periodic=st.sampled_from([(True, True, True), (True, True, False), (False, False, False)]),
                  scale=st.sampled_from([0.3, 1.0, 3.0]))
def test_random_structures_match_a_brute_force_over_images(n, seed, periodic, scale):
    """No false positives on structures without coincidences (the property), and every planted duplicate
    found (triclinic cells, slabs, open boundaries, cells far smaller and larger than the cutoff)."""
    rng = np.random.default_rng(seed)
    cell = TRICLINIC * scale
    pos = rng.uniform(-0.5, 1.5, (n, 3)) @ cell  # wrapped or not
    pos += rng.normal(scale=1e-3, size=pos.shape)
    want = brute_pairs(pos, cell, periodic, COINCIDENT_DISTANCE)
    got = {(i, j) for i, j, _, _ in coincident_pairs(pos, cell, periodic, limit=10**6)}
    assert got == want == set()
    assert _build(pos, cell=cell, periodic=periodic, cutoff=2.0).n_atoms == n
    # plant duplicates: an atom moved onto another one's image (a periodic shift only where periodic)
    k = int(rng.integers(1, n))
    shift = np.where(periodic, rng.integers(-1, 2, 3), 0) @ cell
    pos[k] = pos[0] + shift + rng.normal(scale=1e-10, size=3)
    want = brute_pairs(pos, cell, periodic, COINCIDENT_DISTANCE)
    got = {(i, j) for i, j, _, _ in coincident_pairs(pos, cell, periodic, limit=10**6)}
    assert got == want and (0, k) in got
