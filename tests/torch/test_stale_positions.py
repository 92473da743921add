"""ShardTensor positions are checked against their plan (one process, world size 1).

An atom more than skin/2 from the plan's positions (minimum image) raises `StaleLayoutError` naming it and
the re-plan; atoms moved by lattice vectors are the same positions: the block a kernel sees is the block of
the plan's own positions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.layout import HaloPlan
from nvalchemi_jaxbridge.layout.displacement import StaleLayoutError
from nvalchemi_jaxbridge.torch import ShardTensor

CELL = np.array([[6.0, 0.0, 0.0], [1.5, 6.5, 0.0], [-1.0, 0.8, 7.0]])


@pytest.fixture(scope="module")
def system():
    pos = np.random.default_rng(0).uniform(0, 1, (16, 3)) @ CELL
    return pos, HaloPlan.build(pos, CELL, cutoff=2.5, skin=0.4, n_devices=1)


def test_wrapped_positions_give_the_plans_block(system):
    pos, plan = system
    want = ShardTensor.from_global(torch.tensor(pos), plan, layout="halo", positions=True).to_local()
    shifted = pos + np.random.default_rng(1).integers(-2, 3, (16, 3)) @ CELL
    x = ShardTensor.from_global(torch.tensor(shifted), plan, layout="halo", positions=True)
    torch.testing.assert_close(x.to_local(), want, rtol=0, atol=1e-12)
    raw = ShardTensor.from_global(torch.tensor(shifted), plan, layout="halo", positions=True, check=False)
    assert (raw.to_local() - want).abs().max() > 1.0  # unchecked: the shifted atoms as given, not the plan's block


def test_a_stale_plan_is_refused(system):
    pos, plan = system
    moved = pos.copy()
    moved[4] += [0.0, 0.3, 0.0]  # > skin/2 = 0.2 Å
    with pytest.raises(StaleLayoutError, match=r"ShardTensor.from_global\(positions=True\): 1 atom\(s\) moved more "
                                               r"than skin/2 = 0.2 Å.*atoms 4 \(0.3 Å\).*plan = plan.rebuild"):
        ShardTensor.from_global(torch.tensor(moved), plan, positions=True)
    x = ShardTensor.from_global(torch.tensor(moved), plan, positions=True, check=False)  # as given, unchecked
    np.testing.assert_array_equal(x.to_local().numpy(), moved)
