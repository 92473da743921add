"""A HaloPlan's storage on the host: per-atom values to and from owned and halo storage, reference exchanges.

numpy only. These are the bodies of `HaloPlan.to_owned`, `to_halo`,
`from_owned`, `reference_forward` and `reference_reverse` (the methods keep the
docstrings); `plan` is any `HaloPlan`. The reference exchanges follow the
plan's tables row by row, so the lower layer's collectives can be tested
against them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .inputs import real_positions

if TYPE_CHECKING:
    from .halo_plan import HaloPlan


def _check_global(plan: HaloPlan, x: np.ndarray, where: str, positions: bool) -> np.ndarray:
    """`x` as an array with `n_atoms` rows (and `(N, 3)` real floats when `positions`: TypeError otherwise)."""
    x = real_positions(f"HaloPlan.{where}(positions=True)", x) if positions else np.asarray(x)
    if x.ndim == 0 or x.shape[0] != plan.n_atoms:
        raise ValueError(f"HaloPlan.{where}: expected {plan.n_atoms} rows (one per atom), got shape {x.shape}.")
    if positions and x.shape[1:] != (3,):
        raise ValueError(
            f"HaloPlan.{where}(positions=True): expected float positions of shape ({plan.n_atoms}, 3), "
            f"got {x.dtype} {x.shape}."
        )
    return x


def _check_rows(plan: HaloPlan, x: np.ndarray, rows: int, where: str, storage: str) -> np.ndarray:
    """`x` reshaped to `(D, rows, ...)`, or a ValueError naming the expected shape."""
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[0] != plan.n_devices * rows:
        raise ValueError(
            f"HaloPlan.{where}: expected {storage} storage with D * {rows} = {plan.n_devices * rows} rows, "
            f"got shape {x.shape}."
        )
    return x.reshape(plan.n_devices, rows, *x.shape[1:])


def _layout(x: np.ndarray, ids: np.ndarray, offset: np.ndarray, positions: bool) -> np.ndarray:
    """Rows `x[ids]` (zero where `ids == -1`), plus `offset` for positions, flattened over devices."""
    valid = ids >= 0
    out = np.zeros(ids.shape + x.shape[1:], dtype=x.dtype)
    out[valid] = x[ids[valid]]
    if positions:
        out = out + offset.astype(x.dtype)
    return out.reshape(-1, *x.shape[1:])


def to_owned(plan: HaloPlan, x_global: np.ndarray, positions: bool) -> np.ndarray:
    """`HaloPlan.to_owned`: per-atom values in owned storage."""
    x = _check_global(plan, x_global, "to_owned", positions)
    return _layout(x, plan.owned_global, plan.owned_offset, positions)


def to_halo(plan: HaloPlan, x_global: np.ndarray, positions: bool) -> np.ndarray:
    """`HaloPlan.to_halo`: per-atom values in halo storage."""
    x = _check_global(plan, x_global, "to_halo", positions)
    return _layout(x, plan.halo_global, plan.halo_offset, positions)


def from_owned(plan: HaloPlan, x_owned: np.ndarray) -> np.ndarray:
    """`HaloPlan.from_owned`: owned storage back to global-id order."""
    x = _check_rows(plan, x_owned, plan.owned_capacity, "from_owned", "owned")
    out = np.zeros((plan.n_atoms, *x.shape[2:]), dtype=x.dtype)
    mask = plan.owned_mask
    out[plan.owned_global[mask]] = x[mask]
    return out


def reference_forward(plan: HaloPlan, x_owned: np.ndarray, positions: bool) -> np.ndarray:
    """`HaloPlan.reference_forward`: the forward halo exchange with the tables."""
    x = _check_rows(plan, x_owned, plan.owned_capacity, "reference_forward", "owned")
    d, oc, hr = plan.n_devices, plan.owned_capacity, plan.halo_rows
    feat = x.shape[2:]
    owned = np.zeros((d, oc + 1, *feat), dtype=x.dtype)  # row oc: zero, hit by padding send_idx
    owned[:, :oc][plan.owned_mask] = x[plan.owned_mask]
    halo = np.zeros((d, hr + 1, *feat), dtype=x.dtype)  # row hr: sink for padding recv_slot
    halo[:, :oc] = owned[:, :oc]
    ranks = np.arange(d)
    for k, send, slot in zip(plan.offsets, plan.send_idx, plan.recv_slot):
        message = owned[ranks[:, None], send]  # (D, cap, ...) built by each sender
        received = message[(ranks - k) % d]  # device r receives from r - k
        halo[ranks[:, None], slot] = received
    out = halo[:, :hr]
    if positions:
        out = out + plan.halo_offset.reshape(d, hr, *([1] * (len(feat) - 1)), 3).astype(x.dtype)
    return out.reshape(d * hr, *feat)


def reference_reverse(plan: HaloPlan, x_halo: np.ndarray) -> np.ndarray:
    """`HaloPlan.reference_reverse`: the reverse halo exchange (the transpose of forward)."""
    x = _check_rows(plan, x_halo, plan.halo_rows, "reference_reverse", "halo")
    d, oc, hr = plan.n_devices, plan.owned_capacity, plan.halo_rows
    feat = x.shape[2:]
    halo = np.zeros((d, hr + 1, *feat), dtype=x.dtype)
    halo[:, :hr] = x
    owned = np.zeros((d, oc + 1, *feat), dtype=x.dtype)
    owned[:, :oc][plan.owned_mask] = x[:, :oc][plan.owned_mask]
    ranks = np.arange(d)
    for k, send, slot in zip(plan.offsets, plan.send_idx, plan.recv_slot):
        message = halo[ranks[:, None], slot]  # gathered by each receiver
        returned = message[(ranks + k) % d]  # sender s gets it back from s + k
        np.add.at(owned, (ranks[:, None], send), returned)
    out = owned[:, :oc]
    out[~plan.owned_mask] = 0
    return out.reshape(d * oc, *feat)
