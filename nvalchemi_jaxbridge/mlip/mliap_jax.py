"""An ML-IAP unified model on the JAX front door: one program, the model's own exchanges as collectives.

The model's `compute_forces(data)` runs in a worker thread per device. Each time it
calls `forward_exchange` or `reverse_exchange` the worker stops there and hands its
`src` out; that is where one torch op of the program ends and the next begins
(`mliap_ops`). Between two ops the program moves the rows with XLA collectives (the
halo refresh, or its adjoint), and the next op hands the result to the waiting
worker as `dst`. So one evaluation is

    positions --halo (images)--> rij --op 0--> src_1 --refresh--> op 1 --> ... --> eatoms, pair forces

with the ops cut along the model's exchange schedule, learned once by running the
model on one block (`MLIAPModel.probe_schedule`). A device whose model returns early
(no owned atoms, `npairs <= 1`) hands out zeros for the remaining exchanges.

Gradients: the model gives `fij = dE/drij` (the total energy: its backward ran through
the reverse exchanges), so the program's energy is
`psum(E_local) + psum(sum_p fij_p . (rij_p - stop_gradient(rij_p)))`, whose value is the
energy and whose gradient with respect to `rij` is `fij`; JAX carries that to the
positions (ghost rows folded into their owners by the halo's adjoint) and to the strain.
First derivatives only: the interface gives pair forces, not their derivatives.
"""

from __future__ import annotations

import copy
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..lower import collectives as C
from ..lower import compile as lower_compile
from ..lower import auto_mesh, make_mesh
from ..lower.finite import check_results
from ..lower.tables import place
from ..spec import DistributionSpec, HaloStoragePolicy
from .guards import explain
from .model_layout import ModelState
from .mliap import MLIAPModel, identity_exchange
from .mliap_data import BlockData
from .mliap_ops import SegmentOps
from .mliap_torch import layout
from .specs import cell_volume
from .state_check import fingerprint_change, mliap_fingerprint, needs_replan, new_token, require_current, state_for_call


def _refresh(x: jax.Array, t: Any, axis: str) -> jax.Array:
    """Ghost rows set to their owners' rows (a halo block in, a halo block out)."""
    return C.halo_forward(C.slice_owned(x, t), t, axis)


def _reverse(x: jax.Array, t: Any, axis: str) -> jax.Array:
    """The refresh's adjoint: owned rows plus their ghost copies' rows, ghost rows zero."""
    zero = jnp.zeros((t.owned_capacity,) + x.shape[1:], x.dtype)
    owned = jax.vjp(lambda o: C.halo_forward(o, t, axis), zero)[1](x)[0]
    return jnp.concatenate([owned, jnp.zeros((t.ghost_capacity,) + x.shape[1:], x.dtype)])


