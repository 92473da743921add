"""The callback call path of TorchOpKernel (issue 7): argument slots filled from precomputed
templates, torch's grad mode and CUDA stream/device set for the op and restored after.
(`call_path="callback"` throughout: "auto" takes the FFI path, tested in test_ffi_path.py.)
"""

from __future__ import annotations

import threading

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from nvalchemi_jaxbridge.kernels import TorchOpKernel
from nvalchemi_jaxbridge.kernels import callback_path, torch_op

NS = "ktcp"
SEEN: list[tuple[int, bool]] = []  # (thread id, torch grad mode) as the probe op saw them


# keyword-only Tensors are allowed in schemas but not by @custom_op / register_autograd,
# so these two are defined with torch.library directly
_lib = torch.library.Library(NS, "DEF")
_lib.define("mix(Tensor x, float a, *, Tensor w, float b=1.0) -> Tensor")  # a x + b w
# CompositeImplicitAutograd: autograd and fake tensors go through the decomposition
_lib.impl("mix", lambda x, a, *, w, b=1.0: a * x + b * w, "CompositeImplicitAutograd")
_lib.define("add_into(Tensor x, *, Tensor(a!) out, float b) -> ()")  # out += b x


def _add_into(x, *, out, b):
    out.add_(x, alpha=b)


_lib.impl("add_into", _add_into, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NS}::add_into", lambda x, *, out, b: None, lib=_lib)


def _probe(x):
    if not isinstance(x, FakeTensor):  # the real calls, not the trace-time shape and autograd checks
        SEEN.append((threading.get_ident(), torch.is_grad_enabled()))
    return 3.0 * x


# a composite, so it runs under the grad mode of its caller (a custom_op's autograd wrapper
# would turn grad off around it)
_lib.define("probe(Tensor x) -> Tensor")  # 3 x, recording the thread and grad mode it runs under
_lib.impl("probe", _probe, "CompositeImplicitAutograd")


