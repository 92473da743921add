"""HaloPlan: ownership, pair coverage under periodic images, row layout, exchange identities."""

from __future__ import annotations

import itertools
import logging
import math

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from nvalchemi_jaxbridge.layout import HaloOverflowError, HaloPlan
from nvalchemi_jaxbridge.layout.capacity import GROWTH

from ._reference import assert_pairs_covered


def _heights(cell: np.ndarray) -> np.ndarray:
    """Perpendicular widths of a full-rank cell (volume / face area)."""
    vol = abs(np.linalg.det(cell))
    return vol / np.array([np.linalg.norm(np.cross(cell[(k + 1) % 3], cell[(k + 2) % 3])) for k in range(3)])


@st.composite
def systems(draw):
    """A random system: cell (orthorhombic or triclinic), flags, positions, cutoff, devices, grid.

    Hypothesis picks the seed and the structural choices; numbers come from a
    seeded generator so that early (simple) examples are not all tiny.
    """
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n_atoms = int(rng.integers(2, 21))
    n_devices = int(rng.integers(1, 9))
    periodic = tuple(bool(p) for p in rng.integers(0, 2, 3))
    lengths = rng.uniform(3.0, 8.0, 3)
    cell = np.diag(lengths)
    if draw(st.booleans()):  # triclinic: tilt b along a, c along a and b
        cell[1, 0], cell[2, 0], cell[2, 1] = rng.uniform(-0.45, 0.45, 3) * lengths[[1, 2, 2]]
    kind = draw(st.sampled_from(["uniform", "piled", "unwrapped"]))
    frac = rng.uniform(0.0, 1.0, (n_atoms, 3))
    if kind == "piled":  # all atoms in one small region: one busy domain, the rest empty
        frac = rng.uniform(0.0, 1.0, 3) + rng.uniform(0.0, 0.08, (n_atoms, 3))
    elif kind == "unwrapped":  # caller coordinates outside the cell on periodic axes
        frac = frac + rng.integers(-1, 2, (n_atoms, 3)) * np.array(periodic)
    positions = frac @ cell
    cutoff = float(rng.choice([0.3, 0.6, 1.2]) * _heights(cell).min())  # 1.2: beyond half the box
    skin = float(rng.choice([0.0, 0.4]))
    grid = None
    if draw(st.booleans()):
        options = [g for g in itertools.product(range(1, 9), repeat=3) if np.prod(g) == n_devices]
        grid = options[int(rng.integers(len(options)))]
    return positions, cell, periodic, cutoff, skin, n_devices, grid


def _check_ownership(plan: HaloPlan) -> None:
    """Every atom owned exactly once; halo blocks start with the owned rows."""
    ids = plan.owned_global[plan.owned_mask]
    assert sorted(ids.tolist()) == list(range(plan.n_atoms))
    assert np.all(plan.owned_global[~plan.owned_mask] == -1)
    np.testing.assert_array_equal(plan.n_owned, plan.owned_mask.sum(axis=1))
    np.testing.assert_array_equal(plan.halo_global[:, : plan.owned_capacity][plan.owned_mask], ids)
    assert plan.ghost_capacity >= plan.n_ghost.max() + 1  # the "+1" pad row always exists
    assert np.all(plan.halo_global[~plan.halo_mask] == -1)
    assert np.all(plan.halo_global[plan.halo_mask] >= 0)


def _unwrap_frames(plan: HaloPlan, positions: np.ndarray) -> np.ndarray:
    """`floor` of each atom's fractional coordinates on periodic axes, 0 elsewhere (recomputed here)."""
    frac = np.linalg.solve(plan.basis.T, positions.T).T
    return np.where(np.array(plan.periodic), np.floor(frac), 0).astype(np.int64)


