"""Is a model-level state still the layout of this call? One comparison every front door makes.

A state (`ModelState`, `TorchState`, `MLIAPTorchState`) is the layout of one
structure for one model. It holds for a call when

- it was made by this driver, for the model as it is now (`Fingerprint`: the
  cutoff, layer count and dtype are read from the wrapper at every call, so a
  model changed after `prepare` is seen);
- the call's atom count, atomic numbers, cell and periodicity are the state's;
- no atom is more than `skin / 2` from the position the layout was built for,
  by minimum image: an atom moved by a lattice vector (ASE's `wrap()`) is the
  same point, and is put back at the layout's image (exact; no re-plan).

`evaluate(..., state=s)` raises `StaleStateError` naming the field that differs and
the fix; `update(state, positions)` re-plans instead (that is what it is for); the
engines (ASE calculator, `Engine`) re-plan by themselves.

The model's weights are not part of the fingerprint: the layout does not depend on
them, and the stage ops read them at every call.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np

from ..layout.displacement import moved_atoms, moved_text, to_plan_image
from ..layout.finite import check_structure

_TOKENS = itertools.count(1)

#: Relative tolerance on the cell: a cell that differs by more (per entry, relative to its largest
#: lattice vector) is another cell.
CELL_RTOL = 1e-12


class StaleStateError(ValueError):
    """A state passed to a model does not hold for the call (another structure, model, or moved atoms)."""


def new_token() -> int:
    """A number naming one driver object (states remember which driver made them)."""
    return next(_TOKENS)


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """What a layout depends on besides the structure: the driver, and the model as it was at `prepare`.

    Attributes:
        driver: the token of the driver that made the state (`new_token`).
        cutoff: the wrapper's (or ML-IAP object's) cutoff, Å.
        n_layers: the wrapper's interaction layers (None for an ML-IAP object).
        dtype: the wrapper's floating dtype, as text.
        exchange, skin: the driver's exchange and skin.
    """

    driver: int
    cutoff: float
    n_layers: int | None
    dtype: str
    exchange: str
    skin: float

    def differs(self, other: Fingerprint) -> list[tuple[str, Any, Any]]:
        """`(field, mine, other's)` for every field that differs."""
        return [(f.name, getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]


def wrapper_fingerprint(driver: int, wrapper: Any, exchange: str, skin: float) -> Fingerprint:
    """The fingerprint of a `MessagePassingWrapper` now (its cutoff, n_layers and dtype read live)."""
    return Fingerprint(driver, float(wrapper.cutoff), int(wrapper.n_layers), str(wrapper.dtype), exchange,
                       float(skin))


def mliap_fingerprint(driver: int, obj: Any, exchange: str, skin: float) -> Fingerprint:
    """The fingerprint of an ML-IAP unified object now: its cutoff `2 * rcutfac`, read live."""
    return Fingerprint(driver, 2.0 * float(obj.rcutfac), None, "torch.float64", exchange, float(skin))


def fingerprint_change(state: Any, now: Fingerprint) -> str | None:
    """A sentence naming what of `now` differs from the state's fingerprint, or None if nothing does."""
    mine = getattr(state, "fingerprint", None)
    if mine is None:
        return "the state records no model (it was not made by prepare / update of a model driver)"
    diff = mine.differs(now)
    if not diff:
        return None
    if diff[0][0] == "driver":
        return "the state was made by another model driver object (each driver plans for its own model and mesh)"
    return "; ".join(f"{name} was {old!r} when the state was made, now {new!r}" for name, old, new in diff)


def structure_change(state: Any, positions: Any, numbers: Any, cell: Any, pbc: Any) -> str | None:
    """A sentence naming how the call's structure differs from the state's (atom count, numbers, cell, pbc)."""
    pos = np.asarray(positions)
    n = state.plan.n_atoms
    if pos.ndim != 2 or pos.shape != (n, 3):
        return f"positions have shape {pos.shape}, the state is for ({n}, 3) (another atom count)"
    z = np.asarray(numbers).reshape(-1)
    if z.shape != (n,):
        return f"{z.size} atomic numbers given, the state is for {n} atoms"
    if (diff := np.flatnonzero(z != np.asarray(state.numbers).reshape(-1))).size:
        shown = ", ".join(f"{int(i)}: {state.numbers[i]} -> {z[i]}" for i in diff[:5])
        return f"atomic numbers differ at {diff.size} atom(s) (atom: state's -> given: {shown})"
    periodic = tuple(bool(p) for p in np.broadcast_to(np.asarray(pbc, dtype=bool), (3,)))
    if periodic != tuple(state.periodic):
        return f"pbc is {periodic}, the state's is {tuple(state.periodic)}"
    c = np.asarray(cell, dtype=np.float64).reshape(3, 3)
    ref = np.asarray(state.cell, dtype=np.float64)
    if not np.all(np.abs(c - ref) <= CELL_RTOL * max(float(np.abs(ref).max()), 1.0)):
        return f"the cell differs from the state's by up to {float(np.nanmax(np.abs(c - ref))):.3g} Å"
    return None


