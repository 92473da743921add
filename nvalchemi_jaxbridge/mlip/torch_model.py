"""The PyTorch front door of the model level: one process per device (`launch`, torchrun, SLURM).

Each rank runs the wrapper's stages eagerly in torch on its own block. The
layers are small `nn.Module`s (`StagedModel.layers`); the per-layer exchange is
declared as one `ModuleForwardAdapter` per layer after the first, added to the
model's spec as third-party helpers (`distribution_spec()`) and installed with
the spec's other adapters around each evaluation; the adapter's
forward refreshes the incoming node features (`torch.layer_exchange.refresh_halo`)
before the layer runs. Autograd runs the adjoint exchanges: every rank
differentiates its own owned node energies, and the exchanges' backward programs
sum the ghost contributions into their owners across ranks, so each rank's
forces on its owned atoms are exact. Energy and virial are all-reduced.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from ..layout import HaloPlan
from ..lower import exchange as X
from ..spec import AdapterRegistry, ModuleForwardAdapter
from ..torch import functions as F
from ..torch.layer_exchange import fold_halo, refresh_halo
from .edges import EdgePlan
from .protocol import BlockGraph, MessagePassingWrapper, as_tuple, like, numpy_dtype, with_edge_features
from .specs import RunSettings, as_mlip_spec, cell_volume, check_model, run_settings, stress_wanted


class _Layer(torch.nn.Module):
    """Layer `i` of a wrapper as a module (the unit a refresh adapter wraps)."""

    def __init__(self, wrapper: MessagePassingWrapper, i: int) -> None:
        super().__init__()
        self.wrapper, self.i = wrapper, i

    def forward(self, g: BlockGraph, h: Any) -> tuple[Any, torch.Tensor]:
        return self.wrapper.interaction(self.i, g, h)


class StagedModel(torch.nn.Module):
    """A wrapper's stages as one module: embed, the layers (`self.layers`), node energies."""

    def __init__(self, wrapper: MessagePassingWrapper) -> None:
        super().__init__()
        self.wrapper = wrapper
        self.layers = torch.nn.ModuleList(_Layer(wrapper, i) for i in range(wrapper.n_layers))

    def forward(self, g: BlockGraph) -> torch.Tensor:
        g = with_edge_features(self.wrapper, g)  # once, for every layer
        h = self.wrapper.embed(g)
        total = None
        for layer in self.layers:
            h, e = layer(g, h)
            total = e if total is None else total + e
        return self.wrapper.node_energies(g, total)


@dataclasses.dataclass(frozen=True, eq=False)
class TorchState:
    """This rank's layout: the plan, its edges, and the block's static inputs."""

    plan: HaloPlan
    edges: EdgePlan
    numbers: np.ndarray
    cell: np.ndarray
    periodic: tuple[bool, bool, bool]


