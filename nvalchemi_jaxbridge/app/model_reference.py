"""The single-device reference a distributed model is checked against, and the parity of the two.

"One device" is the torch model on the whole periodic system, without the
bridge: `MPNN.forward` or MACE's own `forward` on a neighbour list over
periodic images (`periodic_graph`, numpy + scipy; MACE builds its own), and,
for any other wrapper, its stages in order on that whole graph. Stress there is
the strain derivative with positions and cell strained together, as on the
distributed side.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def periodic_graph(positions: np.ndarray, cell: np.ndarray, periodic: Any, cutoff: float
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Every pair within `cutoff` over periodic images: edges `(2, E)` sender -> receiver, integer shifts `(E, 3)`.

    The edge vector is `pos[receiver] - pos[sender] + shifts @ cell` (the `BlockGraph` convention);
    positions need not be wrapped.
    """
    from scipy.spatial import cKDTree

    from ..demo.reference import image_shifts

    pos, cell = np.asarray(positions, dtype=np.float64), np.asarray(cell, dtype=np.float64)
    per = np.broadcast_to(np.asarray(periodic, dtype=bool), (3,))
    frame = np.where(per, np.floor(pos @ np.linalg.inv(cell)), 0.0) if per.any() else np.zeros_like(pos)
    wrapped = pos - frame @ cell
    tree = cKDTree(wrapped)
    send, recv, unit = [], [], []
    for s in image_shifts(cell, tuple(per), cutoff):
        hits = tree.query_ball_point(wrapped + s @ cell, r=cutoff)  # receivers of each sender image
        j = np.repeat(np.arange(len(pos)), [len(h) for h in hits])
        i = np.fromiter((k for h in hits for k in h), dtype=np.int64, count=len(j))
        if not s.any():
            j, i = j[i != j], i[i != j]
        send.append(j)
        recv.append(i)
        unit.append(frame[j] - frame[i] - s)
    return np.stack([np.concatenate(send), np.concatenate(recv)]), np.concatenate(unit)


def single_device_reference(wrapper: Any, positions: np.ndarray, numbers: np.ndarray, cell: np.ndarray,
                            pbc: Any = True) -> dict[str, Any]:
    """Energy, forces, stress (ASE's sign) and atomic energies of the whole system on one device, by torch.

    `MPNNWrapper`: `MPNN.forward`; `MACEWrapper`: MACE's own `forward` (its own neighbour list); any
    other wrapper: its stages in order on the whole periodic graph. `how` says which.
    """
    import torch

    from ..mlip import MPNNWrapper
    from ..mlip.protocol import BlockGraph, node_energies_of

    if type(wrapper).__name__ == "MACEWrapper":
        return _mace_reference(wrapper.model, positions, numbers, cell, pbc)
    if isinstance(wrapper, MPNNWrapper):
        fn, how = wrapper.model.forward, "MPNN.forward on the whole periodic system (one device)"
    else:
        def fn(pos, attrs, edge_index, shifts):
            return node_energies_of(wrapper, BlockGraph(pos, attrs, edge_index, shifts))

        how = f"{type(wrapper).__name__} stages on the whole periodic system (one device)"
    dtype = wrapper.dtype
    cell = np.asarray(cell, dtype=np.float64)
    ei, unit = periodic_graph(positions, cell, pbc, wrapper.cutoff)
    pos = torch.tensor(np.asarray(positions, dtype=np.float64), dtype=dtype, requires_grad=True)
    eps = torch.zeros((3, 3), dtype=dtype, requires_grad=True)
    sym = (eps + eps.T) / 2
    cell_t = torch.tensor(cell, dtype=dtype)
    shifts = torch.tensor(unit, dtype=dtype) @ (cell_t + cell_t @ sym)
    attrs = torch.tensor(wrapper.node_attrs(np.asarray(numbers)), dtype=dtype)
    node_e = fn(pos + pos @ sym, attrs, torch.as_tensor(ei, dtype=torch.int64), shifts)
    energy = node_e.sum()
    g_pos, g_eps = torch.autograd.grad(energy, (pos, eps), allow_unused=True)
    g_eps = torch.zeros_like(eps) if g_eps is None else g_eps
    return {"energy": float(energy.detach()), "forces": -g_pos.detach().numpy(),
            "stress": g_eps.detach().numpy() / abs(float(np.linalg.det(cell))),
            "atomic_energies": node_e.detach().numpy(), "how": how}


def _mace_reference(model: Any, positions: np.ndarray, numbers: np.ndarray, cell: np.ndarray, pbc: Any
                    ) -> dict[str, Any]:
    """MACE's own forward on the whole system (its own data pipeline and neighbour list)."""
    import ase

    from ..mlip.mace import mace_input

    atoms = ase.Atoms(numbers=np.asarray(numbers), positions=np.asarray(positions), cell=np.asarray(cell), pbc=pbc)
    batch = mace_input(model, atoms)
    out = model(batch, training=False, compute_force=True, compute_stress=True)
    return {"energy": float(out["energy"][0].detach()), "forces": out["forces"].detach().numpy(),
            "stress": out["stress"][0].detach().numpy(), "atomic_energies": out["node_energy"].detach().numpy(),
            "how": "MACE's own forward on the whole periodic system (one device)"}


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
