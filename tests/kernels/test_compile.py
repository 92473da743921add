"""nvalchemi_jaxbridge.kernels.compile: OpAdapters over torch / Triton ops (live or lazy "ns::name"),
with a real HaloPlan on a periodic box over 8 CPU devices, against single-device torch."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.kernels import TorchOpKernel, compile, resolve_kernel
from nvalchemi_jaxbridge.layout import HaloPlan
from nvalchemi_jaxbridge.lower import make_mesh
from nvalchemi_jaxbridge.spec import DistributionSpec, OpAdapter, OpResolutionError
from nvalchemi_jaxbridge.spec.policies import HaloStoragePolicy

from . import _ops  # noqa: F401

CUTOFF, SIGMA, BOX = 2.0, 1.0, 6.0


def _periodic_torch_reference(pos: np.ndarray, op):
    """Per-atom energies and forces of the periodic system: the op on a 3x3x3 supercell,
    central-cell rows kept; images move with their atom, so autograd gives periodic forces."""
    n = len(pos)
    shifts = torch.tensor([s for s in itertools.product((0, -1, 1), repeat=3)], dtype=torch.float64) * BOX
    t = torch.tensor(pos, requires_grad=True)
    sc = (t[None, :, :] + shifts[:, None, :]).reshape(-1, 3)  # shift (0,0,0) first: rows 0..n-1 central
    e = op(sc, CUTOFF, SIGMA)[:n]
    (g,) = torch.autograd.grad(e.sum(), t)
    return e.detach().numpy(), -g.numpy()


def _run(op_ref, n, seed, rtol):
    pos = np.random.default_rng(seed).uniform(0.0, BOX, (n, 3))
    cell = np.eye(3) * BOX
    adapter = OpAdapter(op_ref, gather_inputs=[0])
    spec = DistributionSpec(policy=HaloStoragePolicy(), custom_ops=(adapter,))
    plan = HaloPlan.build(pos, cell, cutoff=CUTOFF, n_devices=8)
    cs = compile(spec, make_mesh(8), plan, positions={adapter: ["positions"]})
    x = cs.owned(pos, positions=True)
    mask = cs.halo_owned_mask()

    def energy(x):
        rows = cs.call(adapter, x, CUTOFF, sigma=SIGMA)
        return jnp.sum(jnp.where(mask, rows, jnp.zeros((), rows.dtype))), rows

    (e, rows), grad = jax.value_and_grad(energy, has_aux=True)(x)
    want_rows, want_f = _periodic_torch_reference(pos, torch.ops.kt.gauss_pair.default)
    hr, oc = cs.tables.halo_rows, cs.tables.owned_capacity
    owned_rows = np.asarray(rows).reshape(8, hr)[:, :oc].reshape(-1)
    np.testing.assert_allclose(float(e), want_rows.sum(), rtol=rtol)
    np.testing.assert_allclose(cs.to_global(owned_rows), want_rows, rtol=rtol, atol=rtol * 1e-3)
    np.testing.assert_allclose(-cs.to_global(np.asarray(grad)), want_f, rtol=rtol, atol=rtol * 1e-3)


def test_reference_is_the_numpy_closed_form_with_images():
    pos = np.random.default_rng(1).uniform(0.0, BOX, (12, 3))
    rows, f = _periodic_torch_reference(pos, torch.ops.kt.gauss_pair.default)
    shifts = np.array(list(itertools.product((0, -1, 1), repeat=3))) * BOX
    sc = (pos[None] + shifts[:, None]).reshape(-1, 3)
    want_rows, _ = _ops.gauss_numpy(sc, CUTOFF, SIGMA)
    np.testing.assert_allclose(rows, want_rows[:12], rtol=1e-12)
    assert np.isclose(f.sum(axis=0), 0.0, atol=1e-12).all()  # periodic: momentum is conserved


@pytest.mark.parametrize("op_ref", ["kt::gauss_pair", torch.ops.kt.gauss_pair], ids=["lazy", "live"])
def test_torch_op_adapter_matches_single_device_torch(op_ref):
    _run(op_ref, 64, 3, 1e-6)


def test_triton_op_adapter_matches_single_device_torch():
    _run("kt::gauss_pair_tri", 48, 4, 1e-6)


def test_compile_uses_resolve_kernel_and_lazy_errors_name_the_op():
    assert isinstance(resolve_kernel("kt::gauss_pair_tri"), TorchOpKernel)
    adapter = OpAdapter("kt::not_registered", gather_inputs=[0])
    spec = DistributionSpec(policy=HaloStoragePolicy(), custom_ops=(adapter,))
    pos = np.random.default_rng(0).uniform(0.0, BOX, (16, 3))
    plan = HaloPlan.build(pos, np.eye(3) * BOX, cutoff=CUTOFF, n_devices=2)
    with pytest.raises(OpResolutionError, match=r"kt::not_registered.*Import the extension"):
        compile(spec, make_mesh(2), plan)
