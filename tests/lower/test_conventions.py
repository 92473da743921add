"""JAX's conventions at the front door: `jax.make_mesh` meshes, explicit `compile` options, logging."""

from __future__ import annotations

import dataclasses
import inspect
import logging

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nvalchemi_jaxbridge import DistributionSpec, HaloPlan, HaloStoragePolicy, OpAdapter
from nvalchemi_jaxbridge import kernels, lower
from nvalchemi_jaxbridge.demo import argon_fcc, jax_potentials
from nvalchemi_jaxbridge.demo.params import LJParams
from nvalchemi_jaxbridge.demo.reference import lj_reference

LJ = OpAdapter(jax_potentials.lj_energy_forces, gather_inputs=[0], all_reduce_outputs=[0], scatter_outputs=[1])
SPEC = DistributionSpec(policy=HaloStoragePolicy(), adapters=(LJ,))


@pytest.fixture(scope="module")
def system():
    atoms = argon_fcc(3)
    rng = np.random.default_rng(0)
    pos = atoms.positions + rng.normal(scale=0.05, size=atoms.positions.shape)
    return atoms, pos, HaloPlan.build(pos, atoms.cell, cutoff=8.5, n_devices=8)


def _energy_and_forces(cs, pos):
    x, mask = cs.owned(pos, positions=True), cs.halo_owned_mask()
    energy, grad = jax.value_and_grad(lambda x: cs.call(LJ, x, mask)[0])(x)
    return float(energy), -cs.to_global(grad)


@pytest.mark.parametrize("axis_types", [None, (AxisType.Auto,)], ids=["explicit", "auto"])  # None: jax's default
def test_jax_make_mesh_meshes_give_the_reference_energy_and_forces(system, axis_types):
    atoms, pos, plan = system
    mesh = jax.make_mesh((8,), ("x",), axis_types=axis_types)
    cs = kernels.compile(SPEC, mesh, plan, positions={LJ: ["positions"]})
    assert cs.axis == "x" and tuple(cs.mesh.axis_types) == (AxisType.Auto,)
    energy, forces = _energy_and_forces(cs, pos)
    e_ref, f_ref = lj_reference(pos, atoms.cell, (True, True, True), **dataclasses.asdict(LJParams()))
    assert abs(energy - e_ref) <= 1e-10 * abs(e_ref)
    np.testing.assert_allclose(forces, f_ref, rtol=0, atol=1e-10)


def test_arrays_typed_over_an_explicit_mesh_are_refused_with_the_fix(system):
    _, pos, plan = system
    mesh = jax.make_mesh((8,), ("x",))
    cs = kernels.compile(SPEC, mesh, plan, positions={LJ: ["positions"]})
    x = jax.device_put(plan.to_owned(pos, positions=True), NamedSharding(mesh, P("x")))
    with pytest.raises(ValueError, match=r"Explicit mesh axis.*cs\.owned\(\)/cs\.halo\(\).*AxisType\.Auto"):
        cs.call(LJ, x, cs.halo_owned_mask())


def test_a_two_axis_mesh_is_refused_naming_a_one_axis_mesh(system):
    with pytest.raises(ValueError, match=r"expected a 1-D mesh.*jax\.make_mesh\(\(8,\), \('atoms',\)\)"):
        kernels.compile(SPEC, jax.make_mesh((4, 2), ("a", "b")), system[2])


@pytest.mark.parametrize("fn", [kernels.compile, lower.compile], ids=["kernels", "lower"])
def test_compile_options_are_explicit_parameters(fn):
    params = inspect.signature(fn).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
    assert {"kernel_for", "positions", "per_device_reductions"} <= set(params)
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in ("kernel_for", "positions"))


def test_capacity_growth_on_rebuild_is_logged(system, caplog):
    atoms, pos, _ = system
    tight = HaloPlan.build(pos, atoms.cell, cutoff=8.5, n_devices=8, headroom=1.0)
    moved = pos.copy()
    moved[:12] = moved[0] + np.random.default_rng(1).normal(scale=0.3, size=(12, 3))  # crowd one domain
    with caplog.at_level(logging.INFO, logger="nvalchemi_jaxbridge.layout.capacity"):
        new = tight.rebuild(moved)
    assert new.grown, "the crowded domain should need more rows"
    assert any("grew" in r.message and new.grown[0] in r.message for r in caplog.records)
