"""Finite inputs, checked explicitly at the front doors (numpy only).

A NaN coordinate does not stop a cutoff kernel: every comparison with NaN is False,
so the atom's pairs are dropped as "beyond the cutoff" and the energy stays finite.
So every front door checks what it is given with an explicit `np.isfinite(...).all()`
(never a maximum: `max` over an array sharded on several devices has been seen to
return 0.0 for an array holding a NaN) and refuses NaN or infinity with a
`NonFiniteError` naming the input, its first rows (atom ids) and the fix.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

SHOWN = 5
"""How many atom ids (rows) a message lists."""

FIX_POSITIONS = ("a NaN or inf coordinate usually comes from a step that blew up (a time step too large, atoms too "
                 "close) or from an unset array; fix or remove those atoms before the call")


class NonFiniteError(ValueError):
    """An input or a result holds NaN or infinity.

    Attributes:
        name: what held it (`positions`, `cell`, `masses`, `dt`, a model output, ...).
        rows: the first rows (atom ids, or step numbers) where it did, at most `SHOWN`.
    """

    def __init__(self, message: str, *, name: str = "", rows: tuple[int, ...] = ()):
        super().__init__(message)
        self.name = name
        self.rows = tuple(int(r) for r in rows)


def bad_rows(values: Any) -> np.ndarray:
    """Rows (first axis) of `values` holding a NaN or an infinity, ascending."""
    a = np.asarray(values)
    if a.dtype.kind not in "fc":
        return np.zeros(0, dtype=np.int64)
    ok = np.isfinite(a)
    if a.ndim == 0:
        return np.zeros(0 if bool(ok) else 1, dtype=np.int64)
    return np.flatnonzero(~ok.reshape(len(a), -1).all(axis=1))


def rows_text(rows: Any, total: int | None = None) -> str:
    """`[3, 17]` or `[3, 17, 20, 21, 40] (12 in all)`: the first `SHOWN` of `rows`."""
    rows = [int(r) for r in np.asarray(rows).reshape(-1)]
    n = len(rows) if total is None else total
    shown = str(rows[:SHOWN])
    return shown if n <= SHOWN else f"{shown} ({n} in all)"


def check_finite(where: str, name: str, values: Any, *, fix: str, what: str = "atoms",
                 ids: Any = None) -> None:
    """Raise `NonFiniteError` if `values` (rows on the first axis) hold NaN or infinity.

    Args:
        where: the caller, as the user called it (e.g. "JaxBridgeCalculator").
        name: the input's name (e.g. "positions").
        values: the array; integer and bool arrays always pass.
        fix: what the user should do, in words.
        what: what a row is ("atoms", "rows").
        ids: per row, the id to report (default: the row index).
    """
    rows = bad_rows(values)
    if rows.size == 0:
        return
    shown = rows if ids is None else np.asarray(ids).reshape(-1)[rows]
    a = np.asarray(values)
    if a.ndim == 0:
        raise NonFiniteError(f"{where}: {name} is {a.item()!r}, not a finite number; {fix}.", name=name)
    raise NonFiniteError(
        f"{where}: {name} of {what} {rows_text(shown, rows.size)} are not finite (NaN or inf); {fix}.",
        name=name, rows=tuple(shown[:SHOWN]),
    )


def check_structure(where: str, positions: Any, cell: Any = None, per_atom: Any = None) -> None:
    """Positions `(N, 3)`, the cell `(3, 3)` and per-atom float arrays (`{name: (N, ...)}`) all finite."""
    check_finite(where, "positions", positions, fix=FIX_POSITIONS)
    if cell is not None:
        c = np.asarray(cell)
        if c.dtype.kind in "fc" and not np.isfinite(c).all():
            bad = [tuple(int(i) for i in ij) for ij in np.argwhere(~np.isfinite(c.reshape(3, 3)))]
            raise NonFiniteError(
                f"{where}: cell entries {bad[:SHOWN]} (row = lattice vector, column = x, y, z) are not finite "
                "(NaN or inf); give every lattice vector finite components (a zero row for an open axis, with "
                "pbc False there).", name="cell", rows=tuple(r for r, _ in bad[:SHOWN]))
    for key, values in dict(per_atom or {}).items():
        check_finite(where, f"per-atom input {key!r}", values,
                     fix=f"give every atom a finite {key} (an unset array reads as NaN in some readers)")


def check_masses(where: str, masses: Any) -> None:
    """Masses (amu, one per atom) all finite and > 0; raises `NonFiniteError` (non-finite) or ValueError (<= 0)."""
    m = np.asarray(masses)
    if m.dtype.kind not in "fiu":
        raise TypeError(f"{where}: masses must be real numbers (amu), got dtype {m.dtype}; pass a float array.")
    check_finite(where, "masses", m.reshape(-1),
                 fix="give every atom a finite mass in amu (ase.Atoms.get_masses() gives the standard ones)")
    bad = np.flatnonzero(m.reshape(-1) <= 0)
    if bad.size:
        raise ValueError(
            f"{where}: masses of atoms {rows_text(bad)} are <= 0 (e.g. {float(m.reshape(-1)[bad[0]])!r} amu); a "
            "zero or negative mass divides the force by zero or reverses it, so positions become NaN within a "
            "step. Give every atom its mass in amu (> 0); to hold an atom still, constrain it instead."
        )


def check_time_step(where: str, dt: Any) -> float:
    """`dt` (fs) as a float, finite and > 0; raises `NonFiniteError` (NaN, inf) or ValueError (<= 0, not a number)."""
    try:
        value = float(dt)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: dt must be a number of fs, got {type(dt).__name__} {dt!r:.60}.") from None
    if not math.isfinite(value):
        raise NonFiniteError(f"{where}: dt is {value!r} fs, not a finite number; pass a time step such as dt=1.0 "
                             "(fs).", name="dt")
    if value <= 0:
        raise ValueError(f"{where}: dt must be > 0 fs, got {value!r}; pass a positive time step such as dt=1.0.")
    return value
