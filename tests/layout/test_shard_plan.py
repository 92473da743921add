"""ShardPlan: owner / local-index routing for sharded storage."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from nvalchemi_jaxbridge.layout import ShardPlan


@hypothesis.given(
    assignment=st.lists(st.integers(0, 7), min_size=0, max_size=40),
    extra_devices=st.integers(0, 2),
    pad_rows=st.integers(0, 2),
)
def test_arbitrary_assignment_round_trips(assignment, extra_devices, pad_rows):
    a = np.array(assignment, dtype=np.int64)
    n_dev = (int(a.max()) + 1 if a.size else 1) + extra_devices
    plan = ShardPlan.from_assignment(a, n_devices=n_dev)
    assert plan.n_global == a.size and plan.n_owned.sum() == a.size
    np.testing.assert_array_equal(plan.owner, a)
    for rank in range(n_dev):  # stable order: each rank's rows are its global ids ascending
        ids = np.flatnonzero(a == rank)
        np.testing.assert_array_equal(plan.owned_global[rank, : len(ids)], ids)
        np.testing.assert_array_equal(plan.local_index[ids], np.arange(len(ids)))
        assert np.all(plan.owned_global[rank, len(ids) :] == -1)
    x = np.random.default_rng(a.size).normal(size=(a.size, 2))
    owned = plan.to_owned(x, pad_rows=pad_rows)
    assert owned.shape == (n_dev * (plan.owned_capacity + pad_rows), 2)
    np.testing.assert_array_equal(plan.from_owned(owned, pad_rows=pad_rows), x)
    blocks = owned.reshape(n_dev, plan.owned_capacity + pad_rows, 2)
    assert np.all(blocks[:, plan.owned_capacity :] == 0)  # the trailing "+1" rows are last and zero


@hypothesis.given(n_global=st.integers(0, 50), n_devices=st.integers(1, 8))
def test_contiguous_blocks(n_global, n_devices):
    plan = ShardPlan.contiguous(n_global, n_devices)
    assert np.all(np.diff(plan.owner) >= 0)  # blocks in rank order
    assert plan.n_owned.max() - plan.n_owned.min() <= 1 and plan.n_owned.sum() == n_global
    offsets = np.concatenate([[0], np.cumsum(plan.n_owned)[:-1]])
    np.testing.assert_array_equal(plan.local_index, np.arange(n_global) - offsets[plan.owner])


def test_golden_contiguous_assignment_with_pad_row():
    # semantics §3.2: assignment [0,0,0,1,1,1], each rank holds 3 rows + 1 pad row
    plan = ShardPlan.from_assignment(np.array([0, 0, 0, 1, 1, 1]))
    owned = plan.to_owned(10.0 * np.arange(6) + 1).reshape(2, 4)
    np.testing.assert_array_equal(owned, [[1, 11, 21, 0], [31, 41, 51, 0]])


def test_headroom_and_errors():
    assert ShardPlan.from_assignment(np.array([0, 1, 1, 1]), headroom=1.5).owned_capacity == 5
    with pytest.raises(ValueError, match=r"owned_capacity=2 is too small: rank 1 owns 3 rows; pass owned_capacity=3"):
        ShardPlan.from_assignment(np.array([0, 1, 1, 1]), owned_capacity=2)
    with pytest.raises(ValueError, match=r"global rows \[2\] are assigned ranks \[4\] outside \[0, 2\)"):
        ShardPlan.from_assignment(np.array([0, 1, 4]), n_devices=2)
    with pytest.raises(ValueError, match=r"1-D integer array"):
        ShardPlan.from_assignment(np.array([0.0, 1.0]))
    plan = ShardPlan.contiguous(6, 2)
    with pytest.raises(ValueError, match=r"expected D \* \(owned_capacity \+ pad_rows\) = 2 \* 4 rows"):
        plan.from_owned(np.zeros(6))
    with pytest.raises(ValueError, match=r"expected 6 rows \(one per global id\)"):
        plan.to_owned(np.zeros(5))
