"""MACE (`mace-torch`, an optional dependency) as a `MessagePassingWrapper`, and a seeded random model.

The stages call MACE's own submodules in the order its `forward` does (the
model's source is never edited): the edge features (spherical harmonics and
radial embedding) from the block's edge vectors, once for all layers
(`edge_features`); per layer, the interaction block, the product basis and the
readout; then the E0 terms and the scale/shift.
Inside an interaction the only neighbour access is `node_feats[sender]` and a
scatter onto receivers, so refreshing `node_feats` before layers 1.. is all the
exchange MACE needs; the product basis and the readout run on the receiver rows
only (`BlockGraph.receiver_slice`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .protocol import BlockGraph, MessagePassingWrapper, numpy_dtype, one_hot, shared_edge_features


def _mace() -> Any:
    try:
        import mace.modules  # noqa: F401 (also sets torch's weights-only default for MACE checkpoints)
    except ImportError as e:
        raise ImportError(
            "the MACE wrapper needs mace-torch: pip install 'nvalchemi_jaxbridge[mlip]' (it pins e3nn==0.4.4)"
        ) from e
    import mace

    return mace


def random_mace(species: Sequence[int], *, r_max: float = 5.0, num_interactions: int = 2, correlation: int = 3,
                hidden_irreps: str = "8x0e + 8x1o", max_ell: int = 3, num_bessel: int = 8,
                mlp_irreps: str = "16x0e", radial_mlp: Sequence[int] = (32, 32), seed: int = 0,
                dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """A `ScaleShiftMACE` with seeded random weights (the architecture of MACE-MP, sizes as given).

    Args:
        species: atomic numbers, in one-hot order.
        r_max: cutoff (Å); num_interactions: layers; correlation: body order of the product basis.
        hidden_irreps, max_ell, num_bessel, mlp_irreps, radial_mlp: widths.
        seed: `torch.manual_seed` for the weights (the global generator is restored after).
        dtype: parameter dtype.
    """
    _mace()
    from e3nn import o3
    from mace import modules

    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        rng = np.random.default_rng(seed)
        model = modules.ScaleShiftMACE(
            r_max=float(r_max), num_bessel=num_bessel, num_polynomial_cutoff=6, max_ell=max_ell,
            interaction_cls=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
            interaction_cls_first=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
            num_interactions=num_interactions, num_elements=len(species),
            hidden_irreps=o3.Irreps(hidden_irreps), MLP_irreps=o3.Irreps(mlp_irreps),
            atomic_energies=-rng.uniform(1.0, 4.0, len(species)), avg_num_neighbors=12.0,
            atomic_numbers=[int(z) for z in species], correlation=correlation, gate=torch.nn.functional.silu,
            radial_MLP=list(radial_mlp), radial_type="bessel", atomic_inter_scale=1.3, atomic_inter_shift=-0.2,
        )
    finally:
        torch.random.set_rng_state(state)
    return model.to(dtype)


class MACEWrapper(MessagePassingWrapper):
    """`MessagePassingWrapper` for a `mace.modules.MACE` / `ScaleShiftMACE` (single head)."""

    def __init__(self, model: torch.nn.Module) -> None:
        _mace()
        self.model = model
        self.species = tuple(int(z) for z in model.atomic_numbers.tolist())
        self.cutoff = float(model.r_max)
        self.n_layers = len(model.interactions)
        self.dtype = next(model.parameters()).dtype
        self.name = "mace"
        if len(model.readouts) != self.n_layers:
            raise ValueError(
                f"MACEWrapper: the model has {len(model.readouts)} readouts for {self.n_layers} interactions; "
                "only models with one readout per layer are supported."
            )

    def model_reach(self) -> tuple[float, int]:
        return float(self.model.r_max), len(self.model.interactions)

    def node_attrs(self, numbers: np.ndarray) -> np.ndarray:
        return one_hot(numbers, self.species, dtype=numpy_dtype(self.dtype), model="MACE")

    def embed(self, g: BlockGraph) -> torch.Tensor:
        return self.model.node_embedding(g.node_attrs)

    def edge_features(self, g: BlockGraph) -> tuple[torch.Tensor, ...]:
        """The edges' spherical harmonics and radial basis (and the cutoff envelope, where the
        model applies it in its layers): what MACE computes once per forward for all its layers."""
        m = self.model
        vectors = g.edge_vectors()
        lengths = torch.linalg.vector_norm(vectors, dim=1, keepdim=True)
        edge_attrs = m.spherical_harmonics(vectors)
        edge_feats, cutoff = m.radial_embedding(lengths, g.node_attrs, g.edge_index, m.atomic_numbers)
        return (edge_attrs, edge_feats) if cutoff is None else (edge_attrs, edge_feats, cutoff)

    def interaction(self, i: int, g: BlockGraph, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        edge_attrs, edge_feats, *envelope = shared_edge_features(self, g)
        cutoff = envelope[0] if envelope else None
        h, sc = m.interactions[i](
            node_attrs=g.node_attrs, node_feats=h, edge_attrs=edge_attrs, edge_feats=edge_feats,
            edge_index=g.edge_index, cutoff=cutoff, first_layer=(i == 0), lammps_class=None, lammps_natoms=(0, 0))
        # The product basis and the readout are node-wise: the receiver rows are all they need.
        cut = g.receiver_slice
        h = m.products[i](node_feats=cut(h), sc=None if sc is None else cut(sc), node_attrs=cut(g.node_attrs))
        heads = torch.zeros(h.shape[0], dtype=torch.int64, device=h.device)
        rows = torch.arange(h.shape[0], device=h.device)
        return g.to_rows(h), g.to_rows(m.readouts[i](h, heads)[rows, heads])

    def node_energies(self, g: BlockGraph, layer_energy: torch.Tensor) -> torch.Tensor:
        m = self.model
        heads = torch.zeros(g.n_rows, dtype=torch.int64, device=layer_energy.device)
        rows = torch.arange(g.n_rows, device=layer_energy.device)
        e0 = m.atomic_energies_fn(g.node_attrs)[rows, heads]
        inter = m.scale_shift(layer_energy, heads) if hasattr(m, "scale_shift") else layer_energy
        return e0.to(layer_energy.dtype) + inter


def mace_input(model: torch.nn.Module, atoms: Any, *, dtype: torch.dtype | None = None,
               device: Any = None) -> dict[str, Any]:
    """MACE's own input dict for an ASE `atoms` (its data pipeline and neighbour list at `model.r_max`).

    Floating tensors come in `dtype` (default: the model's) on `device` (default: the CPU), as
    `model(batch)` takes them; `AtomicData` reads positions and cell in torch's default dtype,
    so that is set to `dtype` while it runs.
    """
    _mace()
    from mace import data as mdata
    from mace.tools import torch_geometric, utils

    dtype = next(model.parameters()).dtype if dtype is None else dtype
    z_table = utils.AtomicNumberTable([int(z) for z in model.atomic_numbers.tolist()])
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        ad = mdata.AtomicData.from_config(mdata.config_from_atoms(atoms), z_table=z_table, cutoff=float(model.r_max))
    finally:
        torch.set_default_dtype(default)
    batch = torch_geometric.batch.Batch.from_data_list([ad]).to_dict()
    return {k: (v.to(device=device, dtype=dtype) if torch.is_floating_point(v) else v.to(device))
            if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
