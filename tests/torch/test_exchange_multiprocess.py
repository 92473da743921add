"""`refresh_halo` / `fold_halo` in real 2- and 4-process CPU jobs (jax.distributed, gloo).

tests/torch/exchange_worker.py runs on every rank and writes its inputs and
results; the references here come from the plan's `halo_global` ids only (every
halo row of atom g holds g's value; a fold gives every copy of g the sum over all
copies on all ranks), never from the exchange tables. The adjoint identities
`<w, R x> = <R^T w, x>` are summed over ranks, as the reference's gloo tests do.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from tests._launch import run_ranks
from tests.torch import model

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "torch" / "exchange_worker.py"
BOX, N, SEED, FEAT = 7.0, 40, 3, 2  # the worker's

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def ranks(request, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    world = request.param
    return run_ranks(WORKER, world, tmp_path_factory.mktemp(f"exchange{world}"), result="rank{rank}_exchange.json")


def _plan(world: int):
    from nvalchemi_jaxbridge.layout import HaloPlan

    return HaloPlan.build(model.system(N, BOX, SEED), np.eye(3) * BOX, cutoff=model.CUTOFF, n_devices=world)


def _ids(plan, rank: int) -> np.ndarray:
    return np.asarray(plan.halo_global)[rank, : int(plan.n_owned[rank] + plan.n_ghost[rank])]


def _sum_over_copies(plan, per_rank: list[np.ndarray]) -> np.ndarray:
    """`S[g]`: the sum of every rank's rows of atom g (owned and ghost copies)."""
    s = np.zeros((N, FEAT))
    for r, v in enumerate(per_rank):
        np.add.at(s, _ids(plan, r), v)
    return s


def test_refresh_halo_puts_owner_values_on_ghosts_and_its_adjoint_sums_into_owners(ranks):
    world = len(ranks)
    plan = _plan(world)
    assert any(int(n) > 0 for n in plan.n_ghost)
    x_global = np.random.default_rng(SEED).normal(size=(N, FEAT))
    s_w = _sum_over_copies(plan, [np.array(r["w"]) for r in ranks])
    for rank, r in enumerate(ranks):
        n_own = int(plan.n_owned[rank])
        np.testing.assert_allclose(r["refresh"]["out"], x_global[_ids(plan, rank)], rtol=0, atol=0)
        want = np.zeros((len(_ids(plan, rank)), FEAT))
        want[:n_own] = s_w[np.asarray(plan.owned_global)[rank, :n_own]]
        np.testing.assert_allclose(r["refresh"]["grad"], want, rtol=1e-12, atol=1e-12, err_msg=f"rank {rank}")
    lhs, rhs = (sum(r["refresh"][k] for r in ranks) for k in ("dot_w_Rx", "dot_RTw_x"))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-10)


def test_fold_halo_gives_every_copy_the_total_and_is_self_adjoint(ranks):
    plan = _plan(len(ranks))
    s_y = _sum_over_copies(plan, [np.array(r["y"]) for r in ranks])
    s_w = _sum_over_copies(plan, [np.array(r["w"]) for r in ranks])
    for rank, r in enumerate(ranks):
        ids = _ids(plan, rank)
        np.testing.assert_allclose(r["fold"]["out"], s_y[ids], rtol=1e-12, atol=1e-12, err_msg=f"rank {rank}")
        np.testing.assert_allclose(r["fold"]["grad"], s_w[ids], rtol=1e-12, atol=1e-12, err_msg=f"rank {rank}")
    lhs, rhs = (sum(r["fold"][k] for r in ranks) for k in ("dot_w_Fy", "dot_FTw_y"))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-10)


def test_switched_off_exchanges_are_the_identity(ranks):
    for r in ranks:
        assert r["identity"] == {"refresh_only_fold": True, "local_gather_refresh": True,
                                 "local_scatter_fold": True, "refresh_only_refresh_equal": True}


def test_graph_parallel_refresh_gathers_all_rows_and_reduce_scatters_back(ranks):
    world = len(ranks)
    x_global = np.random.default_rng(SEED).normal(size=(N, FEAT))
    w_sum = sum(np.array(r["graph_parallel"]["w"]) for r in ranks)
    for rank, r in enumerate(ranks):
        gp = r["graph_parallel"]
        np.testing.assert_allclose(gp["out"], np.concatenate([x_global, [[-1.0 - rank] * FEAT]]), rtol=0, atol=0)
        ids = np.array(gp["owned_ids"])
        want = np.concatenate([w_sum[ids], [np.array(gp["w"])[N]]])       # owned rows: summed over ranks
        np.testing.assert_allclose(gp["grad"], want, rtol=1e-12, atol=1e-12, err_msg=f"rank {rank}")
    assert sorted(i for r in ranks for i in r["graph_parallel"]["owned_ids"]) == list(range(N)) and world > 1
