"""Where given positions stand against a plan's: minimum-image displacement and periodic images (numpy).

A plan holds while every atom is within `skin / 2` of the position it was built
for. An atom moved by a lattice vector (ASE's `wrap()`, a wrapping shift function)
is the same point of the periodic system, not a displacement: it is counted by
its minimum image, and `to_plan_image` puts it back at the image the plan was
built for, which gives exactly the same energies, forces and stress (only
relative positions, and lattice shifts that strain with the cell, enter).

The minimum image is taken in fractional coordinates: a lattice shift gives a
displacement of zero, and a real move is never under-counted (what is reported
is a lattice image of the move, never shorter than its minimum image), so a plan
that holds by this test holds for the positions given.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: How many moved atoms a stale-layout message lists by id.
LISTED = 5


class StaleLayoutError(ValueError):
    """Positions moved more than `skin / 2` from the plan's (minimum image): the plan may miss pairs."""


def displacement(plan: Any, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(N, 3)` minimum-image displacements from `plan.reference_positions` and `(N, 3)` lattice jumps.

    `positions` is `(N, 3)` float; jumps are integers (as floats) on the plan's periodic axes, 0 elsewhere,
    such that `positions - jumps @ plan.basis = reference + displacement`.
    """
    pos = np.asarray(positions, dtype=np.float64)
    frac = (pos - plan.reference_positions) @ np.linalg.inv(plan.basis)
    jump = np.round(frac)
    jump[:, ~np.asarray(plan.periodic)] = 0.0
    jump[~np.isfinite(jump)] = 0.0  # a non-finite position shows as a non-finite displacement
    return (frac - jump) @ plan.basis, jump


def to_plan_image(plan: Any, positions: np.ndarray) -> np.ndarray:
    """`positions` with every atom moved by whole lattice vectors to the image nearest its plan position.

    Float64 `(N, 3)`; atoms already at the plan's image are returned unchanged (bit for bit).
    """
    pos = np.asarray(positions, dtype=np.float64)
    _, jump = displacement(plan, pos)
    if not jump.any():
        return pos
    return pos - jump @ plan.basis


def rounding(plan: Any, positions: Any) -> float:
    """How far (Å) rounding the plan's positions to the dtype of `positions` may move them (0 for float64 and up).

    Positions handed over in float32 differ from the plan's float64 ones by that much without having moved.
    """
    dtype = getattr(positions, "dtype", np.dtype(np.float64))
    eps = np.finfo(dtype).eps if np.issubdtype(dtype, np.floating) and np.dtype(dtype).itemsize < 8 else 0.0
    scale = float(np.abs(plan.reference_positions).max(initial=0.0)) + float(np.abs(plan.basis).sum())
    return 4.0 * float(eps) * scale


def moved_atoms(plan: Any, positions: Any) -> tuple[np.ndarray, np.ndarray]:
    """Ids of the atoms more than `skin / 2` from their plan position (minimum image; non-finite ones too),
    and every atom's displacement length `(N,)`. Rounding to the dtype of `positions` is no move."""
    return _moved(plan, positions, displacement(plan, positions)[0])


def _moved(plan: Any, positions: Any, disp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    norm = np.sqrt(np.einsum("ij,ij->i", disp, disp))
    return np.flatnonzero(~(norm <= plan.skin / 2 + rounding(plan, positions))), norm


def checked_positions(plan: Any, positions: Any, where: str, fix: str) -> np.ndarray:
    """`positions` at the plan's periodic images (`to_plan_image`), after checking the plan still holds.

    Args:
        plan: a `HaloPlan`.
        positions: `(N, 3)` float positions of the plan's atoms.
        where: the caller, for the message.
        fix: how the caller re-plans (e.g. "cs = cs.rebuild(positions)").

    Raises:
        StaleLayoutError: an atom moved more than `skin / 2` from its plan position (minimum image), or
            a position is not finite; the message names the atoms, their displacement and `fix`.
    """
    pos = np.asarray(positions, dtype=np.float64)
    disp, jump = displacement(plan, pos)
    bad, norm = _moved(plan, positions, disp)
    if len(bad):
        raise StaleLayoutError(f"{where}: {moved_text(plan, bad, norm)}; the layout may miss pairs. Re-plan "
                               f"first: {fix}.")
    return pos - jump @ plan.basis if jump.any() else pos


def moved_text(plan: Any, bad: np.ndarray, norm: np.ndarray) -> str:
    """Which atoms (`bad`, their displacements `norm[bad]`) left the plan's skin, the farthest first."""
    worst = bad[np.argsort(-np.nan_to_num(norm[bad], nan=np.inf), kind="stable")][:LISTED]
    listed = ", ".join(f"{int(i)} ({norm[i]:.4g} Å)" for i in worst)
    more = f" and {len(bad) - len(worst)} more" if len(bad) > len(worst) else ""
    return (
        f"{len(bad)} atom(s) moved more than skin/2 = {plan.skin / 2:g} Å from the positions the layout was built "
        f"for (minimum image, so wrapping by a lattice vector does not count; a non-finite position does): "
        f"atoms {listed}{more}"
    )
