"""The cell-list Lennard-Jones op against the dense op: parity on awkward blocks, autograd, the bridge."""

import subprocess
import sys

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import nvalchemi_jaxbridge.demo.torch_ops  # noqa: F401  (registers jaxbridge_demo::*, cells included)
from nvalchemi_jaxbridge.demo import torch_cells
from nvalchemi_jaxbridge.demo.torch_cells import lj_cells_torch

from ._halo import fold, halo_block, random_gas

OPS = torch.ops.jaxbridge_demo
EPS, SIGMA = 0.0104, 3.4


def _block(rng, n, layout, cutoff):
    """n rows laid out to stress the binning; see the `layout` names."""
    if layout == "gas":  # spread over a few cells
        return rng.uniform(-2.0 * cutoff, 2.0 * cutoff, (n, 3))
    if layout == "pile":  # most rows in one cell, a few scattered far away
        pos = rng.uniform(0.0, 0.3 * cutoff, (n, 3))
        far = rng.random(n) < 0.1
        pos[far] = rng.uniform(-6.0 * cutoff, 6.0 * cutoff, (int(far.sum()), 3))
        return pos
    if layout == "small":  # the whole block is less than one cell across
        return rng.uniform(0.0, 0.8 * cutoff, (n, 3))
    if layout == "flat":  # zero extent along z, long along x
        pos = rng.uniform(0.0, 1.0, (n, 3)) * np.array([10.0 * cutoff, 0.5 * cutoff, 0.0])
        return pos
    # "parked": a gas plus padding rows parked on a far lattice (as the layout layer does)
    pos = rng.uniform(0.0, 3.0 * cutoff, (n, 3))
    pad = rng.random(n) < 0.3
    q = np.arange(int(pad.sum()))
    pos[pad] = 1e4 + 4.0 * cutoff * np.stack([q % 3, (q // 3) % 3, q // 9], axis=1)
    return pos


def _abs_scale(pos, cutoff):
    """Sum of |pair energy| and max |pair force| over all pairs within the cutoff (numpy, tolerance scale)."""
    d = pos[:, None] - pos[None]
    r2 = (d * d).sum(-1)
    inside = (r2 <= cutoff * cutoff) & ~np.eye(len(pos), dtype=bool)
    sr6 = (SIGMA**2 / np.where(inside, r2, 1.0)) ** 3
    u = np.where(inside, 4 * EPS * np.abs(sr6 * sr6 - sr6) + EPS, 0.0)
    f = np.where(inside, 24 * EPS * (2 * sr6 * sr6 + sr6) / np.sqrt(np.where(inside, r2, 1.0)), 0.0)
    return u.sum() + 1e-300, f.sum(1).max(initial=0.0) + 1e-300


@hypothesis.given(
    n=st.integers(0, 300),
    layout=st.sampled_from(["gas", "pile", "small", "flat", "parked"]),
    cutoff=st.sampled_from([2.5, 4.0, 8.5, 40.0]),  # 40 A is larger than every block but "pile"'s far rows
    owned=st.sampled_from([0.0, 0.5, 1.0]),
    slots=st.sampled_from([None, 1, 97, 5000]),
    seed=st.integers(0, 2**16),
)
@hypothesis.example(n=0, layout="gas", cutoff=8.5, owned=1.0, slots=None, seed=0)
@hypothesis.example(n=1, layout="gas", cutoff=8.5, owned=1.0, slots=None, seed=0)
@hypothesis.example(n=300, layout="pile", cutoff=2.5, owned=0.5, slots=1, seed=1)
def test_matches_dense_op_float64(n, layout, cutoff, owned, slots, seed):
    rng = np.random.default_rng(seed)
    pos_np = _block(rng, n, layout, cutoff)
    pos = torch.tensor(pos_np)
    mask = torch.tensor(rng.random(n) < owned)
    want_e, want_f = OPS.lj_energy_forces(pos, mask, EPS, SIGMA, cutoff)
    if slots is None:
        got_e, got_f = OPS.lj_energy_forces_cells(pos, mask, EPS, SIGMA, cutoff)
    else:  # small chunks: one row, a few rows, many rows per chunk
        got_e, got_f = lj_cells_torch(pos, mask, EPS, SIGMA, cutoff, pair_slots=slots)
    assert got_e.dtype == got_f.dtype == torch.float64 and got_e.shape == () and got_f.shape == (n, 3)
    e_scale, f_scale = _abs_scale(pos_np, cutoff)
    np.testing.assert_allclose(got_e.numpy(), want_e.numpy(), rtol=1e-12, atol=1e-13 * e_scale)
    np.testing.assert_allclose(got_f.numpy(), want_f.numpy(), rtol=1e-12, atol=1e-13 * f_scale)


def test_float32_pairs_at_the_cutoff_match_dense_op():
    """Isolated pairs a few float32 steps inside / outside the cutoff, across cell faces: the dense op's pair set."""
    rng = np.random.default_rng(3)
    cutoff = 8.5
    grid = np.stack(np.meshgrid(*[np.arange(4)] * 3, indexing="ij"), -1).reshape(-1, 3)
    base = 3.1 * cutoff * grid + rng.uniform(0.0, cutoff, grid.shape)  # pairs far from each other
    direction = rng.normal(size=base.shape)
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    scale = cutoff * (1.0 + rng.integers(-6, 7, len(base)) * np.finfo(np.float32).eps)
    pos = np.concatenate([base, base + scale[:, None] * direction]).astype(np.float32)
    t = torch.tensor(pos)
    mask = torch.tensor(rng.random(len(pos)) < 0.5)
    want_e, want_f = OPS.lj_energy_forces(t, mask, EPS, SIGMA, cutoff)
    got_e, got_f = OPS.lj_energy_forces_cells(t, mask, EPS, SIGMA, cutoff)
    assert got_e.dtype == got_f.dtype == torch.float32
    # each row has at most one partner: its force is that pair's force or exactly zero
    np.testing.assert_array_equal(got_f.numpy(), want_f.numpy())
    np.testing.assert_allclose(got_e.numpy(), want_e.numpy(), rtol=1e-5, atol=1e-9)
    kept = np.any(want_f.numpy() != 0, axis=1)[: len(base)]
    assert 0 < kept.sum() < len(base)  # the float32 test keeps some pairs and drops others


def _cluster(n, seed, dtype=torch.float64):
    """A non-periodic cluster, pairs 2.8 .. ~9 A apart, so some cross an 6 A cutoff."""
    return torch.tensor(random_gas(np.random.default_rng(seed), n, 9.0, 2.8), dtype=dtype)


def test_gradients_match_dense_forces_and_hessian(monkeypatch):
    monkeypatch.setitem(torch_cells.PAIR_SLOTS, "cpu", 40)  # the backward also works chunk by chunk
    pos = _cluster(12, 0).requires_grad_(True)
    mask = torch.tensor([1.0, 0.0] * 6)
    e, f = OPS.lj_energy_forces_cells(pos, mask, EPS, SIGMA, 6.0)
    want_e, want_f = OPS.lj_energy_forces(pos, mask, EPS, SIGMA, 6.0)
    (g,) = torch.autograd.grad(e, pos, retain_graph=True)
    torch.testing.assert_close(g, -want_f.detach(), rtol=1e-12, atol=1e-14)
    # Hessian-vector product (a force cotangent) vs the dense op's
    v = torch.tensor(np.random.default_rng(1).normal(size=(12, 3)))
    (hvp,) = torch.autograd.grad((f * v).sum() + 0.3 * e, pos)
    (want,) = torch.autograd.grad((want_f * v).sum() + 0.3 * want_e, pos)
    torch.testing.assert_close(hvp, want, rtol=1e-12, atol=1e-14)


def test_autograd_matches_finite_differences():
    pos = _cluster(6, 5).requires_grad_(True)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    # both outputs: energy (the saved forces) and forces (the chunked Hessian-vector product)
    assert torch.autograd.gradcheck(
        lambda p: OPS.lj_energy_forces_cells(p, mask, EPS, SIGMA, 6.0), (pos,), eps=1e-6, atol=1e-7
    )


def test_plain_function_is_differentiable():
    pos = _cluster(10, 2).requires_grad_(True)
    mask = torch.ones(10, dtype=torch.bool)
    e, _ = lj_cells_torch(pos, mask, EPS, SIGMA, 6.0, pair_slots=30)
    (g,) = torch.autograd.grad(e, pos)
    _, want_f = OPS.lj_energy_forces(pos.detach(), mask, EPS, SIGMA, 6.0)
    torch.testing.assert_close(g, -want_f, rtol=1e-12, atol=1e-14)


def test_fake_tensors_and_opcheck():
    with FakeTensorMode():
        for dt in (torch.float32, torch.float64):
            e, f = OPS.lj_energy_forces_cells(torch.empty(7, 3, dtype=dt), torch.empty(7, dtype=torch.bool))
            assert e.shape == () and f.shape == (7, 3) and e.dtype == f.dtype == dt
    pos = _cluster(6, 4)
    torch.library.opcheck(OPS.lj_energy_forces_cells.default, (pos, torch.tensor([1.0, 0, 1, 1, 0, 1]), EPS,
                                                                SIGMA, 6.0))


def test_importing_torch_ops_registers_the_cells_op():
    code = ("import torch\n"
            "print(hasattr(torch.ops.jaxbridge_demo, 'lj_energy_forces_cells'))\n"
            "import nvalchemi_jaxbridge.demo.torch_ops\n"
            "print(hasattr(torch.ops.jaxbridge_demo, 'lj_energy_forces_cells'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]


def test_errors_name_op_argument_and_fix():
    pos = torch.zeros(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"lj_energy_forces_cells: owned_mask must have shape \(4,\)"):
        OPS.lj_energy_forces_cells(pos, torch.ones(3))
    with pytest.raises(TypeError, match=r"lj_energy_forces_cells: positions must be float32 or float64"):
        OPS.lj_energy_forces_cells(torch.zeros(4, 3, dtype=torch.int64), torch.ones(4))
    with pytest.raises(ValueError, match=r"lj_energy_forces_cells: cutoff must be positive"):
        OPS.lj_energy_forces_cells(pos, torch.ones(4), EPS, SIGMA, 0.0)
    bad = torch.rand(4, 3, dtype=torch.float64)
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"lj_energy_forces_cells: positions must be finite.*rows \[2\].*parking"):
        OPS.lj_energy_forces_cells(bad, torch.ones(4))
    with pytest.raises(ValueError, match=r"pair_slots must be >= 1, got 0"):
        lj_cells_torch(torch.rand(4, 3), torch.ones(4), pair_slots=0)


def test_through_the_bridge_matches_dense_op_on_one_device():
    """HaloPlan over 8 CPU devices, the cells op via TorchOpKernel; reference: the dense op on one periodic block."""
    from nvalchemi_jaxbridge.kernels import TorchOpKernel, compile, resolve_kernel
    from nvalchemi_jaxbridge.layout import HaloPlan
    from nvalchemi_jaxbridge.lower import make_mesh
    from nvalchemi_jaxbridge.spec import DistributionSpec, OpAdapter
    from nvalchemi_jaxbridge.spec.policies import HaloStoragePolicy

    rng = np.random.default_rng(7)
    box, cutoff, n = 20.0, 6.0, 120
    pos = random_gas(rng, n, box, 2.6)
    cell, per = np.eye(3) * box, (True, True, True)
    op = OPS.lj_energy_forces_cells.default
    assert isinstance(resolve_kernel(op), TorchOpKernel)
    adapter = OpAdapter(op, gather_inputs=[0], scatter_outputs=[1], all_reduce_outputs=[0])
    spec = DistributionSpec(policy=HaloStoragePolicy(), custom_ops=(adapter,))
    plan = HaloPlan.build(pos, cell, cutoff=cutoff, n_devices=8)
    cs = compile(spec, make_mesh(8), plan, positions={adapter: [0]})
    oc, hr = cs.tables.owned_capacity, cs.tables.halo_rows
    e, fh = jax.jit(lambda cs, x: cs.call(adapter, x, cs.halo_owned_mask(), EPS, SIGMA, cutoff))(
        cs, cs.owned(pos, positions=True))
    got_f = cs.to_global(np.asarray(fh).reshape(8, hr, 3)[:, :oc].reshape(8 * oc, 3))

    rows, mask, owner = halo_block(pos, cell, per, cutoff, rng=rng)
    want_e, f_rows = OPS.lj_energy_forces(torch.tensor(rows), torch.tensor(mask > 0), EPS, SIGMA, cutoff)
    want_f, _ = fold(f_rows.numpy(), owner, n)
    scale = np.abs(want_f).max()
    np.testing.assert_allclose(float(e), float(want_e), rtol=1e-10)
    np.testing.assert_allclose(got_f, want_f, rtol=1e-10, atol=1e-10 * scale)