@torch.library.custom_op(f"{NS}::fails", mutates_args=())
def fails(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("boom from ktcp::fails")


fails.register_fake(lambda x: torch.empty_like(x))


# ------------------------------------------------------------------ argument slots


@hypothesis.settings(max_examples=5)
@hypothesis.given(
    n=st.integers(1, 5), m=st.integers(1, 4), a=st.floats(-3, 3), b=st.floats(-3, 3), seed=st.integers(0, 99)
)
def test_keyword_only_tensor_and_statics_reach_their_slots(n, m, a, b, seed):
    rng = np.random.default_rng(seed)
    x, w, ct = rng.normal(size=(3, n, m))
    k = TorchOpKernel(torch.ops.ktcp.mix, call_path="callback")
    f = jax.jit(lambda x, w: k(x, a, w=w, b=b))
    for _ in range(2):  # the second call reuses the compiled call: templates must not carry over
        np.testing.assert_allclose(np.asarray(f(jnp.asarray(x), jnp.asarray(w))), a * x + b * w, rtol=1e-12)
        x, w = w, x
    gx, gw = jax.grad(lambda x, w: jnp.vdot(k(x, a, w=w, b=b), ct), argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(gx), a * ct, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(gw), b * ct, rtol=1e-12)


def test_mutated_keyword_only_argument_is_written_in_place():
    k = TorchOpKernel(torch.ops.ktcp.add_into, call_path="callback")
    assert k.result_names == ("mutated argument 'out'",)
    x, out0 = jnp.arange(6.0).reshape(2, 3), jnp.full((2, 3), 0.5)
    got = jax.jit(lambda x, o: k(x, out=o, b=2.0))(x, out0)
    np.testing.assert_allclose(np.asarray(got), 0.5 + 2.0 * np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(np.asarray(out0), 0.5)  # JAX's input array is untouched


# ------------------------------------------------------------------ grad mode


def test_grad_mode_is_off_in_forward_on_in_backward_and_restored_after():
    k = TorchOpKernel(torch.ops.ktcp.probe, call_path="callback")
    x = jnp.arange(4.0)
    for outer in (True, False):
        SEEN.clear()
        with torch.set_grad_enabled(outer):
            y = k(x)
            assert torch.is_grad_enabled() is outer
            g = jax.grad(lambda x: k(x).sum())(x)
            assert torch.is_grad_enabled() is outer
        np.testing.assert_allclose(np.asarray(y), 3.0 * np.arange(4.0))
        np.testing.assert_allclose(np.asarray(g), 3.0)
        # [forward, the vjp's forward under autograd (its graph serves the backward: no re-run)];
        # on the CPU the callbacks run on the calling thread, so the restored mode above is theirs
        assert [s[1] for s in SEEN] == [False, True]
        assert {s[0] for s in SEEN} == {threading.get_ident()}


def test_grad_mode_is_restored_when_the_op_raises(caplog):
    k = TorchOpKernel(torch.ops.ktcp.fails, call_path="callback")
    with pytest.raises(Exception, match="boom from ktcp::fails"):
        jax.block_until_ready(k(jnp.ones(3)))
    assert torch.is_grad_enabled()
    # logged at once too, level ERROR (a collective elsewhere in the program could end the process first)
    err = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "ERROR")
    assert "nvalchemi_jaxbridge: on device cpu: torch op ktcp::fails failed inside its call (callback path)" in err
    assert "RuntimeError: boom from ktcp::fails" in err


# ------------------------------------------------------------------ CUDA stream and device


class _FakeCuda:
    """torch's per-thread CUDA state as its C setters change it (see torch/csrc/cuda/Module.cpp):
    a current device, and a current stream per device; setting a stream makes its device current."""

    def __init__(self, n_dev: int, device: int, streams: dict[int, int]):
        self.device = device
        self.streams = {d: (streams.get(d, 0), d, 1) for d in range(n_dev)}
        self.external = 0

    def set_stream(self, *, stream_id: int, device_index: int, device_type: int) -> None:
        self.device = device_index
        self.streams[device_index] = (stream_id, device_index, device_type)

    def state(self):
        return self.device, dict(self.streams)


class _Buf:
    def __init__(self, index: int):
        self.index = index

    def __dlpack_device__(self):
        return (torch_op._KDL_CUDA, self.index)


class _Ctx:
    def __init__(self, stream: int):
        self.stream = stream


@hypothesis.settings(max_examples=20)
@hypothesis.given(data=st.data(), n_dev=st.integers(1, 4))
def test_xla_stream_is_entered_and_everything_restored(data, n_dev):
    device = data.draw(st.integers(0, n_dev - 1), "current device")
    index = data.draw(st.integers(0, n_dev - 1), "buffer's device")
    streams = data.draw(st.dictionaries(st.integers(0, n_dev - 1), st.integers(1, 99)), "non-default streams")
    fake = _FakeCuda(n_dev, device, streams)

    class ExternalStream:  # what torch makes of a raw stream pointer: its id is the pointer
        def __init__(self, ptr, device):
            fake.external += 1
            self.stream_id, self.device_index, self.device_type = ptr, device.index, 1

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(callback_path, "_XLA_STREAMS", {})
        mp.setattr(torch.cuda, "init", lambda: None)
        mp.setattr(torch.cuda, "ExternalStream", ExternalStream)
        mp.setattr(torch._C, "_cuda_getDevice", lambda: fake.device, raising=False)
        mp.setattr(torch._C, "_cuda_setDevice", lambda d: setattr(fake, "device", d), raising=False)
        mp.setattr(torch._C, "_cuda_getCurrentStream", lambda d: fake.streams[d], raising=False)
        mp.setattr(torch._C, "_cuda_setStream", fake.set_stream, raising=False)
        before = fake.state()
        for _ in range(2):  # the second call finds the stream in the cache
            saved = torch_op._enter_xla_stream(_Ctx(7000 + index), _Buf(index))
            assert fake.device == index
            assert fake.streams[index] == (7000 + index, index, 1)
            assert {d: s for d, s in fake.streams.items() if d != index} == {
                d: s for d, s in before[1].items() if d != index
            }
            torch_op._leave_xla_stream(saved)
            assert fake.state() == before
        assert fake.external == 1
    finally:
        mp.undo()


def test_cpu_buffers_leave_torch_alone():
    class Cpu:
        def __dlpack_device__(self):
            return (1, 0)

    class NoStream:  # ctx.stream raises on the CPU; it must not be asked for
        @property
        def stream(self):
            raise AssertionError("ctx.stream read for a CPU buffer")

    assert torch_op._enter_xla_stream(NoStream(), Cpu()) is None


@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="needs JAX and torch on a CUDA GPU; on a GPU machine run with JAX_PLATFORMS=cuda,cpu TRITON_INTERPRET=0 "
    "(tests/conftest.py defaults JAX to the CPU)",
)
def test_gpu_op_runs_after_pending_xla_work_and_leaves_torch_streams():
    """GPU only (not run on the CPU test machine): the op must see the finished result of a long XLA loop."""
    prev = torch.cuda.current_stream()
    k = TorchOpKernel(torch.ops.ktcp.probe, call_path="callback")

    def f(x):
        y = jax.lax.fori_loop(0, 300, lambda i, y: jnp.tanh(y @ y.T) / 64.0 + y, x)
        return k(y)

    x = jnp.full((512, 512), 1e-3, jnp.float32)
    y_ref = np.asarray(jax.jit(lambda x: jax.lax.fori_loop(0, 300, lambda i, y: jnp.tanh(y @ y.T) / 64.0 + y, x))(x))
    np.testing.assert_allclose(np.asarray(jax.jit(f)(x)), 3.0 * y_ref, rtol=1e-5)
    assert torch.cuda.current_stream() == prev