def _check_row_order(plan: HaloPlan, positions: np.ndarray) -> None:
    """Ghosts by source rank ascending; per group direct ghosts by owned row, then shifted images.

    Every real row's offset moves its atom from the caller's frame into the wrapped one.
    """
    owner, local = plan.owner, plan.local_index
    frame = _unwrap_frames(plan, positions)
    np.testing.assert_array_equal(plan.frame, frame)
    for d in range(plan.n_devices):
        rows = slice(plan.n_owned[d], plan.n_padded[d])
        g, img = plan.halo_global[d, rows], plan.halo_image[d, rows]
        shifted = img.any(axis=1)
        assert not np.any((owner[g] == d) & ~shifted), "an owned atom appears as an unshifted ghost"
        keys = [(int(owner[a]), bool(s), int(local[a]), *t.tolist()) for a, s, t in zip(g, shifted, img)]
        assert keys == sorted(keys) and len(set(keys)) == len(keys)
        real = slice(0, plan.n_padded[d])
        g, img = plan.halo_global[d, real], plan.halo_image[d, real]
        assert not img[: plan.n_owned[d]].any()
        np.testing.assert_allclose(plan.halo_offset[d, real], (img - frame[g]) @ plan.cell, rtol=0, atol=1e-12)


def _check_wrapped_frame(plan: HaloPlan, positions: np.ndarray) -> None:
    """Owned halo rows lie inside the cell on periodic axes; every real row is a lattice image of its atom."""
    halo = plan.to_halo(positions, positions=True).reshape(plan.n_devices, plan.halo_rows, 3)
    frac = np.linalg.solve(plan.basis.T, halo[plan.halo_owned_mask].T).T[:, np.array(plan.periodic)]
    assert np.all((frac > -1e-9) & (frac < 1 + 1e-9))
    ids = plan.halo_global[plan.halo_mask]
    lattice = np.linalg.solve(plan.basis.T, (halo[plan.halo_mask] - positions[ids]).T).T
    np.testing.assert_allclose(lattice, np.round(lattice), rtol=0, atol=1e-9)
    assert not np.round(lattice)[:, ~np.array(plan.periodic)].any()


def _check_exchanges(plan: HaloPlan, positions: np.ndarray, rng: np.random.Generator) -> None:
    """Table exchanges agree with the id layout; reverse is the transpose of forward."""
    x = rng.normal(size=(plan.n_atoms, 2))
    np.testing.assert_array_equal(plan.reference_forward(plan.to_owned(x)), plan.to_halo(x))
    np.testing.assert_allclose(
        plan.reference_forward(plan.to_owned(positions, positions=True), positions=True),
        plan.to_halo(positions, positions=True), rtol=0, atol=1e-12)
    np.testing.assert_array_equal(plan.from_owned(plan.to_owned(x)), x)
    u = rng.normal(size=(plan.n_devices * plan.owned_capacity, 2))
    v = rng.normal(size=(plan.n_devices * plan.halo_rows, 2))
    lhs = np.vdot(plan.reference_forward(u), v)
    rhs = np.vdot(u, plan.reference_reverse(v))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-12)
    # reverse(forward(ones)) = 1 + number of ghost copies of each atom (counted from the id tables)
    copies = np.bincount(plan.halo_global[plan.halo_mask], minlength=plan.n_atoms) - 1
    got = plan.from_owned(plan.reference_reverse(plan.reference_forward(plan.to_owned(np.ones(plan.n_atoms)))))
    np.testing.assert_array_equal(got, 1 + copies)
    # forward, zero the ghosts, reverse = identity
    halo = plan.reference_forward(plan.to_owned(x)).reshape(plan.n_devices, plan.halo_rows, 2)
    halo[~plan.halo_owned_mask] = 0
    np.testing.assert_array_equal(plan.from_owned(plan.reference_reverse(halo.reshape(-1, 2))), x)


def _check_parking(plan: HaloPlan, positions: np.ndarray) -> None:
    """Padding rows are parked > 2 (cutoff + skin) from each other and from every real row."""
    reach = plan.cutoff + plan.skin
    halo = plan.to_halo(positions, positions=True).reshape(plan.n_devices, plan.halo_rows, 3)
    owned = plan.to_owned(positions, positions=True).reshape(plan.n_devices, plan.owned_capacity, 3)
    for d in range(plan.n_devices):
        for block, mask in ((halo[d], plan.halo_mask[d]), (owned[d], plan.owned_mask[d])):
            pad, real = block[~mask], block[mask]
            dist = np.linalg.norm(pad[:, None] - np.concatenate([pad, real])[None], axis=2)
            dist[np.arange(len(pad)), np.arange(len(pad))] = np.inf
            assert dist.min(initial=np.inf) > 2 * reach


