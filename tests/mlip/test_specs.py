"""What each MLIPSpec field and storage policy does at run time, and the reference's failures, case by case.

Reference failures (shared/reference/nvalchemi-models.md §1, §5): a policy mode
pair that switches the exchange off (silently wrong there), a refresh adapter
lost in a JSON round trip, graph partition (periodic shifts dropped, stress at
1/W), a preset's stress returned per rank; the empty domain is in
test_jax_door.py and the per-rank stress on the PyTorch door in test_torch_door.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest

from nvalchemi_jaxbridge import (
    SPEC_MPNN_GP,
    SPEC_MPNN_HALO,
    CompilePolicy,
    DistributionSpec,
    HaloStoragePolicy,
    MLIPSpec,
    RefreshOnlyHaloPolicy,
)
from nvalchemi_jaxbridge.mlip import DistributedMLIP, default_spec
from tests.mlip import cases
from tests.mlip._reference import reference

STRUCTURE = "small"


@functools.cache
def want() -> dict:
    w, atoms = cases.wrapper("mpnn"), cases.structure(STRUCTURE)
    return reference(w.model, atoms, w.cutoff, w.node_attrs(atoms.numbers))


def evaluate(spec, n_devices=2, **kwargs) -> dict:
    atoms = cases.structure(STRUCTURE)
    dm = DistributedMLIP(cases.wrapper("mpnn"), spec=spec, n_devices=n_devices)
    return dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc, **kwargs)


def with_policy(policy) -> MLIPSpec:
    return dataclasses.replace(default_spec(), distribution=DistributionSpec(policy=policy))


@pytest.mark.parametrize("policy", [
    HaloStoragePolicy(),
    HaloStoragePolicy(scatter_mode="local"),             # refresh only
    HaloStoragePolicy(gather_mode="local"),              # fold of the owned rows does the refresh
    RefreshOnlyHaloPolicy(),
], ids=["halo", "scatter-local", "gather-local", "refresh-only"])
def test_every_policy_that_exchanges_is_exact(policy):
    out = evaluate(with_policy(policy))
    np.testing.assert_allclose(out["forces"], want()["forces"], rtol=0, atol=1e-8)
    assert abs(out["energy"] - want()["energy"]) <= 1e-9 * abs(want()["energy"])


def test_a_policy_that_switches_the_exchange_off_raises():
    # The reference gives a silently wrong energy here (E -421.8 vs -388.7 on its toy).
    with pytest.raises(ValueError, match="switches both exchanges off"):
        evaluate(with_policy(HaloStoragePolicy(scatter_mode="local", gather_mode="local")))


def test_graph_parallel_is_refused_at_the_model_level():
    # The reference drops periodic shifts (wrong E with PBC) and returns stress at 1/W.
    with pytest.raises(ValueError, match="'graph_parallel'.*halo storage"):
        evaluate(SPEC_MPNN_GP)


@pytest.mark.parametrize("strategy", ["model_internal", "framework_from_global_energy"])
def test_force_strategies_other_than_node_energy_raise(strategy):
    spec = default_spec().with_compile(CompilePolicy(force_strategy=strategy, stress_via_strain=True))
    with pytest.raises(ValueError, match=f"force_strategy={strategy!r}"):
        evaluate(spec)


def test_owned_only_outputs_come_back_as_owned_storage():
    spec = dataclasses.replace(default_spec(), owned_only_outputs=("forces",))
    atoms = cases.structure(STRUCTURE)
    dm = DistributedMLIP(cases.wrapper("mpnn"), spec=spec, n_devices=2)
    state = dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    out = dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc, state=state)
    assert isinstance(out["forces"], jax.Array)
    assert out["forces"].shape == (2 * state.plan.owned_capacity, 3)
    np.testing.assert_allclose(state.cs.to_global(out["forces"]), want()["forces"], rtol=0, atol=1e-8)
    assert isinstance(out["atomic_energies"], np.ndarray)  # not listed: global order


def test_stress_via_strain_off_gives_no_stress():
    spec = default_spec().with_compile(CompilePolicy(force_strategy="framework_from_node_energy"))
    out = evaluate(spec)
    assert "stress" not in out and "virial" not in out
    np.testing.assert_allclose(out["forces"], want()["forces"], rtol=0, atol=1e-8)
    with pytest.raises(ValueError, match="stress_via_strain is off"):
        evaluate(spec, stress=True)


def test_node_energy_key_names_the_per_atom_output():
    spec = dataclasses.replace(default_spec(), node_energy_key="energies",
                               output_kinds={"energy": "per_graph", "energies": "per_node"})
    out = evaluate(spec)
    np.testing.assert_allclose(out["energies"], want()["atomic_energies"], rtol=0, atol=1e-9)


def test_preset_without_compile_policy_runs_without_stress_and_with_it_on_request():
    out = evaluate(SPEC_MPNN_HALO)
    assert "stress" not in out
    on = SPEC_MPNN_HALO.with_compile(CompilePolicy(force_strategy="framework_from_node_energy",
                                                   stress_via_strain=True))
    np.testing.assert_allclose(evaluate(on)["stress"], want()["stress"], rtol=0, atol=1e-9)


def test_spec_survives_a_json_round_trip():
    # The reference's refresh adapter is a local closure that a JSON round trip turns into a no-op
    # (silently wrong E and F); here the per-layer exchange comes from the policy, which is data.
    spec = default_spec()
    again = MLIPSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec
    out = evaluate(again)
    np.testing.assert_allclose(out["forces"], want()["forces"], rtol=0, atol=1e-8)


def test_output_kinds_that_contradict_the_model_raise():
    spec = dataclasses.replace(default_spec(), output_kinds={"forces": "per_graph"})
    with pytest.raises(ValueError, match=r"output_kinds\['forces'\] is 'per_graph'"):
        evaluate(spec)