def checked_call(state: Any, now: Fingerprint, positions: Any, numbers: Any, cell: Any, pbc: Any, *,
                 where: str, prepare: str, update: str) -> np.ndarray:
    """The call's positions at the state's periodic images, after checking the state holds for the call.

    Args:
        state: the state passed in.
        now: the driver's fingerprint now.
        positions, numbers, cell, pbc: the call's structure.
        where: the caller (e.g. "DistributedMLIP.evaluate").
        prepare, update: the calls that make a state for this structure, and re-plan one for moved atoms.

    Raises:
        StaleStateError: the state is of another model or structure, or an atom moved more than
            skin/2 from the layout's positions; the message names which and the fix.
    """
    if (why := fingerprint_change(state, now)) is not None:
        raise StaleStateError(f"{where}(state=...): the state does not hold for this model: {why}; "
                              f"make a new one: state = {prepare}.")
    if (why := structure_change(state, positions, numbers, cell, pbc)) is not None:
        raise StaleStateError(f"{where}(state=...): the state is for another structure: {why}; make one for "
                              f"this structure: state = {prepare}.")
    bad, norm = moved_atoms(state.plan, np.asarray(positions))
    pos = np.asarray(positions, dtype=np.float64)
    if len(bad):
        raise StaleStateError(f"{where}(state=...): {moved_text(state.plan, bad, norm)}; the layout may miss "
                              f"pairs. Re-plan first: state = {update}.")
    return to_plan_image(state.plan, pos)


def require_current(state: Any, now: Fingerprint, where: str, fix: str) -> None:
    """Raise `StaleStateError` unless `state` was made by the driver of `now`, for the model as it is now.

    For the pure programs (`energy_fn`), which take no structure to compare: checked when traced.
    """
    if (why := fingerprint_change(state, now)) is not None:
        raise StaleStateError(f"{where}: the state does not hold for this model: {why}; re-plan it: {fix}.")


def needs_replan(state: Any, now: Fingerprint, positions: Any) -> bool:
    """Whether `update` must re-plan: another fingerprint, or an atom beyond skin/2 (minimum image)."""
    if fingerprint_change(state, now) is not None:
        return True
    pos = np.asarray(positions)
    if pos.shape != (state.plan.n_atoms, 3):
        raise StaleStateError(f"update: positions have shape {pos.shape}, the state is for ({state.plan.n_atoms}, 3); "
                              "another atom count needs a new state: state = model.prepare(positions, numbers, cell, "
                              "pbc).")
    return bool(len(moved_atoms(state.plan, pos)[0]))


def is_current(potential: Any, state: Any) -> bool:
    """Whether `state` was made by `potential` as it is now (a potential without fingerprints: always)."""
    fp = getattr(potential, "fingerprint", None)
    return fp is None or fingerprint_change(state, fp()) is None


def state_for_call(door: Any, state: Any, positions: Any, numbers: Any, cell: Any, pbc: Any, *, where: str,
                   prepare: str = "model.prepare(positions, numbers, cell, pbc)") -> tuple[Any, np.ndarray]:
    """`(state, positions)` for one evaluation of a model door (`prepare`, `_sync`, `_fingerprint`).

    Inputs finite (also with a state, where `prepare` is skipped); no state: a fresh one; a state:
    the door follows a changed model first, then `checked_call` (positions at the state's images).
    """
    check_structure(where, positions, cell)
    if state is None:
        return door.prepare(positions, numbers, cell, pbc), np.asarray(positions, dtype=np.float64)
    door._sync()
    return state, checked_call(state, door._fingerprint, positions, numbers, cell, pbc, where=where,
                               prepare=prepare, update="model.update(state, positions)")
