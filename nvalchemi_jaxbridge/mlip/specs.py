"""What an `MLIPSpec` means at run time for a distributed message-passing model.

| field | effect here |
|---|---|
| `core.policy` | the exchanges between layers (`lower.exchange`); a halo policy is required, and one whose modes switch the per-layer refresh off raises (the reference silently gives a wrong energy then) |
| `compile` | None reads as `framework_from_node_energy` with stress off |
| `compile.force_strategy` | `framework_from_node_energy` (the default): energy = sum of owned node energies, then all-reduced; forces and stress by autodiff, ghost gradients folded into owners. The two others need a model that computes its own forces or its own all-reduced energy; wrappers here do not, so they raise |
| `compile.stress_via_strain` | on: stress from the strain derivative (positions and cell strained together, so ghost images follow the cell); off: no stress (asking for it raises) |
| `owned_only_outputs` | per-atom outputs listed here come back as owned storage (each device's own rows) instead of one global array |
| `node_energy_key` | the name of the per-atom energy output (default `atomic_energies`) |
| `output_kinds` | checked: `energy`/`stress` must be per-graph and `forces`/the node-energy key per-node when declared |
| `system_reductions` | must be on (energies are per-system sums) |
| `gp_replicate_geometry` | must be off (graph-parallel storage is not a model-level layout here) |

Per-graph outputs (energy, stress) are always the global totals, whatever
`all_reduce_outputs` says: a per-rank partial of a per-graph quantity (the
reference's preset stress) is never returned.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..lower import exchange as X
from ..spec import DistributionSpec, HaloStoragePolicy

DEFAULT_STRATEGY = "framework_from_node_energy"
EXCHANGES = ("per_layer", "deep_halo")


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The run-time reading of a spec: policy, force strategy, stress, output layout."""

    policy: Any
    force_strategy: str
    stress_via_strain: bool
    owned_only: frozenset[str]
    node_energy_key: str


def default_spec() -> Any:
    """The spec a wrapper uses unless it says otherwise: halo storage, forces from node energies, stress."""
    from ..spec import CompilePolicy, MLIPSpec

    return MLIPSpec(
        distribution=DistributionSpec(policy=HaloStoragePolicy()),
        node_energy_key="atomic_energies",
        output_kinds={"energy": "per_graph", "forces": "per_node", "stress": "per_graph",
                      "atomic_energies": "per_node"},
        all_reduce_outputs=("stress",),
        compile=CompilePolicy(force_strategy=DEFAULT_STRATEGY, stress_via_strain=True),
    )


def as_mlip_spec(spec: Any) -> Any:
    """`spec` as an `MLIPSpec` (a bare `DistributionSpec` gets the default envelope).

    Raises:
        TypeError: `spec` is neither kind.
    """
    from ..spec import MLIPSpec

    if isinstance(spec, DistributionSpec):
        spec = dataclasses.replace(default_spec(), distribution=spec)
    if not isinstance(spec, MLIPSpec):
        raise TypeError(
            f"a distributed model needs an MLIPSpec or DistributionSpec, got {type(spec).__name__}; "
            "load one with nvalchemi_jaxbridge.load_spec(path).mlip, or leave spec=None for the wrapper's own."
        )
    return spec


