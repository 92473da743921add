"""A small pair-energy model on torch custom ops, plus its independent numpy reference.

Shared by the pytest files and the multi-process worker (tests/torch/worker.py).
The kernel is a `torch.library` op with a CompositeImplicitAutograd body, so
torch differentiates it; the front door only moves rows around it.
"""

from __future__ import annotations

import numpy as np
import torch

EPS, CUTOFF = 0.7, 2.2

_lib = torch.library.Library("jbtest", "DEF")
_lib.define("pair_energy(Tensor pos, int n_owned, float cutoff) -> Tensor")
_lib.define("system_sum(Tensor e) -> Tensor")
_lib.define("twice(Tensor x, Tensor y, float scale=2.0) -> Tensor")
_lib.define("split_sum(Tensor x) -> (Tensor, Tensor)")


def _phi(r2: torch.Tensor, rc: float) -> torch.Tensor:
    """Smooth pair energy eps * (1 - r^2/rc^2)^2 inside the cutoff."""
    u = (1.0 - r2 / (rc * rc)).clamp(min=0.0)
    return EPS * u * u


def _pair_energy(pos: torch.Tensor, n_owned: int, cutoff: float) -> torch.Tensor:
    """Per-row partial energies: pairs with >= 1 owned row; ghost-owned pairs split 1/4 + 1/4."""
    n = pos.shape[0]
    d = pos[:, None, :] - pos[None, :, :]
    r2 = (d * d).sum(-1) + torch.eye(n, dtype=pos.dtype, device=pos.device) * (4 * cutoff * cutoff)  # no self
    phi = _phi(r2, cutoff)
    owned = torch.arange(n, device=pos.device) < n_owned
    both = (owned[:, None] & owned[None, :]).to(pos.dtype)
    one = (owned[:, None] ^ owned[None, :]).to(pos.dtype)
    weight = 0.5 * both + 0.25 * one  # row i's share of pair (i, j)
    return (weight * phi).sum(1)


_lib.impl("pair_energy", _pair_energy, "CompositeImplicitAutograd")
_lib.impl("system_sum", lambda e: e.sum(0, keepdim=True), "CompositeImplicitAutograd")
_lib.impl("twice", lambda x, y, scale=2.0: scale * x + 0 * y.sum(), "CompositeImplicitAutograd")
_lib.impl("split_sum", lambda x: (x.clone(), x.sum(0)), "CompositeImplicitAutograd")


def reference(pos: np.ndarray, box: float) -> tuple[float, np.ndarray]:
    """Total energy and forces by a direct minimum-image double loop (numpy, cubic periodic box)."""
    n = len(pos)
    e, f = 0.0, np.zeros_like(pos)
    for i in range(n):
        for j in range(i + 1, n):
            d = pos[i] - pos[j]
            d -= box * np.round(d / box)
            r2 = float(d @ d)
            if r2 < CUTOFF**2:
                u = 1.0 - r2 / CUTOFF**2
                e += EPS * u * u
                dphi_dr2 = -2.0 * EPS * u / CUTOFF**2
                f[i] -= 2.0 * dphi_dr2 * d
                f[j] += 2.0 * dphi_dr2 * d
    return e, f


def system(n: int, box: float, seed: int) -> np.ndarray:
    """Random positions in a cubic box, kept >= 0.8 apart (rejection sampling)."""
    rng = np.random.default_rng(seed)
    pts: list[np.ndarray] = []
    while len(pts) < n:
        p = rng.uniform(0.0, box, 3)
        if all(np.linalg.norm((p - q) - box * np.round((p - q) / box)) > 0.8 for q in pts):
            pts.append(p)
    return np.array(pts)
