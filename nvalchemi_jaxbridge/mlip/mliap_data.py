"""The `data` object of LAMMPS' ML-IAP "unified" interface, over one device's block.

A model that ships an `MLIAPUnified` object (`compute_forces(data)`) reads the
block through this object and writes its results back into it, exactly as it
does inside LAMMPS (`reference/mliap-interface.md`, LAMMPS' `mliap_data.cpp` and
`mliap_unified_couple.pyx`):

| member | here |
|---|---|
| `nlocal`, `ntotal`, `nghost` | owned rows `[0, nlocal)`, then ghost rows up to `ntotal` (periodic images of the device's own atoms included, as in LAMMPS) |
| `npairs`, `pair_i`, `pair_j`, `rij` | every pair within the cutoff whose `i` is owned (a full list: both directions); `rij = x[j] - x[i]` |
| `elems`, `ielems`, `jelems`, `iatoms`, `jatoms`, `numneighs` | type indices into the model's `element_types` (every row), per-pair copies, neighbour counts |
| `eatoms`, `energy` | writable: per-atom energies of the owned rows; the block's energy (LAMMPS takes the total from `energy`, `eatoms` only for per-atom output) |
| `update_pair_energy(eij)` | `eatoms` set to half of each pair's energy added to its `i` atom (the full list holds both directions), `energy` to their sum |
| `update_pair_forces(fij)`, `update_pair_forces_gpu(fij)` | pair forces: `fij` is added to atom `i` and subtracted from atom `j` (LAMMPS' `f[i] += fij`, `f[j] -= fij`) |
| `forward_exchange(src, dst, n)` | `dst` = `src` with every ghost row set to its owner's row |
| `reverse_exchange(src, dst, n)` | `dst` = owned rows of `src` plus every ghost copy's row added in; ghost rows 0 (the adjoint) |

The two exchanges are the caller's (`exchange(kind, src) -> dst` on the compact
`(ntotal, n)` block): a collective of the PyTorch front door, or a suspension
point of the JAX front door's program. Arrays are numpy on a CPU block and torch
tensors on a GPU block (as in LAMMPS' plain and Kokkos builds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

Exchange = Callable[[str, torch.Tensor], torch.Tensor]
"""`exchange(kind, src)`: `kind` "forward" or "reverse", `src` `(ntotal, n)`; returns `dst` of that shape."""


class MLIAPError(RuntimeError):
    """A model broke the ML-IAP interface (bad shapes, exchanges out of step); the message names it."""


class BlockData:
    """One block as ML-IAP's `data` (see the module docstring).

    Args:
        rij: `(npairs, 3)` pair vectors `x[j] - x[i]` (float64, on the block's device).
        pair_i, pair_j: `(npairs,)` int rows; `pair_i < nlocal`.
        elems: `(ntotal,)` type indices.
        nlocal: owned rows.
        exchange: the block's `exchange(kind, src)`.
        model: the model's name (for errors).
    """

    def __init__(self, rij: torch.Tensor, pair_i: torch.Tensor, pair_j: torch.Tensor, elems: torch.Tensor,
                 nlocal: int, *, exchange: Exchange, model: str = "model") -> None:
        self._device = rij.device
        self._numpy = rij.device.type == "cpu"
        self._exchange = exchange
        self._model = model
        self.nlocal = int(nlocal)
        self.ntotal = int(elems.shape[0])
        self.nghost = self.ntotal - self.nlocal
        self.npairs = int(rij.shape[0])
        self.ndescriptors = 1
        self.nparams = 1
        self.gamma_nnz = 0
        self.eflag = 1
        self.vflag = 1
        i64 = torch.int64
        self._t = {
            "rij": rij.to(torch.float64).contiguous(),
            "pair_i": pair_i.to(torch.int32).contiguous(),
            "pair_j": pair_j.to(torch.int32).contiguous(),
            "elems": elems.to(torch.int32).contiguous(),
        }
        self._t["ielems"] = self._t["elems"][pair_i.to(i64)]
        self._t["jelems"] = self._t["elems"][pair_j.to(i64)]
        self._t["iatoms"] = torch.arange(self.nlocal, dtype=torch.int32, device=self._device)
        self._t["numneighs"] = torch.bincount(pair_i.to(i64), minlength=self.nlocal).to(torch.int32)
        self._t["eatoms"] = torch.zeros(self.nlocal, dtype=torch.float64, device=self._device)
        self.nneigh_max = int(self._t["numneighs"].max()) if self.nlocal else 0
        self.fij = torch.zeros((self.npairs, 3), dtype=torch.float64, device=self._device)
        self._energy = 0.0
        self.energy_set = False
        self.exchanges: list[tuple[str, int]] = []

    # ------------------------------------------------------------------ arrays

    def _view(self, name: str) -> Any:
        t = self._t[name]
        return t.numpy() if self._numpy else t

    rij = property(lambda self: self._view("rij"))
    pair_i = property(lambda self: self._view("pair_i"))
    pair_j = property(lambda self: self._view("pair_j"))
    jatoms = property(lambda self: self._view("pair_j"))
    elems = property(lambda self: self._view("elems"))
    ielems = property(lambda self: self._view("ielems"))
    jelems = property(lambda self: self._view("jelems"))
    iatoms = property(lambda self: self._view("iatoms"))
    numneighs = property(lambda self: self._view("numneighs"))
    eatoms = property(lambda self: self._view("eatoms"))
    nlistatoms = property(lambda self: self.nlocal)
    natomneigh = property(lambda self: self.nlocal)

    @property
    def energy(self) -> float:
        """The block's energy as the model set it (LAMMPS' total is the sum of this over ranks)."""
        return self._energy

    @energy.setter
    def energy(self, value: Any) -> None:
        self._energy = float(value)
        self.energy_set = True

    @property
    def eatoms_tensor(self) -> torch.Tensor:
        """`(nlocal,)` float64 per-atom energies the model wrote."""
        return self._t["eatoms"]

    # ------------------------------------------------------------------ results the model writes

    def _pair_array(self, x: Any, width: int | None, where: str) -> torch.Tensor:
        t = torch.as_tensor(x).detach()
        want = (self.npairs,) if width is None else (self.npairs, width)
        if tuple(t.shape) != want:
            raise MLIAPError(
                f"{self._model}: data.{where} got shape {tuple(t.shape)}, but this block has npairs={self.npairs} "
                f"pairs, so it takes {want}; return one row per pair of data.pair_i / data.pair_j."
            )
        if not (t.is_floating_point()):
            raise MLIAPError(f"{self._model}: data.{where} got dtype {t.dtype}; pass floating-point values.")
        return t.to(device=self._device, dtype=torch.float64)

    def update_pair_forces(self, fij: Any) -> None:
        """Pair forces `(npairs, 3)`: added to atom `i`, subtracted from atom `j` (accumulated over calls)."""
        self.fij += self._pair_array(fij, 3, "update_pair_forces")

    def update_pair_forces_gpu(self, fij: Any) -> None:
        """As `update_pair_forces` (a torch tensor on any device)."""
        self.fij += self._pair_array(fij, 3, "update_pair_forces_gpu")

    def update_pair_energy(self, eij: Any) -> None:
        """Pair energies `(npairs,)`: `eatoms[i]` = half the energies of `i`'s pairs, `energy` their sum."""
        e = self._pair_array(eij, None, "update_pair_energy")
        eatoms = self._t["eatoms"]
        eatoms.zero_()
        eatoms.index_add_(0, self._t["pair_i"].to(torch.int64), 0.5 * e)
        self.energy = float(eatoms.sum())

    update_pair_energy_gpu = update_pair_energy

    def check_energy_written(self) -> None:
        """Raise if the model wrote per-atom energies but never set `energy` (LAMMPS' total comes from it)."""
        if self.nlocal and self._t["eatoms"].abs().sum() > 0 and not self.energy_set:
            raise MLIAPError(
                f"{self._model}: compute_forces wrote eatoms but never set data.energy; LAMMPS takes the energy "
                "from data.energy, so set it (the sum of the owned atoms' energies)."
            )

    # ------------------------------------------------------------------ exchanges the model asks for

    def _exchange_into(self, kind: str, src: Any, dst: Any, n: int) -> None:
        s = torch.as_tensor(src)
        rows = s.shape[0] if s.ndim else 0
        if rows != self.ntotal:
            raise MLIAPError(
                f"{self._model}: data.{kind}_exchange got src of shape {tuple(s.shape)}; it takes (ntotal, n) = "
                f"({self.ntotal}, {n}) (owned rows, then ghost rows)."
            )
        width = int(np.prod(s.shape[1:], dtype=np.int64)) if s.ndim > 1 else 1
        if int(n) != width:
            raise MLIAPError(
                f"{self._model}: data.{kind}_exchange(src, dst, n={n}) but src has {width} values per row "
                f"(shape {tuple(s.shape)}); pass n = src.shape[1]."
            )
        with torch.no_grad():
            out = self._exchange(kind, s.detach().reshape(rows, width))
            d = torch.as_tensor(dst)
            d.copy_(out.reshape(d.shape).to(device=d.device, dtype=d.dtype))
        self.exchanges.append((kind, width))

    def forward_exchange(self, src: Any, dst: Any, n: int) -> None:
        """`dst` = `src` with ghost rows replaced by their owners' rows."""
        self._exchange_into("forward", src, dst, n)

    def reverse_exchange(self, src: Any, dst: Any, n: int) -> None:
        """`dst` = `src`'s owned rows with each ghost copy's row added into its owner; ghost rows 0."""
        self._exchange_into("reverse", src, dst, n)


def row_forces(data: BlockData) -> torch.Tensor:
    """`(ntotal, 3)` forces on the block's rows from the pair forces (`f[i] += fij`, `f[j] -= fij`).

    Ghost rows hold the part of their atom's force found here; the caller folds them into owners.
    """
    f = torch.zeros((data.ntotal, 3), dtype=torch.float64, device=data.fij.device)
    f.index_add_(0, data._t["pair_i"].to(torch.int64), data.fij)
    f.index_add_(0, data._t["pair_j"].to(torch.int64), -data.fij)
    return f


def pair_virial(data: BlockData) -> torch.Tensor:
    """`(3, 3)` virial `-dE/dstrain` of this block's pairs: `-sum_p rij_p (x) fij_p` (each pair once).

    `fij = dE/drij` (the force `fij` on `i`, `-fij` on `j`), and a strain maps `rij` to `(I + eps) rij`.
    """
    return -(data._t["rij"].T @ data.fij)