def run_settings(spec: Any, *, per_layer: bool) -> RunSettings:
    """Read `spec` (an `MLIPSpec`, or a bare `DistributionSpec`) for a distributed model run.

    Raises:
        TypeError: `spec` is neither kind.
        ValueError: a field asks for something this model level cannot do (the message
            names the field and the fix).
    """
    spec = as_mlip_spec(spec)
    policy = spec.distribution.policy
    if policy is None or getattr(policy, "kind", None) not in ("halo", "refresh_halo"):
        kind = "local" if policy is None else policy.kind
        raise ValueError(
            f"MLIPSpec.core.policy is {kind!r}; a message-passing model is distributed here on halo storage: "
            "use HaloStoragePolicy() (or RefreshOnlyHaloPolicy()) in the spec's DistributionSpec."
        )
    if per_layer:
        X.check_exchanges(policy)
    declared = DEFAULT_STRATEGY if spec.compile is None else spec.compile.force_strategy
    strategy = str(getattr(declared, "value", declared))  # ForceStrategy is a str enum
    stress = bool(spec.compile.stress_via_strain) if spec.compile is not None else False
    if strategy != DEFAULT_STRATEGY:
        raise ValueError(
            f"MLIPSpec.compile.force_strategy={strategy!r}: the wrappers here give node energies only, so forces "
            f"come from autodiff of the owned node energies; use force_strategy={DEFAULT_STRATEGY!r} (a model "
            "that computes its own forces or an all-reduced energy needs its own wrapper for this strategy)."
        )
    if not spec.system_reductions:
        raise ValueError(
            "MLIPSpec.system_reductions=False: the energy of a distributed model is a per-system sum over owned "
            "atoms followed by an all-reduce; set system_reductions=True."
        )
    if spec.gp_replicate_geometry:
        raise ValueError(
            "MLIPSpec.gp_replicate_geometry=True asks for graph-parallel geometry, which this model level does "
            "not lay out; set it to False and use a halo policy."
        )
    key = spec.node_energy_key or "atomic_energies"
    want = {"energy": "per_graph", "stress": "per_graph", "forces": "per_node", key: "per_node"}
    for name, kind in dict(spec.output_kinds).items():
        kind = getattr(kind, "value", kind)
        if name in want and kind not in (want[name], "unknown"):
            raise ValueError(
                f"MLIPSpec.output_kinds[{name!r}] is {kind!r}, but a model's {name!r} is {want[name]!r}; fix "
                "the declaration."
            )
    return RunSettings(policy, strategy, stress, frozenset(spec.owned_only_outputs), key)


def check_model(wrapper: Any, exchange: str, skin: float, where: str) -> None:
    """Raise unless `wrapper` is a wrapper that declares itself as the protocol asks (`contract.check_attributes`),
    `exchange` a known exchange and `skin` >= 0 (for `where`'s message)."""
    from .protocol import MessagePassingWrapper

    if not isinstance(wrapper, MessagePassingWrapper):
        raise TypeError(
            f"{where}: expected a MessagePassingWrapper, got {type(wrapper).__name__}; wrap the model (see "
            "nvalchemi_jaxbridge.mlip.MessagePassingWrapper and the guide's 'Writing a wrapper for your own model')."
        )
    from .contract import check_attributes

    check_attributes(wrapper, where)
    if exchange not in EXCHANGES:
        raise ValueError(f"{where}: exchange must be one of {EXCHANGES}, got {exchange!r}.")
    if not skin >= 0:
        raise ValueError(f"{where}: skin must be >= 0 Å, got {skin!r}.")


def stress_wanted(settings: RunSettings, stress: bool | None, where: str) -> bool:
    """Whether to compute the stress: the spec's `stress_via_strain` unless `stress` says; asking without it raises."""
    if stress is None:
        return settings.stress_via_strain
    if stress and not settings.stress_via_strain:
        raise ValueError(
            f"{where}(stress=True): the spec's compile.stress_via_strain is off, so the model computes no stress; "
            "set CompilePolicy(stress_via_strain=True) in the MLIPSpec."
        )
    return bool(stress)


def cell_volume(cell: Any, where: str) -> float:
    """`|det(cell)|`, or a ValueError when it is zero (a stress needs a volume)."""
    import numpy as np

    volume = abs(float(np.linalg.det(np.asarray(cell, dtype=np.float64))))
    if volume == 0.0:
        raise ValueError(
            f"{where}: stress needs a cell of non-zero volume, but det(cell) = 0 (a non-periodic axis with a zero "
            "lattice row); give that axis a vacuum row, or pass stress=False."
        )
    return volume
