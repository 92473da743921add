"""Engines users drive: an ASE calculator and a jax-md-style functional API over distributed potentials.

- `KernelPotential`: the energy of one kernel of a `DistributionSpec` (with `mlip.DistributedMLIP`,
  the potentials these engines take).
- `JaxBridgeCalculator`: `ase.calculators.calculator.Calculator` (needs ASE).
- `halo_energy_fn`: `(neighbor_fn, energy_fn)` on global `(N, 3)` positions, jit-able and differentiable.

Names load on first access, so importing this package imports neither ASE nor the runtime layers.
"""

_LAZY = {
    "KernelPotential": "nvalchemi_jaxbridge.integrations.potential",
    "KernelState": "nvalchemi_jaxbridge.integrations.potential",
    "Engine": "nvalchemi_jaxbridge.integrations.engine",
    "JaxBridgeCalculator": "nvalchemi_jaxbridge.integrations.ase_calculator",
    "halo_energy_fn": "nvalchemi_jaxbridge.integrations.functional",
    "HaloNeighbors": "nvalchemi_jaxbridge.integrations.functional",
    "HaloNeighborFn": "nvalchemi_jaxbridge.integrations.functional",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nvalchemi_jaxbridge.integrations' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
