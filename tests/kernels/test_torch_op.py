"""TorchOpKernel: a torch custom op called from JAX (jit, grad, shard_map) matches torch eager."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P

from nvalchemi_jaxbridge.kernels import KernelError, NotDifferentiableError, TorchOpKernel, resolve_kernel
from nvalchemi_jaxbridge.spec import OpResolutionError

from . import _ops  # noqa: F401  (registers the kt:: ops)

GAUSS = TorchOpKernel(torch.ops.kt.gauss_pair)


def _torch_energy_forces(pos: np.ndarray, op, weights: np.ndarray, cutoff=2.0, sigma=1.0):
    t = torch.tensor(pos, requires_grad=True)
    e = op(t, cutoff, sigma)
    (g,) = torch.autograd.grad((e * torch.tensor(weights)).sum(), t)
    return e.detach().numpy(), g.numpy()


@hypothesis.settings(max_examples=6)
@hypothesis.given(n=st.integers(1, 24), seed=st.integers(0, 2**16), f32=st.booleans())
def test_forward_and_grad_match_torch(n, seed, f32):
    rng = np.random.default_rng(seed)
    pos = rng.uniform(0.0, 3.0, (n, 3))
    w = rng.normal(size=n)
    dtype = np.float32 if f32 else np.float64
    pos = pos.astype(dtype)
    want_e, want_g = _torch_energy_forces(pos, torch.ops.kt.gauss_pair, w.astype(dtype))

    def loss(p):
        return jnp.sum(GAUSS(p, 2.0, sigma=1.0) * w.astype(dtype))

    e = jax.jit(lambda p: GAUSS(p, 2.0, 1.0))(jnp.asarray(pos))
    g = jax.jit(jax.grad(loss))(jnp.asarray(pos))
    assert e.dtype == dtype and g.dtype == dtype
    rtol = 1e-5 if f32 else 1e-12
    np.testing.assert_allclose(np.asarray(e), want_e, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=rtol, atol=rtol)


def test_matches_numpy_reference():
    pos = np.random.default_rng(3).uniform(0.0, 3.0, (20, 3))
    e_ref, f_ref = _ops.gauss_numpy(pos, 2.0, 1.0)
    e = GAUSS(jnp.asarray(pos), 2.0, 1.0)
    f = -jax.grad(lambda p: GAUSS(p, 2.0, 1.0).sum())(jnp.asarray(pos))
    np.testing.assert_allclose(np.asarray(e), e_ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.asarray(f), f_ref, rtol=1e-12, atol=1e-14)


def test_mutated_argument_keyword_only_and_scalar_pass_through():
    k = TorchOpKernel(torch.ops.kt.scale_add)
    assert k.result_names == ("return 0", "mutated argument 'acc'")
    x = jnp.arange(6.0).reshape(2, 3)
    acc0 = jnp.ones((2, 3))
    total, acc = jax.jit(lambda x, a: k(x, a, 2.0, bias=0.5))(x, acc0)
    np.testing.assert_allclose(np.asarray(acc), 1.0 + 2.0 * np.arange(6.0).reshape(2, 3))
    np.testing.assert_allclose(float(total), 15.5)
    np.testing.assert_array_equal(np.asarray(acc0), np.ones((2, 3)))  # JAX's input is never written
    # outputs picked by name and by index; one selected output comes back bare
    by_name = TorchOpKernel(torch.ops.kt.scale_add, outputs=("acc",))(x, acc0, scale=3.0)
    by_index = TorchOpKernel(torch.ops.kt.scale_add, outputs=(1, 0))(x, acc=acc0, scale=3.0)
    np.testing.assert_allclose(np.asarray(by_name), 1.0 + 3.0 * np.asarray(x))
    np.testing.assert_allclose(np.asarray(by_index[0]), np.asarray(by_name))


def test_mutating_op_without_autograd_raises_when_differentiated():
    k = TorchOpKernel(torch.ops.kt.scale_add)
    c = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3)))

    def loss(x, a):
        total, acc = k(x, a, 2.0)
        return jnp.sum(acc * c) + total

    # scale_add has no autograd formula: differentiating it must say so
    with pytest.raises(NotDifferentiableError, match=r"kt::scale_add.*register_autograd"):
        jax.grad(loss)(jnp.ones((2, 3)), jnp.zeros((2, 3)))


def test_multiple_returns_integer_output_and_composite_autograd():
    k = TorchOpKernel(torch.ops.kt.two_out)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 5)))
    y, cnt = k(x, 3)
    assert cnt.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(cnt), (np.asarray(x) > 0).sum(-1))
    g = jax.grad(lambda x: k(x, 3)[0].sum())(x)
    np.testing.assert_allclose(np.asarray(g), 3.0)
    cube = resolve_kernel("kt::cube_sum")  # lazy name, composite autograd
    g = jax.grad(lambda x: cube(x).sum())(x)
    np.testing.assert_allclose(np.asarray(g), 3 * np.asarray(x) ** 2, rtol=1e-12)


def test_zero_copy_inside_callback():
    seen = {}

    @torch.library.custom_op("kt::record_ptr", mutates_args=())
    def record_ptr(x: torch.Tensor) -> torch.Tensor:
        seen["ptr"] = x.data_ptr()
        return x + 1

    record_ptr.register_fake(lambda x: torch.empty_like(x))
    x = jnp.arange(64.0)
    y = TorchOpKernel(torch.ops.kt.record_ptr)(x)
    np.testing.assert_allclose(np.asarray(y), np.arange(64.0) + 1)
    assert seen["ptr"] == x.unsafe_buffer_pointer()


def test_inside_shard_map_keeps_varying_types():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    pos = np.random.default_rng(2).uniform(0.0, 3.0, (8 * 6, 3))

    def per_device(p):
        return jax.lax.psum(GAUSS(p, 2.0, 1.0).sum(), "x")

    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=True))
    want = sum(_ops.gauss_numpy(pos[6 * d : 6 * d + 6], 2.0, 1.0)[0].sum() for d in range(8))
    np.testing.assert_allclose(float(f(pos)), want, rtol=1e-12)
    g = jax.grad(f)(jnp.asarray(pos))
    want_g = np.concatenate([-_ops.gauss_numpy(pos[6 * d : 6 * d + 6], 2.0, 1.0)[1] for d in range(8)])
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-12, atol=1e-14)

    # without the psum the result is still varying: out_specs=P() must be rejected, not
    # silently answered with device 0's block
    bad = jax.shard_map(lambda p: GAUSS(p, 2.0, 1.0).sum(), mesh=mesh, in_specs=P("x"), out_specs=P())
    with pytest.raises(ValueError, match="varying|replicat"):
        jax.jit(bad)(pos)


# ------------------------------------------------------------------ errors


def test_no_fake_registration_is_named():
    with pytest.raises(KernelError, match=r"kt::no_fake.*no fake.*register_fake\('kt::no_fake'\)"):
        TorchOpKernel(torch.ops.kt.no_fake)(jnp.ones(3))


def test_output_position_the_op_does_not_have():
    with pytest.raises(KernelError, match=r"outputs\[0\] of op kt::gauss_pair is 1, but the op has 1 result"):
        TorchOpKernel(torch.ops.kt.gauss_pair, outputs=(1,))
    with pytest.raises(KernelError, match=r"'x' is an argument the op does not mutate.*mutated arguments: \['acc'\]"):
        TorchOpKernel(torch.ops.kt.scale_add, outputs=("x",))


def test_no_autograd_formula_raises_when_differentiated():
    k = TorchOpKernel(torch.ops.kt.no_grad_rule)
    np.testing.assert_allclose(np.asarray(k(jnp.arange(3.0))), [0.0, 1.0, 4.0])  # forward is fine
    with pytest.raises(NotDifferentiableError, match=r"kt::no_grad_rule.*torch.library.register_autograd"):
        jax.grad(lambda x: k(x).sum())(jnp.arange(3.0))


_NOAG = torch.library.Library("ktnoag", "DEF")
_NOAG.define("cube(Tensor x) -> Tensor")


def _cube_no_record(x):
    with torch.no_grad():  # as a C++/Triton kernel: torch records nothing
        return x * x * x


_NOAG.impl("cube", _cube_no_record, "CPU")
_NOAG.impl("cube", lambda x: torch.empty_like(x), "Meta")


@pytest.mark.parametrize("check_grad", [True, False])
def test_op_without_autograd_kernel_is_refused_when_traced(check_grad):
    """An op with a backend kernel only: torch's autograd fallback records no backward (a warning, and no
    gradient: the bridge would write zeros), so jax.grad is refused at trace time (whatever check_grad says),
    naming the op and the fix."""
    x = torch.arange(3.0, dtype=torch.float64, requires_grad=True)
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        (g,) = torch.autograd.grad(torch.ops.ktnoag.cube(x).sum(), x, allow_unused=True)
    assert g is None  # what torch itself gives: no gradient, not 3 x^2
    k = TorchOpKernel(torch.ops.ktnoag.cube, call_path="callback", check_grad=check_grad)
    np.testing.assert_allclose(np.asarray(k(jnp.arange(3.0))), [0.0, 1.0, 8.0])  # forward is fine
    with pytest.raises(NotDifferentiableError, match=r"ktnoag::cube, but the op has no autograd kernel.*"
                       r"register_autograd\('ktnoag::cube'.*forces output"):
        jax.grad(lambda x: k(x).sum())(jnp.arange(3.0))


def test_backward_that_reads_values_is_differentiable():
    # A backward formula that asks for tensor values (`.item()`) cannot run on fake
    # tensors; it is still a registered formula, so jax.grad must run it on real data.
    @torch.library.custom_op("kt::cube_sum_item", mutates_args=())
    def cube_sum_item(x: torch.Tensor) -> torch.Tensor:
        return (x**3).sum()

    cube_sum_item.register_fake(lambda x: x.new_empty(()))

    def setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        scale = float(g.item())  # data-dependent on purpose
        return 3.0 * scale * x**2

    cube_sum_item.register_autograd(backward, setup_context=setup)
    x = np.linspace(-1.0, 2.0, 7)
    k = TorchOpKernel(torch.ops.kt.cube_sum_item)
    np.testing.assert_allclose(np.asarray(jax.grad(lambda v: 2.0 * k(v))(jnp.asarray(x))), 6.0 * x**2, rtol=1e-12)


def test_bad_calls_say_where_and_how():
    with pytest.raises(KernelError, match=r"no argument 'cutof'.*Did you mean 'cutoff'"):
        GAUSS(jnp.ones((3, 3)), cutof=2.0, sigma=1.0)
    with pytest.raises(KernelError, match=r"argument 'cutoff' \(position 1\).*must be a Python value"):
        GAUSS(jnp.ones((3, 3)), jnp.asarray(2.0), 1.0)
    with pytest.raises(KernelError, match=r"argument 'positions' \(position 0\).*pass a JAX array"):
        GAUSS([[0.0, 0.0, 0.0]], 2.0, 1.0)
    with pytest.raises(KernelError, match=r"missing argument 'sigma'"):
        GAUSS(jnp.ones((3, 3)), 2.0)
    with pytest.raises(KernelError, match=r"needs a torch op"):
        TorchOpKernel(lambda x: x)


def test_resolve_kernel():
    assert resolve_kernel(torch.ops.kt.gauss_pair) is resolve_kernel("kt::gauss_pair")
    assert resolve_kernel(_ops.gauss_pair) is resolve_kernel(torch.ops.kt.gauss_pair.default)
    f = jnp.sin
    assert resolve_kernel(f) is f
    assert resolve_kernel(GAUSS) is GAUSS
    assert resolve_kernel("kt::gauss_pair").param_names == ("positions", "cutoff", "sigma")
    with pytest.raises(OpResolutionError, match=r"kt::nope"):
        resolve_kernel("kt::nope")