@hypothesis.given(systems())
def test_random_systems_are_owned_covered_and_exchanged(system):
    positions, cell, periodic, cutoff, skin, n_devices, grid = system
    plan = HaloPlan.build(positions, cell, periodic=periodic, cutoff=cutoff, skin=skin, n_devices=n_devices, grid=grid)
    assert np.prod(plan.grid) == n_devices
    _check_ownership(plan)
    hypothesis.note(f"{assert_pairs_covered(plan, positions, cell, cutoff + skin)} pairs checked")
    _check_row_order(plan, positions)
    _check_wrapped_frame(plan, positions)
    _check_exchanges(plan, positions, np.random.default_rng(0))
    _check_parking(plan, positions)
    ghost = plan.halo_mask & ~plan.halo_owned_mask
    self_images = np.any(plan.owner[plan.halo_global[ghost]] == np.nonzero(ghost)[0])
    assert (0 in plan.offsets) == bool(self_images)


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
@hypothesis.given(systems())
def test_without_self_images_the_rows_and_own_images_are_the_plans_ghosts(system):
    """`self_images=False` moves exactly the images of a device's own atoms out of its rows into
    `own_images` (owned row, shift), and keeps only the images within reach of an owned atom; their
    exchanges and the coverage stay."""
    positions, cell, periodic, cutoff, skin, n_devices, grid = system
    kw = dict(periodic=periodic, cutoff=cutoff, skin=skin, n_devices=n_devices, grid=grid)
    full = HaloPlan.build(positions, cell, **kw)
    lean = HaloPlan.build(positions, cell, self_images=False, **kw)
    _check_ownership(lean)
    _check_exchanges(lean, positions, np.random.default_rng(0))
    assert 0 not in lean.offsets and lean.self_images is False and full.self_images is True
    assert all(len(o) == 0 for o in full.own_images)
    for d in range(n_devices):
        rows = range(full.n_owned[d], full.n_padded[d])
        ghosts = {(int(full.halo_global[d, r]), *map(int, full.halo_image[d, r])) for r in rows}
        kept = {(int(lean.halo_global[d, r]), *map(int, lean.halo_image[d, r]))
                for r in range(lean.n_owned[d], lean.n_padded[d])}
        own = {(int(lean.owned_global[d, o[0]]), *map(int, o[1:])) for o in lean.own_images[d]}
        # the lean plan keeps the search box's images within reach of an owned atom (the full one keeps all)
        assert kept | own <= ghosts and not kept & own
        pos_w = positions - full.frame @ full.basis
        owned = pos_w[full.owned_global[d, : full.n_owned[d]]]
        reach = cutoff + skin
        for a, *t in ghosts:
            near = np.linalg.norm(owned - (pos_w[a] + np.array(t) @ full.basis), axis=1).min() <= reach
            assert near == ((a, *t) in kept | own), (a, t)
        assert all(lean.owner[a] != d for a, *_ in kept) and all(lean.owner[a] == d for a, *_ in own)
        assert len(own) == len(lean.own_images[d])  # listed once each
    if n_devices == 1:
        assert lean.n_ghost[0] == 0  # one device: no ghost rows at all
    rebuilt = lean.rebuild(positions)
    assert rebuilt.self_images is False and all(
        np.array_equal(a, b) for a, b in zip(rebuilt.own_images, lean.own_images))


