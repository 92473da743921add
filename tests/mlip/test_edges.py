"""EdgePlan: the block edges are exactly the pairs within reach, with images of own atoms as shifts."""

from __future__ import annotations

import itertools

import hypothesis
import numpy as np

from nvalchemi_jaxbridge.layout import HaloPlan
from nvalchemi_jaxbridge.mlip import EdgePlan
from tests.layout.test_halo_plan import systems


def _brute_force(positions: np.ndarray, cell: np.ndarray, periodic, reach: float) -> set[tuple]:
    """Every (receiver, sender, vector) with |vector| < reach over all periodic images (O(N^2 T))."""
    heights = abs(np.linalg.det(cell)) / np.linalg.norm(np.cross(cell[[1, 2, 0]], cell[[2, 0, 1]]), axis=1)
    span = [range(-int(np.ceil(reach / h)) - 1, int(np.ceil(reach / h)) + 2) if p else range(1)
            for h, p in zip(heights, periodic)]
    frac = np.linalg.solve(cell.T, positions.T).T
    positions = (frac - np.where(periodic, np.floor(frac), 0.0)) @ cell  # wrapped: the images above suffice
    out = set()
    for t in itertools.product(*span):
        vec = positions[:, None, :] - positions[None, :, :] - np.array(t) @ cell  # receiver i, sender j
        for i, j in zip(*np.nonzero(np.linalg.norm(vec, axis=2) < reach)):
            if i != j or any(t):
                out.add((int(i), int(j), *np.round(vec[i, j], 6)))
    return out


@hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
@hypothesis.given(systems())
def test_edges_without_self_image_rows_are_every_pair_within_reach(system):
    positions, cell, periodic, cutoff, skin, n_devices, grid = system
    plan = HaloPlan.build(positions, cell, periodic=periodic, cutoff=cutoff, skin=skin, n_devices=n_devices,
                          grid=grid, self_images=False)
    edges = EdgePlan.build(plan, positions, cutoff=cutoff, receivers="owned")
    halo = plan.to_halo(positions, positions=True).reshape(n_devices, plan.halo_rows, 3)
    got = set()
    for d in range(n_devices):
        e = edges.edges[d, : edges.n_edges[d]]
        vec = halo[d, e[:, 1]] - halo[d, e[:, 0]] + edges.shift[d, : edges.n_edges[d]]
        assert np.all(e[:, 1] < plan.n_owned[d]) and np.all(e[:, 0] < plan.n_padded[d])  # real rows only
        for (s, r), v in zip(e, vec):
            got.add((int(plan.halo_global[d, r]), int(plan.halo_global[d, s]), *np.round(v, 6)))
        cells = np.linalg.solve(plan.basis.T, -edges.shift[d].T).T  # each shift is a whole lattice vector
        np.testing.assert_allclose(cells, np.round(cells), rtol=0, atol=1e-9)
    assert len(got) == int(edges.n_edges.sum())  # no edge twice
    want = _brute_force(positions, plan.basis, periodic, cutoff + skin)
    assert got == want, (sorted(got - want)[:5], sorted(want - got)[:5])


def _block_reference(plan, positions, dev: int, reach: float, receivers: str, receiver_reach) -> list[tuple]:
    """One block's edges by brute force, `(receiver, sender row, image)` sorted: every point (real rows, then
    images of own atoms placed as points) within `reach` of a receiving row, itself excluded."""
    halo = plan.to_halo(positions, positions=True).reshape(plan.n_devices, plan.halo_rows, 3)[dev]
    n_own, n_real = int(plan.n_owned[dev]), int(plan.n_padded[dev])
    own = plan.own_images[dev] if plan.own_images else np.zeros((0, 4), np.int64)
    points = [(r, (0, 0, 0), halo[r]) for r in range(n_real)]
    points += [(int(o[0]), tuple(int(t) for t in o[1:]), halo[o[0]] + o[1:] @ plan.basis) for o in own]
    if receivers == "owned":
        recv = range(n_own)
    else:
        recv = [r for r in range(n_real) if receiver_reach is None or n_own and min(
            np.linalg.norm(halo[r] - halo[q]) for q in range(n_own)) <= receiver_reach]
    out = []
    for r in recv:
        for k, (row, image, x) in enumerate(points):
            if k != r and np.linalg.norm(x - halo[r]) <= reach:
                out.append((r, row, image))
    return sorted(out)


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(systems(), hypothesis.strategies.booleans(), hypothesis.strategies.sampled_from(["owned", "all", "near"]))
def test_edges_are_the_brute_force_pairs_in_receiver_then_sender_order(system, self_images, mode):
    """Every block's edge table, row by row: the brute-force pairs ordered by receiver, sender row and image
    (the order the edges are listed in), then padding edges on the spare rows with zero shift."""
    positions, cell, periodic, cutoff, skin, n_devices, grid = system
    plan = HaloPlan.build(positions, cell, periodic=periodic, cutoff=2 * cutoff, skin=skin, n_devices=n_devices,
                          grid=grid, self_images=self_images)
    receivers = "owned" if mode == "owned" else "all"
    receiver_reach = cutoff + skin if mode == "near" else None
    edges = EdgePlan.build(plan, positions, cutoff=cutoff, receivers=receivers, receiver_reach=receiver_reach)
    for d in range(n_devices):
        n = int(edges.n_edges[d])
        image = np.rint(np.linalg.solve(plan.basis.T, -edges.shift[d, :n].T).T).astype(int)
        got = [(int(r), int(s), tuple(t)) for (s, r), t in zip(edges.edges[d, :n], image.tolist())]
        assert got == _block_reference(plan, positions, d, cutoff + skin, receivers, receiver_reach)
        pads = np.arange(int(plan.n_padded[d]), plan.halo_rows)
        np.testing.assert_array_equal(edges.spare[d], pads[np.arange(edges.edge_capacity) % len(pads)])
        np.testing.assert_array_equal(edges.edges[d, n:], np.stack([edges.spare[d, n:]] * 2, axis=1))
        assert not edges.shift[d, n:].any()