class JaxMLIAP:
    """An ML-IAP unified model object on the JAX front door (one process, all devices).

    Made by `DistributedMLIP(obj)`; the same methods as `DistributedMLIP` (`prepare`,
    `update`, `rebuild`, `needs_rebuild`, `energy_fn`, `energy_and_gradients`, `evaluate`),
    so the ASE calculator, `halo_energy_fn`, `nve` and `run` drive it alike.
    """

    def __init__(self, obj: Any, *, n_devices: int | None = None, mesh: Any = None, exchange: str = "per_layer",
                 skin: float = 0.5, headroom: float = 1.2, call_path: str = "auto") -> None:
        if exchange != "per_layer":
            raise ValueError(
                f"DistributedMLIP: exchange={exchange!r}, but an ML-IAP model asks for its own exchanges between "
                "its layers (forward_exchange / reverse_exchange); leave exchange='per_layer'."
            )
        if not skin >= 0:
            raise ValueError(f"DistributedMLIP: skin must be >= 0 Å, got {skin!r}.")
        if not jax.config.jax_enable_x64:
            raise ValueError(
                "DistributedMLIP: an ML-IAP model takes float64 pair vectors (as LAMMPS gives them), but JAX runs "
                "with 64-bit types off; call jax.config.update('jax_enable_x64', True) before building it."
            )
        self.obj, self._call_path, self._token = obj, call_path, new_token()
        self.exchange, self.skin, self.headroom = exchange, float(skin), float(headroom)
        self.mesh = auto_mesh(mesh) if mesh is not None else make_mesh(n_devices)
        self.np_dtype = np.dtype(np.float64)
        self._fit()

    def _fit(self) -> None:
        """The model's reading, ops, jitted programs and caches for the object as it is now."""
        self.model = MLIAPModel(self.obj)
        self.wrapper = self.model  # what reports and engines read: name, cutoff
        self.name, self.cutoff = self.model.name, self.model.cutoff
        self.ops = SegmentOps(self.model, call_path=self._call_path)
        self._value_and_grad = jax.jit(jax.value_and_grad(self.energy_fn, argnums=(1, 2), has_aux=True))
        self._value_and_forces = jax.jit(jax.value_and_grad(self.energy_fn, argnums=1, has_aux=True))
        self._programs: dict[Any, Any] = {}
        self._compiled: Any = None
        self._fingerprint = self.fingerprint()

    def fingerprint(self) -> Any:
        """What a layout depends on, read from the object now (its cutoff `2 * rcutfac`)."""
        return mliap_fingerprint(self._token, self.obj, self.exchange, self.skin)

    def _sync(self) -> None:
        """Follow an object whose cutoff changed since the last call (see `DistributedMLIP._sync`)."""
        if self.fingerprint() != self._fingerprint:
            self._fit()

    halo_depth = property(lambda self: self.cutoff)

    def _np_dtype(self) -> Any:
        """The dtype positions come in (float64: the interface's pair vectors are float64)."""
        return self.np_dtype

    def program(self, key: Any, build: Any) -> Any:
        """The program kept under `key` (see `DistributedMLIP.program`)."""
        if key not in self._programs:
            self._programs[key] = build()
        return self._programs[key]

    # ------------------------------------------------------------------ layout

    def prepare(self, positions: Any, numbers: Any, cell: Any, pbc: Any = True, *,
                previous: ModelState | None = None) -> ModelState:
        """The layout of one structure (LAMMPS': ghosts within cutoff + skin, own images as ghost rows)."""
        self._sync()
        plan, edges, elems, numbers, cell, periodic = layout(
            self.model, positions, numbers, cell, pbc, n_devices=int(self.mesh.devices.size), skin=self.skin,
            headroom=self.headroom)
        if self.model.schedule is None:
            self.model.schedule = self._probe(plan, edges, elems, np.asarray(positions, dtype=np.float64))
        return self._state(plan, edges, elems, numbers, cell, periodic)

    def _probe(self, plan: Any, edges: Any, elems: np.ndarray, pos: np.ndarray) -> Any:
        """The model's exchanges, from one run on the block of the device with the most owned atoms."""
        import torch

        d = int(np.argmax(plan.n_owned))
        n_own, n_real = int(plan.n_owned[d]), int(plan.n_owned[d] + plan.n_ghost[d])
        halo = plan.to_halo(pos, positions=True).reshape(plan.n_devices, plan.halo_rows, 3)[d, :n_real]
        pairs = edges.edges[d, : int(edges.n_edges[d])].astype(np.int64)
        rij = halo[pairs[:, 0]] - halo[pairs[:, 1]]
        keep = np.einsum("pk,pk->p", rij, rij) < self.cutoff**2
        data = BlockData(torch.as_tensor(rij[keep]), torch.as_tensor(pairs[keep, 1]),
                         torch.as_tensor(pairs[keep, 0]), torch.as_tensor(elems[plan.halo_global[d, :n_real]]),
                         n_own, exchange=identity_exchange, model=self.name)
        # On a copy: a model may settle its device on its first call (MACE does), and this block is on the CPU.
        return self.model.probe_schedule(data, copy.deepcopy(self.model.obj))

    def _state(self, plan: Any, edges: Any, elems: np.ndarray, numbers: np.ndarray, cell: np.ndarray,
               periodic: tuple[bool, bool, bool]) -> ModelState:
        if self._compiled is None:
            self._compiled = lower_compile(DistributionSpec(HaloStoragePolicy()), self.mesh, plan)
        cs = self._compiled.with_plan(plan)
        row = jax.sharding.NamedSharding(self.mesh, P(cs.axis))
        zero_shift = np.zeros((plan.n_devices * edges.edge_capacity, 3))
        return ModelState(plan, edges, cs, place(edges.edges.reshape(-1, 2), row), place(zero_shift, row),
                          place(edges.spare.reshape(-1), row), cs.owned(elems.reshape(-1, 1).astype(np.int32)),
                          numbers, cell, periodic, self._fingerprint)

    def needs_rebuild(self, state: ModelState, positions: Any) -> bool:
        """Whether `state` no longer holds: an atom beyond skin/2 (minimum image), or the model changed."""
        self._sync()
        return needs_replan(state, self._fingerprint, positions)

    def update(self, state: ModelState, positions: Any) -> ModelState:
        """`state` if it still holds for `positions`, else a rebuilt layout."""
        return self.rebuild(state, positions) if self.needs_rebuild(state, positions) else state

    def rebuild(self, state: ModelState, positions: Any) -> ModelState:
        """A new layout for `positions` with `state`'s capacities (grown where they no longer fit); a
        fresh one for a state of another model or of this one before it changed."""
        self._sync()
        if fingerprint_change(state, self._fingerprint) is not None:
            return self.prepare(positions, state.numbers, state.cell, state.periodic)
        pos = np.asarray(positions, dtype=np.float64)
        plan = state.plan.rebuild(pos)
        edges = state.edges.rebuild(plan, pos)
        elems = self.model.type_indices(state.numbers)
        return self._state(plan, edges, elems, state.numbers, state.cell, state.periodic)

    # ------------------------------------------------------------------ programs

    def energy_fn(self, state: ModelState, pos_owned: jax.Array, strain: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Energy (replicated) and owned per-atom energies (see `DistributedMLIP.energy_fn`)."""
        self._sync()
        require_current(state, self._fingerprint, "DistributedMLIP.energy_fn", "state = model.update(state, positions)")
        cs, rc2 = state.cs, self.cutoff**2
        axis = cs.axis
        rows, cap = cs.tables.halo_rows, state.edges.edge_capacity
        ops = self.ops.for_block(rows, cap)

        def body(t, edges, spare, elems, pos, eps):
            sym = ((eps + eps.T) / 2).astype(pos.dtype)
            pos_h = C.halo_forward(pos, t, axis, positions=True)
            pos_h = pos_h + pos_h @ sym
            types = C.halo_forward(elems, t, axis)[:, 0]
            rij = pos_h[edges[:, 0]] - pos_h[edges[:, 1]]  # x[j] - x[i]: j the sender, i the (owned) receiver
            r0 = jax.lax.stop_gradient(rij)
            keep = (edges[:, 0] != spare) & (jnp.sum(r0 * r0, axis=1) < rc2)
            meta = jnp.stack([jax.lax.axis_index(axis), t.n_owned[0], t.n_owned[0] + t.n_ghost[0]]).astype(jnp.int32)
            out = ops.first(meta, r0, edges, keep.astype(jnp.int32), types)
            for step, op in zip(self.model.schedule, ops.rest):
                x = out
                x = _refresh(x, t, axis) if step.kind == "forward" else _reverse(x, t, axis)
                out = op(meta, x)
            eatoms, fij, energy = out
            fij = jnp.where(keep[:, None], fij, 0.0)
            local = energy[0] + jnp.sum(fij * (rij - r0))  # value: energy; d/drij: fij
            return jax.lax.psum(local, axis), C.slice_owned(eatoms, t)

        smap = jax.shard_map(
            body, mesh=cs.mesh, in_specs=(cs.tables.specs(axis), P(axis), P(axis), P(axis), P(axis), P()),
            out_specs=(P(), P(axis)), check_vma=False)
        energy, node_e = smap(cs.tables, state.edge_table, state.spare, state.attrs, pos_owned, strain)
        return energy, jax.lax.stop_gradient(node_e)

    def energy_and_gradients(self, state: ModelState, pos_owned: jax.Array, *, strain: bool = True) -> tuple:
        """`(energy, node energies, dE/dpositions (owned storage), dE/dstrain (3, 3) or None)`."""
        zero = jnp.zeros((3, 3), pos_owned.dtype)
        if not strain:
            (energy, node_e), g_pos = self._value_and_forces(state, pos_owned, zero)
            return energy, node_e, g_pos, None
        (energy, node_e), (g_pos, g_strain) = self._value_and_grad(state, pos_owned, zero)
        return energy, node_e, g_pos, g_strain

    def evaluate(self, positions: Any, numbers: Any, cell: Any, pbc: Any = True, *,
                 state: ModelState | None = None, stress: bool | None = None) -> dict[str, Any]:
        """Energy, forces, stress (default: when every axis is periodic) and atomic energies, global order."""
        state, pos = state_for_call(self, state, positions, numbers, cell, pbc, where="DistributedMLIP.evaluate")
        want = all(state.periodic) if stress is None else bool(stress)
        pos_owned = state.cs.owned(pos, positions=True, check=False)
        energy, node_e, g_pos, g_strain = self.energy_and_gradients(state, pos_owned, strain=want)
        out: dict[str, Any] = {"energy": float(energy), "forces": state.cs.to_global(-g_pos),
                               "atomic_energies": state.cs.to_global(node_e)}
        if want:
            out["virial"] = -np.asarray(g_strain)
            out["stress"] = -out["virial"] / cell_volume(state.cell, "DistributedMLIP.evaluate")
        check_results("DistributedMLIP.evaluate", out, explain=lambda: explain(self, positions, numbers, cell, pbc))
        return out