def test_golden_two_rank_vectors():
    # A non-periodic chain with a zero cell: rank 0 owns g0-g2 and borrows g3; rank 1 owns g3-g5, borrows g1, g2.
    x = np.array([0.0, 1.5, 1.6, 3.0, 5.0, 6.0])
    positions = np.stack([x, np.zeros(6), np.zeros(6)], axis=1)
    plan = HaloPlan.build(positions, np.zeros((3, 3)), periodic=(False,) * 3, cutoff=1.6, n_devices=2, grid=(2, 1, 1))
    np.testing.assert_array_equal(plan.n_owned, [3, 3])
    np.testing.assert_array_equal(plan.n_padded, [4, 5])
    np.testing.assert_array_equal(plan.halo_global[0, :4], [0, 1, 2, 3])
    np.testing.assert_array_equal(plan.halo_global[1, :5], [3, 4, 5, 1, 2])
    halo = plan.reference_forward(plan.to_owned(10.0 * np.arange(6) + 1)).reshape(2, plan.halo_rows)
    np.testing.assert_array_equal(halo[0, :4], [1, 11, 21, 31])
    np.testing.assert_array_equal(halo[1, :5], [31, 41, 51, 11, 21])
    ones = np.zeros((2, plan.halo_rows))
    ones[plan.halo_mask] = 1.0
    owned = plan.reference_reverse(ones.reshape(-1)).reshape(2, plan.owned_capacity)
    np.testing.assert_array_equal(owned[0, :3], [1, 2, 2])
    np.testing.assert_array_equal(owned[1, :3], [2, 1, 1])


def test_thin_box_gives_self_images_at_offset_zero():
    # One atom, cutoff 2.5 box lengths: the atom must see its own images up to |t| = 2 on each axis.
    cell = np.diag([2.0, 2.0, 2.0])
    plan = HaloPlan.build(np.array([[0.3, 0.2, 1.9]]), cell, cutoff=5.0, n_devices=1)
    assert plan.offsets == (0,)
    images = {tuple(t) for t in plan.halo_image[0, 1 : plan.n_padded[0]].tolist()}
    want = {t for t in itertools.product(range(-3, 4), repeat=3) if 0 < np.linalg.norm(np.array(t) * 2.0) <= 5.0}
    assert want <= images
    assert_pairs_covered(plan, plan.reference_positions, cell, 5.0)


@st.composite
def image_variants(draw):
    """One system given three ways: wrapped, nudged across the faces it is near, shifted by random images.

    Returns `(cell, periodic, cutoff, n_devices, grid, {name: positions})`. Fractional
    coordinates keep 1e-6 away from the faces so that rounding cannot move an atom
    to the other side of one.
    """
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n_atoms = int(rng.integers(2, 41))
    n_devices = draw(st.sampled_from([1, 2, 3, 4, 8]))
    periodic = tuple(bool(p) for p in rng.integers(0, 2, 3)) if draw(st.booleans()) else (True, True, True)
    lengths = rng.uniform(4.0, 9.0, 3)
    cell = np.diag(lengths)
    if draw(st.booleans()):
        cell[1, 0], cell[2, 0], cell[2, 1] = rng.uniform(-0.4, 0.4, 3) * lengths[[1, 2, 2]]
    frac = rng.uniform(1e-6, 1.0 - 1e-6, (n_atoms, 3))
    per = np.array(periodic)
    nudge = np.where(frac < 0.1, 1, np.where(frac > 0.9, -1, 0)) * per  # just above L / just below 0
    shift = rng.integers(-2, 3, (n_atoms, 3)) * per
    cutoff = float(rng.choice([0.3, 0.6, 1.2]) * _heights(cell).min())
    grid = draw(st.sampled_from([None, "slabs"]))
    grid = (n_devices, 1, 1) if grid == "slabs" else None
    variants = {"wrapped": frac @ cell, "nudged": (frac + nudge) @ cell, "shifted": (frac + shift) @ cell}
    return cell, periodic, cutoff, n_devices, grid, variants


def _rows(plan: HaloPlan, positions: np.ndarray) -> list[list[tuple]]:
    """Per device, the sorted (atom, rounded wrapped-frame position) multiset of its ghost rows."""
    halo = plan.to_halo(positions, positions=True).reshape(plan.n_devices, plan.halo_rows, 3)
    ghost = plan.halo_mask & ~plan.halo_owned_mask
    return [sorted((int(g), *np.round(p, 6).tolist()) for g, p in zip(plan.halo_global[d][ghost[d]], halo[d][ghost[d]]))
            for d in range(plan.n_devices)]


