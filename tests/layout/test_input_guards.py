"""Plan construction refuses bad input before it allocates: types, positions, degenerate cells, huge plans."""

from __future__ import annotations

import re

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from nvalchemi_jaxbridge.layout import HaloPlan, ShardPlan, choose_grid
from nvalchemi_jaxbridge.layout import partition as partition_module
from nvalchemi_jaxbridge.layout.structure import checked_structure

from ._reference import assert_pairs_covered

BOX = 6.0


def _system(n: int = 12, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.uniform(0.0, BOX, (n, 3)), np.eye(3) * BOX


def _build(positions=None, cell=None, **kwargs):
    pos, box = _system()
    args = {"cutoff": 1.5, "n_devices": 2, **kwargs}
    return HaloPlan.build(pos if positions is None else positions, box if cell is None else cell, **args)


# ------------------------------------------------------------------ scalar arguments

NOT_NUMBERS = [
    "3.0", True, False, np.bool_(True), None, 1 + 0j, [2.0], b"2",
]


@pytest.mark.parametrize("name", ["cutoff", "skin", "headroom"])
@pytest.mark.parametrize("value", NOT_NUMBERS, ids=repr)
def test_numbers_of_the_wrong_type_are_type_errors_naming_the_argument(name, value):
    with pytest.raises(TypeError, match=rf"HaloPlan.build: {name} must be a real number \(int or float\), got "):
        _build(**{name: value})


@pytest.mark.parametrize("value", ["2", True, np.bool_(True), 2.0, None, np.float64(2.0)], ids=repr)
def test_n_devices_of_the_wrong_type_is_a_type_error(value):
    with pytest.raises(TypeError, match=r"HaloPlan.build: n_devices must be an int >= 1, got "):
        _build(n_devices=value)
    with pytest.raises(TypeError, match=r"choose_grid: n_devices must be an int >= 1, got "):
        choose_grid(value, np.eye(3), (True, True, True))


def test_numbers_of_the_right_type_keep_their_range_errors_and_numpy_scalars_pass():
    with pytest.raises(ValueError, match=r"cutoff must be a finite number > 0, got -1.0"):
        _build(cutoff=-1)
    with pytest.raises(ValueError, match=r"skin must be a finite number >= 0, got inf"):
        _build(skin=np.inf)
    with pytest.raises(ValueError, match=r"headroom must be >= 1.0"):
        _build(headroom=0.5)
    with pytest.raises(ValueError, match=r"n_devices must be an int >= 1, got 0"):
        _build(n_devices=0)
    want = _build(headroom=2.0)
    got = _build(cutoff=np.float32(1.5), skin=np.array(0.0), headroom=np.int64(2), n_devices=np.int64(2))
    with pytest.raises(TypeError, match=r"cutoff must be a real number \(int or float\), got ndarray"):
        _build(cutoff=np.array(True))
    np.testing.assert_array_equal(got.owned_global, want.owned_global)
    np.testing.assert_array_equal(got.halo_global[got.halo_mask], want.halo_global[want.halo_mask])


def test_shard_plan_headroom_and_devices_types():
    with pytest.raises(TypeError, match=r"ShardPlan.from_assignment: headroom must be a real number"):
        ShardPlan.from_assignment(np.zeros(4, int), headroom="1.2")
    with pytest.raises(TypeError, match=r"ShardPlan.from_assignment: n_devices must be an int >= 1, got bool"):
        ShardPlan.from_assignment(np.zeros(4, int), n_devices=True)


# ------------------------------------------------------------------ positions dtypes

NON_REAL = ["int8", "int16", "int32", "int64", "uint8", "uint32", "bool", "complex64", "complex128"]


@hypothesis.given(dtype=st.sampled_from(NON_REAL),
                  door=st.sampled_from(["build", "to_owned", "to_halo", "needs_rebuild", "structure"]))
def test_positions_must_be_real_floating_point_on_every_layout_door(dtype, door):
    pos, cell = _system()
    plan = _build()
    bad = np.round(pos).astype(dtype)
    call = {
        "build": lambda: HaloPlan.build(bad, cell, cutoff=1.5, n_devices=2),
        "to_owned": lambda: plan.to_owned(bad, positions=True),
        "to_halo": lambda: plan.to_halo(bad, positions=True),
        "needs_rebuild": lambda: plan.needs_rebuild(bad),
        "structure": lambda: checked_structure(bad, np.ones(len(bad)), cell, True, "my_calculator"),
    }[door]
    why = "imaginary part" if dtype.startswith("complex") else "periodic image shifts truncated"
    with pytest.raises(TypeError, match=rf"positions must be real floating point, got dtype {dtype}; .*{why}.*"
                                        r"positions\.astype\(np\.float64\)"):
        call()


@hypothesis.given(dtype=st.sampled_from(["float16", "float32", "float64"]))
def test_float_positions_of_any_width_plan_as_their_float64_values(dtype):
    pos, cell = _system()
    pos = pos.astype(dtype)
    got = HaloPlan.build(pos, cell, cutoff=1.5, n_devices=2)
    want = HaloPlan.build(pos.astype(np.float64), cell, cutoff=1.5, n_devices=2)
    np.testing.assert_array_equal(got.halo_global, want.halo_global)
    np.testing.assert_array_equal(got.halo_offset, want.halo_offset)
    np.testing.assert_array_equal(got.to_owned(pos, positions=True).dtype, np.dtype(dtype))


def test_integer_values_are_accepted_once_cast_explicitly():
    _, cell = _system()
    ints = np.argwhere(np.ones((6, 6, 6), dtype=bool))[::17][:12].astype(np.int64)  # distinct sites (no two coincide)
    plan = HaloPlan.build(ints.astype(np.float64), cell, cutoff=1.5, n_devices=2)
    assert_pairs_covered(plan, ints.astype(np.float64), cell, 1.5)


# ------------------------------------------------------------------ degenerate cells

@hypothesis.given(tilt=st.floats(1e-13, 5e-7), pair=st.sampled_from([(0, 1), (1, 2), (0, 2)]))
def test_nearly_parallel_lattice_vectors_are_refused_by_name(tilt, pair):
    i, j = pair
    cell = np.eye(3) * BOX
    cell[j] = cell[i] + tilt * BOX * np.eye(3)[j]  # a_j is a_i tilted by ~tilt rad
    with pytest.raises(ValueError, match=rf"cell is singular or nearly so: lattice vector\(s\) \[{i}, {j}\] lie "
                                         r"within a sine of .* perpendicular width"):
        _build(cell=cell)


def test_a_mildly_skewed_cell_still_plans_every_pair():
    rng = np.random.default_rng(3)
    cell = np.array([[6.0, 0.0, 0.0], [5.9, 1.2, 0.0], [0.0, 0.0, 6.0]])  # sine ~0.2
    pos = rng.uniform(0, 1, (10, 3)) @ cell
    plan = HaloPlan.build(pos, cell, cutoff=1.0, n_devices=2)
    assert assert_pairs_covered(plan, pos, cell, 1.0) > 0


def test_thin_cells_beyond_the_row_limit_are_refused_before_allocating():
    cell = np.eye(3) * 0.01  # 0.01 wide: ~300 images per atom per axis at this reach
    pos = np.random.default_rng(0).uniform(0, 0.01, (20, 3))
    with pytest.raises(ValueError, match=r"would hold .* rows .* above the limit MAX_PLAN_ROWS = 1073741824; its "
                                         r"tables were not allocated\. .*axis 0 is 0\.01 wide, so every atom has "
                                         r"~301 images"):
        HaloPlan.build(pos, cell, cutoff=1.5, n_devices=2)


@hypothesis.settings(max_examples=10)
@hypothesis.given(seed=st.integers(0, 999), thin=st.floats(0.05, 2.0), n_devices=st.integers(1, 4))
def test_row_limit_is_exactly_the_rows_the_plan_holds(seed, thin, n_devices):
    rng = np.random.default_rng(seed)
    cell = np.diag([4.0, 4.0, thin])
    pos = rng.uniform(0, 1, (8, 3)) @ cell
    plan = HaloPlan.build(pos, cell, cutoff=1.0, n_devices=n_devices)
    rows = plan.n_devices * int(plan.n_padded.max())  # what the plan's halo blocks hold before headroom
    old = partition_module.MAX_PLAN_ROWS
    try:
        partition_module.MAX_PLAN_ROWS = rows
        HaloPlan.build(pos, cell, cutoff=1.0, n_devices=n_devices)  # at the limit: accepted
        partition_module.MAX_PLAN_ROWS = rows - 1
        with pytest.raises(ValueError, match=re.escape(f"would hold {rows:.3g} rows ({n_devices} devices x "
                                                       f"{int(plan.n_padded.max()):.3g} owned + ghost rows")):
            HaloPlan.build(pos, cell, cutoff=1.0, n_devices=n_devices)
    finally:
        partition_module.MAX_PLAN_ROWS = old


@pytest.mark.parametrize("kwargs", [{"headroom": 1e9}, {"ghost_capacity": 2**30}, {"owned_capacity": 2**29},
                                    {"pair_capacities": 2**30}])
def test_capacities_beyond_the_row_limit_are_refused_before_allocating(kwargs):
    with pytest.raises(ValueError, match=r"HaloPlan.build: owned_capacity=\d+, ghost_capacity=\d+ and pair_capacities="
                                         r".* above the limit MAX_PLAN_ROWS = 1073741824, though the system needs only"):
        _build(**kwargs)


# ------------------------------------------------------------------ coordinates

@hypothesis.given(atom=st.integers(0, 11), axis=st.integers(0, 2), exponent=st.integers(11, 300),
                  sign=st.sampled_from([1.0, -1.0]), periodic=st.booleans())
def test_an_absurd_coordinate_is_named_not_blamed_on_the_cell(atom, axis, exponent, sign, periodic):
    pos, cell = _system()
    pos[atom, axis] = sign * 10.0**exponent
    with pytest.raises(ValueError, match=rf"atom {atom} has coordinate .*\(positions\[{atom}, {axis}\]\).*"
                                         r"Wrap positions into the cell, or check their units"):
        HaloPlan.build(pos, cell, periodic=(periodic,) * 3, cutoff=1.5, n_devices=2)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_coordinates_name_the_atom(bad):
    pos, cell = _system()
    pos[7, 2] = bad
    with pytest.raises(ValueError, match=r"positions of atoms \[7\] are not finite"):
        HaloPlan.build(pos, cell, cutoff=1.5, n_devices=2)


def test_an_atom_billions_of_cells_away_is_named():
    pos, _ = _system()
    cell = np.eye(3) * 1e-3
    pos[4, 0] = 1e7  # 1e10 cells along axis 0
    with pytest.raises(ValueError, match=r"atom 4 is 1e\+10 cells from the origin along periodic lattice vector 0"):
        HaloPlan.build(pos, cell, cutoff=1.5, n_devices=2)


def test_large_but_sane_coordinates_still_plan():
    pos, cell = _system()
    shifted = pos + np.array([1e6, -1e6, 0.0]) * BOX  # a million cells away, unwrapped
    plan = HaloPlan.build(shifted, cell, cutoff=1.5, n_devices=2)
    want = HaloPlan.build(pos, cell, cutoff=1.5, n_devices=2)
    np.testing.assert_array_equal(plan.halo_global, want.halo_global)
