"""The compiled XLA FFI call path of TorchOpKernel (issue 7) against the native torch call and the
buffer_callback path: statics of every encodable kind, aliasing, zero-size arrays, Triton, shard_map,
jax.grad (the FFI backward against the callback backward, torch autograd and closed forms), errors,
fallbacks, and the build cache.
"""

from __future__ import annotations

import logging
import math
import os
import pathlib
import stat
import subprocess
import sys
import threading
import warnings

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P

import nvalchemi_jaxbridge.demo.torch_ops  # noqa: F401 - registers jaxbridge_demo::
from nvalchemi_jaxbridge.demo import argon_fcc
from nvalchemi_jaxbridge.kernels import KernelError, TorchOpKernel
from nvalchemi_jaxbridge.kernels import ffi_path, torch_op
from nvalchemi_jaxbridge.kernels.ffi import build, plans, target

NS = "ktffi"
LJ = torch.ops.jaxbridge_demo.lj_energy_forces.default
LJ_TRITON = torch.ops.jaxbridge_demo.lj_energy_forces_triton.default


@pytest.fixture(autouse=True)
def _no_env_path(monkeypatch):
    monkeypatch.delenv(torch_op.ENV_CALL_PATH, raising=False)


# ------------------------------------------------------------------ test ops

_lib = torch.library.Library(NS, "DEF")
# keyword-only statics: a x + b + k
_lib.define("kwstat(Tensor x, float a, *, int k, float b=0.5) -> Tensor")
_lib.impl("kwstat", lambda x, a, *, k, b=0.5: a * x + b + k, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NS}::kwstat", lambda x, a, *, k, b=0.5: torch.empty_like(x), lib=_lib)
# the float static, exactly, as a float64 array shaped like x
_lib.define("echo(Tensor x, float a) -> Tensor")
_lib.impl("echo", lambda x, a: torch.full(x.shape, a, dtype=torch.float64), "CompositeExplicitAutograd")
torch.library.register_fake(f"{NS}::echo", lambda x, a: torch.empty(x.shape, dtype=torch.float64), lib=_lib)
# ScalarType static: not encodable, so an ineligible call
_lib.define("cast(Tensor x, ScalarType dtype) -> Tensor")
_lib.impl("cast", lambda x, dtype: x.to(dtype), "CompositeExplicitAutograd")
torch.library.register_fake(f"{NS}::cast", lambda x, dtype: torch.empty(x.shape, dtype=dtype), lib=_lib)


@torch.library.custom_op(f"{NS}::roll", mutates_args=())
def roll(x: torch.Tensor, shifts: list[int], dims: list[int]) -> torch.Tensor:
    """torch.roll: any dtype, int-list statics."""
    return torch.roll(x, shifts, dims)


roll.register_fake(lambda x, shifts, dims: torch.empty_like(x))


def _maybe_add(x, y=None, flags=(), w=()):
    out = x + (y if y is not None else 1.0)
    out = out * math.prod(w)
    for i, f in enumerate(flags):
        if f:
            out[i] = -out[i]
    return out


# x + y (or x + 1 without y), times prod(w), leading rows negated where flags says so
_lib.define("maybe_add(Tensor x, Tensor? y=None, bool[] flags=[], float[] w=[]) -> Tensor")
_lib.impl("maybe_add", _maybe_add, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NS}::maybe_add", lambda x, y=None, flags=(), w=(): torch.empty_like(x), lib=_lib)


@torch.library.custom_op(f"{NS}::accum", mutates_args=("out",))
def accum(x: torch.Tensor, out: torch.Tensor, b: float) -> None:
    """out += b x, in place."""
    out.add_(x, alpha=b)


accum.register_fake(lambda x, out, b: None)


@torch.library.custom_op(f"{NS}::accum_ret", mutates_args=("out",))
def accum_ret(x: torch.Tensor, out: torch.Tensor, b: float) -> torch.Tensor:
    """out += b x in place, and returns 2 x."""
    out.add_(x, alpha=b)
    return 2 * x


accum_ret.register_fake(lambda x, out, b: torch.empty_like(x))


