"""Dense pairwise energy models written for one device, in the many ways torch lets one write "all pairs".

Each takes the positions tensor it is given and returns the energy of every pair
of its rows, masked at the cutoff and summed: on one device and a whole system
the right number; fed a ShardTensor it would be the energy of one rank's rows
only. Shared by tests/torch/test_op_catalogue.py (one process) and
tests/torch/meaning_worker.py (two ranks), which check that each one either
raises `ShardTensorMeaningError` or gives the single-device energy.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

CUTOFF, SIGMA, EPS = 2.5, 1.0, 0.3


def _lj(r2: torch.Tensor) -> torch.Tensor:
    """Pair energy of squared distances, zero beyond the cutoff and for r = 0 (a row with itself)."""
    keep = (r2 < CUTOFF**2) & (r2 > 1e-12)
    s6 = (SIGMA**2 / torch.where(keep, r2, torch.ones_like(r2))) ** 3
    return torch.where(keep, 4 * EPS * (s6 * s6 - s6), torch.zeros_like(r2))


def _from_diff(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * _lj((d * d).sum(-1)).sum()


def _loop(p: torch.Tensor) -> torch.Tensor:
    return 0.5 * sum(_lj(((p[i] - p) ** 2).sum(-1)).sum() for i in range(p.shape[0]))


def _iterate(p: torch.Tensor) -> torch.Tensor:
    return 0.5 * sum(_lj(((q - p) ** 2).sum(-1)).sum() for q in p)


def _gram(p: torch.Tensor) -> torch.Tensor:
    sq = (p * p).sum(-1)
    return 0.5 * _lj((sq[:, None] + sq[None, :] - 2 * p @ p.T).clamp(min=0)).sum()


def _triu(p: torch.Tensor) -> torch.Tensor:
    i, j = torch.triu_indices(p.shape[0], p.shape[0], 1)
    return _lj(((p[i] - p[j]) ** 2).sum(-1)).sum()


def _repeat(p: torch.Tensor) -> torch.Tensor:
    n = p.shape[0]
    return _from_diff(p.repeat(1, n).view(n, n, 3) - p.repeat(n, 1).view(n, n, 3))


def _expand(p: torch.Tensor) -> torch.Tensor:
    return _from_diff(p.unsqueeze(1).expand(-1, p.shape[0], -1) - p)


def _transpose(p: torch.Tensor) -> torch.Tensor:
    a = p[:, None, :].expand(-1, p.shape[0], -1)
    return _from_diff(a - a.transpose(0, 1))


def _einsum(p: torch.Tensor) -> torch.Tensor:
    sq = torch.einsum("id,id->i", p, p)
    return 0.5 * _lj((sq[:, None] + sq[None, :] - 2 * torch.einsum("id,jd->ij", p, p)).clamp(min=0)).sum()


def _roll(p: torch.Tensor) -> torch.Tensor:
    return 0.5 * sum(_lj(((p - p.roll(k, 0)) ** 2).sum(-1)).sum() for k in range(1, p.shape[0]))


class DensePairModel(torch.nn.Module):
    """The held-out case as a module: every pair of the tensor it is given, masked at the cutoff, summed."""

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        d = pos[:, None, :] - pos[None, :, :]
        r2 = (d * d).sum(-1)
        return 0.5 * _lj(r2).sum()


MODELS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "module": DensePairModel(),
    "broadcast": lambda p: _from_diff(p[:, None, :] - p[None, :, :]),
    "unsqueeze": lambda p: _from_diff(p.unsqueeze(1) - p.unsqueeze(0)),
    "view": lambda p: _from_diff(p.view(-1, 1, 3) - p.view(1, -1, 3)),
    "half_broadcast": lambda p: _from_diff(p[:, None, :] - p),
    "expand": _expand,
    "transpose": _transpose,
    "repeat": _repeat,
    "stack": lambda p: _from_diff(torch.stack([p] * p.shape[0], dim=1) - torch.stack([p] * p.shape[0])),
    "cdist": lambda p: 0.5 * _lj(torch.cdist(p, p) ** 2).sum(),
    "pdist": lambda p: _lj(F.pdist(p) ** 2).sum(),
    "gram": _gram,
    "einsum": _einsum,
    "triu_gather": _triu,
    "index_loop": _loop,
    "iterate": _iterate,
    "roll": _roll,
    "flatten": lambda p: _from_diff((p.reshape(-1)[:, None] - p.reshape(-1)[None, :]).view(-1, 3)),
}


def reference(pos: np.ndarray) -> float:
    """The single-device energy: the held-out model on the whole array (plain torch)."""
    return float(DensePairModel()(torch.tensor(pos)))


def outcome(name: str, pos: torch.Tensor) -> dict:
    """What the model does with `pos`: {"raised": message} or {"energy": value}."""
    from nvalchemi_jaxbridge.torch import ShardTensorMeaningError

    try:
        e = MODELS[name](pos)
    except ShardTensorMeaningError as err:
        return {"raised": str(err)}
    return {"energy": float(e.to_local() if hasattr(e, "to_local") else e)}
