"""JAX, torch and Triton block potentials against the numpy references (halo rows built in numpy)."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import nvalchemi_jaxbridge.demo.torch_ops  # noqa: F401  (registers jaxbridge_demo::*)
from nvalchemi_jaxbridge.demo import argon_fcc
from nvalchemi_jaxbridge.demo import jax_potentials as jp
from nvalchemi_jaxbridge.demo.reference import dsf_reference, lj_reference

from ._halo import fold, halo_block, random_gas

LJ = dict(epsilon=0.0104, sigma=3.40)
DSF = dict(alpha=0.25, born_a=1120.0, born_rho=0.317)
TOL = {np.float64: 1e-10, np.float32: 2e-5}


_jax_lj = jax.jit(jp.lj_energy_forces, static_argnums=(2, 3, 4))
_jax_dsf = jax.jit(jp.dsf_energy_forces, static_argnums=(3, 4, 5, 6))


def _call(impl, kind, rows, mask, charges, dtype, cutoff):
    """Run one implementation on numpy rows; return numpy (energy, forces)."""
    if impl == "jax":
        r, m = jnp.asarray(rows, dtype), jnp.asarray(mask, dtype)
        if kind == "lj":
            e, f = _jax_lj(r, m, LJ["epsilon"], LJ["sigma"], cutoff)
        else:
            q = jnp.asarray(charges, dtype)
            e, f = _jax_dsf(r, q, m, DSF["alpha"], cutoff, DSF["born_a"], DSF["born_rho"])
        return np.asarray(e), np.asarray(f)
    tdt = {np.float64: torch.float64, np.float32: torch.float32}[dtype]
    r, m = torch.tensor(rows, dtype=tdt), torch.tensor(mask > 0)
    suffix = "_triton" if impl == "triton" else ""
    ops = torch.ops.jaxbridge_demo
    if kind == "lj":
        e, f = getattr(ops, "lj_energy_forces" + suffix)(r, m, LJ["epsilon"], LJ["sigma"], cutoff)
    else:
        q = torch.tensor(charges, dtype=tdt)
        e, f = getattr(ops, "dsf_energy_forces" + suffix)(
            r, q, m, DSF["alpha"], cutoff, DSF["born_a"], DSF["born_rho"])
    assert e.dtype == tdt and f.dtype == tdt and e.shape == () and f.shape == r.shape
    return e.numpy(), f.numpy()


def _check(impl, kind, dtype, n, box, seed, cutoff):
    rng = np.random.default_rng(seed)
    pos = random_gas(rng, n, box, min_dist=2.4)
    charges = rng.choice([-1.0, 1.0], n)
    cell, per = np.eye(3) * box, (True, True, True)
    if kind == "lj":
        e_ref, f_ref = lj_reference(pos, cell, per, cutoff=cutoff, **LJ)
    else:
        e_ref, f_ref = dsf_reference(pos, charges, cell, per, cutoff=cutoff, **DSF)
    rows, mask, owner = halo_block(pos, cell, per, cutoff, rng=rng, bucket=128)
    q_rows = np.where(owner >= 0, charges[np.maximum(owner, 0)], 0.0)
    e, f_rows = _call(impl, kind, rows, mask, q_rows, dtype, cutoff)
    f, f_pad = fold(f_rows.astype(np.float64), owner, n)
    tol = TOL[dtype]
    scale = max(np.abs(f_ref).max(), 1e-3)
    np.testing.assert_allclose(e, e_ref, rtol=tol, atol=tol * scale * n)
    np.testing.assert_allclose(f, f_ref, rtol=tol, atol=tol * scale * 10)
    assert np.all(f_pad == 0.0)  # parked padding rows are exactly inert


gas = dict(n=st.integers(2, 14), box=st.floats(7.0, 11.0), seed=st.integers(0, 10**6))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lj", "dsf"])
@pytest.mark.parametrize("impl", ["jax", "torch"])
@hypothesis.settings(max_examples=12)
@hypothesis.given(**gas, cut_frac=st.sampled_from([0.45, 0.7, 0.9]))
def test_block_matches_reference_float64(impl, kind, n, box, seed, cut_frac):
    _check(impl, kind, np.float64, n, box, seed, round(cut_frac * box, 1))


@pytest.mark.parametrize("kind", ["lj", "dsf"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@hypothesis.settings(max_examples=3)
@hypothesis.given(**gas)
def test_triton_block_matches_reference(kind, dtype, n, box, seed):
    _check("triton", kind, dtype, n, box, seed, 0.45 * box)


@pytest.mark.parametrize("impl", ["jax", "torch"])
@pytest.mark.parametrize("kind", ["lj", "dsf"])
def test_block_float32_matches_reference(impl, kind):
    _check(impl, kind, np.float32, 12, 9.0, 7, 5.0)


@pytest.mark.parametrize("impl", ["jax", "torch", "triton"])
@pytest.mark.parametrize("kind", ["lj", "dsf"])
@hypothesis.settings(max_examples=4)
@hypothesis.given(n_dev=st.integers(2, 4), seed=st.integers(0, 10**6))
def test_owned_partition_sums_to_the_whole(impl, kind, n_dev, seed):
    """Energy partials and folded forces of a partition of the owned atoms add up to the total."""
    rng = np.random.default_rng(seed)
    n, box, cutoff = 10, 8.0, 3.9
    pos = random_gas(rng, n, box, min_dist=2.4)
    rows, mask, owner = halo_block(pos, np.eye(3) * box, (True,) * 3, cutoff)
    q = np.where(owner >= 0, rng.choice([-1.0, 1.0], n)[np.maximum(owner, 0)], 0.0)
    e_all, f_all = _call(impl, kind, rows, mask, q, np.float64, cutoff)
    part = rng.integers(0, n_dev, n)
    e_sum, f_sum = 0.0, np.zeros_like(f_all)
    for d in range(n_dev):
        m_d = mask * (part[np.maximum(owner, 0)] == d)
        e_d, f_d = _call(impl, kind, rows, m_d, q, np.float64, cutoff)
        e_sum, f_sum = e_sum + e_d, f_sum + f_d
    np.testing.assert_allclose(e_sum, e_all, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(f_sum, f_all, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["lj", "dsf"])
def test_jax_forces_are_minus_energy_gradient(kind):
    rng = np.random.default_rng(1)
    rows = jnp.asarray(random_gas(rng, 16, 9.0, 2.4))
    mask = jnp.asarray(rng.integers(0, 2, 16).astype(np.float64))
    q = jnp.asarray(rng.normal(size=16))
    if kind == "lj":
        fn = lambda r: jp.lj_energy_forces(r, mask, cutoff=6.0, **LJ)  # noqa: E731
    else:
        fn = lambda r: jp.dsf_energy_forces(r, q, mask, cutoff=6.0, **DSF)  # noqa: E731
    _, f = jax.jit(fn)(rows)
    g = jax.jit(jax.grad(lambda r: fn(r)[0]))(rows)
    np.testing.assert_allclose(f, -g, rtol=1e-10, atol=1e-12)


def test_periodic_wrapper_matches_ase_on_argon():
    from ase.calculators.lj import LennardJones

    s = argon_fcc(2)
    pos = s.positions + np.random.default_rng(5).normal(scale=0.2, size=s.positions.shape)
    pos[0] += s.cell[0] * 2  # an atom outside the cell must be wrapped
    atoms = s.to_ase()
    atoms.positions = pos
    atoms.calc = LennardJones(rc=8.5, smooth=False, **LJ)
    fn = jp.periodic_energy_forces(jp.lj_energy_forces, s.cell, s.periodic, 8.5, **LJ)
    e, f = jax.jit(fn)(jnp.asarray(pos))
    np.testing.assert_allclose(e, atoms.get_potential_energy(), rtol=1e-10)
    np.testing.assert_allclose(f, atoms.get_forces(), rtol=1e-10, atol=1e-10 * np.abs(f).max())


def test_jax_errors_name_argument_and_fix():
    with pytest.raises(ValueError, match=r"lj_energy_forces: positions must have shape \(R, 3\)"):
        jp.lj_energy_forces(jnp.zeros((4, 2)), jnp.ones(4))
    with pytest.raises(ValueError, match=r"owned_mask must have shape \(4,\).*1 for owned rows"):
        jp.lj_energy_forces(jnp.zeros((4, 3)), jnp.ones(5))
    with pytest.raises(ValueError, match=r"dsf_energy_forces: charges must have shape \(4,\)"):
        jp.dsf_energy_forces(jnp.zeros((4, 3)), jnp.ones(3), jnp.ones(4))
    with pytest.raises(TypeError, match=r"charges \(float64\) are wider than positions \(float32\)"):
        jp.dsf_energy_forces(jnp.zeros((4, 3), jnp.float32), jnp.ones(4, jnp.float64), jnp.ones(4))
    with pytest.raises(ValueError, match="cutoff must be positive"):
        jp.lj_energy_forces(jnp.zeros((4, 3)), jnp.ones(4), cutoff=-1.0)


def test_dsf_energy_gradient_through_compile_on_4_devices():
    """jax.grad of the DSF energy inside compile's shard_map(check_vma=True) (which jax 0.12's own erfc
    JVP cannot do, see jax_potentials._erfc): minus it equals the kernel's forces and the numpy reference."""
    from nvalchemi_jaxbridge import DistributionSpec, HaloStoragePolicy, OpAdapter
    from nvalchemi_jaxbridge.demo import rock_salt
    from nvalchemi_jaxbridge.layout import HaloPlan
    from nvalchemi_jaxbridge.lower import compile, make_mesh

    s = rock_salt(2, lattice_constant=5.64)
    pos = s.positions + np.random.default_rng(3).normal(scale=0.1, size=s.positions.shape)
    cutoff = 6.0
    dsf = OpAdapter(jp.dsf_energy_forces, gather_inputs=[0, 1], all_reduce_outputs=[0], scatter_outputs=[1])
    plan = HaloPlan.build(pos, s.cell, cutoff=cutoff, n_devices=4)
    cs = compile(DistributionSpec(policy=HaloStoragePolicy(), adapters=(dsf,)), make_mesh(4), plan,
                 positions={dsf: [0]})
    args = (DSF["alpha"], cutoff, DSF["born_a"], DSF["born_rho"])

    def energy_forces(cs, r, q):
        return cs.call(dsf, r, q, cs.halo_owned_mask(), *args)

    r, q = cs.owned(pos, positions=True), cs.owned(s.charges)
    e, f = jax.jit(energy_forces)(cs, r, q)
    g = jax.jit(jax.grad(lambda cs, r, q: energy_forces(cs, r, q)[0], argnums=1))(cs, r, q)
    e_ref, f_ref = dsf_reference(pos, s.charges, s.cell, s.periodic, cutoff=cutoff, **DSF)
    np.testing.assert_allclose(float(e), e_ref, rtol=1e-10)
    np.testing.assert_allclose(-cs.to_global(g), cs.halo_to_global(f), rtol=0, atol=1e-10)  # f: halo rows, folded
    np.testing.assert_allclose(-cs.to_global(g), f_ref, rtol=0, atol=1e-9)
