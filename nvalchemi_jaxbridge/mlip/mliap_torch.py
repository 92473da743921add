"""An ML-IAP unified model on the PyTorch front door: one process per device, as LAMMPS runs it.

Each rank hands its block to the model's own `compute_forces(data)` (`mliap_data.BlockData`):
owned atoms, then ghost rows for every other atom within the cutoff + skin
(periodic images of its own atoms included), and every pair whose `i` is owned.
The model asks for its exchanges itself; `forward_exchange` is the front door's
halo refresh and `reverse_exchange` its adjoint (ghost rows summed into their
owners), both collectives over the ranks. A rank whose model returns early (no
owned atoms, `npairs <= 1`) then takes part in the exchanges the others still
make, with zero rows, following the model's schedule (learned once, the ranks
agreeing on it), so no rank waits forever.

Results from what the model wrote: energy = sum over ranks of `data.energy`;
forces from the pair forces (`f[i] += fij`, `f[j] -= fij`, ghost rows folded
into their owners); virial `-sum rij (x) fij` over each rank's pairs, summed;
per-atom energies from `eatoms`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from ..layout import HaloPlan
from ..layout.structure import checked_structure
from ..lower.finite import check_results
from ..torch import functions as F
from ..torch.agreement import check_same_structure, layout_key
from .edges import EdgePlan
from .guards import explain
from .mliap import ExchangeStep, MLIAPModel, check_schedule, identity_exchange
from .mliap_data import BlockData, MLIAPError, pair_virial, row_forces
from .mliap_kokkos import block_data
from .specs import cell_volume
from .state_check import fingerprint_change, mliap_fingerprint, needs_replan, new_token, state_for_call

_DTYPES = {1: torch.float32, 2: torch.float64, 3: torch.float16, 4: torch.bfloat16}
_MAX_STEPS = 64


@dataclasses.dataclass(frozen=True, eq=False)
class MLIAPTorchState:
    """This job's layout for one structure: plan, block edges, type indices, cell."""

    plan: HaloPlan
    edges: EdgePlan
    elems: np.ndarray
    numbers: np.ndarray
    cell: np.ndarray
    periodic: tuple[bool, bool, bool]
    fingerprint: Any = None  # state_check.Fingerprint: the driver and the object as they were at prepare


def layout(model: MLIAPModel, positions: Any, numbers: Any, cell: Any, pbc: Any, *, n_devices: int, skin: float,
           headroom: float) -> tuple[HaloPlan, EdgePlan, np.ndarray, np.ndarray, np.ndarray, tuple[bool, ...]]:
    """LAMMPS' layout: ghosts within cutoff + skin (own periodic images too), pairs into owned atoms."""
    pos, numbers, cell, periodic = checked_structure(positions, numbers, cell, pbc, model.name)
    elems = model.type_indices(numbers)
    plan = HaloPlan.build(pos, cell, periodic=periodic, cutoff=model.cutoff, skin=skin, n_devices=n_devices,
                          headroom=headroom, self_images=True)
    edges = EdgePlan.build(plan, pos, cutoff=model.cutoff, receivers="owned", headroom=headroom)
    return plan, edges, elems, numbers, cell, periodic


def torch_device(ctx: Any) -> torch.device:
    """The torch device of this rank's JAX device."""
    dev = ctx.device
    return torch.device("cuda", dev.local_hardware_id) if dev.platform == "gpu" else torch.device("cpu")


