"""DLPack conversion: zero copy both ways, dtypes kept, every pitfall a clear error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvalchemi_jaxbridge.kernels import (
    DLPackError,
    jax_to_torch,
    jax_to_torch_shards,
    torch_shards_to_jax,
    torch_to_jax,
)
from nvalchemi_jaxbridge.kernels.dlpack import is_compact

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool, torch.int8,
          torch.uint8, torch.int32, torch.int64, torch.complex64]


def _make(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


@hypothesis.given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 1000),
)
def test_round_trip_is_zero_copy_and_exact(shape, dtype, seed):
    t = _make(tuple(shape), dtype, seed).clone()  # fresh allocation: aligned
    a = torch_to_jax(t, name="t")
    assert a.shape == t.shape
    back = jax_to_torch(a)
    assert back.dtype == t.dtype
    assert torch.equal(back, t)
    if t.numel():
        assert a.unsafe_buffer_pointer() == t.data_ptr() == back.data_ptr()


def test_values_are_aliased_and_int64_kept_whole():
    t = torch.tensor([2**40, 3], dtype=torch.int64)
    a = torch_to_jax(t)
    assert a.dtype == jnp.int64 and int(a[0]) == 2**40
    t[1] = 7  # aliasing: JAX sees torch's memory (documented; do not mutate in practice)
    assert int(a[1]) == 7


def test_requires_grad_is_detached():
    t = torch.ones(8, requires_grad=True)
    a = torch_to_jax(t, name="w")
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), np.ones(8, np.float32))


def test_permuted_dense_layout_is_shared():
    t = torch.arange(12.0).reshape(3, 4)
    a = torch_to_jax(t.T, name="tT")
    np.testing.assert_array_equal(np.asarray(a), t.T.numpy())


@hypothesis.given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), perm_seed=st.integers(0, 100))
def test_is_compact_matches_torch(shape, perm_seed):
    t = torch.empty(shape)
    perm = np.random.default_rng(perm_seed).permutation(len(shape)).tolist()
    v = t.permute(perm)
    assert is_compact(v.shape, v.stride())  # any permutation of a dense tensor is dense
    if shape[0] > 1:
        s = t[::2] if shape[0] > 2 else t.expand(2, *shape)[:, :1]
        assert is_compact(s.shape, s.stride()) == s.is_contiguous()


def test_strided_tensor_is_refused_with_the_fix():
    t = torch.arange(16.0).reshape(4, 4)[:, ::2]
    with pytest.raises(DLPackError, match=r"positions is not stored densely.*\.contiguous\(\).*copy=True"):
        torch_to_jax(t, name="positions")
    a = torch_to_jax(t, name="positions", copy=True)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_broadcast_tensor_is_refused():
    with pytest.raises(DLPackError, match=r"charges is not stored densely"):
        torch_to_jax(torch.ones(3).expand(4, 3), name="charges")


def test_misaligned_tensor_is_refused_with_the_fix():
    base = torch.arange(40.0, dtype=torch.float64)
    t = base[1:]  # starts 8 bytes into a 64-byte-aligned allocation
    assert t.data_ptr() % 64
    with pytest.raises(DLPackError, match=r"energy starts at address 0x[0-9a-f]+, which is not a multiple of 64 bytes.*clone\(\)"):
        torch_to_jax(t, name="energy")
    a = torch_to_jax(t, name="energy", copy=True)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_conjugate_view_is_refused():
    t = torch.tensor([1 + 2j, 3 - 1j]).conj()
    with pytest.raises(DLPackError, match=r"z has its conjugate bit set.*resolve_conj"):
        torch_to_jax(t, name="z")
    np.testing.assert_array_equal(np.asarray(torch_to_jax(t, name="z", copy=True)), t.resolve_conj().numpy())


def test_sharded_arrays_go_shard_by_shard():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("x"))
    x = jax.device_put(np.arange(32.0).reshape(16, 2), sharding)
    with pytest.raises(DLPackError, match=r"forces is spread over 8 devices.*jax_to_torch_shards\(forces\)"):
        jax_to_torch(x, name="forces")
    shards = jax_to_torch_shards(x)
    assert len(shards) == 8
    for s, t in zip(x.addressable_shards, shards):
        assert t.data_ptr() == s.data.unsafe_buffer_pointer()
        np.testing.assert_array_equal(t.numpy(), np.asarray(s.data))
    y = torch_shards_to_jax(shards, sharding, x.shape)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    with pytest.raises(DLPackError, match=r"got 3 tensors for a sharding with 8 addressable devices"):
        torch_shards_to_jax(shards[:3], sharding, x.shape)


@pytest.mark.slow
def test_int64_with_x64_off_is_an_error_not_a_cut():
    # conftest turns x64 on for the whole session, so check the off state in a fresh process
    code = textwrap.dedent(
        """
        import os
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax, jax.numpy as jnp, torch
        jax.config.update("jax_enable_x64", False)
        from nvalchemi_jaxbridge.kernels import DLPackError, TorchOpKernel, torch_to_jax
        try:
            torch_to_jax(torch.tensor([2**40, 3]), name="neighbor_ptr")
        except DLPackError as e:
            print("ERR1", e)
        a = torch_to_jax(torch.tensor([1, 2], dtype=torch.int32), name="ok")
        print("OK", a.dtype)

        @torch.library.custom_op("x64probe::count", mutates_args=())
        def count(x: torch.Tensor) -> torch.Tensor:
            return (x > 0).sum().reshape(1)

        count.register_fake(lambda x: x.new_empty((1,), dtype=torch.int64))
        try:
            TorchOpKernel(torch.ops.x64probe.count)(jnp.ones(3))
        except DLPackError as e:
            print("ERR2", e)
        """
    )
    env = {**os.environ, "JAX_ENABLE_X64": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    err1 = next(line for line in lines if line.startswith("ERR1"))
    assert "neighbor_ptr has dtype torch.int64" in err1
    assert "int32" in err1 and 'jax.config.update("jax_enable_x64", True)' in err1
    assert "OK int32" in lines
    err2 = next(line for line in lines if line.startswith("ERR2"))
    assert "return 0 of op x64probe::count has dtype torch.int64" in err2
