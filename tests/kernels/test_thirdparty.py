"""A real third-party op: nvalchemiops::dsf_csr_op (damped shifted force electrostatics,
Warp on the CPU) behind an OpAdapter, on a periodic NaCl box over 4 devices, against the
same op run once on the whole box.

Needs `nvalchemi-toolkit-ops` (and its dependency `warp-lang`); skipped without them.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

pytestmark = pytest.mark.thirdparty

dsf = pytest.importorskip(
    "nvalchemiops.torch.interactions.electrostatics.dsf",
    reason="needs nvalchemi-toolkit-ops + warp-lang (pip install nvalchemi-toolkit-ops warp-lang)",
)

import torch  # noqa: E402

from nvalchemi_jaxbridge.kernels import compile  # noqa: E402
from nvalchemi_jaxbridge.layout import HaloPlan  # noqa: E402
from nvalchemi_jaxbridge.lower import make_mesh  # noqa: E402
from nvalchemi_jaxbridge.spec import DistributionSpec, OpAdapter  # noqa: E402
from nvalchemi_jaxbridge.spec.policies import HaloStoragePolicy  # noqa: E402

A, CELLS, CUTOFF, ALPHA, D = 5.64, 2, 5.0, 0.2, 4


def _rock_salt(seed: int):
    fcc = np.array([[0, 0, 0], [0, 0.5, 0.5], [0.5, 0, 0.5], [0.5, 0.5, 0]])
    na = np.array([f + c for c in itertools.product(range(CELLS), repeat=3) for f in fcc]) * A
    pos = np.concatenate([na, na + [A / 2, 0, 0]])
    pos += np.random.default_rng(seed).normal(scale=0.1, size=pos.shape)  # non-zero forces
    q = np.concatenate([np.ones(len(na)), -np.ones(len(na))])
    return pos, q, np.eye(3) * A * CELLS


def _csr(rows_i: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.concatenate([[0], np.cumsum([len(r) for r in rows_i])]).astype(np.int32)
    idx = np.array([j for r in rows_i for j in r], dtype=np.int32)
    return idx, ptr


def _reference(pos, q, cell):
    """The op once on the whole periodic box: full CSR list over all images within the cutoff."""
    n = len(pos)
    rows, shifts = [], []
    for i in range(n):
        row = []
        for j in range(n):
            for s in itertools.product((-1, 0, 1), repeat=3):
                if i == j and s == (0, 0, 0):
                    continue
                if np.linalg.norm(pos[i] - pos[j] - np.array(s) @ cell) < CUTOFF:
                    row.append(j)
                    shifts.append(s)
        rows.append(row)
    idx, ptr = _csr(rows)
    t = lambda a, dt=torch.float64: torch.tensor(np.asarray(a), dtype=dt)  # noqa: E731
    energy, forces = torch.zeros(1, dtype=torch.float64), torch.zeros(n, 3, dtype=torch.float64)
    torch.ops.nvalchemiops.dsf_csr_op(
        t(pos), t(q), t(idx, torch.int32), t(ptr, torch.int32), CUTOFF, ALPHA, energy, forces,
        torch.zeros(1, 3, 3, dtype=torch.float64), torch.zeros(n, dtype=torch.float64), True, False, False,
        cell=t(cell[None]), unit_shifts=t(shifts, torch.int32), batch_idx=torch.zeros(n, dtype=torch.int32),
    )
    return float(energy[0]), forces.numpy()


def _halo_neighbors(halo_pos: np.ndarray, owned_mask: np.ndarray, hr: int):
    """Per device: CSR over its halo block (owned rows list neighbours among all rows), padded."""
    idx_all, ptr_all = [], []
    for d in range(D):
        block = halo_pos[d * hr : (d + 1) * hr]
        rows = []
        for i in range(hr):
            if not owned_mask[d, i]:
                rows.append([])
                continue
            r = np.linalg.norm(block[i] - block, axis=1)
            rows.append([j for j in np.flatnonzero(r < CUTOFF) if j != i])
        idx, ptr = _csr(rows)
        idx_all.append(idx)
        ptr_all.append(ptr)
    cap = max(len(i) for i in idx_all) + 1
    idx = np.concatenate([np.pad(i, (0, cap - len(i))) for i in idx_all]).astype(np.int32)
    return idx, np.concatenate(ptr_all).astype(np.int32)


def test_dsf_csr_op_over_4_devices_matches_one_device():
    pos, q, cell = _rock_salt(seed=0)
    e_ref, f_ref = _reference(pos, q, cell)
    assert np.abs(f_ref).max() > 1e-3  # the displacements make the forces a real test

    adapter = OpAdapter("nvalchemiops::dsf_csr_op", gather_inputs=[0, 1], all_reduce_outputs=[0], scatter_outputs=[1])
    spec = DistributionSpec(policy=HaloStoragePolicy(), custom_ops=(adapter,))
    plan = HaloPlan.build(pos, cell, cutoff=CUTOFF, n_devices=D)
    cs = compile(spec, make_mesh(D), plan, positions={adapter: ["positions"]})
    hr = cs.tables.halo_rows
    owned_mask = np.asarray(cs.halo_owned_mask()).reshape(D, hr)
    idx, ptr = _halo_neighbors(plan.to_halo(pos, positions=True), owned_mask, hr)
    sh = NamedSharding(cs.mesh, P(cs.axis))
    put = lambda a: jax.device_put(np.asarray(a), sh)  # noqa: E731 (per-device blocks)
    batch = np.where(owned_mask, 0, 1).astype(np.int32).reshape(-1)  # system 0: owned rows

    energy, forces, _virial, _cg = cs.call(
        adapter, cs.owned(pos, positions=True), cs.owned(q), put(idx), put(ptr), CUTOFF, ALPHA,
        put(np.zeros(2 * D)), put(np.zeros((D * hr, 3))), put(np.zeros((2 * D, 3, 3))), put(np.zeros(D * hr)),
        True, False, False, batch_idx=put(batch),
    )
    np.testing.assert_allclose(float(energy[0]), e_ref, rtol=1e-10)
    f = cs.to_global(np.asarray(forces).reshape(D, hr, 3)[:, : cs.tables.owned_capacity].reshape(-1, 3))
    np.testing.assert_allclose(f, f_ref, rtol=1e-10, atol=1e-12)
