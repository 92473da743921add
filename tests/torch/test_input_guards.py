"""The torch front door refuses positions that are not real floats, and malformed restore mementos."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.layout import HaloPlan
from nvalchemi_jaxbridge.torch import ShardTensor
from nvalchemi_jaxbridge.torch.dispatch import restore_adapter
from tests.torch import model

BOX = 6.37  # image shifts of a non-integer length: truncating them would move ghosts by up to ~0.4


@pytest.fixture(scope="module")
def system() -> tuple[np.ndarray, HaloPlan]:
    pos = model.system(12, BOX, 1)
    return pos, HaloPlan.build(pos, np.eye(3) * BOX, cutoff=model.CUTOFF, n_devices=1)


TORCH_BAD = [torch.int32, torch.int64, torch.int16, torch.uint8, torch.bool, torch.complex64, torch.complex128]


@hypothesis.settings(max_examples=20)
@hypothesis.given(dtype=st.sampled_from(TORCH_BAD),
                  door=st.sampled_from(["global_owned", "global_halo", "numpy", "local"]))
def test_positions_must_be_real_floating_point(system, dtype, door):
    pos, plan = system
    bad = torch.tensor(np.round(pos)).to(dtype)
    call = {
        "global_owned": lambda: ShardTensor.from_global(bad, plan, positions=True),
        "global_halo": lambda: ShardTensor.from_global(bad, plan, layout="halo", positions=True),
        "numpy": lambda: ShardTensor.from_global(bad.numpy(), plan, layout="halo", positions=True),
        "local": lambda: ShardTensor.from_local(bad, plan, positions=True),
    }[door]
    why = "its imaginary part would be dropped" if dtype.is_complex else \
        "the periodic image shifts .* would be truncated"
    where = "from_local" if door == "local" else "from_global"
    with pytest.raises(TypeError, match=rf"ShardTensor\.{where}\(positions=True\): positions must be real "
                                        rf"floating point, got {dtype}; {why}\. Convert explicitly: "
                                        r"positions\.to\(torch\.float64\)"):
        call()


def test_non_positions_of_any_dtype_and_cast_positions_pass(system):
    pos, plan = system
    mine = torch.as_tensor(plan.owned_global[0][plan.owned_mask[0]])  # this rank's atoms (one rank: all)
    ids = ShardTensor.from_global(torch.arange(12), plan)  # integer per-atom data is fine when not positions
    torch.testing.assert_close(ids.to_local(), mine)
    for dtype in (torch.float32, torch.float64):  # an explicit cast is the fix the message gives
        x = ShardTensor.from_global(torch.tensor(np.round(pos)).to(dtype), plan, positions=True, check=False)
        assert x.is_positions and x.dtype == dtype
        local = x.to_local().numpy()
        np.testing.assert_array_equal(local, np.round(pos)[mine.numpy()].astype(local.dtype))


@hypothesis.given(memento=st.one_of(
    st.fixed_dictionaries({"op": st.one_of(st.integers(), st.text(max_size=5), st.none(), st.floats())}),
    st.fixed_dictionaries({"packet": st.integers()}),
    st.fixed_dictionaries({"op": st.just(torch.ops.aten.add.default), "packet": st.integers()}),
    st.fixed_dictionaries({"op": st.just(torch.ops.aten.add.default), "token": st.one_of(st.text(), st.booleans())}),
    st.fixed_dictionaries({"op": st.just(torch.ops.aten.add.default), "extra": st.integers()}),
))
def test_malformed_memento_dicts_are_refused_naming_the_key(memento):
    key = "extra" if "extra" in memento else "token" if "token" in memento else \
        "packet" if "packet" in memento and "op" in memento else "op"
    with pytest.raises(TypeError, match=rf"restore_adapter: a memento dict must be .*\b{key}\b.*Pass the Memento"):
        restore_adapter(memento)
