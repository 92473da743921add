"""Independent numpy references for the layout tests (no code shared with the package)."""

from __future__ import annotations

import itertools

import numpy as np


def brute_force_pairs(pos: np.ndarray, cell: np.ndarray, periodic, cutoff: float):
    """All `(i, j, t)` with `|pos[j] + t @ cell - pos[i]| <= cutoff`, `t` integer, `(i, j, t) != (i, i, 0)`.

    Loops over every atom `i` and every image `t` in a cube that certainly
    holds all partners (`t = 0` on non-periodic axes).
    """
    full = cell.copy()
    for k in range(3):  # a zero row (non-periodic) only matters for the range bound: complete it
        if not np.any(full[k]):
            a, b = full[(k + 1) % 3], full[(k + 2) % 3]
            c = np.cross(a, b)
            full[k] = c / np.linalg.norm(c) if np.any(c) else np.eye(3)[k]
    heights = np.abs(np.linalg.det(full)) / np.array(
        [np.linalg.norm(np.cross(full[(k + 1) % 3], full[(k + 2) % 3])) for k in range(3)]
    )
    frac = np.linalg.solve(full.T, pos.T).T if len(pos) else np.zeros((1, 3))  # pos = frac @ full
    reach = np.ceil(np.ptp(frac, axis=0) + cutoff / heights).astype(int) + 1
    ranges = [range(-reach[k], reach[k] + 1) if periodic[k] else range(0, 1) for k in range(3)]
    images = np.array(list(itertools.product(*ranges)), dtype=np.int64)
    shifts = images @ cell
    out_i, out_j, out_t = [], [], []
    for i in range(len(pos)):
        d = pos[None, :, :] + shifts[:, None, :] - pos[i]  # (T, N, 3)
        t_idx, j = np.nonzero(np.linalg.norm(d, axis=2) <= cutoff)
        keep = ~((j == i) & ~images[t_idx].any(axis=1))
        out_i.append(np.full(keep.sum(), i))
        out_j.append(j[keep])
        out_t.append(images[t_idx[keep]])
    if not out_i:
        return np.zeros(0, int), np.zeros(0, int), np.zeros((0, 3), int)
    return np.concatenate(out_i), np.concatenate(out_j), np.concatenate(out_t)


def assert_pairs_covered(plan, pos: np.ndarray, cell: np.ndarray, cutoff: float) -> int:
    """Every pair within `cutoff` appears in the halo of the first atom's owner, at the right displacement.

    The halo block may hold the atoms in another periodic frame than `pos`, so
    the pair `(i, j, t)` must appear as a row of `j` at `p_i + (pos[j] + t @ cell - pos[i])`,
    where `p_i` is the owned halo row of `i`. Returns the number of ordered pairs checked.
    """
    owner = np.full(len(pos), -1)
    for d in range(plan.n_devices):
        ids = plan.owned_global[d][plan.owned_global[d] >= 0]
        owner[ids] = d
    halo_pos = plan.to_halo(pos, positions=True).reshape(plan.n_devices, plan.halo_rows, 3)
    n_owned = [int((plan.owned_global[d] >= 0).sum()) for d in range(plan.n_devices)]
    own_row = np.zeros((len(pos), 3))
    for d in range(plan.n_devices):
        own_row[plan.halo_global[d, : n_owned[d]]] = halo_pos[d, : n_owned[d]]
    quantum = 1e-6
    rows = [
        {(int(g), *np.round(p / quantum).astype(np.int64).tolist()) for g, p in zip(plan.halo_global[d], halo_pos[d]) if g >= 0}
        for d in range(plan.n_devices)
    ]
    i, j, t = brute_force_pairs(pos, cell, plan.periodic, cutoff)
    target = own_row[i] + (pos[j] + t @ cell - pos[i])
    for a, b, x in zip(i, j, target):
        d = owner[a]
        if (int(b), *np.round(x / quantum).astype(np.int64).tolist()) in rows[d]:
            continue
        found = halo_pos[d][plan.halo_global[d] == b]
        assert len(found) and np.min(np.linalg.norm(found - x, axis=1)) < 1e-8, (
            f"pair ({a}, {b}) at {x} is missing from the halo of rank {d}"
        )
    return len(i)