@pytest.mark.slow
@hypothesis.given(image_variants())
def test_any_periodic_image_gives_the_wrapped_plan(system):
    cell, periodic, cutoff, n_devices, grid, variants = system
    plans = {k: HaloPlan.build(p, cell, periodic=periodic, cutoff=cutoff, n_devices=n_devices, grid=grid)
             for k, p in variants.items()}
    want, pos_w = plans["wrapped"], variants["wrapped"]
    assert not want.frame.any()
    halo_w = want.to_halo(pos_w, positions=True)
    for name in ("nudged", "shifted"):
        plan, pos = plans[name], variants[name]
        np.testing.assert_array_equal(plan.owner, want.owner, err_msg=name)
        np.testing.assert_array_equal(plan.n_ghost, want.n_ghost, err_msg=name)
        np.testing.assert_array_equal(plan.halo_global, want.halo_global, err_msg=name)
        assert _rows(plan, pos) == _rows(want, pos_w), name
        np.testing.assert_allclose(plan.to_halo(pos, positions=True), halo_w, rtol=0, atol=1e-9, err_msg=name)
        np.testing.assert_allclose(
            plan.reference_forward(plan.to_owned(pos, positions=True), positions=True), halo_w, rtol=0, atol=1e-9)
        _check_row_order(plan, pos)
        _check_wrapped_frame(plan, pos)
        assert_pairs_covered(plan, pos, cell, cutoff)


def test_nudged_plan_survives_moves_across_faces_until_rewrapped():
    # Atoms just outside the cell; they drift back and forth across the faces by < skin / 2.
    rng = np.random.default_rng(11)
    cell = np.diag([9.0, 8.0, 7.0])
    frac = rng.uniform(0.0, 1.0, (80, 3))
    frac[:20] = rng.uniform(-0.02, 0.0, (20, 3))  # just below 0
    frac[20:40] = rng.uniform(1.0, 1.02, (20, 3))  # just above L
    positions = frac @ cell
    plan = HaloPlan.build(positions, cell, cutoff=2.0, skin=0.6, n_devices=4)
    wrapped = HaloPlan.build(positions - np.floor(frac) @ cell, cell, cutoff=2.0, skin=0.6, n_devices=4)
    np.testing.assert_array_equal(plan.n_ghost, wrapped.n_ghost)
    step = rng.normal(size=positions.shape)
    moved = positions + 0.29 * step / np.linalg.norm(step, axis=1, keepdims=True)
    assert not plan.needs_rebuild(moved)
    assert_pairs_covered(plan, moved, cell, 2.0)
    rewrapped = moved.copy()
    rewrapped[0] += cell[0]  # the caller wraps one atom: its stored shift into the frame is stale
    assert plan.needs_rebuild(rewrapped)
    assert plan.max_displacement(rewrapped) == pytest.approx(plan.max_displacement(moved))
    assert "atoms given outside the cell: 40 " in plan.describe()
    assert "outside the cell" not in wrapped.describe()


def test_random_images_build_as_fast_as_wrapped():
    # 1e5 atoms, each shifted by -1, 0 or +1 cells per axis: same ghosts, about the same build time.
    import time

    rng = np.random.default_rng(0)
    n, length = 100_000, 167.0  # argon-like density
    cell = np.diag([length] * 3)
    wrapped = rng.uniform(0.0, length, (n, 3))
    shifted = wrapped + rng.integers(-1, 2, (n, 3)) * length
    seconds, plans = [], []
    for pos in (wrapped, shifted):
        t0 = time.perf_counter()
        plans.append(HaloPlan.build(pos, cell, cutoff=8.5, skin=1.0, n_devices=8))
        seconds.append(time.perf_counter() - t0)
    np.testing.assert_array_equal(plans[1].n_ghost, plans[0].n_ghost)
    np.testing.assert_array_equal(plans[1].halo_global, plans[0].halo_global)
    assert seconds[1] < 3.0 * seconds[0] + 0.5, f"build took {seconds[1]:.2f} s shifted vs {seconds[0]:.2f} s wrapped"


def test_zero_cell_row_on_a_non_periodic_axis():
    rng = np.random.default_rng(5)
    cell = np.array([[7.0, 0.0, 0.0], [1.0, 6.0, 0.0], [0.0, 0.0, 0.0]])  # slab, vacuum along z
    positions = rng.uniform(0.0, 1.0, (30, 3)) * [7.0, 6.0, 20.0]
    plan = HaloPlan.build(positions, cell, periodic=(True, True, False), cutoff=2.5, n_devices=6)
    _check_ownership(plan)
    assert_pairs_covered(plan, positions, cell, 2.5)


