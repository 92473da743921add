"""Assembly of a HaloPlan from a Partition: row order, capacities, exchange tables (numpy only)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

import numpy as np

from .capacity import Growth, fitted, regrown
from .errors import HaloOverflowError
from .inputs import positive_int
from .partition import MAX_PLAN_ROWS, Partition

OnOverflow = Literal["replan", "raise"]
_INT32_MAX = np.iinfo(np.int32).max


def _readonly(a: np.ndarray) -> np.ndarray:
    """`a`, made read-only (plans are immutable)."""
    a.setflags(write=False)
    return a


def _parking(count: int, base: np.ndarray, spacing: float, side: int) -> np.ndarray:
    """`count` points of a cubic lattice with `side` points per edge, `spacing` apart, from `base`."""
    q = np.arange(count)
    return base + spacing * np.stack([q % side, (q // side) % side, q // (side * side)], axis=1)


def _pair_request(pair_capacities: int | Mapping[int, int] | None, n_devices: int) -> int | dict[int, int] | None:
    """Validated `pair_capacities` argument: None, one int, or `{offset: rows}`."""
    if pair_capacities is None:
        return None
    if isinstance(pair_capacities, Mapping):
        out = {}
        for k, v in pair_capacities.items():
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k < n_devices:
                raise ValueError(
                    f"HaloPlan.build: pair_capacities key {k!r} is not a rank offset in [0, {n_devices}); "
                    "keys are offsets k (device d sends to (d + k) % n_devices)."
                )
            out[int(k)] = positive_int("HaloPlan.build", f"pair_capacities[{k}]", v)
        return out
    return positive_int("HaloPlan.build", "pair_capacities", pair_capacities)


def _assemble(
    pos: np.ndarray,
    cell: np.ndarray,
    basis: np.ndarray,
    periodic: tuple[bool, bool, bool],
    grid: tuple[int, int, int],
    cutoff: float,
    skin: float,
    n_devices: int,
    headroom: float,
    part: Partition,
    owned_request: int | None,
    ghost_request: int | None,
    pair_request: int | dict[int, int] | None,
    on_overflow: OnOverflow,
    self_images: bool = True,
    grow: bool = False,
    grow_all: bool = False,
) -> dict:
    """Fields of a `HaloPlan` from a `Partition`: row order, capacities, tables, parking points.

    `self_images=False`: a rank's ghosts that are images of its own atoms are left out of its
    rows (and of the messages, where they are offset 0) and listed in `own_images` instead.
    Requested capacities that no longer fit grow (`capacity.regrown`), and with them every requested
    one that has used part of its headroom (`grow_all`: every requested one); `grow=True` grows them even
    when all fit.
    """
    n_atoms, d = len(pos), n_devices
    owner = part.owner
    n_owned = np.bincount(owner, minlength=d).astype(np.int64)
    by_rank = np.argsort(owner, kind="stable")  # owned rows: ascending global id
    starts = np.cumsum(n_owned) - n_owned
    local_index = np.empty(n_atoms, dtype=np.int64)
    local_index[by_rank] = np.arange(n_atoms) - starts[owner[by_rank]]

    ghosts, messages = [], {}  # messages[k][receiver] = (sender's owned rows, receiver's halo rows)
    own_images = []  # per rank: (m, 4) int64 (owned row, lattice shift) of the images of its own atoms left out
    for r in range(d):
        atom, image = part.ghost_atom[r], part.ghost_image[r]
        mine = owner[atom] == r
        if self_images or not mine.any():
            own_images.append(np.zeros((0, 4), dtype=np.int64))
        else:
            own = np.concatenate([local_index[atom[mine]][:, None], image[mine]], axis=1).astype(np.int64)
            own_images.append(_readonly(own[np.lexsort(own.T[::-1])]))
            atom, image = atom[~mine], image[~mine]
        src, row = owner[atom], local_index[atom]
        order = np.lexsort((image[:, 2], image[:, 1], image[:, 0], row, image.any(axis=1), src))
        atom, image, src, row = atom[order], image[order], src[order], row[order]
        ghosts.append((atom, image))
        cuts = np.flatnonzero(np.diff(src)) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(src)]):
            if hi > lo:
                k = int((r - src[lo]) % d)
                messages.setdefault(k, {})[r] = (row[lo:hi], n_owned[r] + np.arange(lo, hi))
    n_ghost = np.array([len(a) for a, _ in ghosts], dtype=np.int64)

    overflows: dict[str, tuple[int, int]] = {}
    max_owned, max_ghost = int(n_owned.max(initial=0)), int(n_ghost.max(initial=0))
    needed_pairs = {k: max(len(rows) for rows, _ in m.values()) for k, m in messages.items()}
    if isinstance(pair_request, dict):
        # Offsets of the requested mapping are kept; a new one is a new message (a capacity of 0 grown).
        offsets = sorted(set(pair_request) | set(needed_pairs))
        requested = {k: pair_request.get(k, 0) for k in offsets}
    else:
        offsets = sorted(needed_pairs)
        requested = {k: pair_request for k in offsets}
    # (name, requested, needed, chosen afresh): ghosts count the pad row
    wanted = [("owned_capacity", owned_request, max(max_owned, 1), max(fitted(max_owned, headroom), 1)),
              ("ghost_capacity", ghost_request, max_ghost + 1, fitted(max_ghost, headroom) + 1)]
    wanted += [(f"pair_capacities[{k}]", requested[k], needed_pairs.get(k, 0),
                max(fitted(needed_pairs.get(k, 0), headroom), 1)) for k in offsets]
    # A growth compiles the programs again anyway: every capacity that has used part of its headroom grows with it.
    together = grow or (on_overflow == "replan" and any(r is not None and r < n for _, r, n, _ in wanted))
    growth: list[Growth] = []
    chosen = []
    for name, req, need, fresh in wanted:
        cap = fresh if req is None else req
        if req is not None and req < need and on_overflow == "raise":
            overflows[name] = (need, req)
        elif req is not None and (req < need or (together and (grow_all or fresh > req))):
            cap = regrown(req, fresh)
            growth.append(Growth(name, req, cap, need))
        chosen.append(cap)
    oc, gc, caps = chosen[0], chosen[1], chosen[2:]
    if overflows:
        _raise_overflow(overflows, oc, gc, dict(zip(offsets, caps)), headroom, n_owned, n_ghost)
    hr = oc + gc
    if (total := d * (hr + sum(caps))) > MAX_PLAN_ROWS:
        raise ValueError(
            f"HaloPlan.build: owned_capacity={oc}, ghost_capacity={gc} and pair_capacities={caps} on {d} devices "
            f"make {total:.3g} table rows, above the limit MAX_PLAN_ROWS = {MAX_PLAN_ROWS}, though the system needs "
            f"only {max_owned} owned and {max_ghost} ghost rows per device; lower the fixed capacities or "
            f"headroom={headroom:g} (nothing was allocated)."
        )
    if hr > _INT32_MAX:
        raise ValueError(f"HaloPlan.build: halo_rows={hr} does not fit int32 row indices; use more devices.")

    owned_global = np.full((d, oc), -1, dtype=np.int64)
    halo_global = np.full((d, hr), -1, dtype=np.int64)
    halo_image = np.zeros((d, hr, 3), dtype=np.int64)
    for r in range(d):
        mine = by_rank[starts[r] : starts[r] + n_owned[r]]
        owned_global[r, : n_owned[r]] = mine
        halo_global[r, : n_owned[r]] = mine
        atom, image = ghosts[r]
        halo_global[r, n_owned[r] : n_owned[r] + len(atom)] = atom
        halo_image[r, n_owned[r] : n_owned[r] + len(atom)] = image

    send_idx, recv_slot = [], []
    for k, cap in zip(offsets, caps):
        send = np.full((d, cap), oc, dtype=np.int32)
        slot = np.full((d, cap), hr, dtype=np.int32)
        for r, (rows, slots) in messages.get(k, {}).items():
            send[(r - k) % d, : len(rows)] = rows
            slot[r, : len(slots)] = slots
        send_idx.append(_readonly(send))
        recv_slot.append(_readonly(slot))

    # Every real halo row is moved into the wrapped frame: its wrapped-frame image minus the atom's
    # unwrap frame (owned rows: image 0, so an atom outside the cell is shifted back into it).
    valid = halo_global >= 0
    shift = np.zeros((d, hr, 3))
    shift[valid] = (halo_image[valid] - part.frame[halo_global[valid]]) @ basis

    # Parking points: a cubic lattice beyond every atom and ghost, 4 * reach apart. The halo block's
    # lie beyond its wrapped-frame rows only (so they do not depend on the caller's images); owned
    # storage holds the caller's coordinates, so its parking lies beyond those too.
    reach = cutoff + skin
    real = pos[halo_global[valid]] + shift[valid] if n_atoms else np.zeros((1, 3))
    halo_base = real.max(axis=0) + 4.0 * reach
    owned_base = np.maximum(halo_base, pos.max(axis=0, initial=-np.inf) + 4.0 * reach)
    side = math.ceil(round(max(hr, oc) ** (1.0 / 3.0), 9))
    n_padded = n_owned + n_ghost
    halo_offset = shift
    owned_offset = np.zeros((d, oc, 3))
    for r in range(d):
        halo_offset[r, n_padded[r] :] = _parking(hr - n_padded[r], halo_base, 4.0 * reach, side)
        owned_offset[r, n_owned[r] :] = _parking(oc - n_owned[r], owned_base, 4.0 * reach, side)

    return dict(
        n_devices=d, n_atoms=n_atoms, cutoff=cutoff, skin=skin, cell=_readonly(cell.copy()), periodic=periodic,
        grid=grid, owned_capacity=oc, ghost_capacity=gc, offsets=tuple(int(k) for k in offsets),
        pair_capacities=tuple(int(c) for c in caps), n_owned=_readonly(n_owned.astype(np.int32)),
        n_ghost=_readonly(n_ghost.astype(np.int32)), owned_global=_readonly(owned_global),
        halo_global=_readonly(halo_global), send_idx=tuple(send_idx), recv_slot=tuple(recv_slot),
        halo_offset=_readonly(halo_offset), owned_offset=_readonly(owned_offset),
        reference_positions=_readonly(pos.copy()), headroom=headroom, basis=_readonly(basis),
        halo_image=_readonly(halo_image), frame=_readonly(part.frame.copy()), grown=tuple(g.name for g in growth),
        growth=tuple(growth),
        self_images=self_images, own_images=tuple(own_images),
    )


def _raise_overflow(
    overflows: dict[str, tuple[int, int]],
    oc: int,
    gc: int,
    pairs: dict[int, int],
    headroom: float,
    n_owned: np.ndarray,
    n_ghost: np.ndarray,
) -> None:
    """Raise a `HaloOverflowError` that lists every short capacity and the arguments that fit."""
    parts, fix = [], {}
    for name, (needed, reserved) in overflows.items():
        if name == "owned_capacity":
            why = f"rank {int(np.argmax(n_owned))} owns {needed} atoms"
            fix["owned_capacity"] = fitted(needed, headroom)
        elif name == "ghost_capacity":
            why = f"rank {int(np.argmax(n_ghost))} has {needed - 1} ghosts + 1 pad row"
            fix["ghost_capacity"] = fitted(needed - 1, headroom) + 1
        else:
            k = int(name[name.index("[") + 1 : -1])
            why = f"a rank sends {needed} rows at offset {k}"
            pairs[k] = fitted(needed, headroom)
            fix["pair_capacities"] = dict(pairs)
        parts.append(f"{name} needs {needed} ({why}) but the plan reserves {reserved}")
    args = ", ".join(f"{k}={v}" for k, v in fix.items())
    raise HaloOverflowError(
        "HaloPlan overflow: " + "; ".join(parts) + f". Fix: HaloPlan.build(..., {args}), or a larger headroom, "
        "or on_overflow='replan' to grow capacities automatically (compiled programs are rebuilt).",
        overflows,
    )
