"""Checks of what callers hand the layout layer: scalar arguments, positions and their coordinates (numpy only).

Every check runs before a plan allocates anything, and its error names the
argument (or atom), what was wrong and the fix. The rules:

- a number (`cutoff`, `skin`, `headroom`) is a real Python or numpy scalar, not
  a bool or a string (TypeError), and finite in its range (ValueError);
- a count (`n_devices`, capacities) is an int, not a bool (TypeError), >= 1 (ValueError);
- positions are real floating point (TypeError otherwise): integer positions
  would have their periodic image shifts truncated, complex ones lose their
  imaginary part. The fix is an explicit `positions.astype(np.float64)`;
- every coordinate is finite, and small enough that float64 resolves it
  finely against `cutoff + skin` (`coordinate_limit`): a coordinate of 1e22 is
  a units or wrapping mistake, not a position.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

# A coordinate may be at most this many times `cutoff + skin`: there float64 still spaces
# values 2**-20 (about 1e-6) of `cutoff + skin` apart.
COORDINATE_REACHES = 2.0**32


def real_number(where: str, name: str, value: Any, *, positive: bool) -> float:
    """`value` as a finite float (> 0 if `positive`, else >= 0); TypeError for a non-number, ValueError out of range."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    kind = getattr(getattr(value, "dtype", None), "kind", "")
    if not ok and getattr(value, "ndim", None) == 0 and kind in ("i", "u", "f"):
        ok = True  # a 0-d numpy (or jax) array of a real dtype
    if not ok:
        raise TypeError(
            f"{where}: {name} must be a real number (int or float), got {type(value).__name__} {value!r:.60}; "
            f"pass a float, e.g. {name}=float(...)."
        )
    value = float(value)
    if not (np.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise ValueError(f"{where}: {name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}.")
    return value


def headroom(where: str, value: Any) -> float:
    """`value` as a relative headroom >= 1.0 (TypeError for a non-number, ValueError below 1)."""
    h = real_number(where, "headroom", value, positive=True)
    if h < 1.0:
        raise ValueError(f"{where}: headroom must be >= 1.0 (1.2 = 20% spare rows), got {value!r}.")
    return h


def positive_int(where: str, name: str, value: Any) -> int:
    """`value` as an int >= 1; TypeError for a non-int (a bool or float included), ValueError below 1."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: {name} must be an int >= 1, got {type(value).__name__} {value!r:.60}.")
    if value < 1:
        raise ValueError(f"{where}: {name} must be an int >= 1, got {value!r}.")
    return int(value)


def real_positions(where: str, positions: Any, name: str = "positions") -> np.ndarray:
    """`positions` as a numpy array, refused (TypeError) unless its dtype is real floating point."""
    x = np.asarray(positions)
    if not np.issubdtype(x.dtype, np.floating):
        if np.issubdtype(x.dtype, np.complexfloating):
            why = "a complex array would lose its imaginary part"
        elif x.dtype.kind in "iub":
            why = "integer or bool positions would have their periodic image shifts truncated"
        else:
            why = "positions are Cartesian coordinates"
        raise TypeError(
            f"{where}: {name} must be real floating point, got dtype {x.dtype}; {why}. "
            f"Convert explicitly: {name}.astype(np.float64) (or np.float32)."
        )
    return x


def coordinate_limit(reach: float) -> float:
    """Largest coordinate magnitude a plan takes for `reach = cutoff + skin`: `COORDINATE_REACHES * reach`."""
    return COORDINATE_REACHES * reach


def check_coordinates(where: str, positions: np.ndarray, reach: float) -> None:
    """Raise (ValueError) at the first atom with a non-finite or absurdly large coordinate, naming it."""
    finite = np.isfinite(positions)
    if not finite.all():
        bad = np.flatnonzero(~finite.all(axis=1))[:5].tolist()
        raise ValueError(f"{where}: positions of atoms {bad} are not finite; fix them before planning.")
    limit = coordinate_limit(reach)
    big = np.abs(positions) > limit
    if big.any():
        atom, axis = (int(i) for i in np.argwhere(big)[0])
        value = float(positions[atom, axis])
        raise ValueError(
            f"{where}: atom {atom} has coordinate {value:.6g} (positions[{atom}, {axis}]), more than "
            f"{COORDINATE_REACHES:.3g} x (cutoff + skin = {reach:g}) from the origin, where float64 spaces values "
            f"{float(np.spacing(abs(value))):.3g} apart ({int(big.any(axis=1).sum())} atom(s) in all). "
            "Wrap positions into the cell, or check their units, before planning."
        )