def _slab_system(n: int = 60, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    cell = np.diag([20.0, 6.0, 6.0])
    return rng.uniform(0.0, 1.0, (n, 3)) * [20.0, 6.0, 6.0], cell


def test_overflow_raises_with_capacity_and_needed_value():
    positions, cell = _slab_system()
    plan = HaloPlan.build(positions, cell, cutoff=2.0, skin=0.5, n_devices=2, grid=(2, 1, 1), headroom=1.0)
    # squeeze every atom towards the rank boundary at x = 10: many more ghosts
    squeezed = positions.copy()
    squeezed[:, 0] = 10.0 + (positions[:, 0] - 10.0) * 0.15
    with pytest.raises(HaloOverflowError, match=r"ghost_capacity needs (\d+) .* reserves (\d+).*ghost_capacity=\d+") as err:
        plan.rebuild(squeezed, on_overflow="raise")
    needed, reserved = err.value.overflows["ghost_capacity"]
    assert reserved == plan.ghost_capacity and needed > reserved
    grown = plan.rebuild(squeezed)  # default: re-plan with larger capacities
    assert "ghost_capacity" in grown.grown and grown.ghost_capacity >= needed
    assert grown.n_ghost.max() + 1 == needed
    assert grown.n_owned.sum() == len(positions)
    _check_ownership(grown)
    assert_pairs_covered(grown, squeezed, cell, 2.5)


def test_owned_and_pair_overflow_name_their_capacity():
    positions, cell = _slab_system()
    plan = HaloPlan.build(positions, cell, cutoff=2.0, n_devices=2, grid=(2, 1, 1), headroom=1.0)
    piled = positions.copy()
    piled[:, 0] = 2.0 + 0.1 * positions[:, 0]  # all atoms in rank 0's half
    with pytest.raises(HaloOverflowError, match=rf"owned_capacity needs {len(positions)} .*owned_capacity=\d+"):
        plan.rebuild(piled, on_overflow="raise")
    replanned = plan.rebuild(piled)
    assert replanned.owned_capacity >= len(positions) and replanned.n_owned.sum() == len(positions)
    with pytest.raises(HaloOverflowError, match=r"pair_capacities\[1\] needs 37 .*pair_capacities=\{0: \d+, 1: \d+\}"):
        HaloPlan.build(positions, cell, cutoff=2.0, n_devices=2, grid=(2, 1, 1), pair_capacities=1, on_overflow="raise")


def test_rebuild_keeps_capacities_and_offsets():
    positions, cell = _slab_system(seed=1)
    plan = HaloPlan.build(positions, cell, cutoff=2.0, skin=1.0, n_devices=4, grid=(4, 1, 1), headroom=2.0)
    moved = positions + np.random.default_rng(2).uniform(-0.1, 0.1, positions.shape)
    new = plan.rebuild(moved, on_overflow="raise")
    assert (new.owned_capacity, new.ghost_capacity, new.offsets, new.pair_capacities) == (
        plan.owned_capacity, plan.ghost_capacity, plan.offsets, plan.pair_capacities)
    assert new.grown == ()
    assert_pairs_covered(new, moved, cell, 3.0)


def test_plan_stays_valid_within_half_skin():
    # Atoms move less than skin / 2: every pair within cutoff *now* is still in the old plan's halo.
    positions, cell = _slab_system(seed=4)
    plan = HaloPlan.build(positions, cell, cutoff=2.0, skin=1.0, n_devices=4)
    rng = np.random.default_rng(6)
    step = rng.normal(size=positions.shape)
    moved = positions + 0.49 * step / np.linalg.norm(step, axis=1, keepdims=True)
    assert not plan.needs_rebuild(moved)
    # the old tables with the new positions: same rows, halo positions follow the atoms
    assert_pairs_covered(plan, moved, cell, 2.0)


def test_max_displacement_minimum_image_and_rewrap():
    cell = np.diag([5.0, 5.0, 5.0])
    positions = np.array([[0.1, 2.0, 2.0], [2.5, 2.5, 2.5]])
    plan = HaloPlan.build(positions, cell, cutoff=1.0, skin=0.4, n_devices=1)
    moved = positions.copy()
    moved[0, 0] = 4.95  # crossed x = 0 and was wrapped: a move of 0.15
    np.testing.assert_allclose(plan.max_displacement(moved), 0.15, rtol=1e-12)
    assert plan.needs_rebuild(moved)  # re-wrapped: the stored image shifts no longer apply
    small = positions + [0.0, 0.19, 0.0]
    assert plan.max_displacement(small) == pytest.approx(0.19) and not plan.needs_rebuild(small)
    assert plan.needs_rebuild(positions + [0.0, 0.21, 0.0])
    with pytest.raises(ValueError, match=r"shape \(3, 3\), the plan has \(2, 3\)"):
        plan.max_displacement(np.zeros((3, 3)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"positions": np.zeros((4, 2))}, r"positions must be a numeric \(N, 3\) array"),
        ({"positions": np.full((2, 3), np.nan)}, r"positions of atoms \[0, 1\] are not finite"),
        ({"cell": np.diag([4.0, 0.0, 4.0])}, r"lattice vector 1 \(cell\[1\]\) is zero but axis 1 is periodic"),
        ({"cell": np.ones((3, 3))}, r"cell is singular"),
        ({"grid": (2, 2, 1)}, r"grid \(2, 2, 1\) must have 3 entries whose product is n_devices=2"),
        ({"headroom": 0.9}, r"headroom must be >= 1.0"),
        ({"on_overflow": "drop"}, r"on_overflow must be 'replan' or 'raise', got 'drop'"),
        ({"pair_capacities": {5: 10}}, r"pair_capacities key 5 is not a rank offset in \[0, 2\)"),
        ({"cutoff": -1.0}, r"cutoff must be a finite number > 0"),
        ({"periodic": (True, True)}, r"periodic must be three bools"),
        ({"ghost_capacity": 0}, r"ghost_capacity must be an int >= 1"),
    ],
)
def test_build_errors_say_what_and_how(kwargs, match):
    args = {"positions": np.random.default_rng(0).uniform(0, 4, (5, 3)), "cell": np.eye(3) * 4.0,
            "cutoff": 1.0, "n_devices": 2}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        HaloPlan.build(args.pop("positions"), args.pop("cell"), **args)


