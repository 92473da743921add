"""A LAMMPS ML-IAP "unified" model object as the model level runs it (both front doors).

`MLIAPModel(obj)` reads what the interface declares (`element_types`, `rcutfac`,
`compute_forces`), maps atomic numbers to the model's type indices, lays a
structure out as LAMMPS would (owned atoms, then ghost rows for every other
atom within the cutoff + skin, periodic images of a device's own atoms
included), and learns the model's exchange schedule: the sequence of
`forward_exchange` / `reverse_exchange` calls (kind, width, dtype) it makes in one
`compute_forces`. The schedule is what lets a device whose model returns early
(no owned atoms, `npairs <= 1`) still take part in every exchange of the others,
with zero rows, and what the JAX front door's program is cut along.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from .mliap_data import BlockData, MLIAPError

SYMBOLS = (
    "X H He Li Be B C N O F Ne Na Mg Al Si P S Cl Ar K Ca Sc Ti V Cr Mn Fe Co Ni Cu Zn Ga Ge As Se Br Kr Rb Sr Y "
    "Zr Nb Mo Tc Ru Rh Pd Ag Cd In Sn Sb Te I Xe Cs Ba La Ce Pr Nd Pm Sm Eu Gd Tb Dy Ho Er Tm Yb Lu Hf Ta W Re "
    "Os Ir Pt Au Hg Tl Pb Bi Po At Rn Fr Ra Ac Th Pa U Np Pu Am Cm Bk Cf Es Fm Md No Lr Rf Db Sg Bh Hs Mt Ds Rg "
    "Cn Nh Fl Mc Lv Ts Og"
).split()
"""Chemical symbols by atomic number (`SYMBOLS[29] == "Cu"`; 0 is no element)."""

KINDS = ("forward", "reverse")


def is_mliap_model(obj: Any) -> bool:
    """Whether `obj` is an ML-IAP unified model object (not a class): `compute_forces`, `element_types`, `rcutfac`."""
    return (not isinstance(obj, type) and callable(getattr(obj, "compute_forces", None))
            and hasattr(obj, "element_types") and hasattr(obj, "rcutfac"))


@dataclasses.dataclass(frozen=True)
class ExchangeStep:
    """One exchange a model asks for: its kind ("forward"/"reverse"), values per row and dtype."""

    kind: str
    width: int
    dtype: torch.dtype


class MLIAPModel:
    """An `MLIAPUnified` object with the model level's reading of it.

    Args:
        obj: the model object (unmodified; its `compute_forces(data)` is called as LAMMPS calls it).

    Attributes:
        cutoff: the pair cutoff, `2 * rcutfac` (Å).
        element_types: the model's element symbols (LAMMPS' `pair_coeff * * A B ...` order).
        name: the object's class name (errors and reports).
    """

    def __init__(self, obj: Any) -> None:
        if not is_mliap_model(obj):
            raise TypeError(
                f"{type(obj).__name__} is not an ML-IAP unified model: it needs compute_forces(data), "
                "element_types and rcutfac (lammps.mliap.mliap_unified_abc.MLIAPUnified); build one with the "
                "model's own tool (MACE: mace_create_lammps_model MODEL --format=mliap)."
            )
        self.obj = obj
        self.name = type(obj).__name__
        self.element_types = tuple(str(s) for s in obj.element_types)
        rcut = float(obj.rcutfac)
        if not rcut > 0:
            raise ValueError(f"{self.name}: rcutfac must be > 0 (half the pair cutoff, Å), got {obj.rcutfac!r}.")
        self.cutoff = 2.0 * rcut
        self.schedule: tuple[ExchangeStep, ...] | None = None

    def type_indices(self, numbers: Any) -> np.ndarray:
        """`(N,)` int32 indices into `element_types` of atomic numbers `numbers`; unknown elements raise."""
        z = np.asarray(numbers).reshape(-1)
        if z.size and (not np.issubdtype(z.dtype, np.integer) and not np.all(z == np.round(z))):
            raise ValueError(f"{self.name}: atomic numbers must be integers, got {sorted(set(z.tolist()))[:5]}.")
        z = z.astype(np.int64)
        index = {s: k for k, s in enumerate(self.element_types) if s != "X"}
        bad = sorted({int(v) for v in z if not 0 < v < len(SYMBOLS) or SYMBOLS[v] not in index})
        if bad:
            names = [SYMBOLS[v] if 0 < v < len(SYMBOLS) else str(v) for v in bad]
            raise ValueError(
                f"{self.name}: atomic numbers {bad} ({', '.join(names)}) are not among the model's element_types "
                f"{[s for s in self.element_types if s != 'X'][:20]}; use a structure of those elements."
            )
        return np.array([index[SYMBOLS[v]] for v in z], dtype=np.int32)

    def compute(self, data: BlockData, obj: Any = None) -> None:
        """`obj.compute_forces(data)` (default: the model's object), its errors named as the model's."""
        try:
            (self.obj if obj is None else obj).compute_forces(data)
        except MLIAPError:
            raise
        except Exception as e:
            raise MLIAPError(
                f"{self.name}.compute_forces raised {type(e).__name__}: {e} (block of nlocal={data.nlocal}, "
                f"ntotal={data.ntotal}, npairs={data.npairs})."
            ) from e

    def probe_schedule(self, data: BlockData, obj: Any = None) -> tuple[ExchangeStep, ...]:
        """Run the model (or `obj`, a copy of it) once on `data`, whose exchange may be an identity, and
        record its exchanges."""
        steps: list[ExchangeStep] = []
        inner = data._exchange

        def recording(kind: str, src: torch.Tensor) -> torch.Tensor:
            steps.append(ExchangeStep(kind, int(src.shape[1]), src.dtype))
            return inner(kind, src)

        data._exchange = recording
        try:
            self.compute(data, obj)
        finally:
            data._exchange = inner
        return tuple(steps)


def identity_exchange(kind: str, src: torch.Tensor) -> torch.Tensor:
    """An exchange that moves nothing (for probing a schedule on one block)."""
    return src.clone()


def check_schedule(name: str, got: list[tuple[str, int]], want: tuple[ExchangeStep, ...]) -> None:
    """Raise unless the exchanges a model made (`got`) are a prefix of its schedule (`want`)."""
    head = [(s.kind, s.width) for s in want[: len(got)]]
    if len(got) > len(want) or list(got) != head:
        raise MLIAPError(
            f"{name}: this evaluation's exchanges {got} differ from the model's schedule "
            f"{[(s.kind, s.width) for s in want]} (learned on its first evaluation); the model level needs every "
            "device to make the same exchanges in the same order (as LAMMPS' ranks must). Build a new "
            "DistributedMLIP / TorchDistributedMLIP for a model whose exchanges change."
        )
