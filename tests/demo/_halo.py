"""Test helper: a one-device halo block built with plain numpy (independent of the layout layer)."""

import itertools
import math

import numpy as np


def halo_block(positions, cell, periodic, cutoff, *, n_pad=3, rng=None, bucket=1):
    """Rows [owned | periodic-image ghosts within cutoff of an owned atom | parked padding].

    Returns (rows (R, 3), owned_mask (R,), owner (R,) atom index or -1 for padding).
    Rows are shuffled when `rng` is given (the potentials must not depend on row order);
    extra padding rows round the row count up to a multiple of `bucket`.
    """
    pos = np.asarray(positions, dtype=np.float64)
    n = pos.shape[0]
    cell = np.asarray(cell, dtype=np.float64)
    inv = np.linalg.inv(cell)
    frac = pos @ inv
    frac = np.where(np.array(periodic)[None], frac - np.floor(frac), frac)
    pos = frac @ cell
    reach = [math.ceil(cutoff / (1.0 / np.linalg.norm(inv[:, k]))) if periodic[k] else 0 for k in range(3)]
    rows, owner = [pos], [np.arange(n)]
    for shift in itertools.product(*[range(-r, r + 1) for r in reach]):
        if not any(shift):
            continue
        img = pos + np.array(shift, dtype=np.float64) @ cell
        dist = np.sqrt(((img[:, None, :] - pos[None, :, :]) ** 2).sum(-1)).min(1)
        keep = dist <= cutoff + 1e-9
        rows.append(img[keep])
        owner.append(np.arange(n)[keep])
    n_real = sum(r.shape[0] for r in rows)
    n_pad += (-(n_real + n_pad)) % bucket
    far = 1e4 + 10.0 * cutoff * np.arange(1, n_pad + 1)  # parked far apart from everything
    rows.append(np.stack([far, -far, far], axis=1))
    owner.append(np.full(n_pad, -1))
    rows, owner = np.concatenate(rows), np.concatenate(owner)
    mask = np.zeros(rows.shape[0])
    mask[:n] = 1.0
    if rng is not None:
        perm = rng.permutation(rows.shape[0])
        rows, owner, mask = rows[perm], owner[perm], mask[perm]
    return rows, mask, owner


def fold(row_forces, owner, n):
    """Add each row's force into its atom (the ScatterOutputs reverse step); padding must be zero."""
    f = np.zeros((n, 3))
    real = owner >= 0
    np.add.at(f, owner[real], np.asarray(row_forces)[real])
    return f, np.asarray(row_forces)[~real]


def random_gas(rng, n, box, min_dist):
    """n points in a cubic box, no two closer than min_dist (periodic), by rejection."""
    pts = []
    while len(pts) < n:
        p = rng.uniform(0, box, 3)
        if all(np.linalg.norm((p - q) - box * np.round((p - q) / box)) >= min_dist for q in pts):
            pts.append(p)
    return np.array(pts)