def test_layout_helpers_check_shapes_and_plan_is_readonly():
    positions, cell = _slab_system(n=10)
    plan = HaloPlan.build(positions, cell, cutoff=2.0, n_devices=2)
    with pytest.raises(ValueError, match=r"to_halo: expected 10 rows \(one per atom\), got shape \(9,\)"):
        plan.to_halo(np.zeros(9))
    with pytest.raises(ValueError, match=r"reference_forward: expected owned storage with D \* \d+ = \d+ rows"):
        plan.reference_forward(np.zeros(3))
    with pytest.raises(ValueError, match=r"positions=True\): expected float positions of shape \(10, 3\)"):
        plan.to_owned(np.zeros((10, 2)), positions=True)
    with pytest.raises(ValueError, match=r"rebuild: positions have shape \(4, 3\) but the plan has 10 atoms"):
        plan.rebuild(np.zeros((4, 3)))
    with pytest.raises(ValueError, match="read-only"):
        plan.send_idx[0][0, 0] = 1
    text = plan.describe(features=3, itemsize=8)
    assert f"grid {plan.grid}" in text and str(plan.n_owned.tolist()) in text
    assert f"{int(plan.n_ghost.sum()) * 24} bytes of ghosts" in text


def test_from_ase_reads_positions_cell_and_pbc():
    from ase.build import fcc111

    slab = fcc111("Cu", size=(4, 4, 3), vacuum=6.0)  # periodic in x, y only
    plan = HaloPlan.from_ase(slab, cutoff=4.0, n_devices=4, skin=0.5)
    want = HaloPlan.build(slab.positions, slab.cell.array, periodic=(True, True, False), cutoff=4.0, n_devices=4,
                          skin=0.5)
    assert plan.periodic == (True, True, False)
    np.testing.assert_array_equal(plan.owned_global, want.owned_global)
    np.testing.assert_array_equal(plan.halo_global, want.halo_global)
    with pytest.raises(TypeError, match=r"expected an ase.Atoms .*HaloPlan.build"):
        HaloPlan.from_ase(slab.positions, cutoff=4.0, n_devices=4)


@hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
@hypothesis.given(systems(), st.floats(0.2, 1.5), st.booleans(), st.booleans())
def test_growth_is_geometric_and_joint(system, scale, grow, grow_all):
    """Fixed capacities `scale` x what a fresh plan holds: each short one grows to at least GROWTH x itself, and
    so does every other one that has used part of its headroom (every other one with `grow_all`: one compilation
    for all); the rest are kept."""
    positions, cell, periodic, cutoff, skin, n_devices, grid = system
    kw = dict(periodic=periodic, cutoff=cutoff, skin=skin, n_devices=n_devices, grid=grid, headroom=1.2)
    fresh = HaloPlan.build(positions, cell, **kw)
    scaled = lambda c: max(1, int(c * scale))  # noqa: E731
    asked = {"owned_capacity": scaled(fresh.owned_capacity), "ghost_capacity": scaled(fresh.ghost_capacity),
             **{f"pair_capacities[{k}]": scaled(c) for k, c in zip(fresh.offsets, fresh.pair_capacities)}}
    plan = HaloPlan.build(positions, cell, owned_capacity=asked["owned_capacity"],
                          ghost_capacity=asked["ghost_capacity"], grow=grow, grow_all=grow_all,
                          pair_capacities={k: asked[f"pair_capacities[{k}]"] for k in fresh.offsets}, **kw)
    got = {"owned_capacity": plan.owned_capacity, "ghost_capacity": plan.ghost_capacity,
           **{f"pair_capacities[{k}]": c for k, c in zip(plan.offsets, plan.pair_capacities)}}
    need = {"owned_capacity": max(int(fresh.n_owned.max()), 1), "ghost_capacity": int(fresh.n_ghost.max()) + 1,
            **{f"pair_capacities[{k}]": int((s != fresh.owned_capacity).sum(axis=1).max())
               for k, s in zip(fresh.offsets, fresh.send_idx)}}
    short = {n for n in asked if asked[n] < need[n]}
    grown = {g.name: g for g in plan.growth}
    assert plan.grown == tuple(grown)
    assert short <= set(grown)
    if short or grow:  # a growth: every capacity whose fresh choice exceeds the asked one grows with it
        assert set(grown) == {n for n in asked if grow_all or _fresh(fresh, n) > asked[n]}
    else:
        assert not grown
    for name, cap in got.items():
        g = grown.get(name)
        if g is None:
            assert cap == asked[name]
        else:
            assert (g.old, g.new, g.needed) == (asked[name], cap, need[name])
            assert cap >= max(need[name], math.ceil(GROWTH * asked[name]), _fresh(fresh, name))
    _check_ownership(plan)
    _check_exchanges(plan, positions, np.random.default_rng(0))


def _fresh(plan: HaloPlan, name: str) -> int:
    """The capacity a plan without requested ones chose for `name`."""
    if name.startswith("pair_capacities["):
        return plan.pair_capacities[plan.offsets.index(int(name[16:-1]))]
    return getattr(plan, name)


def test_rebuild_logs_each_growth_once_with_old_and_new(caplog):
    positions, cell = _slab_system()
    plan = HaloPlan.build(positions, cell, cutoff=2.0, skin=0.5, n_devices=2, grid=(2, 1, 1), headroom=1.0)
    squeezed = positions.copy()
    squeezed[:, 0] = 10.0 + (positions[:, 0] - 10.0) * 0.15
    with caplog.at_level(logging.INFO, logger="nvalchemi_jaxbridge.layout"):
        grown = plan.rebuild(squeezed)
        again = grown.rebuild(squeezed)  # fits now: nothing grows, nothing logged
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and again.growth == ()
    assert f"ghost_capacity {plan.ghost_capacity} -> {grown.ghost_capacity}" in lines[0], lines
    assert all(str(g) in lines[0] for g in grown.growth)
