"""HaloPlan: owned and ghost rows per device, exchange tables and static capacities (numpy only).

Row layout (docs/design.md): per device, owned storage is `[owned | padding]`
with `owned_capacity` rows; halo storage is
`[owned | ghosts by source rank ascending | padding]` with
`halo_rows = owned_capacity + ghost_capacity` rows and at least one padding
row (row `n_padded` is the "+1" pad row). Within one source rank's group,
direct ghosts come first by ascending owned-row index on the sender, then
shifted images by owned-row index and lattice shift.

Coordinates: owned storage holds the caller's positions as given (wrapped
or not). Ownership and ghosts are decided on the positions wrapped into the
cell (periodic axes), so any periodic image of an atom gives the same plan. In
the halo block every real row, owned or ghost, is in that wrapped frame: a row
holds the caller's position of its atom plus
`halo_offset = (halo_image - frame[atom]) @ cell`, where `frame` is the atom's
unwrap frame `floor(frac)` at build time and `halo_image` the row's lattice
shift from the wrapped position (0 on owned rows). Only relative positions
enter a cutoff kernel, so energies and forces are those of the caller's
coordinates. If the caller re-wraps an atom (moves it by a lattice vector)
the stored shifts no longer apply: `needs_rebuild` then returns True.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _storage, inputs
from .coincident import check_coincident
from ._assemble import OnOverflow, _assemble, _pair_request, _readonly
from .capacity import Growth, describe, log_growth
from .errors import HaloOverflowError as HaloOverflowError
from .budget import MemoryBudget
from .grid import choose_grid
from .partition import effective_cell, partition


@dataclasses.dataclass(frozen=True, eq=False)
class HaloPlan:
    """Owned and ghost rows of every device, with the tables of the halo exchanges.

    Build with `HaloPlan.build`; refresh with `rebuild` once `needs_rebuild`
    says so. All arrays are read-only numpy arrays; shapes use `D = n_devices`,
    `oc = owned_capacity`, `hr = halo_rows`.

    Attributes:
        n_devices, n_atoms, cutoff, skin, cell, periodic, grid: what the plan was built for.
        owned_capacity, ghost_capacity: static rows per device (`ghost_capacity > max(n_ghost)`).
        offsets: rank offsets `k` with a message (device `d` sends to `(d + k) % D`), ascending;
            `0` appears when a device holds images of its own atoms.
        pair_capacities: static message rows per offset.
        n_owned, n_ghost: `(D,)` int32 true counts.
        owned_global: `(D, oc)` int64 global atom id per owned row, -1 for padding.
        halo_global: `(D, hr)` int64 global atom id per halo row, -1 for padding.
        send_idx: per offset `(D, pair_capacity)` int32 owned-row index to send; padding = `oc`.
        recv_slot: per offset `(D, pair_capacity)` int32 halo row to fill; padding = `hr`.
        halo_offset: `(D, hr, 3)` added to gathered positions: the shift into the wrapped frame
            `(halo_image - frame[atom]) @ cell` (owned and ghost rows; 0 for an owned atom already
            inside the cell), the parking point (padding, whose gathered value is zero).
        owned_offset: `(D, oc, 3)` parking point for owned padding rows, 0 otherwise.
        reference_positions: `(N, 3)` positions the plan was built from.
        headroom: relative headroom used when a capacity is chosen or grown.
        basis: `(3, 3)` lattice for fractional coordinates (`cell` with zero non-periodic rows filled).
        halo_image: `(D, hr, 3)` int64 lattice shift of each halo row from its atom's wrapped
            position (0 on owned rows and direct ghosts).
        frame: `(N, 3)` int64 unwrap frame `floor(frac)` of each atom at build time (periodic
            axes; 0 elsewhere): caller position = wrapped position + `frame @ cell`.
        grown: names of capacities that `build`/`rebuild` had to enlarge beyond the requested ones.
        growth: the same as `capacity.Growth` records (name, old -> new rows, rows needed).
        self_images: whether images of a device's own atoms are ghost rows (see `build`).
        own_images: per device, `(m, 4)` int64 rows `(owned row, lattice shift)`: the images of its own
            atoms within reach that are not ghost rows (`self_images=False`; empty otherwise), by
            owned row then shift.
    """

    n_devices: int
    n_atoms: int
    cutoff: float
    skin: float
    cell: np.ndarray
    periodic: tuple[bool, bool, bool]
    grid: tuple[int, int, int]
    owned_capacity: int
    ghost_capacity: int
    offsets: tuple[int, ...]
    pair_capacities: tuple[int, ...]
    n_owned: np.ndarray
    n_ghost: np.ndarray
    owned_global: np.ndarray
    halo_global: np.ndarray
    send_idx: tuple[np.ndarray, ...]
    recv_slot: tuple[np.ndarray, ...]
    halo_offset: np.ndarray
    owned_offset: np.ndarray
    reference_positions: np.ndarray
    headroom: float
    basis: np.ndarray
    halo_image: np.ndarray
    frame: np.ndarray
    grown: tuple[str, ...] = ()
    growth: tuple[Growth, ...] = ()
    self_images: bool = True
    own_images: tuple[np.ndarray, ...] = ()

    # ------------------------------------------------------------------ build

    @classmethod
    def build(
        cls,
        positions: np.ndarray,
        cell: np.ndarray,
        *,
        periodic: tuple[bool, bool, bool] = (True, True, True),
        cutoff: float,
        skin: float = 0.0,
        n_devices: int,
        grid: tuple[int, int, int] | None = None,
        headroom: float = 1.2,
        owned_capacity: int | None = None,
        ghost_capacity: int | None = None,
        pair_capacities: int | Mapping[int, int] | None = None,
        on_overflow: OnOverflow = "replan",
        self_images: bool = True,
        grow: bool = False,
        grow_all: bool = False,
        budget: MemoryBudget | None = None,
    ) -> HaloPlan:
        """Partition `positions` over `n_devices` spatial domains and lay out their halo rows.

        Args:
            positions: `(N, 3)` real floating-point Cartesian positions (the caller's coordinates,
                wrapped or not: any periodic image of an atom gives the same ownership and ghosts).
                Integer, bool or complex arrays are refused: convert with `positions.astype(np.float64)`.
            cell: `(3, 3)` lattice vectors as rows. A row may be zero on a non-periodic axis; a lattice
                vector within a sine of `partition.MIN_CELL_SINE` of the others' plane is refused.
            periodic: periodic flag per lattice axis.
            cutoff: interaction cutoff (a real number > 0; not a bool or string).
            skin: Verlet skin (>= 0); ghosts reach `cutoff + skin`, and the plan stays valid
                until some atom moves more than `skin / 2`.
            n_devices: number of devices (ranks), an int >= 1.
            grid: domains per lattice axis; default `choose_grid(n_devices, ...)`.
            headroom: capacities are `ceil(headroom * needed)` (plus the pad row for ghosts).
            owned_capacity, ghost_capacity: fixed capacities (default: from `headroom`).
            pair_capacities: message rows, one int for every offset or `{offset: rows}`; offsets
                named in a mapping are kept even when no longer needed (programs are reused).
            on_overflow: `"replan"` grows a fixed capacity that is too small (listed in
                `plan.grown`), to at least `capacity.GROWTH` times its size, and with it every
                fixed capacity that has used part of its headroom (the programs recompile once for
                all of them); `"raise"` raises `HaloOverflowError` instead.
            self_images: True (default): periodic images of a device's own atoms are ghost rows, as
                an opaque kernel that finds its neighbours from positions needs. False: they are left
                out of the rows and exchanges and listed in `plan.own_images` (owned row, lattice
                shift), for a consumer with explicit edges that puts the shift on the edge instead
                (the model level: one device then holds no ghost rows at all).
            grow: grow every fixed capacity that has used part of its headroom even though all fit
                (a consumer whose own capacity grew, e.g. the model level's edges, asks for it).
            grow_all: when capacities grow, grow every fixed one, used or not: after a change of the cell
                every count scales together (a cell filter), so one growth then covers them all.
                (the model level: one device then holds no ghost rows at all). Such a plan holds exactly
                the images within `cutoff + skin` of a device's atoms; one with self images every image in
                the search box of its atoms (a superset whose capacities vary less between rebuilds, as an
                opaque kernel's programs are reused; several times more rows in a skewed cell).
            budget: a `MemoryBudget` (None: none); a rank whose rows would pass `budget.max_rows` raises
                `LayoutBudgetError` while they are found (`partition.find_ghosts`).

        Returns:
            The plan.

        Raises:
            HaloOverflowError: a fixed capacity is too small and `on_overflow="raise"`.
            TypeError: an argument of the wrong type: positions not real floating point, a number
                (`cutoff`, `skin`, `headroom`) or count (`n_devices`, capacities) that is a bool, string, ...
            ValueError: malformed input (the message says which argument and how to fix it); a degenerate
                cell; an atom whose coordinate is non-finite or absurdly large (`inputs.coordinate_limit`);
                a plan that would hold more than `partition.MAX_PLAN_ROWS` rows (refused before any
                allocation, e.g. for a periodic axis far thinner than `cutoff + skin`).

        Example:
            >>> plan = HaloPlan.build(pos, cell, cutoff=5.0, skin=1.0, n_devices=4)
            >>> x_halo = plan.to_halo(pos, positions=True)   # numpy reference layout
        """
        where = "HaloPlan.build"
        pos = inputs.real_positions(where, positions)
        if pos.ndim != 2 or pos.shape[1] != 3:
            raise ValueError(f"{where}: positions must be a numeric (N, 3) array, got shape {pos.shape}.")
        pos = pos.astype(np.float64)
        cell_arr = np.asarray(cell)
        if cell_arr.dtype.kind not in "iuf":
            raise TypeError(f"{where}: cell must be a real (3, 3) array of lattice rows, got dtype {cell_arr.dtype}.")
        cell_arr = cell_arr.astype(np.float64)
        if cell_arr.shape != (3, 3) or not np.all(np.isfinite(cell_arr)):
            raise ValueError(f"{where}: cell must be a finite (3, 3) array of lattice rows, got {cell_arr.shape}.")
        if len(periodic) != 3 or not all(isinstance(p, (bool, np.bool_)) for p in periodic):
            raise ValueError(f"{where}: periodic must be three bools, one per lattice axis, got {periodic!r}.")
        periodic = tuple(bool(p) for p in periodic)
        cutoff = inputs.real_number(where, "cutoff", cutoff, positive=True)
        skin = inputs.real_number(where, "skin", skin, positive=False)
        n_devices = inputs.positive_int(where, "n_devices", n_devices)
        headroom = inputs.headroom(where, headroom)
        if on_overflow not in ("replan", "raise"):
            raise ValueError(f"{where}: on_overflow must be 'replan' or 'raise', got {on_overflow!r}.")
        if not isinstance(self_images, (bool, np.bool_)):
            raise TypeError(f"{where}: self_images must be True or False, got {self_images!r}.")
        inputs.check_coordinates(where, pos, cutoff + skin)  # finite, and resolvable at the cutoff scale
        basis = effective_cell(cell_arr, periodic, pos)
        check_coincident(where, pos, basis, periodic)  # two atoms (or images) at one point: the model's NaN
        if grid is None:
            grid = choose_grid(n_devices, basis, periodic)
        else:
            grid = tuple(inputs.positive_int(where, "grid entries", g) for g in grid)
            if len(grid) != 3 or math.prod(grid) != n_devices:
                raise ValueError(
                    f"HaloPlan.build: grid {grid} must have 3 entries whose product is n_devices={n_devices}; "
                    "pass grid=None to choose one."
                )
        if owned_capacity is not None:
            owned_capacity = inputs.positive_int(where, "owned_capacity", owned_capacity)
        if ghost_capacity is not None:
            ghost_capacity = inputs.positive_int(where, "ghost_capacity", ghost_capacity)
        pair_request = _pair_request(pair_capacities, n_devices)
        part = partition(pos, basis, periodic, grid, cutoff + skin, budget, exact=not self_images)
        return cls(**_assemble(
            pos, cell_arr, basis, periodic, tuple(grid), cutoff, skin, n_devices, headroom,
            part, owned_capacity, ghost_capacity, pair_request, on_overflow, bool(self_images), bool(grow),
            bool(grow_all),
        ))

    @classmethod
    def from_ase(cls, atoms: Any, *, cutoff: float, n_devices: int, **kwargs: Any) -> HaloPlan:
        """`build` from an ASE `Atoms`: its positions, cell (rows are lattice vectors) and `pbc`.

        Keyword arguments (`skin`, `headroom`, `grid`, capacities) go to `build`. ASE itself is not
        imported: any object with `positions`, `cell` (array-like or ASE `Cell`) and `pbc` works.

        Raises:
            TypeError: `atoms` lacks `positions`, `cell` or `pbc`.
        """
        missing = [name for name in ("positions", "cell", "pbc") if not hasattr(atoms, name)]
        if missing:
            raise TypeError(f"HaloPlan.from_ase: expected an ase.Atoms (positions, cell, pbc), got "
                            f"{type(atoms).__name__} without {missing}; call HaloPlan.build(positions, cell, "
                            "periodic=...) for plain arrays.")
        cell = np.asarray(getattr(atoms.cell, "array", atoms.cell), dtype=np.float64)
        periodic = tuple(bool(v) for v in np.broadcast_to(np.asarray(atoms.pbc, dtype=bool), (3,)))
        return cls.build(np.asarray(atoms.positions, dtype=np.float64), cell, periodic=periodic, cutoff=cutoff,
                         n_devices=n_devices, **kwargs)

    def rebuild(self, positions: np.ndarray, *, on_overflow: OnOverflow = "replan") -> HaloPlan:
        """A new plan for `positions` with the same cell, cutoff, skin and grid.

        Capacities and offsets are kept, so programs compiled for this plan run
        on the new one. A capacity that no longer suffices is grown (listed in
        `plan.grown` and `plan.growth`, logged once at INFO by `layout.capacity`; programs then
        recompile once) with `on_overflow="replan"`, or raises `HaloOverflowError` with
        `on_overflow="raise"`.
        """
        pos = np.asarray(positions)
        if pos.shape != (self.n_atoms, 3):
            raise ValueError(
                f"HaloPlan.rebuild: positions have shape {pos.shape} but the plan has {self.n_atoms} atoms; "
                "a different atom count needs HaloPlan.build."
            )
        plan = HaloPlan.build(
            pos, self.cell, periodic=self.periodic, cutoff=self.cutoff, skin=self.skin,
            n_devices=self.n_devices, grid=self.grid, headroom=self.headroom,
            owned_capacity=self.owned_capacity, ghost_capacity=self.ghost_capacity,
            pair_capacities=dict(zip(self.offsets, self.pair_capacities)), on_overflow=on_overflow,
            self_images=self.self_images,
        )
        log_growth("HaloPlan.rebuild", plan.growth)
        return plan

    # ------------------------------------------------------------ properties

    @property
    def halo_rows(self) -> int:
        """Rows of one device's halo block: `owned_capacity + ghost_capacity`."""
        return self.owned_capacity + self.ghost_capacity

    @property
    def n_padded(self) -> np.ndarray:
        """`(D,)` rows a kernel sees per device: `n_owned + n_ghost`."""
        return self.n_owned + self.n_ghost

    @property
    def owned_mask(self) -> np.ndarray:
        """`(D, owned_capacity)` True on real owned rows."""
        return np.arange(self.owned_capacity) < self.n_owned[:, None]

    @property
    def halo_owned_mask(self) -> np.ndarray:
        """`(D, halo_rows)` True on the owned rows of the halo block."""
        return np.arange(self.halo_rows) < self.n_owned[:, None]

    @property
    def halo_mask(self) -> np.ndarray:
        """`(D, halo_rows)` True on owned and ghost rows (not padding)."""
        return np.arange(self.halo_rows) < self.n_padded[:, None]

    @functools.cached_property
    def owner(self) -> np.ndarray:
        """`(N,)` int32 rank owning each atom."""
        out = np.empty(self.n_atoms, dtype=np.int32)
        rank = np.broadcast_to(np.arange(self.n_devices)[:, None], self.owned_global.shape)
        out[self.owned_global[self.owned_mask]] = rank[self.owned_mask]
        return _readonly(out)

    @functools.cached_property
    def local_index(self) -> np.ndarray:
        """`(N,)` int32 owned-row index of each atom on its owner."""
        out = np.empty(self.n_atoms, dtype=np.int32)
        row = np.broadcast_to(np.arange(self.owned_capacity), self.owned_global.shape)
        out[self.owned_global[self.owned_mask]] = row[self.owned_mask]
        return _readonly(out)

    # ------------------------------------------------------- rebuild criterion

    def max_displacement(self, positions: np.ndarray) -> float:
        """Largest displacement of any atom since the plan, minimum image on periodic axes.

        The minimum image is taken in fractional coordinates (exact for moves
        shorter than half the perpendicular width of the cell).
        """
        return float(np.max(np.linalg.norm(self._displacement(positions)[0], axis=1), initial=0.0))

    def needs_rebuild(self, positions: np.ndarray) -> bool:
        """True if some atom moved more than `skin / 2`, or was moved by a lattice vector (re-wrapped)."""
        disp, jumped = self._displacement(positions)
        return bool(jumped.any()) or float(np.max(np.linalg.norm(disp, axis=1), initial=0.0)) > self.skin / 2

    def _displacement(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Minimum-image displacements `(N, 3)` and whether each atom jumped by a lattice vector."""
        pos = inputs.real_positions("HaloPlan.needs_rebuild / max_displacement", positions).astype(np.float64)
        if pos.shape != (self.n_atoms, 3):
            raise ValueError(f"HaloPlan: positions have shape {pos.shape}, the plan has ({self.n_atoms}, 3).")
        frac = (pos - self.reference_positions) @ np.linalg.inv(self.basis)
        jump = np.where(np.array(self.periodic), np.round(frac), 0.0)
        return (frac - jump) @ self.basis, jump.any(axis=1)

    # ------------------------------------- numpy reference layouts (_storage.py)

    def to_owned(self, x_global: np.ndarray, *, positions: bool = False) -> np.ndarray:
        """Per-atom `(N, ...)` values in owned storage `(D * owned_capacity, ...)`; padding zero or parked."""
        return _storage.to_owned(self, x_global, positions)

    def to_halo(self, x_global: np.ndarray, *, positions: bool = False) -> np.ndarray:
        """Per-atom values in halo storage `(D * halo_rows, ...)`: owned rows, ghost copies, padding.

        With `positions=True` owned and ghost rows are shifted into the wrapped frame
        (`halo_offset`) and padding rows parked.
        """
        return _storage.to_halo(self, x_global, positions)

    def from_owned(self, x_owned: np.ndarray) -> np.ndarray:
        """Owned storage `(D * owned_capacity, ...)` back to `(N, ...)` in global-id order."""
        return _storage.from_owned(self, x_owned)

    def reference_forward(self, x_owned: np.ndarray, *, positions: bool = False) -> np.ndarray:
        """Forward halo exchange (GatherInputs) with the tables: owned storage -> halo storage.

        Owned padding rows are zeroed, each device keeps its owned rows and
        receives, for every offset `k`, the rows `send_idx` of rank `d - k` into
        its `recv_slot`s. With `positions=True`, `halo_offset` is added to every row
        (owned and ghost rows then lie in the wrapped frame).
        """
        return _storage.reference_forward(self, x_owned, positions)

    def reference_reverse(self, x_halo: np.ndarray) -> np.ndarray:
        """Reverse halo exchange with the tables: halo storage -> owned storage (the transpose of forward).

        Each ghost row goes back to its owner and is added into its owned row;
        padding rows are ignored and owned padding comes out zero.
        """
        return _storage.reference_reverse(self, x_halo)

    # ------------------------------------------------------------- summary

    def describe(self, features: int = 1, itemsize: int = 4) -> str:
        """A short human summary: grid, capacities, counts per device, bytes per exchange.

        Args:
            features: floats per row in the exchange (e.g. 3 for positions).
            itemsize: bytes per float.
        """
        row = features * itemsize
        padded_bytes = self.n_devices * sum(self.pair_capacities) * row
        true_bytes = int(self.n_ghost.sum()) * row
        lines = [
            f"HaloPlan: {self.n_atoms} atoms on {self.n_devices} devices, grid {self.grid}, "
            f"periodic {self.periodic}, cutoff {self.cutoff:g} + skin {self.skin:g}",
            f"  capacities: owned {self.owned_capacity}, ghost {self.ghost_capacity}, halo rows {self.halo_rows}",
            f"  offsets {self.offsets}, message rows {self.pair_capacities}",
            f"  owned per device: {self.n_owned.tolist()}",
            f"  ghosts per device: {self.n_ghost.tolist()}",
            f"  one exchange of {features} x {itemsize}-byte floats: {true_bytes} bytes of ghosts, "
            f"{padded_bytes} bytes sent with padding",
        ]
        if not self.self_images:
            lines.append(f"  images of own atoms (no rows; shifts on edges) per device: "
                         f"{[len(o) for o in self.own_images]}")
        if unwrapped := int(np.count_nonzero(self.frame.any(axis=1))):
            lines.append(f"  atoms given outside the cell: {unwrapped} (shifted into it in the halo block)")
        if self.growth:
            lines.append(f"  grown to fit: {describe(self.growth)}")
        return "\n".join(lines)
