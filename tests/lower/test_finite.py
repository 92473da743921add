"""Non-finite values on a mesh: found by explicit `isfinite` reductions, never by a maximum; a compiled
kernel program refuses a NaN position (it would drop that atom's pairs and return a finite energy)."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvalchemi_jaxbridge.layout import HaloPlan
from nvalchemi_jaxbridge.layout.finite import NonFiniteError
from nvalchemi_jaxbridge.lower import compile, make_mesh
from nvalchemi_jaxbridge.lower.finite import all_finite, max_or_inf
from nvalchemi_jaxbridge.spec.adapter import OpAdapter
from nvalchemi_jaxbridge.spec.policies import HaloStoragePolicy

from .plans import make_spec


@hypothesis.settings(max_examples=12)
@hypothesis.given(d=st.sampled_from([2, 8]), row=st.integers(0, 15), value=st.sampled_from([np.nan, np.inf, -np.inf]),
                  jit=st.booleans())
def test_a_nan_on_one_device_is_found_by_the_explicit_reductions(d, row, value, jit):
    mesh = make_mesh(d)
    a = np.random.default_rng(row).uniform(0.0, 1.0, 16)
    a[row] = value
    x = jax.device_put(a, NamedSharding(mesh, P(mesh.axis_names[0])))
    f = (lambda g: jax.jit(g)) if jit else (lambda g: g)
    assert not bool(f(all_finite)(x))
    assert float(f(max_or_inf)(x)) == (np.inf if value != -np.inf else float(np.max(np.delete(a, row))))
    b = np.where(np.isfinite(a), a, 0.5)
    y = jax.device_put(b, NamedSharding(mesh, P(mesh.axis_names[0])))
    assert bool(f(all_finite)(y)) and float(f(max_or_inf)(y)) == float(b.max())


def _lj_sum(pos, owned, rows):
    """A cutoff pair energy that, like most kernels, drops pairs whose distance compares False (a NaN)."""
    d = pos[:rows, None, :] - pos[None, :, :]
    r2 = jnp.sum(d * d, axis=-1)
    inside = (r2 < 9.0) & (jnp.arange(rows)[:, None] != jnp.arange(pos.shape[0])[None, :])
    e = jnp.where(inside, 1.0 / jnp.where(inside, r2, 1.0), 0.0)
    return 0.5 * jnp.sum(owned[:rows, None].astype(pos.dtype) * e)


def test_a_nan_position_into_a_compiled_program_is_refused_with_the_atom():
    adapter = OpAdapter(_lj_sum, gather_inputs=[0], all_reduce_outputs=[0])
    spec = make_spec(HaloStoragePolicy(), adapter)
    rng = np.random.default_rng(0)
    cell = np.eye(3) * 8.0
    pos = rng.uniform(0.0, 8.0, (24, 3))
    plan = HaloPlan.build(pos, cell, cutoff=3.0, n_devices=2)
    cs = compile(spec, make_mesh(2), plan, positions={adapter: [0]})
    mask, oc = cs.halo_owned_mask(), cs.tables.owned_capacity
    assert np.isfinite(float(cs.call(adapter, cs.owned(pos, positions=True), mask, oc)))
    bad = pos.copy()
    bad[[13, 2], 1] = np.nan
    with pytest.raises(NonFiniteError, match=r"CompiledSpec.owned\(positions=True\): positions of atoms \[2, 13\]"):
        cs.owned(bad, positions=True)     # checked on the host where they are placed
    x = cs.owned(bad, positions=True, check=False)  # placed unchecked: call's check is one device reduction
    with pytest.raises(NonFiniteError, match=r"CompiledSpec.call: adapter .* argument 0 \('pos'\): positions of atoms "
                                             r"\[2, 13\] are not finite \(NaN or inf\)"):
        cs.call(adapter, x, mask, oc)
    with pytest.raises(NonFiniteError, match=r"positions of atoms \[2, 13\]"):  # as a numpy array too
        cs.call(adapter, np.asarray(x), mask, oc)