@torch.library.custom_op(f"{NS}::fails", mutates_args=())
def fails(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("boom from ktffi::fails")


fails.register_fake(lambda x: torch.empty_like(x))


@torch.library.custom_op(f"{NS}::liar", mutates_args=())
def liar(x: torch.Tensor) -> torch.Tensor:
    return x[:-1] * 2  # one row fewer than its fake says


liar.register_fake(lambda x: torch.empty_like(x))


# differentiable ops for the backward (the ops above without autograd only run forward)


@torch.library.custom_op(f"{NS}::scale_by", mutates_args=())
def scale_by(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """x * n for an integer n (not differentiated), with a backward formula."""
    return x * n.to(x.dtype)


scale_by.register_fake(lambda x, n: torch.empty_like(x))
scale_by.register_autograd(lambda ctx, g: (g * ctx.n.to(g.dtype), None), setup_context=lambda ctx, inputs, output: setattr(ctx, "n", inputs[1]))

# keyword-only tensor and statics, autograd through the decomposition: a x w + b + k
_lib.define("kwlin(Tensor x, float a, *, Tensor w, int k, float b=0.5) -> Tensor")
_lib.impl("kwlin", lambda x, a, *, w, k, b=0.5: a * x * w + b + k, "CompositeImplicitAutograd")
# a mutated argument, differentiable through the decomposition: out += b x in place, returns x^2
_lib.define("axpy_sq(Tensor x, Tensor(a!) out, float b) -> Tensor")


def _axpy_sq(x, out, b):
    out.add_(x, alpha=b)
    return x * x


_lib.impl("axpy_sq", _axpy_sq, "CompositeImplicitAutograd")


@torch.library.custom_op(f"{NS}::bad_bwd", mutates_args=())
def bad_bwd(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def _bad_backward(ctx, g):
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(g, FakeTensor):  # the trace-time differentiability check passes
        return g * 3
    raise RuntimeError("boom in the backward of ktffi::bad_bwd")


bad_bwd.register_fake(lambda x: torch.empty_like(x))
bad_bwd.register_autograd(_bad_backward)


def _ffi_and_callback(op, *args, outputs=None, **kwargs):
    """The op's results through the FFI path and the callback path (both jitted), checking the paths."""
    kf = TorchOpKernel(op, outputs=outputs, call_path="ffi")
    kc = TorchOpKernel(op, outputs=outputs, call_path="callback")
    assert kf.call_path_of(*args, **kwargs) == "ffi"
    assert kc.call_path_of(*args, **kwargs) == "callback (call_path='callback')"
    arr = [i for i, a in enumerate(args) if isinstance(a, (np.ndarray, jax.Array))]

    def run(k):
        def f(*xs):
            full = list(args)
            for i, x in zip(arr, xs):
                full[i] = x
            return k(*full, **kwargs)

        return jax.jit(f)(*[args[i] for i in arr])

    return run(kf), run(kc)


def _np(out):
    return [np.asarray(o) for o in (out if isinstance(out, (tuple, list)) else (out,))]


def _native(op, *args, **kwargs):
    out = op(*[torch.from_numpy(np.array(a)) if isinstance(a, (np.ndarray, jax.Array)) else a for a in args], **kwargs)
    return [o.numpy() for o in (out if isinstance(out, (tuple, list)) else (out,))]


def _lj_inputs(cells: int, dtype):
    pos = argon_fcc(cells).positions.astype(dtype)
    mask = np.ones(len(pos), bool)
    mask[-3:] = False  # a few ghost rows
    return pos, mask


# ------------------------------------------------------------------ results against torch


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", [LJ, LJ_TRITON], ids=["torch", "triton"])
def test_lj_matches_native_torch_and_callback(op, dtype):
    pos, mask = _lj_inputs(2, dtype)
    ffi, cb = _ffi_and_callback(op, pos, mask, cutoff=6.0)
    want = _native(op, pos, mask, cutoff=6.0)
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    for got_f, got_c, w in zip(_np(ffi), _np(cb), want):
        assert got_f.dtype == w.dtype
        np.testing.assert_allclose(got_f, w, rtol=rtol, atol=rtol * np.abs(w).max())
        np.testing.assert_array_equal(got_f, got_c)


def test_keyword_only_statics_and_defaults():
    x = np.linspace(-1.0, 1.0, 7)
    ffi, cb = _ffi_and_callback(torch.ops.ktffi.kwstat.default, x, 3.0, k=-4)
    np.testing.assert_allclose(np.asarray(ffi), 3.0 * x + 0.5 - 4, rtol=1e-15)
    np.testing.assert_array_equal(np.asarray(ffi), np.asarray(cb))
    ffi, _ = _ffi_and_callback(torch.ops.ktffi.kwstat.default, x, 3, b=-2.25, k=2**40)
    np.testing.assert_allclose(np.asarray(ffi), 3.0 * x - 2.25 + 2**40, rtol=1e-15)


@pytest.mark.parametrize("a", [0.1, 1 / 3, math.pi * 1e-300, -2.0**-1074, 1.7976931348623157e308, -0.0, math.inf])
def test_float_static_is_exact(a):
    got, _ = _ffi_and_callback(torch.ops.ktffi.echo.default, np.zeros(2), a)
    assert np.asarray(got).tobytes() == np.full(2, a).tobytes()  # bit for bit, sign of zero included


def test_float_static_nan():
    got, _ = _ffi_and_callback(torch.ops.ktffi.echo.default, np.zeros(2), math.nan)
    assert np.isnan(np.asarray(got)).all()


def test_int_lists_optional_tensor_bool_and_float_lists():
    x = np.arange(12.0).reshape(4, 3)
    ffi, cb = _ffi_and_callback(torch.ops.ktffi.roll.default, x, [1, -2], [0, 1])
    np.testing.assert_array_equal(np.asarray(ffi), np.roll(x, (1, -2), (0, 1)))
    np.testing.assert_array_equal(np.asarray(ffi), np.asarray(cb))
    ffi, _ = _ffi_and_callback(torch.ops.ktffi.maybe_add.default, x)  # y=None, empty lists
    np.testing.assert_array_equal(np.asarray(ffi), x + 1.0)  # prod([]) = 1
    ffi, _ = _ffi_and_callback(torch.ops.ktffi.maybe_add.default, x, None, [True, False], [2.0, 0.5, 3.0])
    want = (x + 1.0) * 3.0
    want[0] = -want[0]
    np.testing.assert_array_equal(np.asarray(ffi), want)
    y = np.full_like(x, 10.0)
    ffi, _ = _ffi_and_callback(torch.ops.ktffi.maybe_add.default, x, y, w=[1.0])
    np.testing.assert_array_equal(np.asarray(ffi), x + 10.0)


def test_aten_op_with_an_overload_and_scalar_statics():
    """A C++ op (no Python, no GIL on the call) under a named overload, with `Scalar` statics."""
    x = np.arange(6.0).reshape(2, 3)
    ffi, cb = _ffi_and_callback(torch.ops.aten.add.Scalar, x, 2.5, alpha=2)
    np.testing.assert_array_equal(np.asarray(ffi), x + 5.0)
    np.testing.assert_array_equal(np.asarray(ffi), np.asarray(cb))
    ffi, _ = _ffi_and_callback(torch.ops.aten.add.Scalar, x.astype(np.int64), 3, alpha=-1)
    np.testing.assert_array_equal(np.asarray(ffi), x.astype(np.int64) - 3)


def test_mutated_argument_is_aliased():
    x, out0 = np.arange(5.0), np.full(5, 100.0)
    ffi, cb = _ffi_and_callback(torch.ops.ktffi.accum.default, x, out0, 0.5)
    np.testing.assert_array_equal(np.asarray(ffi), out0 + 0.5 * x)
    np.testing.assert_array_equal(np.asarray(ffi), np.asarray(cb))
    k = TorchOpKernel(torch.ops.ktffi.accum.default, call_path="ffi")
    hlo = jax.jit(lambda a, o: k(a, o, 0.5)).lower(x, out0).as_text()
    assert "nvalchemi_jaxbridge_torch_call" in hlo and "output_operand_aliases" in hlo
    # a return and a mutated argument; the caller's array is unchanged (JAX arrays are immutable)
    o = jnp.asarray(out0)
    ffi, cb = _ffi_and_callback(torch.ops.ktffi.accum_ret.default, x, o, -1.0, outputs=(0, "out"))
    np.testing.assert_array_equal(np.asarray(ffi[0]), 2 * x)
    np.testing.assert_array_equal(np.asarray(ffi[1]), out0 - x)
    np.testing.assert_array_equal(np.asarray(o), out0)


def test_zero_size_arrays():
    x = np.zeros((0, 3), np.float32)
    ffi, cb = _ffi_and_callback(torch.ops.ktffi.roll.default, x, [1], [1])
    assert np.asarray(ffi).shape == (0, 3) and np.asarray(cb).shape == (0, 3)
    e, f = _ffi_and_callback(LJ, np.zeros((0, 3)), np.zeros(0, bool))[0]
    assert float(e) == 0.0 and np.asarray(f).shape == (0, 3)


def test_inside_jit_and_shard_map_over_8_devices():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    pos, _ = _lj_inputs(2, np.float64)  # 32 atoms, 4 per device
    mask = np.ones(len(pos), bool)
    k = TorchOpKernel(LJ, call_path="ffi")
    assert k.call_path_of(pos[:4], mask[:4], cutoff=6.0) == "ffi"

    def per_device(p, m):
        e, f = k(p, m, cutoff=6.0)
        return e[None], f

    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))
    e, forces = f(pos, mask)
    for d in range(8):
        we, wf = _native(LJ, pos[4 * d : 4 * d + 4], mask[4 * d : 4 * d + 4], cutoff=6.0)
        np.testing.assert_allclose(float(e[d]), we, rtol=1e-12)
        np.testing.assert_allclose(np.asarray(forces[4 * d : 4 * d + 4]), wf, rtol=1e-12, atol=1e-14)


def _grads_ffi_and_callback(op, loss_of, arrays, *, outputs=None, argnums=0):
    """jax.jit(jax.grad(loss_of(kernel))) on the FFI path and on the callback path, checking both paths."""
    kf = TorchOpKernel(op, outputs=outputs, call_path="ffi")
    kc = TorchOpKernel(op, outputs=outputs, call_path="callback")
    out = []
    for k in (kf, kc):
        out.append(jax.jit(jax.grad(loss_of(k), argnums=argnums))(*arrays))
    return out, kf, kc


def _torch_lj_grad(op, pos, mask, a, v):
    """d(a E + sum(v . F))/d pos by torch autograd through the op's own backward formula."""
    t = torch.tensor(pos, requires_grad=True)
    e, f = op(t, torch.from_numpy(mask), cutoff=6.0)
    (g,) = torch.autograd.grad(a * e + (f * torch.from_numpy(v)).sum(), t)
    return g.numpy()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", [LJ, LJ_TRITON], ids=["torch", "triton"])
def test_grad_ffi_backward_matches_callback_and_torch_autograd_in_shard_map(op, dtype):
    """Energy and a forces cotangent (a Hessian-vector product), 8 devices, 4 atoms each."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    pos, _ = _lj_inputs(2, dtype)
    mask = np.ones(len(pos), bool)
    mask[::5] = False
    v = np.random.default_rng(1).normal(size=pos.shape).astype(dtype)
    a = 1.5

    def loss_of(k):
        def per_device(p, m, w):
            e, f = k(p, m, cutoff=6.0)
            return (a * e + jnp.sum(f * w))[None]

        sm = jax.shard_map(per_device, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x"))
        return lambda p: jnp.sum(sm(p, mask, v))

    (gf, gc), kf, _ = _grads_ffi_and_callback(op, loss_of, (pos,))
    assert kf.backward_path_of(pos[:4], mask[:4], cutoff=6.0) == "ffi"
    assert gf.dtype == dtype
    want = np.concatenate([_torch_lj_grad(op, pos[b : b + 4], mask[b : b + 4], a, v[b : b + 4]) for b in range(0, len(pos), 4)])
    rtol = 2e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(np.asarray(gf), want, rtol=rtol, atol=rtol * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(gf), np.asarray(gc), rtol=rtol, atol=rtol * np.abs(want).max())


def test_grad_of_a_selected_subset_of_outputs():
    """outputs=(1,) (forces only, a Hessian-vector product) and outputs=(0,) (energy)."""
    pos, mask = _lj_inputs(2, np.float64)
    v = np.random.default_rng(2).normal(size=pos.shape)
    (gf, gc), kf, _ = _grads_ffi_and_callback(LJ, lambda k: lambda p: jnp.sum(k(p, mask, cutoff=6.0) * v), (pos,), outputs=(1,))
    assert kf.backward_path_of(pos, mask, cutoff=6.0) == "ffi"
    want = _torch_lj_grad(LJ, pos, mask, 0.0, v)
    np.testing.assert_allclose(np.asarray(gf), want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(gf), np.asarray(gc), rtol=1e-12, atol=1e-12 * np.abs(want).max())
    (gf, gc), _, _ = _grads_ffi_and_callback(LJ, lambda k: lambda p: k(p, mask, cutoff=6.0), (pos,), outputs=(0,))
    want = _torch_lj_grad(LJ, pos, mask, 1.0, np.zeros_like(pos))
    np.testing.assert_allclose(np.asarray(gf), want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.asarray(gf), np.asarray(gc), rtol=1e-12, atol=1e-14)


def test_grad_keyword_only_tensor_and_statics():
    x, w = np.linspace(-1.0, 1.0, 6), np.linspace(2.0, 3.0, 6)
    ct = np.arange(1.0, 7.0)
    loss_of = lambda k: lambda x, w: jnp.vdot(k(x, 2.5, w=w, k=3, b=-1.0), ct)  # noqa: E731
    ((gx, gw), (cx, cw)), kf, _ = _grads_ffi_and_callback(torch.ops.ktffi.kwlin.default, loss_of, (x, w), argnums=(0, 1))
    assert kf.backward_path_of(x, 2.5, w=w, k=3, b=-1.0) == "ffi"
    np.testing.assert_allclose(np.asarray(gx), 2.5 * w * ct, rtol=1e-15)  # d(a x w)/dx
    np.testing.assert_allclose(np.asarray(gw), 2.5 * x * ct, rtol=1e-15)
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(cx))
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(cw))


@pytest.mark.parametrize("outputs", [None, ("out",), (0,)])
def test_grad_through_a_mutated_argument(outputs):
    """axpy_sq: (x^2, out0 + b x); the mutated input's gradient is its cotangent, x's 2x ct0 + b ct1."""
    x, out0, b = np.linspace(-2.0, 2.0, 5), np.full(5, 10.0), -0.75
    ct0, ct1 = np.arange(5.0) + 1, np.arange(5.0) * 0.5 - 1
    cts = {None: (ct0, ct1), ("out",): (ct1,), (0,): (ct0,)}[outputs]

    def loss_of(k):
        def loss(x, o):
            res = k(x, o, b)
            res = res if isinstance(res, tuple) else (res,)
            return sum(jnp.vdot(r, c) for r, c in zip(res, cts))

        return loss

    ((gx, go), (cx, co)), kf, _ = _grads_ffi_and_callback(torch.ops.ktffi.axpy_sq.default, loss_of, (x, out0), outputs=outputs, argnums=(0, 1))
    assert kf.backward_path_of(x, out0, b) == "ffi"
    c0 = ct0 if outputs != ("out",) else 0.0
    c1 = ct1 if outputs != (0,) else 0.0
    np.testing.assert_allclose(np.asarray(gx), 2 * x * c0 + b * c1, rtol=1e-15)
    np.testing.assert_allclose(np.asarray(go), np.broadcast_to(c1, x.shape), rtol=1e-15)
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(cx))
    np.testing.assert_array_equal(np.asarray(go), np.asarray(co))


@hypothesis.given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    dtype=st.sampled_from([np.float32, np.float64]),
    n=st.integers(-3, 3),
    seed=st.integers(0, 2**16),
)
def test_grad_shapes_and_dtypes_match_closed_form_and_callback(shape, dtype, n, seed):
    """x * n with an integer (undifferentiated) n: the gradient is n ct, on both paths."""
    rng = np.random.default_rng(seed)
    x, ct = rng.normal(size=shape).astype(dtype), rng.normal(size=shape).astype(dtype)
    nn = np.asarray(n, np.int32)
    (gf, gc), kf, _ = _grads_ffi_and_callback(torch.ops.ktffi.scale_by.default, lambda k: lambda x: jnp.vdot(k(x, nn), ct), (x,))
    assert kf.backward_path_of(x, nn) == "ffi"
    assert gf.dtype == dtype and gf.shape == x.shape
    np.testing.assert_array_equal(np.asarray(gf), n * ct)
    np.testing.assert_array_equal(np.asarray(gf), np.asarray(gc))


@hypothesis.given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    dtype=st.sampled_from([np.bool_, np.int32, np.int64, np.float32, np.float64]),
    shift=st.integers(-7, 7),
    seed=st.integers(0, 2**16),
)
def test_shapes_and_dtypes_match_native_and_callback(shape, dtype, shift, seed):
    x = (np.random.default_rng(seed).normal(size=shape) * 50).astype(dtype)
    dims = [len(shape) - 1]
    ffi, cb = _ffi_and_callback(torch.ops.ktffi.roll.default, x, [shift], dims)
    assert np.asarray(ffi).dtype == dtype
    np.testing.assert_array_equal(np.asarray(ffi), np.roll(x, shift, dims[0]))
    np.testing.assert_array_equal(np.asarray(ffi), np.asarray(cb))


# ------------------------------------------------------------------ errors and fallbacks


def test_op_raising_in_its_impl_reaches_jax(capfd):
    k = TorchOpKernel(torch.ops.ktffi.fails.default, call_path="ffi")
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"torch op ktffi::fails failed inside its FFI call.*boom from ktffi::fails"):
        jax.block_until_ready(jax.jit(k)(jnp.ones(3)))
    # written to stderr at once too (a collective elsewhere in the program could end the process first)
    err = capfd.readouterr().err
    device = "cpu" if jax.default_backend() == "cpu" else "cuda:0"  # the default device's, as torch names it
    assert f"nvalchemi_jaxbridge: on device {device}: torch op ktffi::fails failed inside its FFI call" in err
    assert "boom from ktffi::fails" in err


def test_op_whose_backward_raises_reaches_jax():
    k = TorchOpKernel(torch.ops.ktffi.bad_bwd.default, call_path="ffi")
    assert k.backward_path_of(jnp.ones(3)) == "ffi"
    g = jax.jit(jax.grad(lambda x: k(x).sum()))
    with pytest.raises(
        jax.errors.JaxRuntimeError,
        match=r"torch op ktffi::bad_bwd failed inside its FFI backward call.*boom in the backward of ktffi::bad_bwd",
    ):
        jax.block_until_ready(g(jnp.ones(3)))


def test_fake_that_lies_about_a_shape_is_named():
    k = TorchOpKernel(torch.ops.ktffi.liar.default, call_path="ffi")
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"ktffi::liar: return 0 is \[3\] Double but JAX expected \[4\] Double.*register_fake"):
        jax.block_until_ready(jax.jit(k)(jnp.ones(4)))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"return 0 is \[1, 3\] Float but JAX expected \[2, 3\] Float"):
        jax.block_until_ready(jax.jit(k)(jnp.ones((2, 3), jnp.float32)))
    k = TorchOpKernel(torch.ops.ktffi.liar.default, call_path="callback")  # the same words on the other path
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"ktffi::liar: return 0 is \[3\] torch.float64 but JAX expected \[4\] torch.float64.*register_fake"):
        jax.block_until_ready(jax.jit(k)(jnp.ones(4)))


def test_ineligible_call_falls_back_under_auto_and_raises_under_ffi():
    x = np.arange(4.0)
    auto = TorchOpKernel(torch.ops.ktffi.cast.default)
    assert TorchOpKernel(torch.ops.ktffi.roll.default).call_path_of(x, [1], [0]) == "ffi"  # eligible: FFI
    path = auto.call_path_of(x, torch.int32)
    assert path.startswith("callback (argument 'dtype' (position 1) has schema type int and value dtype")
    assert auto.backward_path_of(x, torch.int32) == path  # the backward follows the forward
    np.testing.assert_array_equal(np.asarray(auto(x, torch.int32)), np.arange(4, dtype=np.int32))
    strict = TorchOpKernel(torch.ops.ktffi.cast.default, call_path="ffi")
    with pytest.raises(KernelError, match=r"ktffi::cast cannot take the FFI call path \(call_path='ffi'\): argument 'dtype'.*call_path=\"auto\""):
        strict(x, torch.int32)


def test_bad_call_path_and_env_value(monkeypatch):
    with pytest.raises(KernelError, match=r"call_path='fast' for op ktffi::roll is not a call path; use one of \['auto', 'ffi', 'callback'\]"):
        TorchOpKernel(torch.ops.ktffi.roll.default, call_path="fast")
    monkeypatch.setenv(torch_op.ENV_CALL_PATH, "callback")
    x = np.arange(3.0)
    assert TorchOpKernel(torch.ops.ktffi.roll.default).call_path_of(x, [1], [0]) == "callback (JAXBRIDGE_KERNEL_PATH=callback)"
    assert TorchOpKernel(torch.ops.ktffi.roll.default).backward_path_of(x, [1], [0]) == "callback (JAXBRIDGE_KERNEL_PATH=callback)"
    assert TorchOpKernel(torch.ops.ktffi.roll.default, call_path="ffi").call_path_of(x, [1], [0]) == "ffi"
    monkeypatch.setenv(torch_op.ENV_CALL_PATH, "gpu")
    with pytest.raises(KernelError, match=r"JAXBRIDGE_KERNEL_PATH is 'gpu'.*one of \['auto', 'ffi', 'callback'\]"):
        TorchOpKernel(torch.ops.ktffi.roll.default).call_path_of(x, [1], [0])


def test_build_failure_warns_once_under_auto_and_raises_under_ffi(monkeypatch):
    err = KernelError("building the FFI call path failed (exit 1). [test]")

    def broken():
        raise err

    monkeypatch.setattr(target, "load", broken)
    monkeypatch.setattr(ffi_path, "_FFI_WARNED", [])
    x = np.arange(3.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        k1, k2 = TorchOpKernel(torch.ops.ktffi.roll.default), TorchOpKernel(torch.ops.ktffi.kwstat.default)
        assert k1.call_path_of(x, [1], [0]).startswith("callback (the FFI extension is unavailable: building")
        np.testing.assert_array_equal(np.asarray(k2(x, 2.0, k=1)), 2 * x + 1.5)
    msgs = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "[test]" in msgs[0] and 'call_path="callback"' in msgs[0] and "JAXBRIDGE_KERNEL_PATH=callback" in msgs[0]
    with pytest.raises(KernelError, match=r"\[test\]"):
        TorchOpKernel(torch.ops.ktffi.roll.default, call_path="ffi")(x, [1], [0])


# ------------------------------------------------------------------ plan encoding


def _decode(line: str):
    """An independent reader of one static plan line (the format in plans.py's docstring)."""
    tag, body = line[0], line[1:]
    items = body.split(",") if body else []
    return {
        "N": lambda: None,
        "b": lambda: body == "1",
        "i": lambda: int(body),
        "d": lambda: float.fromhex(body),
        "s": lambda: bytes.fromhex(body).decode(),
        "I": lambda: [int(v) for v in items],
        "D": lambda: [float.fromhex(v) for v in items],
        "B": lambda: [v == "1" for v in items],
    }[tag]()


_STATIC = st.one_of(
    st.tuples(st.just("float"), st.floats(allow_nan=False)),
    st.tuples(st.just("int"), st.integers(-(2**63), 2**63 - 1)),
    st.tuples(st.just("bool"), st.booleans()),
    st.tuples(st.just("str"), st.text(max_size=8)),
    st.tuples(st.just("List[int]"), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4)),
    st.tuples(st.just("List[float]"), st.lists(st.floats(allow_nan=False), max_size=4)),
    st.tuples(st.just("List[bool]"), st.lists(st.booleans(), max_size=4)),
    st.tuples(st.just("Optional[float]"), st.none()),
    st.tuples(st.just("number"), st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False))),
)


