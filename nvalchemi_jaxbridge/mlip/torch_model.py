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
With `exchange="deep_halo"` and `tiles=`, a rank's block runs tile by tile (`mlip.torch_tiles`), and the
halo's adjoint folds the tiles' ghost-row gradients into their owners once, after the last tile.
With `cuda_graphs` on (a GPU rank, by default), the block runs at the layout's capacities and each stage between
two exchanges is recorded once per set of capacities and replayed (`mlip.torch_graphs`); tiles run eagerly.

Devices: every tensor of an evaluation lives on the rank's device, the front door's
JAX device of this process as a torch device (`rank_device`: GPU `LOCAL_RANK` after
`initialize()` on a GPU machine, else the CPU); the exchanges run on it through
DLPack with no copy. The model must already be there: the wrapper's parameters and
buffers (`wrapper_modules`) on another device are refused at the first evaluation
(`device=` moves them at construction). Inputs come from the host once per layout;
nothing goes back to the host before the results (and, with `as_tensors=True`,
not even then).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from ..kernels.cuda_graphs import capture_backend
from ..layout import HaloPlan
from ..lower.finite import check_results
from ..lower import exchange as X
from ..spec import AdapterRegistry, ModuleForwardAdapter
from ..torch import functions as F
from ..torch.agreement import check_same_structure, layout_key
from ..torch.layer_exchange import fold_halo, refresh_halo
from . import contract
from .edges import EdgePlan
from .guards import explain
from .memory import check_argument, model_budget, tables_budget
from .memory_probe import ModelCost, probe_cost
from .tile_choice import TileChoice, layout_tiles
from .tiles import TilePlan, check_tiles, refuse_tiles
from .stages import Stages
from .torch_graphs import block_attrs, capacity_inputs, graphed_node_energies, uploaded, within
from .torch_tiles import rank_tiles, tiled_node_energies
from .torch_device import normalized_device, rank_device as rank_device, torch_device as torch_device
from .torch_device import model_devices as model_devices, wrapper_modules as wrapper_modules
from .protocol import BlockGraph, MessagePassingWrapper, as_tuple, like, numpy_dtype, with_edge_features
from .specs import RunSettings, as_mlip_spec, cell_volume, check_model, run_settings, stress_wanted
from .state_check import fingerprint_change, needs_replan, new_token, state_for_call, wrapper_fingerprint


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
        w, where = self.wrapper, "StagedModel.forward of the PyTorch door"
        g = with_edge_features(w, g, where)  # once, for every layer
        h = contract.embed(w, g, where)
        n, total = len(as_tuple(h)), None
        for layer in self.layers:
            # the refresh adapter may stand in for layer.forward: the result is checked here
            h, e = contract.interaction_result(w, layer.i, g, layer(g, h), where, n)
            total = e if total is None else total + e
        return contract.node_energies(w, g, total, where)


@dataclasses.dataclass(frozen=True, eq=False)
class TorchState:
    """This rank's layout: the plan, its edges, and the block's static inputs."""

    plan: HaloPlan
    edges: EdgePlan
    numbers: np.ndarray
    cell: np.ndarray
    periodic: tuple[bool, bool, bool]
    fingerprint: Any = None  # state_check.Fingerprint: the driver and the model as they were at prepare
    tiles: TilePlan | None = None  # the block's tiles (None: the block in one go)
    # The layout's static block inputs on a device (parked row, edges, shifts, node attributes), by
    # (device, dtype): uploaded once per layout, not once per evaluation. A rebuilt state starts empty.
    uploaded: dict[tuple, tuple[torch.Tensor, ...]] = dataclasses.field(
        default_factory=dict, init=False, repr=False)


