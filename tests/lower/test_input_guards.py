"""The JAX front door narrows nothing: 64-bit inputs with x64 off are refused; positions must be real floats.

The test process runs with `jax_enable_x64` on (tests/conftest.py); the x64-off
cases run inside `jax.enable_x64(False)`, a context manager that restores the flag.
"""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest

from nvalchemi_jaxbridge.layout import HaloPlan, ShardPlan
from nvalchemi_jaxbridge.lower import compile, make_mesh
from nvalchemi_jaxbridge.spec.adapter import OpAdapter
from nvalchemi_jaxbridge.spec.policies import HaloStoragePolicy, PlainShard

from .plans import make_spec

N = 10
WIDE = {"int64": "int32", "uint64": "uint32", "float64": "float32", "complex128": "complex64"}


def identity(x):
    return x


def scale(x, y):
    return x * y


GATHER = OpAdapter(identity, gather_inputs=[0])
SCALE = OpAdapter(scale, gather_inputs=[0])


@pytest.fixture(scope="module")
def system() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.uniform(0.0, 6.0, (N, 3)), np.eye(3) * 6.0


def _halo_cs(system, positions=None):
    pos, cell = system
    plan = HaloPlan.build(pos, cell, cutoff=1.5, n_devices=2)
    return compile(make_spec(HaloStoragePolicy(), GATHER, SCALE), make_mesh(2), plan, positions=positions)


def _wide(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    return (np.arange(int(np.prod(shape))).reshape(shape) + 2**40).astype(dtype)


@hypothesis.settings(max_examples=40)
@hypothesis.given(dtype=st.sampled_from(sorted(WIDE)),
                  door=st.sampled_from(["owned", "halo", "shard_owned", "call_gathered", "call_plain", "call_scalar",
                                        "refresh", "fold", "owned_to_halo", "halo_to_owned"]))
def test_64_bit_inputs_are_refused_with_x64_off(system, dtype, door):
    with jax.enable_x64(False):
        cs = _halo_cs(system)
        owned_rows = 2 * cs.tables.owned_capacity
        halo_rows = 2 * cs.tables.halo_rows
        call = {
            "owned": lambda: cs.owned(_wide(dtype, (N,))),
            "halo": lambda: cs.halo(_wide(dtype, (N, 2))),
            "shard_owned": lambda: compile(make_spec(PlainShard()), make_mesh(2), ShardPlan.contiguous(N, 2))
            .owned(_wide(dtype, (N,))),
            "call_gathered": lambda: cs.call(GATHER, _wide(dtype, (owned_rows,))),
            "call_plain": lambda: cs.call(SCALE, cs.owned(np.ones(N, np.float32)), _wide(dtype, (1,))),
            "call_scalar": lambda: cs.call(SCALE, cs.owned(np.ones(N, np.float32)), _wide(dtype, (1,))[0]),
            "refresh": lambda: cs.refresh(_wide(dtype, (halo_rows,))),
            "fold": lambda: cs.fold(_wide(dtype, (halo_rows,))),
            "owned_to_halo": lambda: cs.owned_to_halo(_wide(dtype, (owned_rows,))),
            "halo_to_owned": lambda: cs.halo_to_owned(_wide(dtype, (halo_rows,))),
        }[door]
        with pytest.raises(ValueError, match=rf"has dtype {dtype}, but jax_enable_x64 is off, so JAX would silently "
                                             rf"cut it to {WIDE[dtype]} .*jax\.config\.update\(\"jax_enable_x64\", "
                                             rf"True\), or convert it yourself .*x\.astype\(np\.{WIDE[dtype]}\)"):
            call()


def test_float64_holding_float32_values_is_still_refused_with_x64_off(system):
    # the rule is about the dtype, not the values: the array would come back float32
    with jax.enable_x64(False):
        cs = _halo_cs(system)
        with pytest.raises(ValueError, match=r"CompiledSpec.owned: x has dtype float64, but jax_enable_x64 is off"):
            cs.owned(np.ones(N))
        with pytest.raises(ValueError, match=r"CompiledSpec.owned: x has dtype int64"):
            cs.owned([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])  # a list of Python ints is int64 to numpy
        np.testing.assert_array_equal(cs.to_global(cs.owned(np.ones(N, np.float32))), np.ones(N))


def test_32_bit_inputs_pass_with_x64_off_and_come_back_exact(system):
    pos, _ = system
    ids = (np.arange(N) + 2**30).astype(np.int32)
    with jax.enable_x64(False):
        cs = _halo_cs(system)
        x = cs.owned(ids)
        assert x.dtype == np.int32
        np.testing.assert_array_equal(cs.to_global(x), ids)
        p32 = (pos + 100.0).astype(np.float32)
        np.testing.assert_array_equal(cs.to_global(cs.owned(p32, positions=True, check=False)), p32)  # unchecked: as given
        halo = np.asarray(cs.call(GATHER, x)).reshape(2, -1)
        assert halo.dtype == np.int32
        np.testing.assert_array_equal(halo[cs.plan.halo_mask], ids[cs.plan.halo_global[cs.plan.halo_mask]])
        # a numpy owned block given to to_global stays on the host: int64 comes back exact even with x64 off
        wide = _wide("int64", (N,))
        np.testing.assert_array_equal(cs.to_global(cs.plan.to_owned(wide)), wide)


def test_64_bit_inputs_are_carried_exactly_with_x64_on(system):
    pos, _ = system
    cs = _halo_cs(system)
    ids = _wide("int64", (N,))
    x = cs.owned(ids)
    assert x.dtype == np.int64
    np.testing.assert_array_equal(cs.to_global(x), ids)
    far = pos + 1e6  # float32 would move these by ~0.03
    np.testing.assert_array_equal(cs.to_global(cs.owned(far, positions=True, check=False)), far)
    halo = np.asarray(cs.call(GATHER, x)).reshape(2, -1)
    np.testing.assert_array_equal(halo[cs.plan.halo_mask], ids[cs.plan.halo_global[cs.plan.halo_mask]])


@hypothesis.settings(max_examples=12)
@hypothesis.given(dtype=st.sampled_from(["int32", "int64", "bool", "complex64", "complex128"]),
                  door=st.sampled_from(["call", "owned", "halo", "rebuild"]))
def test_positions_must_be_real_floating_point_on_the_jax_door(system, dtype, door):
    pos, _ = system
    cs = _halo_cs(system, positions={GATHER: [0]})
    bad = np.round(pos).astype(dtype)
    call = {
        "call": lambda: cs.call(GATHER, np.zeros((2 * cs.tables.owned_capacity, 3), dtype)),
        "owned": lambda: cs.owned(bad, positions=True),
        "halo": lambda: cs.halo(bad, positions=True),
        "rebuild": lambda: cs.rebuild(bad),
    }[door]
    with pytest.raises(TypeError, match=rf"positions.* must be real floating point, got dtype {dtype}.*"
                                        r"positions\.astype\(np\.float64\)"):
        call()
