"""A structure as the layout layer takes it: positions, atomic numbers, cell and periodic flags, checked."""

from __future__ import annotations

from typing import Any

import numpy as np

from .finite import check_structure
from .inputs import real_positions


def checked_structure(positions: Any, numbers: Any, cell: Any, pbc: Any, where: str
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[bool, bool, bool]]:
    """Positions `(N, 3)` float64, numbers `(N,)`, cell `(3, 3)` float64 and three periodic flags.

    Raises:
        TypeError: positions are not real floating point (integer, bool or complex arrays are refused;
            convert with `positions.astype(np.float64)`).
        ValueError: positions are not `(N, 3)` with one atomic number each, or an axis is periodic
            with a zero lattice vector; `where` names the caller in the message.
    """
    pos = real_positions(where, positions).astype(np.float64)
    numbers = np.asarray(numbers).reshape(-1)
    if pos.ndim != 2 or pos.shape[1] != 3 or len(numbers) != len(pos):
        raise ValueError(
            f"{where}: positions must be (N, 3) with one atomic number each; got positions {pos.shape} and "
            f"{len(numbers)} numbers."
        )
    cell = np.asarray(cell, dtype=np.float64).reshape(3, 3)
    check_structure(where, pos, cell)
    periodic = tuple(bool(p) for p in np.broadcast_to(np.asarray(pbc, dtype=bool), (3,)))
    for k in range(3):
        if periodic[k] and not np.linalg.norm(cell[k]) > 0:
            raise ValueError(
                f"{where}: the structure is periodic along lattice vector {k} but cell[{k}] is zero; give a cell "
                f"or set pbc[{k}] = False."
            )
    return pos, numbers, cell, periodic
