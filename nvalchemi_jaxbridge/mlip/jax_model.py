"""The JAX front door of the model level: a torch MLIP on the domain decomposition, one program.

One energy evaluation is one `shard_map` program over all devices:

    positions (owned storage) --GatherInputs (periodic images)--> halo block
        --strain (I + eps)--> stages as torch ops, ghost rows refreshed between layers
        --> owned node energies --psum--> energy

and `jax.value_and_grad` of it gives forces (ghost gradients reach their owners
through the exchanges' adjoints) and the strain derivative (stress). Because the
whole thing is a JAX function of sharded arrays, an integrator step around it is
one XLA program too (`DistributedMLIP.energy_fn`).

`exchange="per_layer"`: a halo of one cutoff (+ skin); only owned atoms receive
messages and ghost features are refreshed before every layer after the first.
`exchange="deep_halo"`: a halo of `n_layers x cutoff` (+ skin), the whole model
as one op on the block, no exchange between layers (the fallback; same numbers).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..layout import HaloPlan
from ..layout.capacity import GrowthLog
from ..lower import collectives as C
from ..lower import compile as lower_compile
from ..lower import exchange as X
from ..lower import auto_mesh, make_mesh
from ..lower.cache import enable_compilation_cache
from ..lower.finite import check_results
from ..lower.tables import place
from ..spec import DistributionSpec
from .edges import EdgePlan
from .guards import explain
from .memory import model_budget, tables_budget
from .model_layout import ModelState, active_edges, build_layout, halo_depth, padding_length
from .tiled import tile_arrays, tiled_node_energies
from . import tile_choice
from .memory_probe import ModelCost, probe_cost
from .tiles import TilePlan, check_tiles, refuse_tiles
from .protocol import MessagePassingWrapper, numpy_dtype
from .specs import RunSettings, cell_volume, check_model, run_settings, stress_wanted
from .stages import Stages, run_stages
from .state_check import (fingerprint_change, needs_replan, new_token, require_current, state_for_call,
                          wrapper_fingerprint)


def between_layers(x: jax.Array, t: Any, axis: str, policy: Any) -> jax.Array:
    """Ghost rows of a layer's output set to their owners' values, by whichever exchange `policy` has on.

    With the refresh off but the fold on (`gather_mode="local"`, `scatter_mode="halo_correction"`),
    folding the owned rows alone (ghost rows zeroed) gives the same values: every ghost then
    receives its owner's row and nothing is added to an owner.
    """
    refresh_on, _ = X.exchanges_of(policy)
    if refresh_on:
        return X.refresh(x, t, axis, policy)
    owned = jnp.concatenate([C.slice_owned(x, t), jnp.zeros((t.ghost_capacity,) + x.shape[1:], x.dtype)])
    return X.fold(owned, t, axis, policy)


class DistributedMLIP:
    """A torch message-passing model distributed over a JAX mesh (one process, all devices).

    Args:
        wrapper: a `MessagePassingWrapper` (e.g. `MPNNWrapper`, `MACEWrapper`).
        spec: an `MLIPSpec` (or a `DistributionSpec`, or None for the wrapper's own
            `distribution_spec()`): the storage policy, force strategy, stress, outputs.
        n_devices: devices of a new 1-D mesh (default: all); or pass `mesh`.
        exchange: "per_layer" (halo of one cutoff, refresh between layers) or
            "deep_halo" (halo of n_layers cutoffs, the model as one op).
        skin: Verlet skin (Å): halo and edges reach `cutoff + skin`; the layout is
            rebuilt when an atom has moved more than `skin / 2`.
        headroom: relative headroom of every static capacity (1.2: 20 % spare rows and edges). A capacity
            that no longer fits grows to at least `layout.capacity.GROWTH` times itself (the programs compile
            again; logged once at INFO with the capacities, a warning after a few): raise it for a cell
            that will shrink, e.g. 2.0 under a cell filter.
        call_path: how the stage ops are called ("auto", "ffi", "callback").
        tiles: evaluate each device's block in this many tiles, one after another, each with its own deep
            halo (`mlip.tiles`): memory per device is one tile's intermediates, the numbers are the same.
            Needs `exchange="deep_halo"`; 1 (the default): the block in one go; "auto": the fewest tiles that
            fit `memory_budget`, from the model's memory measured once (`mlip.tile_choice`).
        cuda_graphs: "auto" (default: on where the mesh's devices are GPUs), True (a GPU is required) or
            False. On, each stage op is recorded as CUDA graphs once per set of capacities and dtype
            and replayed from then on; a model that cannot be recorded (it synchronises with the host,
            or a shape depends on values) runs eagerly, with one logged warning saying why; the numbers
            are the same either way.
        memory_budget: bytes one device's layout may take (None: half of each device's memory, 80 % with
            tiles="auto", whose cost is measured; `mlip.memory`); a layout whose estimated or counted rows and edges cost more is refused
            before it is built (`LayoutBudgetError`, with the numbers and the fix).

    Example:
        >>> model = DistributedMLIP(MPNNWrapper(MPNN([29, 79])), n_devices=8)
        >>> out = model.evaluate(positions, numbers, cell)        # energy, forces, stress, atomic_energies
    """

    def __new__(cls, wrapper: Any = None, **kwargs: Any) -> Any:
        """A LAMMPS ML-IAP unified model object (`compute_forces`, `element_types`, `rcutfac`) gets its own
        driver (`mliap_jax.JaxMLIAP`, same methods); anything else is a wrapper."""
        from .mliap import is_mliap_model

        if is_mliap_model(wrapper):
            from .mliap_jax import JaxMLIAP

            if kwargs.get("spec") is not None:
                raise ValueError(
                    "DistributedMLIP: an ML-IAP model takes no spec (it computes its own pair forces and asks for "
                    "its own exchanges); leave spec=None."
                )
            kwargs.pop("spec", None)
            refuse_tiles(kwargs, "DistributedMLIP")
            if kwargs.pop("cuda_graphs", "auto") not in ("auto", False):
                raise ValueError(
                    "DistributedMLIP: an ML-IAP model runs its own forward eagerly (CUDA graphs record a wrapper's "
                    "stage ops); leave cuda_graphs out."
                )
            return JaxMLIAP(wrapper, **kwargs)
        return super().__new__(cls)

    def __init__(self, wrapper: MessagePassingWrapper, *, spec: Any = None, n_devices: int | None = None,
                 mesh: Any = None, exchange: str = "per_layer", skin: float = 0.5, headroom: float = 1.2,
                 call_path: str = "auto", memory_budget: float | None = None, cuda_graphs: bool | str = "auto",
                 tiles: int | str = 1) -> None:
        check_model(wrapper, exchange, skin, "DistributedMLIP")
        self.tiles = check_tiles(tiles, exchange, "DistributedMLIP")
        self.model_cost: ModelCost | None = None  # tiles="auto": the model's measured memory cost
        self.tile_choice: tile_choice.TileChoice | None = None  # and the last layout's choice
        enable_compilation_cache()  # unless the user chose a cache or opted out (lower/cache.py)
        self.wrapper, self.exchange, self.skin, self.headroom = wrapper, exchange, float(skin), float(headroom)
        self.settings: RunSettings = run_settings(wrapper.distribution_spec() if spec is None else spec,
                                                  per_layer=exchange == "per_layer")
        self.mesh = auto_mesh(mesh) if mesh is not None else make_mesh(n_devices)
        self.budget = model_budget(memory_budget, exchange, list(self.mesh.devices.flat), "DistributedMLIP",
                                   measured=self.tiles == "auto")
        self._call_path, self._cuda_graphs, self._token = call_path, cuda_graphs, new_token()
        #: every capacity growth of this model's layouts (logged once at INFO; a warning past a few)
        self.growth_log = GrowthLog("DistributedMLIP")
        self._fit()

    def _fit(self) -> None:
        """Stages, jitted programs and caches for the wrapper as it is now (again after it changed)."""
        gpu = self.mesh.devices.flat[0].platform == "gpu"
        self.stages = Stages.of(self.wrapper, call_path=self._call_path, device="cuda" if gpu else "cpu",
                                cuda_graphs=self._cuda_graphs)
        self._value_and_grad = jax.jit(jax.value_and_grad(self.energy_fn, argnums=(1, 2), has_aux=True))
        self._value_and_forces = jax.jit(jax.value_and_grad(self.energy_fn, argnums=1, has_aux=True))
        self._programs: dict[Hashable, Callable[..., Any]] = {}
        self._compiled: Any = None  # the CompiledSpec every layout of this model shares (so do its programs)
        self._fingerprint = self.fingerprint()

    def fingerprint(self) -> Any:
        """What a layout of this model depends on, read from the wrapper now (`state_check.Fingerprint`)."""
        return wrapper_fingerprint(self._token, self.wrapper, self.exchange, self.skin)

    def _sync(self) -> None:
        """Follow a wrapper changed since the last call (cutoff, layers, dtype): new stages and programs;
        older states no longer hold (`evaluate(state=)` and `energy_fn` refuse them, `update` re-plans)."""
        if self.fingerprint() != self._fingerprint:
            check_model(self.wrapper, self.exchange, self.skin, "DistributedMLIP")
            self._fit()

    def program(self, key: Hashable, build: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        """The program this model keeps under `key`: `build()` on first use, the same object after.

        Drivers built on the model (`dynamics.nve`'s jitted chunk of steps) keep their jitted functions
        here, so a second run on the same model reuses the first run's compilations.
        """
        if key not in self._programs:
            self._programs[key] = build()
        return self._programs[key]

    # ---------------------------------------------------------------- layout

    @property
    def halo_depth(self) -> float:
        """Halo width without skin: one cutoff (per-layer) or n_layers cutoffs (deep halo)."""
        return halo_depth(self.wrapper, self.exchange)

    def prepare(self, positions: Any, numbers: Any, cell: Any, pbc: Any = True, *,
                previous: ModelState | None = None) -> ModelState:
        """The layout for one geometry: halo plan, block edges, device tables, node attributes.

        Args:
            positions, numbers, cell, pbc: the structure (Å; cell rows are lattice vectors).
            previous: a state of this model for the same atoms (count, atomic numbers and
                periodicity), e.g. before the cell changed: its grid, capacities and compiled
                spec are kept (capacities grown where they no longer fit), so the jitted
                programs are reused rather than traced again. A state of other atoms, or
                of a model with another halo, skin or policy, is ignored (a fresh layout).

        Raises:
            TypeError: `previous` is not a `ModelState`.
        """
        if previous is not None and not isinstance(previous, ModelState):
            raise TypeError(
                f"DistributedMLIP.prepare: previous must be a ModelState (from prepare / update / rebuild of "
                f"this model), got {type(previous).__name__}; pass the state itself, or leave previous out."
            )
        self._sync()
        z = np.asarray(numbers).reshape(-1)
        periodic = tuple(bool(p) for p in np.broadcast_to(np.asarray(pbc, dtype=bool), (3,)))
        same = (previous is not None and previous.fingerprint == self._fingerprint
                and previous.plan.n_atoms == len(z) and np.array_equal(previous.numbers, z)
                and previous.periodic == periodic and previous.cs.mesh == self.mesh
                and previous.plan.cutoff == self.halo_depth and previous.plan.skin == self.skin
                and previous.cs.spec.policy == self.settings.policy)
        plan, edges, numbers, cell, periodic = build_layout(
            self.wrapper, self.exchange, positions, numbers, cell, pbc, n_devices=int(self.mesh.devices.size),
            skin=self.skin, headroom=self.headroom, keep=(previous.plan, previous.edges) if same else None,
            cell_changed=same and not np.array_equal(previous.cell, np.asarray(cell, dtype=np.float64)),
            budget=self.budget if self.tiles == 1 else tables_budget(self.budget, self.tiles))
        tiles = self._tiles(plan, edges, positions, numbers, previous.tiles if same else None)
        self.growth_log.record(plan.growth + edges.growth + (tiles.growth if tiles else ()), self.headroom)
        return self._state(plan, edges, self.wrapper.node_attrs(numbers), numbers, cell, periodic,
                           cs=previous.cs if same else None, tiles=tiles)

    def _tiles(self, plan: HaloPlan, edges: EdgePlan, positions: Any, numbers: np.ndarray, keep: TilePlan | None
               ) -> TilePlan | None:
        """The block's tiles (None without tiles), with `keep`'s capacities where they suffice."""
        def cost() -> ModelCost:
            if self.model_cost is None:  # measured once per model, on its device (mlip.memory_probe)
                gpu = self.mesh.devices.flat[0].platform == "gpu"
                self.model_cost = probe_cost(self.wrapper, np.unique(numbers), "cuda" if gpu else "cpu")
            return self.model_cost

        tiles, choice = tile_choice.layout_tiles(
            self.tiles, plan, edges, positions, n_layers=self.wrapper.n_layers, headroom=self.headroom,
            budget=self.budget, keep=keep, cost=cost, name=self.wrapper.name)
        self.tile_choice = choice or self.tile_choice
        return tiles

    def _state(self, plan: HaloPlan, edges: EdgePlan, attrs: np.ndarray, numbers: np.ndarray, cell: np.ndarray,
               periodic: tuple[bool, bool, bool], cs: Any = None, tiles: TilePlan | None = None) -> ModelState:
        # One compiled spec per model, on each layout's plan: a jitted program traced for one layout is
        # reused by every later one of equal capacities (a second prepare of the same atoms included)
        base = cs if cs is not None else self._compiled
        if base is None:
            cs = lower_compile(DistributionSpec(self.settings.policy), self.mesh, plan)
        else:
            cs = base.with_plan(plan)
        if self._compiled is None:
            self._compiled = cs
        row = NamedSharding(self.mesh, P(cs.axis))
        shift = edges.shift.reshape(-1, 3).astype(self._np_dtype())
        return ModelState(plan, edges, cs, place(edges.edges.reshape(-1, 2), row), place(shift, row),
                          place(edges.spare.reshape(-1), row), cs.owned(attrs), numbers, cell, periodic,
                          self._fingerprint, tiles, None if tiles is None else tile_arrays(tiles, row))

    def needs_rebuild(self, state: ModelState, positions: Any) -> bool:
        """Whether `state` no longer holds for `positions`: an atom more than skin/2 from the layout's
        positions (minimum image: re-wrapping is no move), or the model changed since `prepare`."""
        self._sync()
        return needs_replan(state, self._fingerprint, positions)

    def update(self, state: ModelState, positions: Any) -> ModelState:
        """`state` if it still holds for `positions`, else a re-planned layout (capacities kept or grown;
        a state of another model, or of this model before it changed, is laid out anew)."""
        return self.rebuild(state, positions) if self.needs_rebuild(state, positions) else state

    def rebuild(self, state: ModelState, positions: Any) -> ModelState:
        """A new layout for `positions` with `state`'s capacities (grown where they no longer fit); a fresh
        one of the state's structure for a state of another model, or of this one before it changed."""
        self._sync()
        if fingerprint_change(state, self._fingerprint) is not None:
            return self.prepare(positions, state.numbers, state.cell, state.periodic)
        plan, edges, *_ = build_layout(
            self.wrapper, self.exchange, positions, state.numbers, state.cell, state.periodic,
            n_devices=int(self.mesh.devices.size), skin=self.skin, headroom=self.headroom,
            keep=(state.plan, state.edges))
        tiles = self._tiles(plan, edges, positions, state.numbers, state.tiles)
        self.growth_log.record(plan.growth + edges.growth + (tiles.growth if tiles else ()), self.headroom)
        attrs = self.wrapper.node_attrs(state.numbers)
        return self._state(plan, edges, attrs, state.numbers, state.cell, state.periodic, cs=state.cs, tiles=tiles)

    # ---------------------------------------------------------------- programs

    def energy_fn(self, state: ModelState, pos_owned: jax.Array, strain: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Energy (replicated) and owned node energies of owned-storage positions under a strain.

        A pure JAX function (jit it with `state` as an argument); `strain` is a
        `(3, 3)` array whose symmetric part strains positions and cell together.

        Returns:
            `(energy, node_energies)`: a scalar and `(D * owned_capacity,)` owned storage.
        """
        self._sync()
        require_current(state, self._fingerprint, "DistributedMLIP.energy_fn", "state = model.update(state, "
                        "positions) (halo_energy_fn: nbrs = neighbor_fn.allocate(R, nbrs))")
        cs, w = state.cs, self.wrapper
        axis, policy, deep = cs.axis, self.settings.policy, self.exchange == "deep_halo"
        far = padding_length(w.cutoff, self.skin)
        # Per layer, only the owned rows receive edges (EdgePlan receivers="owned").
        st = self.stages.for_receivers(None if deep else cs.tables.owned_capacity)

        def body(t, edges, edge_shift, spare, attrs, pos, eps, tiles):
            sym = ((eps + eps.T) / 2).astype(pos.dtype)
            pos_h = C.halo_forward(pos, t, axis, positions=True)
            pos_h = pos_h + pos_h @ sym
            edge_shift = edge_shift + edge_shift @ sym  # lattice shifts follow the strained cell
            attrs_h = C.halo_forward(attrs, t, axis)
            e_idx, shifts = active_edges(pos_h, edges, edge_shift, spare, w.cutoff, far)
            graph = (pos_h, attrs_h, e_idx, shifts)
            if tiles is not None:  # the deep halo's block, tile by tile
                node_e = tiled_node_energies(st.whole, pos_h, shifts, attrs_h, e_idx[:, 0] != spare, tiles, far)
            else:  # the whole model as one op (deep halo, or a single layer), or layer by layer
                node_e = run_stages(st, graph, lambda x: between_layers(x, t, axis, policy), whole=deep)
            own = C.slice_owned(node_e, t)
            return jax.lax.psum(jnp.sum(own), axis), own

        smap = jax.shard_map(
            body, mesh=cs.mesh,
            in_specs=(cs.tables.specs(axis), P(axis), P(axis), P(axis), P(axis), P(axis), P(), P(axis)),
            out_specs=(P(), P(axis)), check_vma=True)
        return smap(cs.tables, state.edge_table, state.edge_shift, state.spare, state.attrs, pos_owned, strain,
                    state.tile_arrays)

    def energy_and_gradients(self, state: ModelState, pos_owned: jax.Array, *, strain: bool = True
                             ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """`(energy, node energies, dE/dpositions (owned storage), dE/dstrain (3, 3))`, one jitted program.

        `strain=False`: the program leaves the strain derivative out (None in its place), so
        nothing is differentiated for it (the edges' lattice shifts stay constants).
        """
        zero = jnp.zeros((3, 3), pos_owned.dtype)
        if not strain:
            (energy, node_e), g_pos = self._value_and_forces(state, pos_owned, zero)
            return energy, node_e, g_pos, None
        (energy, node_e), (g_pos, g_strain) = self._value_and_grad(state, pos_owned, zero)
        return energy, node_e, g_pos, g_strain

    # ---------------------------------------------------------------- results

    def evaluate(self, positions: Any, numbers: Any, cell: Any, pbc: Any = True, *,
                 state: ModelState | None = None, stress: bool | None = None) -> dict[str, Any]:
        """Energy, forces, stress and atomic energies of one geometry, in global atom order.

        Args:
            positions, numbers, cell, pbc: the structure (Å; cell rows are lattice vectors).
            state: a layout from `prepare`/`update` to reuse (default: built now); it must be this model's
                (as it is now), of this structure, with no atom past skin/2 (minimum image: re-wrapping is exact).
            stress: return the stress (default: when the spec's `stress_via_strain` is on).

        Returns:
            A dict with `energy` (eV), `forces` `(N, 3)` (eV/Å), `stress` `(3, 3)` (eV/Å³,
            ASE's sign: `(1/V) dE/dstrain`), `virial` (`-dE/dstrain`, eV) and the per-atom
            energies under the spec's `node_energy_key` (default "atomic_energies"). Outputs
            listed in the spec's `owned_only_outputs` come back as owned-storage
            `jax.Array`s instead of global numpy arrays.

        Raises:
            nvalchemi_jaxbridge.mlip.state_check.StaleStateError: `state` does not hold for the call (the
                message names what differs and the fix).
        """
        s = self.settings
        state, pos = state_for_call(self, state, positions, numbers, cell, pbc, where="DistributedMLIP.evaluate",
                                    prepare="model.prepare(positions, numbers, cell, pbc, previous=state)")
        want_stress = stress_wanted(s, stress, "DistributedMLIP.evaluate")
        pos_owned = state.cs.owned(pos.astype(self._np_dtype()), positions=True, check=False)
        energy, node_e, g_pos, g_strain = self.energy_and_gradients(state, pos_owned, strain=want_stress)
        out: dict[str, Any] = {"energy": float(energy)}
        forces = -g_pos
        out["forces"] = forces if "forces" in s.owned_only else state.cs.to_global(forces)
        out[s.node_energy_key] = node_e if s.node_energy_key in s.owned_only else state.cs.to_global(node_e)
        if want_stress:
            virial = -np.asarray(g_strain)
            volume = cell_volume(state.cell, "DistributedMLIP.evaluate")
            out["virial"] = virial
            out["stress"] = -virial / volume
        check_results("DistributedMLIP.evaluate", out, explain=lambda: explain(self, positions, numbers, cell, pbc))
        return out

    def _np_dtype(self) -> Any:
        return numpy_dtype(self.wrapper.dtype)

