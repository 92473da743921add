"""The model-wrapper protocol: how a message-passing model is cut into stages.

A wrapper tells the model level four things about a torch model: its cutoff,
how many interaction layers it has, what per-atom inputs it reads (`node_attrs`),
and how to run it in stages on one device's block:

    g.edge_features = edge_features(g)    # optional: per-edge tensors every layer reads, once
    h = embed(g)                          # node features on every row of the block
    for i in range(n_layers):             # ghost rows of h refreshed before every layer i > 0
        h, e_i = interaction(i, g, h)     # new features and this layer's node-energy term,
                                          # valid on the receiver rows (the owned atoms)
    node_energy = node_energies(g, e_0 + ... + e_{L-1})

`edge_features` (default: none) is for what a model computes from the edge vectors
alone and shares between its layers (MACE: the edges' spherical harmonics and radial
basis): the driver computes it once per evaluation and hands it to every layer as
`g.edge_features`, where a model run in stages would otherwise compute it in each
layer (forward and backward). A layer that finds `g.edge_features` None computes it
itself (`shared_edge_features`).

Only the first `g.n_receivers` rows receive messages (the owned atoms, with
per-layer exchange; every row with the deep halo). What a layer computes node by
node after its messages are summed is needed on those rows alone, since the
other rows are overwritten by the refresh or ignored: a wrapper may run that
part on `g.receiver_slice(x)` and hand back `g.to_rows(y)` (zero rows appended),
which saves the node-wise work on the ghost rows (1.6 per owned row at 10^4 atoms
on 8 devices, MACE's cutoff). A wrapper that computes on every row is right too.

The block `g` (a `BlockGraph`) holds owned atoms, then ghost atoms (other devices'
atoms, at the periodic image the device sees), then inert padding rows parked far
away. An image of a device's own atom is no row: an edge from it is an edge from
its owned row whose `shift` is the lattice vector (as in a model's own periodic
neighbour list; on one device the block is the owned atoms alone), so geometry
always comes from `g.edge_vectors()`. Its edges point from senders to receivers
(MACE's convention); a padding edge joins a padding row to itself with a long
shift vector, so it touches no atom. Stages must be pure torch functions of
their inputs (they may run more than once: shape probing, autograd re-runs).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import contract

Features = torch.Tensor | tuple[torch.Tensor, ...]
"""Node features between layers: one `(rows, ...)` tensor or a tuple of them."""


@dataclasses.dataclass(frozen=True, eq=False)
class BlockGraph:
    """One device's block as a model's input graph.

    Attributes:
        positions: `(rows, 3)` Cartesian positions (ghosts as periodic images; padding parked).
        node_attrs: `(rows, A)` per-atom inputs from `MessagePassingWrapper.node_attrs`
            (zero on padding rows).
        edge_index: `(2, E)` int64; row 0 senders, row 1 receivers.
        shifts: `(E, 3)`: a lattice vector where the sender is a periodic image of its row's own
            atom (else zero), a long vector for padding edges; strained with the positions.
        n_receivers: rows `[0, n_receivers)` are the only receivers of edges (None: every row).
        edge_features: the wrapper's `edge_features(g)` of this block, computed once by the
            driver for all layers (None: not computed; a layer then computes what it needs).
    """

    positions: torch.Tensor
    node_attrs: torch.Tensor
    edge_index: torch.Tensor
    shifts: torch.Tensor
    n_receivers: int | None = None
    edge_features: tuple[torch.Tensor, ...] | None = None

    def __post_init__(self) -> None:
        n = self.n_receivers
        if n is not None and not 0 <= n <= self.n_rows:
            raise ValueError(
                f"BlockGraph: n_receivers={n} must lie in [0, {self.n_rows}] (the block's rows); "
                "pass the count of leading rows that receive edges, or None for every row."
            )

    @property
    def n_rows(self) -> int:
        """Rows of the block (owned, ghost and padding rows)."""
        return int(self.positions.shape[0])

    @property
    def receiver_rows(self) -> int:
        """How many leading rows receive edges (`n_receivers`, or every row)."""
        return self.n_rows if self.n_receivers is None else self.n_receivers

    def receiver_slice(self, x: torch.Tensor) -> torch.Tensor:
        """The receiver rows of a per-row tensor `x` (its first `receiver_rows` rows)."""
        return x[: self.receiver_rows]

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A per-receiver-row tensor as a per-row one: zero rows appended up to `n_rows`."""
        missing = self.n_rows - x.shape[0]
        if missing < 0:
            raise ValueError(f"BlockGraph.to_rows: got {x.shape[0]} rows, more than the block's {self.n_rows}.")
        return x if missing == 0 else torch.cat([x, x.new_zeros((missing, *x.shape[1:]))])

    @property
    def senders(self) -> torch.Tensor:
        """`(E,)` sender row of each edge."""
        return self.edge_index[0]

    @property
    def receivers(self) -> torch.Tensor:
        """`(E,)` receiver row of each edge."""
        return self.edge_index[1]

    def edge_vectors(self) -> torch.Tensor:
        """`(E, 3)` vector from sender to receiver: `pos[receiver] - pos[sender] + shift`."""
        return self.positions[self.receivers] - self.positions[self.senders] + self.shifts