class TorchMLIAP:
    """An ML-IAP unified model object on the PyTorch front door (call on every rank together).

    Made by `TorchDistributedMLIP(obj)`; `evaluate` returns what `TorchDistributedMLIP.evaluate`
    returns (energy, forces, stress, virial, atomic energies, owned ids).
    """

    def __init__(self, obj: Any, *, exchange: str = "per_layer", skin: float = 0.5, headroom: float = 1.2,
                 device: Any = None) -> None:
        if device is not None:
            raise ValueError(
                f"TorchDistributedMLIP: device={device!r}, but an ML-IAP model places itself (its data is on the "
                "rank's device, which initialize() chose); leave device out."
            )
        if exchange != "per_layer":
            raise ValueError(
                f"TorchDistributedMLIP: exchange={exchange!r}, but an ML-IAP model asks for its own exchanges "
                "between its layers (forward_exchange / reverse_exchange); leave exchange='per_layer'."
            )
        if not skin >= 0:
            raise ValueError(f"TorchDistributedMLIP: skin must be >= 0 Å, got {skin!r}.")
        self.obj, self._token = obj, new_token()
        self.exchange, self.skin, self.headroom = exchange, float(skin), float(headroom)
        self._fit()

    def _fit(self) -> None:
        """The object's reading (cutoff, species; schedule learned again) as it is now."""
        self.model = MLIAPModel(self.obj)
        self.name = self.model.name
        self.cutoff = self.model.cutoff
        self._fingerprint = self.fingerprint()

    def fingerprint(self) -> Any:
        """What a layout depends on, read from the object now (its cutoff `2 * rcutfac`)."""
        return mliap_fingerprint(self._token, self.obj, self.exchange, self.skin)

    def _sync(self) -> None:
        """Follow an object whose cutoff changed since the last call; older states no longer hold."""
        if self.fingerprint() != self._fingerprint:
            self._fit()

    # ------------------------------------------------------------------ layout

    def prepare(self, positions: Any, numbers: Any, cell: Any, pbc: Any = True) -> MLIAPTorchState:
        """The layout (the same on every rank)."""
        self._sync()
        plan, edges, elems, numbers, cell, periodic = layout(
            self.model, positions, numbers, cell, pbc, n_devices=F.front_door_mesh().devices.size, skin=self.skin,
            headroom=self.headroom)
        return MLIAPTorchState(plan, edges, elems, numbers, cell, periodic, self._fingerprint)

    def update(self, state: MLIAPTorchState, positions: Any) -> MLIAPTorchState:
        """`state` if it still holds for `positions` (re-wrapping is no move), else a re-planned layout."""
        self._sync()
        if fingerprint_change(state, self._fingerprint) is not None:
            return self.prepare(positions, state.numbers, state.cell, state.periodic)
        pos = np.asarray(positions, dtype=np.float64)
        if not needs_replan(state, self._fingerprint, pos):
            return state
        plan = state.plan.rebuild(pos)
        return dataclasses.replace(state, plan=plan, edges=state.edges.rebuild(plan, pos))

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, positions: Any, numbers: Any, cell: Any, pbc: Any = True, *,
                 state: MLIAPTorchState | None = None, stress: bool | None = None) -> dict[str, Any]:
        """Energy, forces, stress (when the cell has volume) and atomic energies, on every rank.

        Raises:
            nvalchemi_jaxbridge.torch.agreement.RankMismatchError: the ranks passed different structures
                (or states), named with what differs.
        """
        check_same_structure(positions, numbers, cell, pbc, caller="TorchDistributedMLIP.evaluate",
                             layout=None if state is None else layout_key(state.plan, state.edges))
        state, pos = state_for_call(self, state, positions, numbers, cell, pbc, where="TorchDistributedMLIP.evaluate")
        ctx = F.context_for(state.plan)
        data = self._block(ctx, state, pos)
        if self.model.schedule is None:
            self.model.schedule = self._agree(ctx, self.model.probe_schedule(self._block(ctx, state, pos, probe=True)))
        self.model.compute(data)
        check_schedule(self.name, data.exchanges, self.model.schedule)
        for step in self.model.schedule[len(data.exchanges):]:  # the model returned early: join the others
            self._exchange(ctx)(step.kind, torch.zeros((data.ntotal, step.width), dtype=step.dtype,
                                                       device=data.fij.device))
        data.check_energy_written()
        f_rows = row_forces(data)
        owned = F.gather_inputs_step(ctx, (ctx.n_owned, 3), np.float64, positions=False).backward(f_rows)
        total = self._sum(ctx, torch.tensor([data.energy], dtype=torch.float64, device=f_rows.device))
        virial = self._sum(ctx, pair_virial(data).reshape(1, 9)).reshape(3, 3)
        out: dict[str, Any] = {"energy": float(total[0])}
        out["forces"] = F.gather_owned(ctx, owned.contiguous()).cpu().numpy()
        out["atomic_energies"] = F.gather_owned(ctx, data.eatoms_tensor.contiguous()).cpu().numpy()
        out["owned_ids"] = ctx.owned_ids()
        want_stress = stress if stress is not None else bool(np.linalg.det(state.cell)) and all(state.periodic)
        if want_stress:
            out["virial"] = virial.cpu().numpy()
            out["stress"] = -out["virial"] / cell_volume(state.cell, "TorchDistributedMLIP.evaluate")
        check_results("TorchDistributedMLIP.evaluate", out, explain=lambda: explain(self, pos, numbers, cell, pbc))
        return out

    def _block(self, ctx: Any, state: MLIAPTorchState, pos: np.ndarray, *, probe: bool = False) -> BlockData:
        """This rank's `BlockData`: positions refreshed through the halo, pairs within the cutoff."""
        rank, n_own, n_real = ctx.rank, ctx.n_owned, ctx.n_owned + ctx.n_ghost
        device = torch_device(ctx)
        pos_owned = torch.as_tensor(pos[ctx.owned_ids()], dtype=torch.float64, device=device)
        with torch.no_grad():
            pos_h = F.halo_from_owned(ctx, pos_owned, positions=True)
        e = state.edges
        pairs = torch.as_tensor(e.edges[rank, : int(e.n_edges[rank])].astype(np.int64), device=device)
        i_t, j_t = pairs[:, 1], pairs[:, 0]  # receiver (owned) and sender
        rij = pos_h[j_t] - pos_h[i_t]
        keep = (rij * rij).sum(1) < self.cutoff**2
        elems = torch.as_tensor(state.elems[state.plan.halo_global[rank, :n_real]], device=device)
        exchange = identity_exchange if probe else self._exchange(ctx)
        return block_data(rij[keep], i_t[keep], j_t[keep], elems, n_own, exchange=exchange, model=self.name)

    def _exchange(self, ctx: Any) -> Any:
        def exchange(kind: str, src: torch.Tensor) -> torch.Tensor:
            n_own = ctx.n_owned
            dtype = F._jax_dtype(src)
            if kind == "forward":
                return F.gather_inputs_step(ctx, (n_own, src.shape[1]), dtype, positions=False).forward(
                    src[:n_own].contiguous())
            owned = F.gather_inputs_step(ctx, (n_own, src.shape[1]), dtype, positions=False).backward(
                src.contiguous())
            return torch.cat([owned, owned.new_zeros((src.shape[0] - n_own, src.shape[1]))])

        return exchange

    def _agree(self, ctx: Any, mine: tuple[ExchangeStep, ...]) -> tuple[ExchangeStep, ...]:
        """The one schedule of every rank whose model made exchanges (they must agree); ranks without take it."""
        if len(mine) > _MAX_STEPS:
            raise MLIAPError(f"{self.name}: {len(mine)} exchanges in one compute_forces; at most {_MAX_STEPS}.")
        codes = {v: k for k, v in _DTYPES.items()}
        vec = torch.zeros(2 + 3 * _MAX_STEPS, dtype=torch.float64)
        if mine:
            vec[0], vec[1] = 1.0, len(mine)
            for k, s in enumerate(mine):
                vec[2 + 3 * k: 5 + 3 * k] = torch.tensor([KIND_CODE[s.kind], s.width, codes[s.dtype]])
        total = self._sum(ctx, vec.reshape(1, -1)).reshape(-1)
        squares = self._sum(ctx, (vec * vec).reshape(1, -1)).reshape(-1)
        count = float(total[0])
        if count == 0:
            return ()
        mean = total / count
        if not torch.allclose(squares * count, total * total, rtol=0, atol=1e-6):
            raise MLIAPError(
                f"{self.name}: the ranks' models made different exchanges on their first evaluation; every "
                "rank must make the same forward_exchange / reverse_exchange calls in the same order."
            )
        kinds = {v: k for k, v in KIND_CODE.items()}
        return tuple(ExchangeStep(kinds[int(mean[2 + 3 * k])], int(mean[3 + 3 * k]), _DTYPES[int(mean[4 + 3 * k])])
                     for k in range(int(mean[1])))

    @staticmethod
    def _sum(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a per-rank `(1, F)` partial."""
        step = F.all_reduce_step(ctx, tuple(x.shape), F._jax_dtype(x), replicated_consumer=False)
        return step.forward(x.to(torch_device(ctx)))


KIND_CODE = {"forward": 1, "reverse": 2}