@hypothesis.given(st.lists(_STATIC, max_size=6))
def test_plan_encoding_round_trips(statics):
    entries = [(f"a{i}", t, v) for i, (t, v) in enumerate(statics)]
    lines = plans.encode(0, entries).split("\n")
    assert lines[0] == "jb1 0" and len(lines) == len(statics) + 1
    for line, (t, v) in zip(lines[1:], statics):
        got = _decode(line)
        assert got == (list(v) if isinstance(v, (list, tuple)) else v) and type(got) is type(v)
        if t == "float":
            assert math.copysign(1.0, got) == math.copysign(1.0, v)


def test_plan_encoding_refuses_what_it_cannot_express():
    with pytest.raises(plans.Ineligible, match=r"argument 'n' \(position 0\) is 18446744073709551616, outside int64"):
        plans.encode(0, [("n", "int", 2**64)])
    with pytest.raises(plans.Ineligible, match=r"argument 'd' \(position 1\) has schema type Device"):
        plans.encode(1, [("x", "Tensor", plans.TensorSlot(0)), ("d", "Device", "cpu")])


# ------------------------------------------------------------------ the build cache


def _fake_compiler(tmp_path: pathlib.Path, *, fail: bool = False) -> pathlib.Path:
    """A stand-in for c++: answers --version, writes its -o file (or fails), logs each compile."""
    script = tmp_path / "fakecxx"
    body = 'echo "ERROR: cannot compile (test compiler)" >&2; exit 3' if fail else 'echo built > "$out"'
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "fakecxx 1.0"; exit 0; fi\n'
        f'echo compile >> "{tmp_path}/log"\nsleep 0.3\n'
        'while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; fi; shift; done\n'
        f"{body}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_build_compiles_once_then_reuses_the_cache(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=build.__name__)
    monkeypatch.setenv("JAXBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path)))
    cfg = build.config()
    assert cfg.compiler_version == "fakecxx 1.0"
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(build.build(cfg))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    paths.append(build.build(cfg))
    assert len(set(paths)) == 1 and paths[0].read_text() == "built\n"
    assert paths[0].parent == tmp_path / "cache" / cfg.key()
    assert (tmp_path / "log").read_text() == "compile\n"  # four builds, one compile
    lines = [r.getMessage() for r in caplog.records if r.name == build.__name__]  # library lines go to logging
    assert sum("(once per machine and torch/jax versions; about" in m for m in lines) == 1
    starts = [r for r in caplog.records if r.name == build.__name__ and "compiling the torch FFI" in r.getMessage()]
    assert [r.levelno for r in starts] == [logging.WARNING]  # seen by default: the user knows why the call waits
    assert sum("compiled the torch FFI call path in" in m for m in lines) == 1


def test_failed_build_names_the_command_and_output(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path, fail=True)))
    with pytest.raises(KernelError, match=r"(?s)failed \(exit 3\).*command: .*fakecxx .*torch_call\.cc.*cannot compile \(test compiler\).*call_path=\"callback\""):
        build.build(build.config(), quiet=True)
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_ffi_sources_write_no_iostreams():
    """The handler's messages are joined with std::to_string, not written through an iostream: on the H200
    machine the first number written into an ostringstream inside the built library crashed the process
    (SIGSEGV), so the error of an op whose fake lies ended the process instead of reaching JAX. CI has no GPU;
    `scripts/gpu_kernels_check.py` (errors-lies-ffi) is the check there."""
    sources = sorted(pathlib.Path(build.SOURCE).parent.glob("*.cc"))
    assert len(sources) >= 5
    for path in sources:
        code = "\n".join(line.split("//")[0] for line in path.read_text().splitlines())
        for banned in ("<sstream>", "<iostream>", "ostringstream", "std::cout", "std::cerr", "c10::str("):
            assert banned not in code, f"{path.name} uses {banned}; join messages with jb::text (plan.cc)"