class TorchDistributedMLIP:
    """A message-passing model on the PyTorch front door (call on every rank together).

    Args:
        wrapper: a `MessagePassingWrapper`.
        spec: an `MLIPSpec`/`DistributionSpec`, or None for the wrapper's own.
        exchange: "per_layer" or "deep_halo" (as for `DistributedMLIP`).
        skin, headroom, memory_budget: as for `DistributedMLIP` (the default budget shares the host's memory
            between the `LOCAL_WORLD_SIZE` processes of a CPU host).
        tiles: as for `DistributedMLIP` (with `exchange="deep_halo"`): each rank's block in this many tiles, each
            tile's forward and backward in its turn (`mlip.torch_tiles`), or "auto" (the fewest that fit
            `memory_budget`, from the model's memory measured once on the rank's device); same numbers.
        device: where this rank's model runs. None (default): the model stays where it is and
            must already be on the rank's device (`rank_device()`: `cuda:LOCAL_RANK` after
            `initialize()` on a GPU machine, else `cpu`). A device (`"cuda"` is the current
            one, which `initialize()` sets to `LOCAL_RANK`): the wrapper's modules are moved
            there now (`module.to(device)`); it must be the rank's device.
        cuda_graphs: as for `DistributedMLIP`: "auto" (default: on where the model is on a GPU at
            construction, for blocks of at most `kernels.cuda_graphs.AUTO_MAX_ROWS` rows), True (a GPU
            is required) or False (eager), or a capture backend (`FakeCapture()` in tests). On, the
            block runs at the layout's static capacities (`mlip.torch_graphs`) and each stage between
            two exchanges (edge features + embed + layer 0, each later layer, the last one + node
            energies) is recorded as CUDA graphs once per set of capacities and replayed from then
            on; the refreshes between them stay eager. A model that cannot be recorded runs eagerly
            after one logged warning; the numbers are the same either way. Tiles (`tiles=` other than
            1) run eagerly.

    Every rank passes the same global structure; results are global arrays on
    every rank (per-atom outputs listed in the spec's `owned_only_outputs`:
    this rank's owned rows, with `owned_ids`).

    Every tensor of an evaluation is on the rank's device. The model's parameters and
    buffers (those of `wrapper_modules(wrapper)`: the wrapper if it is a
    `torch.nn.Module`, else its attributes that are) must be there too: another
    device is refused at the first evaluation, naming both devices; a wrapper with
    no module found is not checked.

    Raises:
        ValueError: (first evaluation) the model's parameters are not on the rank's
            device, or `device=` is not the rank's device; (construction) `cuda_graphs=True`
            with the model on the CPU, or an unknown `cuda_graphs`.

    Example:
        >>> initialize()                                        # under launch / torchrun / srun
        >>> dm = TorchDistributedMLIP(MACEWrapper(model), device="cuda")    # model moved to cuda:LOCAL_RANK
        >>> out = dm.evaluate(positions, numbers, cell)                      # numpy on the host
        >>> out = dm.evaluate(positions, numbers, cell, as_tensors=True)     # torch tensors on cuda:LOCAL_RANK
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
            refuse_tiles(kwargs, "TorchDistributedMLIP")
            if kwargs.pop("cuda_graphs", "auto") not in ("auto", False):
                raise ValueError(
                    "TorchDistributedMLIP: an ML-IAP model runs its own forward eagerly (CUDA graphs record a "
                    "wrapper's stages); leave cuda_graphs out."
                )
            return TorchMLIAP(wrapper, **kwargs)
        return super().__new__(cls)

    def __init__(self, wrapper: MessagePassingWrapper, *, spec: Any = None, exchange: str = "per_layer",
                 skin: float = 0.5, headroom: float = 1.2, device: Any = None, memory_budget: float | None = None,
                 tiles: int | str = 1, cuda_graphs: Any = "auto") -> None:
        check_model(wrapper, exchange, skin, "TorchDistributedMLIP")
        self.tiles = check_tiles(tiles, exchange, "TorchDistributedMLIP")
        self.model_cost: ModelCost | None = None  # tiles="auto": the model's measured memory cost
        self.tile_choice: TileChoice | None = None  # and the last layout's choice
        self.wrapper, self.exchange, self.skin, self.headroom = wrapper, exchange, float(skin), float(headroom)
        self.spec = as_mlip_spec(wrapper.distribution_spec() if spec is None else spec)
        self.settings: RunSettings = run_settings(self.spec, per_layer=exchange == "per_layer")
        self.model = StagedModel(wrapper)
        self._token = new_token()
        self._fingerprint = self.fingerprint()
        self.requested_device = None if device is None else normalized_device(device)
        if self.requested_device is not None:
            for module in wrapper_modules(wrapper):
                module.to(self.requested_device)
        check_argument(memory_budget, "TorchDistributedMLIP")
        self.memory_budget = memory_budget
        self._cuda_graphs = cuda_graphs
        capture_backend(cuda_graphs, self._model_device(), self._graphs_where())  # a bad option refused now
        self._stages: Stages | None | bool = False  # False: not built yet (`stages`, on the rank's device)
        self._device: torch.device | None = None  # the rank's device, once checked (first evaluation)
        self._ctx: Any = None

    @property
    def device(self) -> torch.device:
        """The rank's device, where the model and every tensor of an evaluation live (checked on first use).

        Raises:
            ValueError: the model's parameters or buffers, or `device=`, are on another device.
        """
        if self._device is None:
            self._device = self._checked_device(rank_device())
        return self._device

    def _checked_device(self, rank: torch.device) -> torch.device:
        """`rank`, after checking that `device=` and the model's parameters and buffers are there."""
        here = str(rank)
        if self.requested_device is not None and self.requested_device != rank:
            raise ValueError(
                f"TorchDistributedMLIP: device={str(self.requested_device)!r} but this rank's device is "
                f"{here!r} (rank {_rank()}; one process per device, GPU LOCAL_RANK after initialize()); "
                f"pass device={here!r} or device=None (then move the model there yourself)."
            )
        if wrong := sorted(str(d) for d in model_devices(self.wrapper) if d != rank):
            checked = ", ".join(type(m).__name__ for m in wrapper_modules(self.wrapper))
            raise ValueError(
                f"TorchDistributedMLIP: the model's parameters or buffers are on {', '.join(wrong)} but this "
                f"rank's device is {here!r} (rank {_rank()}; modules checked: {checked}), where every tensor "
                f"of an evaluation and the exchanges live; build it with TorchDistributedMLIP(..., "
                f"device={here!r}), which moves the wrapper's modules there, or move the model yourself "
                f"first (model.to({here!r}))."
            )
        return rank

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

    def fingerprint(self) -> Any:
        """What a layout of this model depends on, read from the wrapper now (`state_check.Fingerprint`)."""
        return wrapper_fingerprint(self._token, self.wrapper, self.exchange, self.skin)

    def _sync(self) -> None:
        """Follow a wrapper changed since the last call: its layers again; older states no longer hold."""
        if self.fingerprint() != self._fingerprint:
            check_model(self.wrapper, self.exchange, self.skin, "TorchDistributedMLIP")
            self.model = StagedModel(self.wrapper)
            self._stages = False  # built again for the changed wrapper
            self._fingerprint = self.fingerprint()

    @property
    def stages(self) -> Stages | None:
        """The stages as recorded functions per `cuda_graphs` on the rank's device (`mlip.torch_graphs`; None:
        eager), built on first use (after the device check: the shape probes run the model there)."""
        if self._stages is False:
            device = self.device
            backend = capture_backend(self._cuda_graphs, device, self._graphs_where())
            self._stages = None if backend is None else Stages.of(self.wrapper, device=str(device),
                                                                   cuda_graphs=self._cuda_graphs)
        return self._stages

    def _graphs_where(self) -> str:
        return f"TorchDistributedMLIP: the stages of model {self.wrapper.name!r}"

    def _model_device(self) -> torch.device:
        """Where the model is now (`device=`, else a GPU of its parameters, else the CPU): for an early check."""
        devs = [self.requested_device] if self.requested_device is not None else model_devices(self.wrapper)
        return min((d for d in devs if d.type == "cuda"), key=str, default=torch.device("cpu"))

    def _graphed(self, state: TorchState) -> bool:
        """Whether this evaluation runs the recorded stages at the layout's capacities (else today's eager path)."""
        g = None if self.stages is None else self.stages.graphs
        return (g is not None and g.off is None and state.tiles is None
                and (g.max_rows is None or state.plan.halo_rows <= g.max_rows))

    # ---------------------------------------------------------------- layout

    def prepare(self, positions: Any, numbers: Any, cell: Any, pbc: Any = True) -> TorchState:
        """The layout (same on every rank): halo plan and block edges."""
        from .model_layout import build_layout

        import jax

        self._sync()
        mesh = F.front_door_mesh()
        self.budget = model_budget(self.memory_budget, self.exchange, [mesh.devices.flat[jax.process_index()]],
                                   "TorchDistributedMLIP", measured=self.tiles == "auto")
        plan, edges, numbers, cell, periodic = build_layout(
            self.wrapper, self.exchange, positions, numbers, cell, pbc, n_devices=mesh.devices.size, skin=self.skin,
            headroom=self.headroom, budget=self.budget if self.tiles == 1 else tables_budget(self.budget, self.tiles))
        tiles = self._tiles(plan, edges, positions, numbers, None)
        return TorchState(plan, edges, numbers, cell, periodic, self._fingerprint, tiles)

    def _tiles(self, plan: HaloPlan, edges: EdgePlan, positions: Any, numbers: np.ndarray, keep: TilePlan | None
               ) -> TilePlan | None:
        """The block's tiles (None without tiles); the same on every rank (every rank plans every device)."""
        def cost() -> ModelCost:
            if self.model_cost is None:  # measured once per model, on the rank's device (mlip.memory_probe)
                self.model_cost = probe_cost(self.wrapper, np.unique(numbers), self.device)
            return self.model_cost

        tiles, choice = layout_tiles(self.tiles, plan, edges, positions, n_layers=self.wrapper.n_layers,
                                     headroom=self.headroom, budget=self.budget, keep=keep, cost=cost,
                                     name=self.wrapper.name)
        self.tile_choice = choice or self.tile_choice
        return tiles

    def update(self, state: TorchState, positions: Any) -> TorchState:
        """`state` if it still holds for `positions` (an atom re-wrapped by a lattice vector has not moved),
        else a re-planned layout (a fresh one for a state of another model, or of this one before it changed)."""
        self._sync()
        if fingerprint_change(state, self._fingerprint) is not None:
            return self.prepare(positions, state.numbers, state.cell, state.periodic)
        pos = np.asarray(positions, dtype=np.float64)
        if not needs_replan(state, self._fingerprint, pos):
            return state
        plan = state.plan.rebuild(pos)
        edges = state.edges.rebuild(plan, pos)
        tiles = self._tiles(plan, edges, pos, state.numbers, state.tiles)
        return dataclasses.replace(state, plan=plan, edges=edges, tiles=tiles)

    # ---------------------------------------------------------------- evaluation

    def evaluate(self, positions: Any, numbers: Any, cell: Any, pbc: Any = True, *,
                 state: TorchState | None = None, stress: bool | None = None,
                 as_tensors: bool = False) -> dict[str, Any]:
        """Energy, forces, stress and atomic energies (see `DistributedMLIP.evaluate`), on every rank.

        Args:
            as_tensors: False (default): numpy arrays on the host (energy a float). True: energy
                (0-d), forces, atomic energies, virial and stress as detached torch tensors on the
                rank's device (`self.device`), with no copy to the host; `owned_ids` stays numpy.
                The tensors view the exchanges' output buffers: clone one before writing into it.

        Raises:
            nvalchemi_jaxbridge.torch.agreement.RankMismatchError: the ranks passed different structures
                (or states); it names the ranks and what differs (atom count, atomic numbers, cell, pbc,
                positions, layout), on every rank, before any exchange.
        """
        s = self.settings
        dev = self.device  # checks the model's device on first use
        # every rank the same structure, before any exchange whose size depends on it (one small all-gather)
        check_same_structure(positions, numbers, cell, pbc, caller="TorchDistributedMLIP.evaluate",
                             layout=None if state is None else layout_key(state.plan, state.edges))
        state, pos = state_for_call(self, state, positions, numbers, cell, pbc, where="TorchDistributedMLIP.evaluate")
        want_stress = stress_wanted(s, stress, "TorchDistributedMLIP.evaluate")
        ctx = F.context_for(state.plan)
        self._ctx = ctx
        n_own = ctx.n_owned
        dtype = self.wrapper.dtype
        graphed = self._graphed(state)
        if graphed:  # the layout's capacities: the same shapes for every layout of equal capacities
            parked, edges, shift, spare, attrs = capacity_inputs(state, ctx, self.wrapper, dev, dtype)
        else:
            parked, edges, shift, attrs = self._uploaded(state, ctx, dev, dtype)
        pos_owned = torch.tensor(pos[ctx.owned_ids()], dtype=dtype, device=dev, requires_grad=True)
        pos_h = F.halo_from_owned(ctx, pos_owned, positions=True)
        block = torch.cat([pos_h, parked])
        strain = torch.zeros((3, 3), dtype=dtype, device=dev, requires_grad=True) if want_stress else None
        if strain is not None:  # without stress nothing is differentiated for it
            sym = (strain + strain.T) / 2
            block = block + block @ sym
            shift = shift + shift @ sym  # lattice shifts follow the strained cell
        registry = AdapterRegistry()
        installed = self.distribution_spec().distribution
        registry.install((*installed.custom_ops, *installed.third_party_helpers))
        try:
            if state.tiles is not None:  # the deep halo's block, tile by tile
                node_e = tiled_node_energies(self.model, block, attrs, shift, self._kept(block, edges, shift),
                                             self._rank_tiles(state, ctx, dev))
            elif graphed:
                node_e = graphed_node_energies(
                    self.stages, block, attrs, edges, shift, spare, skin=self.skin,
                    n_receivers=ctx.owned_capacity if self.exchange == "per_layer" else None,
                    between=lambda x: self._refresh(x, s.policy))
            else:
                node_e = self.model(self._graph(block, attrs, edges, shift,
                                                n_receivers=n_own if self.exchange == "per_layer" else None))
            partial = node_e[:n_own].sum()
            wrt = (pos_owned,) if strain is None else (pos_owned, strain)
            g_pos, *g_strain = torch.autograd.grad(partial, wrt, allow_unused=True)
        finally:
            registry.restore()
        g_pos = torch.zeros_like(pos_owned) if g_pos is None else g_pos
        out: dict[str, Any] = {"energy": self._sum(ctx, partial.detach().reshape(1))[0]}
        own_e = node_e[:n_own].detach()
        for key, value in (("forces", -g_pos), (s.node_energy_key, own_e)):
            out[key] = value if key in s.owned_only else F.gather_owned(ctx, value.contiguous())
        if strain is not None:
            g = torch.zeros_like(strain) if g_strain[0] is None else g_strain[0]
            virial = -self._sum(ctx, g.reshape(1, 9)).reshape(3, 3)
            volume = cell_volume(state.cell, "TorchDistributedMLIP.evaluate")
            out["virial"], out["stress"] = virial, -virial / volume
        # every rank holds the same global results, so every rank raises alike (no rank left in a collective)
        check_results("TorchDistributedMLIP.evaluate", out,
                      explain=lambda: explain(self, positions, numbers, cell, pbc))
        if not as_tensors:  # the only copies to the host, once everything is computed
            out = {k: float(v) if k == "energy" else v.cpu().numpy() for k, v in out.items()}
        out["owned_ids"] = ctx.owned_ids()
        return out

    def _uploaded(self, state: TorchState, ctx: Any, device: torch.device, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, ...]:
        """The layout's static block inputs on `device`: parked row, edges `(2, E)`, shifts, node attributes.

        Built on the host and copied to the device once per layout (kept in `state.uploaded`).
        """
        plan, e, rank = state.plan, state.edges, ctx.rank
        n_pad, n_e = ctx.n_owned + ctx.n_ghost, int(e.n_edges[rank])
        return uploaded(state, (rank, device, dtype), device, lambda: (
            torch.tensor(plan.halo_offset[rank, n_pad: n_pad + 1], dtype=dtype),
            torch.as_tensor(e.edges[rank, :n_e], dtype=torch.int64).T.contiguous(),
            torch.tensor(e.shift[rank, :n_e], dtype=dtype),
            torch.tensor(block_attrs(self.wrapper, state, rank, n_pad, n_pad + 1), dtype=dtype),
        ))

    def _graph(self, block: torch.Tensor, attrs: torch.Tensor, ei: torch.Tensor, shift: torch.Tensor, *,
               n_receivers: int | None) -> BlockGraph:
        """The block graph with the edges longer than the cutoff (at these positions) left out.

        `ei`: the block's `(2, E)` edges (senders, receivers); `shift`: their (strained) shift
        vectors; `n_receivers`: the owned rows, the only receivers with per-layer exchange (None:
        every row).
        """
        keep = self._kept(block, ei, shift)
        ei = ei[:, keep].contiguous()
        return BlockGraph(block, attrs, ei, shift[keep], n_receivers)

    def _kept(self, block: torch.Tensor, ei: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """`(E,)` True on the block edges within the cutoff at these positions."""
        return within(block, ei[0], ei[1], shift, self.wrapper.cutoff)

    @staticmethod
    def _rank_tiles(state: TorchState, ctx: Any, device: torch.device) -> Any:
        """This rank's tiles as index tensors on `device` (uploaded once per layout, kept in `state.uploaded`)."""
        key = ("tiles", ctx.rank, device)
        if key not in state.uploaded:
            state.uploaded[key] = rank_tiles(state.tiles, ctx.rank, ctx.n_owned + ctx.n_ghost, device)
        return state.uploaded[key]

    @staticmethod
    def _sum(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a per-rank `(1, F)` partial (no autograd)."""
        step = F.all_reduce_step(ctx, tuple(x.shape), numpy_dtype(x.dtype), replicated_consumer=False)
        return step.forward(x)



def _rank() -> int:
    """This process's rank on the front door."""
    import jax

    return jax.process_index()
