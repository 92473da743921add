"""The single-device reference a distributed model is compared with in a run report, and the parity of the two.

"One device" is the torch model on the whole periodic system, without the bridge
(`nvalchemi_jaxbridge.mlip.reference`): `MPNN.forward` or MACE's own `forward`, and, for any other
wrapper, its stages in order on the whole periodic graph. Stress there is the strain derivative with
positions and cell strained together, as on the distributed side.

The stages of a wrapper run on the whole graph agree with the distributed run whenever the wrapper does
not depend on how the system is cut; they do not show that the wrapper computes the model. To check a
wrapper against the model's own forward, use `nvalchemi_jaxbridge.mlip.check_wrapper`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..mlip.reference import periodic_graph as periodic_graph  # re-exported: its home before mlip.reference


def single_device_reference(wrapper: Any, positions: np.ndarray, numbers: np.ndarray, cell: np.ndarray,
                            pbc: Any = True) -> dict[str, Any]:
    """Energy, forces, stress (ASE's sign) and atomic energies of the whole system on one device, by torch.

    `MPNNWrapper`: `MPNN.forward`; `MACEWrapper`: MACE's own `forward` (its own neighbour list); any
    other wrapper: its stages in order on the whole periodic graph, which checks the distribution but not
    the wrapper (see the module docstring). `how` says which. No `stress` where the cell has no volume.
    """
    from ..mlip.reference import own_forward, stages_on_whole_graph

    own = own_forward(wrapper)
    out = own[0](positions, numbers, cell, pbc) if own is not None else stages_on_whole_graph(
        wrapper, positions, numbers, cell, pbc)
    return {k: v for k, v in out.items() if v is not None}


def parity(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    """Differences of a distributed result from the reference: absolute and relative (to the reference's max)."""
    tiny = np.finfo(np.float64).tiny
    out = {}
    for key in ("energy", "forces", "stress", "atomic_energies"):
        if key not in got or key not in want:
            continue
        a, b = np.asarray(got[key], dtype=np.float64), np.asarray(want[key], dtype=np.float64)
        err = float(np.max(np.abs(a - b), initial=0.0))
        out[f"{key}_max_abs"] = err
        out[f"{key}_rel"] = err / max(float(np.max(np.abs(b), initial=0.0)), tiny)
    return out