class TorchDistributedMLIP:
    """A message-passing model on the PyTorch front door (call on every rank together).

    Args:
        wrapper: a `MessagePassingWrapper`.
        spec: an `MLIPSpec`/`DistributionSpec`, or None for the wrapper's own.
        exchange: "per_layer" or "deep_halo" (as for `DistributedMLIP`).
        skin, headroom: as for `DistributedMLIP`.

    Every rank passes the same global structure; results are global arrays on
    every rank (per-atom outputs listed in the spec's `owned_only_outputs`:
    this rank's owned rows, with `owned_ids`).
    """

    def __new__(cls, wrapper: Any = None, **kwargs: Any) -> Any:
        """A LAMMPS ML-IAP unified model object gets its own driver (`mliap_torch.TorchMLIAP`, same
        `prepare` / `update` / `evaluate`); anything else is a wrapper."""
        from .mliap import is_mliap_model

        if is_mliap_model(wrapper):
            from .mliap_torch import TorchMLIAP

            if kwargs.pop("spec", None) is not None:
                raise ValueError(
                    "TorchDistributedMLIP: an ML-IAP model takes no spec (it computes its own pair forces and asks "
                    "for its own exchanges); leave spec=None."
                )
            return TorchMLIAP(wrapper, **kwargs)
        return super().__new__(cls)

    def __init__(self, wrapper: MessagePassingWrapper, *, spec: Any = None, exchange: str = "per_layer",
                 skin: float = 0.5, headroom: float = 1.2) -> None:
        check_model(wrapper, exchange, skin, "TorchDistributedMLIP")
        self.wrapper, self.exchange, self.skin, self.headroom = wrapper, exchange, float(skin), float(headroom)
        self.spec = as_mlip_spec(wrapper.distribution_spec() if spec is None else spec)
        self.settings: RunSettings = run_settings(self.spec, per_layer=exchange == "per_layer")
        self.model = StagedModel(wrapper)
        self._ctx: Any = None

    def distribution_spec(self) -> Any:
        """The spec this driver installs: the model's, plus the per-layer refresh adapters."""
        return self.spec.with_adapters(*self.refresh_adapters())

    def refresh_adapters(self) -> tuple[ModuleForwardAdapter, ...]:
        """The per-layer exchange as adapters: layer i >= 1 gets its input features refreshed first."""
        if self.exchange != "per_layer":
            return ()
        out = []
        for layer in list(self.model.layers)[1:]:
            out.append(ModuleForwardAdapter(layer, replacement=self._refreshing(layer),
                                            label=f"{self.wrapper.name}_refresh_layer_{layer.i}"))
        return tuple(out)

    def _refreshing(self, layer: _Layer) -> Any:
        original = type(layer).forward.__get__(layer)
        policy = self.settings.policy

        def forward(g: BlockGraph, h: Any) -> tuple[Any, torch.Tensor]:
            parts = [self._refresh(x, policy) for x in as_tuple(h)]
            return original(g, like(h, parts))

        return forward

    def _refresh(self, x: torch.Tensor, policy: Any) -> torch.Tensor:
        """Ghost rows of the block's real rows set to their owners' values (the trailing pad row kept).

        By the refresh, or, with the refresh off and the fold on, by folding the owned rows
        alone (as `jax_model.between_layers` does).
        """
        ctx = self._ctx
        n, n_own = ctx.n_owned + ctx.n_ghost, ctx.n_owned
        if X.exchanges_of(policy)[0]:
            real = refresh_halo(ctx, x[:n], policy)
        else:
            real = fold_halo(ctx, torch.cat([x[:n_own], torch.zeros_like(x[n_own:n])]), policy)
        return torch.cat([real, x[n:]])

    # ---------------------------------------------------------------- layout

    def prepare(self, positions: Any, numbers: Any, cell: Any, pbc: Any = True) -> TorchState:
        """The layout (same on every rank): halo plan and block edges."""
        from .jax_model import build_layout

        plan, edges, numbers, cell, periodic = build_layout(
            self.wrapper, self.exchange, positions, numbers, cell, pbc,
            n_devices=F.front_door_mesh().devices.size, skin=self.skin, headroom=self.headroom)
        return TorchState(plan, edges, numbers, cell, periodic)

    def update(self, state: TorchState, positions: Any) -> TorchState:
        """`state` if it still holds for `positions`, else a rebuilt layout."""
        pos = np.asarray(positions, dtype=np.float64)
        if not state.plan.needs_rebuild(pos):
            return state
        plan = state.plan.rebuild(pos)
        return dataclasses.replace(state, plan=plan, edges=state.edges.rebuild(plan, pos))

    # ---------------------------------------------------------------- evaluation

    def evaluate(self, positions: Any, numbers: Any, cell: Any, pbc: Any = True, *,
                 state: TorchState | None = None, stress: bool | None = None) -> dict[str, Any]:
        """Energy, forces, stress and atomic energies (see `DistributedMLIP.evaluate`), on every rank."""
        s = self.settings
        state = self.prepare(positions, numbers, cell, pbc) if state is None else state
        want_stress = stress_wanted(s, stress, "TorchDistributedMLIP.evaluate")
        plan, ctx = state.plan, F.context_for(state.plan)
        self._ctx = ctx
        rank, n_own, n_pad = ctx.rank, ctx.n_owned, ctx.n_owned + ctx.n_ghost
        dtype = self.wrapper.dtype
        pos = np.asarray(positions, dtype=np.float64)
        pos_owned = torch.tensor(pos[ctx.owned_ids()], dtype=dtype, requires_grad=True)
        pos_h = F.halo_from_owned(ctx, pos_owned, positions=True)
        parked = torch.tensor(plan.halo_offset[rank, n_pad: n_pad + 1], dtype=dtype)
        block = torch.cat([pos_h, parked])
        shift = torch.tensor(state.edges.shift[rank, : state.edges.n_edges[rank]], dtype=dtype)
        strain = torch.zeros((3, 3), dtype=dtype, requires_grad=True) if want_stress else None
        if strain is not None:  # without stress nothing is differentiated for it
            sym = (strain + strain.T) / 2
            block = block + block @ sym
            shift = shift + shift @ sym  # lattice shifts follow the strained cell
        attrs = self.wrapper.node_attrs(state.numbers)[plan.halo_global[rank, :n_pad]]
        attrs = torch.tensor(np.concatenate([attrs, np.zeros((1, attrs.shape[1]), attrs.dtype)]), dtype=dtype)
        graph = self._graph(block, attrs, state.edges.edges[rank, : state.edges.n_edges[rank]], shift,
                            n_receivers=n_own if self.exchange == "per_layer" else None)
        registry = AdapterRegistry()
        installed = self.distribution_spec().distribution
        registry.install((*installed.custom_ops, *installed.third_party_helpers))
        try:
            node_e = self.model(graph)
            partial = node_e[:n_own].sum()
            wrt = (pos_owned,) if strain is None else (pos_owned, strain)
            g_pos, *g_strain = torch.autograd.grad(partial, wrt, allow_unused=True)
        finally:
            registry.restore()
        g_pos = torch.zeros_like(pos_owned) if g_pos is None else g_pos
        out: dict[str, Any] = {"energy": float(self._sum(ctx, partial.detach().reshape(1))[0])}
        own_e = node_e[:n_own].detach()
        for key, value in (("forces", -g_pos), (s.node_energy_key, own_e)):
            out[key] = value.numpy() if key in s.owned_only else F.gather_owned(ctx, value.contiguous()).numpy()
        out["owned_ids"] = ctx.owned_ids()
        if strain is not None:
            g = torch.zeros_like(strain) if g_strain[0] is None else g_strain[0]
            virial = -self._sum(ctx, g.reshape(1, 9)).reshape(3, 3).numpy()
            volume = cell_volume(state.cell, "TorchDistributedMLIP.evaluate")
            out["virial"], out["stress"] = virial, -virial / volume
        return out

    def _graph(self, block: torch.Tensor, attrs: torch.Tensor, edges: np.ndarray, shift: torch.Tensor, *,
               n_receivers: int | None) -> BlockGraph:
        """The block graph with the edges longer than the cutoff (at these positions) left out.

        `shift`: the edges' (strained) shift vectors; `n_receivers`: the owned rows, the only
        receivers with per-layer exchange (None: every row).
        """
        ei = torch.as_tensor(edges, dtype=torch.int64).T
        with torch.no_grad():
            d = block[ei[1]] - block[ei[0]] + shift
            keep = (d * d).sum(1) < self.wrapper.cutoff**2
        ei = ei[:, keep].contiguous()
        return BlockGraph(block, attrs, ei, shift[keep], n_receivers)

    @staticmethod
    def _sum(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a per-rank `(1, F)` partial (no autograd)."""
        step = F.all_reduce_step(ctx, tuple(x.shape), numpy_dtype(x.dtype), replicated_consumer=False)
        return step.forward(x)