def test_real_build_is_cached():
    ext = target.load()  # built (or found) for this process
    cfg = build.config()
    assert ext.path == build.cache_root() / cfg.key() / build.LIB_NAME
    mtime = ext.path.stat().st_mtime_ns
    assert build.build(cfg) == ext.path and ext.path.stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_other_process_reuses_the_build():
    ext = target.load()
    # only the compile is refused: config() asks the compiler its version first
    code = (
        "import subprocess\n"
        "from nvalchemi_jaxbridge.kernels.ffi import build\n"
        "cfg = build.config()\n"
        "def boom(*a, **k): raise AssertionError('compiled again')\n"
        "subprocess.run = boom\n"
        "print(build.build(cfg, quiet=True))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ}, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == str(ext.path)


# ------------------------------------------------------------------ GPU (run by the lead on an H200)


@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="needs JAX and torch on a CUDA GPU; on a GPU machine run with JAX_PLATFORMS=cuda,cpu TRITON_INTERPRET=0 "
    "(tests/conftest.py defaults JAX to the CPU)",
)
def test_gpu_ffi_path_orders_with_xla_work_and_matches_torch():
    """GPU only: the op (on XLA's stream) sees a long XLA loop's result, and XLA sees the op's result;
    the FFI backward matches torch's on the GPU; torch's current stream of every device is left as it was
    (per device: JAX itself may switch the Python thread's current device, which is not ours to check)."""

    def streams():
        return [torch.cuda.current_stream(d) for d in range(torch.cuda.device_count())]

    prev = streams()
    k = TorchOpKernel(torch.ops.ktffi.kwstat.default, call_path="ffi")
    acc = TorchOpKernel(torch.ops.ktffi.accum.default, call_path="ffi")

    def loop(x):
        return jax.lax.fori_loop(0, 300, lambda i, y: jnp.tanh(y @ y.T) / 64.0 + y, x)

    def f(x):
        y = k(loop(x), 3.0, k=1)  # after the loop
        return acc(x, y, -1.0).sum(axis=1)  # XLA reads the op's (aliased) result right after it

    x = jnp.full((512, 512), 1e-3, jnp.float32)
    y_ref = 3.0 * np.asarray(jax.jit(loop)(x), np.float64) + 1.5
    want = (y_ref - np.asarray(x, np.float64)).sum(axis=1)
    np.testing.assert_allclose(np.asarray(jax.jit(f)(x)), want, rtol=1e-4)
    assert streams() == prev
    for op in (LJ, LJ_TRITON):
        pos, mask = _lj_inputs(3, np.float32)
        got = jax.jit(lambda p, m, op=op: TorchOpKernel(op, call_path="ffi")(p, m, cutoff=6.0))(pos, mask)
        want = op(torch.tensor(pos, device="cuda"), torch.tensor(mask, device="cuda"), cutoff=6.0)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), w.cpu().numpy(), rtol=1e-5, atol=1e-5 * float(w.abs().max()))
        # the FFI backward on XLA's stream: energy and a forces cotangent (Hessian-vector product)
        v = np.random.default_rng(3).normal(size=pos.shape).astype(np.float32)
        k = TorchOpKernel(op, call_path="ffi")
        assert k.backward_path_of(pos, mask, cutoff=6.0) == "ffi"
        loss = lambda p, k=k: 1.5 * k(p, mask, cutoff=6.0)[0] + jnp.sum(k(p, mask, cutoff=6.0)[1] * v)  # noqa: E731
        g = jax.jit(jax.grad(loss))(pos)
        t = torch.tensor(pos, device="cuda", requires_grad=True)
        e, f = op(t, torch.tensor(mask, device="cuda"), cutoff=6.0)
        (w,) = torch.autograd.grad(1.5 * e + (f * torch.tensor(v, device="cuda")).sum(), t)
        np.testing.assert_allclose(np.asarray(g), w.cpu().numpy(), rtol=1e-4, atol=1e-4 * float(w.abs().max()))
        # one call, of a plan no other kernel shares (another cutoff): its backward finds its graph by
        # the token's site, with no read back (no stream synchronisation)
        one = TorchOpKernel(op, call_path="ffi")
        g1 = jax.jit(jax.grad(lambda p, one=one: one(p, mask, cutoff=5.5)[0]))(pos)
        _, f1 = op(torch.tensor(pos, device="cuda"), torch.tensor(mask, device="cuda"), cutoff=5.5)
        np.testing.assert_allclose(np.asarray(g1), -f1.cpu().numpy(), rtol=1e-4, atol=1e-4 * float(f1.abs().max()))
        assert one.token_reads() == 0
        assert streams() == prev
