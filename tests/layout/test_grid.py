"""choose_grid: device counts per lattice axis."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from nvalchemi_jaxbridge.layout import choose_grid


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % k for k in range(2, int(n**0.5) + 1))


@hypothesis.given(
    n=st.integers(1, 64),
    lengths=st.tuples(*[st.floats(2.0, 50.0)] * 3),
    periodic=st.sampled_from([(True, True, True), (False, False, False)]),
)
def test_product_and_widest_axes_split_most(n, lengths, periodic):
    grid = choose_grid(n, np.diag(lengths), periodic)
    assert np.prod(grid) == n
    # with equal periodicity, a strictly wider axis never gets fewer domains than a narrower one
    for a in range(3):
        for b in range(3):
            if lengths[a] > lengths[b] * (1 + 1e-9):
                assert grid[a] >= grid[b], (grid, lengths)
    if _is_prime(n):
        assert sorted(grid) == [1, 1, n] and grid[int(np.argmax(lengths))] == n


def test_known_grids():
    cube = np.eye(3) * 10.0
    assert choose_grid(8, cube, (True, True, True)) == (2, 2, 2)
    assert choose_grid(1, cube, (True, True, True)) == (1, 1, 1)
    assert choose_grid(8, np.diag([80.0, 10.0, 10.0]), (True, True, True)) == (8, 1, 1)
    assert choose_grid(4, np.diag([10.0, 30.0, 10.0]), (True, True, True)) == (1, 4, 1)
    # triclinic: the perpendicular width counts, not the row length; row 0 is long but its axis is thin
    sheared = np.array([[10.0, 0.0, 0.0], [0.0, 10.0, 0.0], [0.0, 40.0, 3.0]])
    assert choose_grid(2, sheared, (True, True, True))[2] == 1


def test_errors():
    with pytest.raises(ValueError, match=r"n_devices must be an int >= 1, got 0"):
        choose_grid(0, np.eye(3), (True, True, True))
    with pytest.raises(ValueError, match=r"cell is singular"):
        choose_grid(2, np.diag([1.0, 1.0, 0.0]), (True, True, False))
    with pytest.raises(ValueError, match=r"finite \(3, 3\) array"):
        choose_grid(2, np.eye(2), (True, True, True))
