"""A model on the whole system, on one device, without the bridge: what a distributed model is checked against.

`own_forward(wrapper)` is the model's own forward where the project knows it: `MPNN.forward` on a
neighbour list over periodic images (`periodic_graph`, numpy + scipy), MACE's `forward` through its own data
pipeline and neighbour list. `stages_on_whole_graph` runs a wrapper's stages in order on that whole graph:
it shows whether a wrapper depends on how the system is cut into blocks, but not whether it computes the
model (a wrapper that is another model than the forward passes it); `check.check_wrapper` compares with
the model's own forward.

Stress is `(1/V) dE/dstrain` (ASE's sign) with positions and cell strained together, the cell's volume `V`;
it is None where the cell has no volume.
"""

from __future__ import annotations

from collections.abc import Callable
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


def on_whole_graph(node_energy_fn: Callable[..., Any], positions: Any, cell: Any, pbc: Any, cutoff: float,
                   node_attrs: np.ndarray, dtype: Any) -> dict[str, Any]:
    """Energy, forces, stress and atomic energies of `node_energy_fn(pos, attrs, edge_index, shifts) -> (N,)`
    on the whole periodic graph, by torch autograd (strain on positions and shifts together)."""
    import torch

    cell = np.asarray(cell, dtype=np.float64).reshape(3, 3)
    ei, unit = periodic_graph(positions, cell, pbc, cutoff)
    pos = torch.tensor(np.asarray(positions, dtype=np.float64), dtype=dtype, requires_grad=True)
    eps = torch.zeros((3, 3), dtype=dtype, requires_grad=True)
    sym = (eps + eps.T) / 2
    cell_t = torch.tensor(cell, dtype=dtype)
    shifts = torch.tensor(unit, dtype=dtype) @ (cell_t + cell_t @ sym)
    attrs = torch.tensor(node_attrs, dtype=dtype)
    node_e = node_energy_fn(pos + pos @ sym, attrs, torch.as_tensor(ei, dtype=torch.int64), shifts)
    energy = node_e.sum()
    g_pos, g_eps = torch.autograd.grad(energy, (pos, eps), allow_unused=True)
    g_eps = torch.zeros_like(eps) if g_eps is None else g_eps
    volume = abs(float(np.linalg.det(cell)))
    return {"energy": float(energy.detach()), "forces": -g_pos.detach().numpy(),
            "stress": g_eps.detach().numpy() / volume if volume > 0 else None,
            "atomic_energies": node_e.detach().numpy()}


def stages_on_whole_graph(wrapper: Any, positions: Any, numbers: Any, cell: Any, pbc: Any = True
                          ) -> dict[str, Any]:
    """The wrapper's own stages in order on the whole periodic graph (no blocks, no exchange); `how` says so."""
    from .protocol import BlockGraph, node_energies_of

    def fn(pos: Any, attrs: Any, edge_index: Any, shifts: Any) -> Any:
        return node_energies_of(wrapper, BlockGraph(pos, attrs, edge_index, shifts))

    out = on_whole_graph(fn, positions, cell, pbc, wrapper.cutoff, wrapper.node_attrs(np.asarray(numbers)),
                         wrapper.dtype)
    return out | {"how": f"{type(wrapper).__name__} stages on the whole periodic system (one device)"}


def mpnn_forward(model: Any, positions: Any, numbers: Any, cell: Any, pbc: Any = True) -> dict[str, Any]:
    """`MPNN.forward` on the whole periodic system (one device)."""
    from .mpnn import MPNNWrapper

    attrs = MPNNWrapper(model).node_attrs(np.asarray(numbers))
    out = on_whole_graph(model.forward, positions, cell, pbc, model.cutoff, attrs, model.e0.dtype)
    return out | {"how": "MPNN.forward on the whole periodic system (one device)"}


def mace_forward(model: Any, positions: Any, numbers: Any, cell: Any, pbc: Any = True) -> dict[str, Any]:
    """MACE's own `forward` on the whole system (its own data pipeline and neighbour list, one device).

    MACE divides its stress by the volume of its own cell, whose open axes it replaces by a long vector;
    it is rescaled to the structure's cell (the bridge's convention), and None where that has no volume.
    """
    import ase
    import torch

    from .mace import mace_input

    cell = np.asarray(cell, dtype=np.float64).reshape(3, 3)
    atoms = ase.Atoms(numbers=np.asarray(numbers), positions=np.asarray(positions), cell=cell, pbc=pbc)
    batch = mace_input(model, atoms)
    out = model(batch, training=False, compute_force=True, compute_stress=True)
    volume = abs(float(np.linalg.det(cell)))
    stress = None
    if volume > 0 and out.get("stress") is not None:
        mace_volume = abs(float(torch.linalg.det(batch["cell"].view(3, 3).detach())))
        stress = out["stress"][0].detach().numpy() * mace_volume / volume
    return {"energy": float(out["energy"][0].detach()), "forces": out["forces"].detach().numpy(),
            "stress": stress, "atomic_energies": out["node_energy"].detach().numpy(),
            "how": "MACE's own forward on the whole periodic system (one device)"}


def own_forward(wrapper: Any) -> tuple[Callable[..., dict[str, Any]], str] | None:
    """The model's own forward for the wrappers the project ships: `(f(positions, numbers, cell, pbc), name)`.

    `MPNNWrapper`: `mpnn_forward`; `MACEWrapper`: `mace_forward`; any other wrapper: None (its author
    passes a reference: the model's ASE calculator or a function of the structure).
    """
    from .mace import MACEWrapper  # imports no mace-torch (a MACEWrapper exists only where it is installed)
    from .mpnn import MPNNWrapper

    if isinstance(wrapper, MACEWrapper):
        return (lambda *structure: mace_forward(wrapper.model, *structure)), "MACE's own forward"
    if isinstance(wrapper, MPNNWrapper):
        return (lambda *structure: mpnn_forward(wrapper.model, *structure)), "MPNN.forward"
    return None
