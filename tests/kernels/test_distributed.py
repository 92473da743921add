"""Torch and Triton pair kernels inside shard_map over 8 CPU devices: halo + kernel + psum
give the single-device torch energies, per-atom energies and forces (autograd)."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvalchemi_jaxbridge.kernels import TorchOpKernel

from . import _ops  # noqa: F401
from ._blocks import distributed_energy, make_blocks

CUTOFF, SIGMA, BOX = 2.0, 1.0, 8.0


def _mesh():
    return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def _torch_reference(pos: np.ndarray, op):
    t = torch.tensor(pos, requires_grad=True)
    e = op(t, CUTOFF, SIGMA)
    (g,) = torch.autograd.grad(e.sum(), t)
    return float(e.detach().sum()), e.detach().numpy(), -g.numpy()


def _check(op, n, seed, dtype, rtol):
    pos = np.random.default_rng(seed).uniform(0.0, BOX, (n, 3)).astype(dtype)
    mesh = _mesh()
    blocks = make_blocks(pos.astype(np.float64), BOX, CUTOFF, 8)
    f = distributed_energy(TorchOpKernel(op), blocks, mesh, cutoff=CUTOFF, sigma=SIGMA)
    p_owned = jax.device_put(blocks.to_owned(pos), NamedSharding(mesh, P("x")))
    (energy, e_rows), vjp = jax.vjp(jax.jit(f), p_owned)
    (grad,) = vjp((jnp.ones((), energy.dtype), jnp.zeros_like(e_rows)))
    want_e, want_rows, want_f = _torch_reference(pos, op)
    np.testing.assert_allclose(float(energy), want_e, rtol=rtol)
    np.testing.assert_allclose(blocks.from_halo_owned(np.asarray(e_rows), n), want_rows, rtol=rtol, atol=rtol * 1e-2)
    np.testing.assert_allclose(-blocks.from_owned(np.asarray(grad), n), want_f, rtol=rtol, atol=rtol * 1e-2)
    # padding rows of the owned storage get no gradient
    pad = np.ones(8 * blocks.oc, bool)
    for d, ids in enumerate(blocks.owned_ids):
        pad[d * blocks.oc : d * blocks.oc + len(ids)] = False
    assert not np.any(np.asarray(grad)[pad])


@hypothesis.settings(max_examples=4)
@hypothesis.given(n=st.integers(40, 160), seed=st.integers(0, 2**16))
def test_torch_op_matches_single_device_torch(n, seed):
    _check(torch.ops.kt.gauss_pair.default, n, seed, np.float64, 1e-6)


def test_triton_op_matches_single_device_torch_float64():
    _check(torch.ops.kt.gauss_pair_tri.default, 96, 7, np.float64, 1e-6)


def test_triton_op_matches_single_device_torch_float32():
    _check(torch.ops.kt.gauss_pair_tri.default, 64, 11, np.float32, 2e-4)


def test_torch_reference_is_the_numpy_closed_form():
    pos = np.random.default_rng(5).uniform(0.0, BOX, (60, 3))
    e, rows, f = _torch_reference(pos, torch.ops.kt.gauss_pair.default)
    want_rows, want_f = _ops.gauss_numpy(pos, CUTOFF, SIGMA)
    np.testing.assert_allclose(rows, want_rows, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(f, want_f, rtol=1e-12, atol=1e-14)
