"""`torch_function`: a plain torch function as a JAX kernel, checked against torch itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P

from nvalchemi_jaxbridge.kernels import KernelError
from nvalchemi_jaxbridge.kernels.torch_fn import torch_function

LIN = torch.nn.Linear(3, 5, dtype=torch.float64)


def stage(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stage closing over weights (fake-tensor shape probing must accept them)."""
    return torch.tanh(LIN(x)) * y.sum(), (x**2).sum(1)


def _torch_reference(x: np.ndarray, y: np.ndarray):
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.tensor(y, requires_grad=True)
    a, b = stage(xt, yt)
    loss = (a**2).sum() + (b * torch.arange(len(b), dtype=b.dtype)).sum()
    return a.detach().numpy(), b.detach().numpy(), [g.numpy() for g in torch.autograd.grad(loss, (xt, yt))]


@pytest.mark.parametrize("call_path", ["callback", "ffi"])
def test_values_and_gradients_match_torch(call_path):
    k = torch_function(stage, 2, 2, label="stage", call_path=call_path)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(7, 3)), rng.normal(size=4)
    want_a, want_b, want_g = _torch_reference(x, y)

    def loss(x, y):
        a, b = k(x, y)
        return (a**2).sum() + (b * jnp.arange(b.shape[0])).sum()

    a, b = jax.jit(k)(jnp.asarray(x), jnp.asarray(y))
    g = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(x), jnp.asarray(y))
    np.testing.assert_allclose(np.asarray(a), want_a, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(b), want_b, rtol=1e-12)
    for got, want in zip(g, want_g):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-14)


def test_inside_shard_map_keeps_per_device_values():
    k = torch_function(lambda x: x * 3 + x.sum(), 1, 1, label="affine")
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    x = np.arange(16.0).reshape(8, 2)
    f = jax.jit(jax.shard_map(k, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    want = np.concatenate([b * 3 + b.sum() for b in np.split(x, 4)])
    np.testing.assert_allclose(np.asarray(f(jnp.asarray(x))), want)


def test_wrong_output_count_is_named():
    k = torch_function(lambda x: (x, x), 1, 1, label="twice")
    with pytest.raises(KernelError, match="returned 2 tensor"):
        jax.block_until_ready(k(jnp.ones(3)))


def test_arity_must_be_positive():
    with pytest.raises(KernelError, match="must both be >= 1"):
        torch_function(lambda: None, 0, 1, label="empty")
