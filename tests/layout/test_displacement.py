"""The stale-layout test by minimum image: re-wrapping is never a move, a real move past skin/2 always is.

Triclinic cells, atoms shifted by random lattice vectors and moved by random vectors; the expected answer
comes from the moves the test made (their lengths), not from the code under test.
"""

from __future__ import annotations

import itertools

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from nvalchemi_jaxbridge.layout import HaloPlan
from nvalchemi_jaxbridge.layout.displacement import (StaleLayoutError, checked_positions, moved_atoms,
                                                     to_plan_image)

CUTOFF = 2.0


def shortest_lattice_vector(cell: np.ndarray) -> float:
    """Length of the shortest non-zero lattice vector (brute force over small integer combinations)."""
    combos = np.array([c for c in itertools.product(range(-3, 4), repeat=3) if any(c)], dtype=np.float64)
    return float(np.min(np.linalg.norm(combos @ cell, axis=1)))


@st.composite
def systems(draw):
    lengths = [draw(st.floats(6.0, 11.0)) for _ in range(3)]
    shear = [draw(st.floats(-0.45, 0.45)) for _ in range(3)]
    cell = np.diag(lengths)
    cell[1, 0] = shear[0] * lengths[0]
    cell[2, 0], cell[2, 1] = shear[1] * lengths[0], shear[2] * lengths[1]
    seed = draw(st.integers(0, 2**16))
    n = draw(st.integers(2, 24))
    skin = draw(st.floats(0.2, 1.0))
    periodic = tuple(draw(st.lists(st.booleans(), min_size=3, max_size=3)))
    hypothesis.assume(any(periodic))
    return cell, seed, n, skin, periodic


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(system=systems())
def test_lattice_shifts_are_never_moves_and_real_moves_past_half_the_skin_always_are(system):
    cell, seed, n, skin, periodic = system
    rng = np.random.default_rng(seed)
    pos = rng.uniform(-0.2, 1.2, (n, 3)) @ cell  # some atoms outside the cell, as callers give them
    plan = HaloPlan.build(pos, cell, periodic=periodic, cutoff=CUTOFF, skin=skin, n_devices=1)

    # whole lattice vectors on periodic axes: no displacement, and back at the plan's image exactly
    shifts = rng.integers(-3, 4, (n, 3)) * np.asarray(periodic)
    shifts[rng.random(n) < 0.3] = 0
    wrapped = pos + shifts @ cell
    bad, norm = moved_atoms(plan, wrapped)
    assert bad.size == 0 and np.all(norm < 1e-9)
    np.testing.assert_allclose(to_plan_image(plan, wrapped), pos, rtol=0, atol=1e-9)
    np.testing.assert_allclose(checked_positions(plan, wrapped, "t", "fix"), pos, rtol=0, atol=1e-9)

    # real moves, some within skin/2 and some beyond it (all shorter than half the shortest lattice vector,
    # so the move is its own minimum image), on top of the lattice shifts
    limit = 0.49 * shortest_lattice_vector(plan.basis)
    lengths = rng.uniform(0.0, min(limit, 2.0 * skin), n)
    lengths[np.abs(lengths - skin / 2) < 1e-6] += 2e-6  # nothing within rounding of the threshold
    direction = rng.normal(size=(n, 3))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    move = lengths[:, None] * direction * np.array([1.0 if p else 0.3 for p in periodic])
    want = np.flatnonzero(np.linalg.norm(move, axis=1) > skin / 2)
    bad, norm = moved_atoms(plan, wrapped + move)
    np.testing.assert_array_equal(bad, want)
    np.testing.assert_allclose(norm, np.linalg.norm(move, axis=1), rtol=0, atol=1e-9)
    if want.size:
        with pytest.raises(StaleLayoutError, match=rf"{want.size} atom\(s\) moved more than skin/2 = .*atoms "
                                                   rf"\d+ \(.*Re-plan first: fix"):
            checked_positions(plan, wrapped + move, "t", "fix")


def test_a_non_finite_position_counts_as_moved():
    cell = np.diag([8.0, 8.0, 8.0])
    pos = np.random.default_rng(0).uniform(0, 8, (6, 3))
    plan = HaloPlan.build(pos, cell, cutoff=CUTOFF, skin=0.4, n_devices=1)
    bad = pos.copy()
    bad[3, 1] = np.nan
    with pytest.raises(StaleLayoutError, match=r"a non-finite position does\): atoms 3 \(nan Å\)"):
        checked_positions(plan, bad, "here", "rebuild")


def test_rounding_to_float32_is_no_move_but_a_move_past_it_is():
    cell = np.diag([9.0, 9.0, 9.0])
    pos = np.random.default_rng(1).uniform(0, 9, (20, 3)) + 100.0  # far from the origin: float32 rounds ~4e-6 Å
    plan = HaloPlan.build(pos, cell, cutoff=CUTOFF, skin=0.0, n_devices=1)  # skin 0: any real move is stale
    f32 = pos.astype(np.float32)
    assert moved_atoms(plan, f32)[0].size == 0
    assert moved_atoms(plan, f32.astype(np.float64))[0].size == 20  # the same numbers in float64: moved
    moved = f32.copy()
    moved[7, 0] += np.float32(0.01)
    np.testing.assert_array_equal(moved_atoms(plan, moved)[0], [7])