class MessagePassingWrapper(abc.ABC):
    """Base class of model wrappers (see the module docstring for the stage order).

    Subclasses set `cutoff` (Å, one layer's reach), `n_layers` and `dtype`, and
    implement `node_attrs`, `embed` and `interaction`; `node_energies` defaults to
    the sum of the layers' terms. `name` labels the stages in errors and reports.
    """

    cutoff: float
    n_layers: int
    dtype: torch.dtype = torch.float64
    name: str = "model"

    @abc.abstractmethod
    def node_attrs(self, numbers: np.ndarray) -> np.ndarray:
        """`(N, A)` per-atom inputs for atomic numbers `numbers` (e.g. a one-hot of the species).

        Raises a clear error for a species the model does not know.
        """

    @abc.abstractmethod
    def embed(self, g: BlockGraph) -> Features:
        """Initial node features on every row of the block."""

    @abc.abstractmethod
    def interaction(self, i: int, g: BlockGraph, h: Features) -> tuple[Features, torch.Tensor]:
        """Layer `i`: new node features and the layer's `(rows,)` node-energy term.

        Only the receiver rows (`g.receiver_rows`: the owned atoms, with per-layer
        exchange) need to be right; the others are overwritten or ignored, so
        node-wise work may run on `g.receiver_slice(...)` only (see the module docstring).
        Both results have `g.n_rows` rows.
        """

    def node_energies(self, g: BlockGraph, layer_energy: torch.Tensor) -> torch.Tensor:
        """`(rows,)` node energies from the summed layer terms (add per-atom shifts here)."""
        return layer_energy

    def edge_features(self, g: BlockGraph) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """Per-edge tensors `(E, ...)` every layer reads (one tensor or a tuple), from `g`'s positions,
        attributes and edges.

        Default None: the layers compute their edge quantities themselves. A wrapper that
        returns them reads them in `interaction` as `shared_edge_features(self, g)`; the
        drivers then compute them once per evaluation instead of once per layer.
        """
        return None

    def model_reach(self) -> tuple[float, int] | None:
        """The wrapped model's own `(cutoff, interaction layers)`, where the wrapper knows them.

        Checked against `cutoff` and `n_layers` before a run (`contract.check_attributes`): a wrapper
        cutoff below the model's leaves out edges the model uses. Default None: not checked.
        """
        return None

    def distribution_spec(self) -> Any:
        """The model's `MLIPSpec` (default: per-layer halo exchange, forces from node energies,
        stress by strain)."""
        from .specs import default_spec

        return default_spec()


def with_edge_features(wrapper: MessagePassingWrapper, g: BlockGraph, stage: str = "edge features") -> BlockGraph:
    """`g` holding `wrapper.edge_features(g)` for its layers (unchanged if the wrapper shares none), checked."""
    feats = contract.edge_features(wrapper, g, wrapper.edge_features(g), stage)
    return g if feats is None else dataclasses.replace(g, edge_features=as_tuple(feats))


def shared_edge_features(wrapper: MessagePassingWrapper, g: BlockGraph) -> tuple[torch.Tensor, ...]:
    """The edge features a driver computed for `g`, or (none there) `wrapper.edge_features(g)` now."""
    if g.edge_features is not None:
        return g.edge_features
    feats = wrapper.edge_features(g)
    if feats is None:
        raise TypeError(
            f"{wrapper.name}: shared_edge_features was called but the wrapper's edge_features returns None; "
            "implement edge_features (the per-edge tensors its layers share) or compute them in interaction."
        )
    return as_tuple(feats)


def node_energies_of(wrapper: MessagePassingWrapper, g: BlockGraph, stage: str = "whole model") -> torch.Tensor:
    """`(rows,)` node energies of the whole model on `g` in one go: every stage in order, no exchange.

    Every stage's result is checked against the protocol (`contract`); `stage` names this run in errors.
    """
    g = with_edge_features(wrapper, g, stage)
    h = contract.embed(wrapper, g, stage)
    n = len(as_tuple(h))
    total = torch.zeros(g.n_rows, dtype=g.positions.dtype, device=g.positions.device)
    for i in range(wrapper.n_layers):
        h, e = contract.interaction(wrapper, i, g, h, stage, n)
        total = total + e
    return contract.node_energies(wrapper, g, total, stage)


def as_tuple(h: Features) -> tuple[torch.Tensor, ...]:
    """Node features as a tuple of tensors."""
    return tuple(h) if isinstance(h, (tuple, list)) else (h,)


def like(template: Features, parts: Sequence[torch.Tensor]) -> Features:
    """`parts` in the structure of `template` (a tensor or a tuple)."""
    return tuple(parts) if isinstance(template, (tuple, list)) else parts[0]


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of a torch floating dtype."""
    return np.dtype(str(dtype).removeprefix("torch."))


def one_hot(numbers: np.ndarray, species: Sequence[int], *, dtype: Any, model: str) -> np.ndarray:
    """`(N, len(species))` one-hot rows of `numbers` in `species` order; unknown species raise."""
    numbers = contract.atomic_numbers(numbers, model)
    index = {int(z): k for k, z in enumerate(species)}
    if bad := sorted({int(z) for z in numbers} - set(index)):
        raise ValueError(
            f"{model}: atomic numbers {bad} are not among the model's species {list(species)}; "
            "use a structure of those elements, or build the model with them (species=...)."
        )
    out = np.zeros((len(numbers), len(species)), dtype=dtype)
    out[np.arange(len(numbers)), [index[int(z)] for z in numbers]] = 1
    return out
