"""The PyTorch front door in real multi-process jobs (jax.distributed, gloo, one CPU device per process).

One launch per world size (tests/torch/all_workers.py; real torchrun starts the 2-process one) runs the
front door's workers on every rank: tests/torch/worker.py (a model and the golden vectors),
exchange_worker.py (refresh/fold), on 2 ranks meaning_worker.py (sums over atoms), and the checks that
tests/mlip/test_torch_door.py and tests/torch/test_torchrun.py judge. Importing and starting torch, JAX and
gloo cost most of a small launch, so the checks share it; the sections below judge what the ranks wrote
against independent references. The golden vectors are checked in a real 2-process run rather than one
process driving two devices, because the front door's contract is one local block per process: that is
the path users run.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from tests._launch import front_door_run, read_ranks
from tests.torch import model, pair_models

BOX, N, SEED, FEAT = 7.0, 40, 3, 2  # exchange_worker.py's

pytestmark = pytest.mark.multiprocess


def _run(world: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Launch the worker on `world` processes; the per-rank results (or a failure with the log)."""
    return read_ranks(front_door_run(world, tmp_path_factory) / "worker", world)


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _run(2, tmp_path_factory)


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _run(4, tmp_path_factory)


@pytest.fixture(scope="module")
def reference() -> tuple[float, np.ndarray]:
    pos = model.system(40, 7.0, 3)  # the worker's system (BOX, N, SEED)
    return model.reference(pos, 7.0)


def _check_model(ranks: list[dict], ref: tuple[float, np.ndarray]) -> None:
    e_ref, f_ref = ref
    world = len(ranks)
    assert sum(r["n_owned"] for r in ranks) == 40
    assert any(r["n_ghost"] > 0 for r in ranks), "the test system should have ghosts on some rank"
    for r in ranks:
        rep, sym = r["replicated"], r["symmetric"]
        assert rep["layout_e_atoms"] == "halo" and rep["layout_energy"] == "replicated"
        np.testing.assert_allclose(rep["energy"], e_ref, rtol=1e-12)
        np.testing.assert_allclose(np.array(rep["forces"]), f_ref, rtol=1e-9, atol=1e-12, err_msg=f"rank {r['rank']}")
        # all_reduce_outputs (replicated_consumer=False): each rank's cotangent is a partial, so
        # seeding 1 on every rank sums to world_size (the reference semantics, golden [2,2,2,0]).
        np.testing.assert_allclose(sym["energy"], e_ref, rtol=1e-12)
        np.testing.assert_allclose(np.array(sym["forces"]), world * f_ref, rtol=1e-9, atol=1e-12)


def test_two_processes_match_single_device(world2, reference):
    _check_model(world2, reference)


def test_four_processes_match_single_device(world4, reference):
    _check_model(world4, reference)


def test_golden_gather_inputs_forward_and_reverse(world2):
    g0, g1 = world2[0]["golden"], world2[1]["golden"]
    assert g0["forward"] == [1, 11, 21, 31] and g1["forward"] == [31, 41, 51, 11, 21]
    assert g0["reverse_ones"] == [1, 2, 2] and g1["reverse_ones"] == [2, 1, 1]
    assert g0["grad_sum_2out"] == [2, 4, 4] and g1["grad_sum_2out"] == [4, 2, 2]


def test_golden_scatter_outputs_value_and_adjoint(world2):
    g0, g1 = world2[0]["golden"], world2[1]["golden"]
    assert g0["scatter"] == [2, 4, 4, 4] and g1["scatter"] == [4, 2, 2, 4, 4]
    assert g0["scatter_adjoint"] == [2, 12, 16, 10] and g1["scatter_adjoint"] == [10, 4, 6, 12, 16]
    # beyond the reference: a trailing "+1" row is kept as the kernel wrote it, not dropped
    assert g0["scatter_plus1"] == [2, 4, 4, 4, 2] and g1["scatter_plus1"] == [4, 2, 2, 4, 4, 2]


def test_golden_all_reduce_sum_both_adjoints(world2):
    for rank, r in enumerate(world2):
        g = r["golden"]
        pad = [[0], [0, 0]][rank]
        for key in ("symmetric", "replicated"):
            assert g[f"allreduce_{key}_out1"] == [42]
            assert g[f"allreduce_{key}_out0_shape"] == [3, 1]
            assert g[f"allreduce_{key}_out1_layout"] == "replicated"
        assert g["allreduce_symmetric_grad"] == [2, 2, 2] + pad
        assert g["allreduce_replicated_grad"] == [1, 1, 1] + pad


def test_golden_gather_full_and_slice_outputs_owned(world2):
    g0, g1 = world2[0]["golden"], world2[1]["golden"]
    assert g0["shard_out"] == [2, 22, 42, -2] and g1["shard_out"] == [62, 82, 102, -2]
    assert g0["shard_grad"] == [2, 2, 2, 2] and g1["shard_grad"] == [2, 2, 2, 2]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

# ------------------------------------------------------------------ refresh_halo / fold_halo (exchange_worker.py)
# `refresh_halo` / `fold_halo` in real 2- and 4-process CPU jobs (jax.distributed, gloo).
#
# tests/torch/exchange_worker.py runs on every rank and writes its inputs and
# results; the references here come from the plan's `halo_global` ids only (every
# halo row of atom g holds g's value; a fold gives every copy of g the sum over all
# copies on all ranks), never from the exchange tables. The adjoint identities
# `<w, R x> = <R^T w, x>` are summed over ranks, as the reference's gloo tests do.


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def exchange_ranks(request, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    world = request.param
    return read_ranks(front_door_run(world, tmp_path_factory) / "exchange_worker", world,
                      result="rank{rank}_exchange.json")


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


def test_refresh_halo_puts_owner_values_on_ghosts_and_its_adjoint_sums_into_owners(exchange_ranks):
    world = len(exchange_ranks)
    plan = _plan(world)
    assert any(int(n) > 0 for n in plan.n_ghost)
    x_global = np.random.default_rng(SEED).normal(size=(N, FEAT))
    s_w = _sum_over_copies(plan, [np.array(r["w"]) for r in exchange_ranks])
    for rank, r in enumerate(exchange_ranks):
        n_own = int(plan.n_owned[rank])
        np.testing.assert_allclose(r["refresh"]["out"], x_global[_ids(plan, rank)], rtol=0, atol=0)
        want = np.zeros((len(_ids(plan, rank)), FEAT))
        want[:n_own] = s_w[np.asarray(plan.owned_global)[rank, :n_own]]
        np.testing.assert_allclose(r["refresh"]["grad"], want, rtol=1e-12, atol=1e-12, err_msg=f"rank {rank}")
    lhs, rhs = (sum(r["refresh"][k] for r in exchange_ranks) for k in ("dot_w_Rx", "dot_RTw_x"))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-10)


def test_fold_halo_gives_every_copy_the_total_and_is_self_adjoint(exchange_ranks):
    plan = _plan(len(exchange_ranks))
    s_y = _sum_over_copies(plan, [np.array(r["y"]) for r in exchange_ranks])
    s_w = _sum_over_copies(plan, [np.array(r["w"]) for r in exchange_ranks])
    for rank, r in enumerate(exchange_ranks):
        ids = _ids(plan, rank)
        np.testing.assert_allclose(r["fold"]["out"], s_y[ids], rtol=1e-12, atol=1e-12, err_msg=f"rank {rank}")
        np.testing.assert_allclose(r["fold"]["grad"], s_w[ids], rtol=1e-12, atol=1e-12, err_msg=f"rank {rank}")
    lhs, rhs = (sum(r["fold"][k] for r in exchange_ranks) for k in ("dot_w_Fy", "dot_FTw_y"))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-10)


def test_switched_off_exchanges_are_the_identity(exchange_ranks):
    for r in exchange_ranks:
        assert r["identity"] == {"refresh_only_fold": True, "local_gather_refresh": True,
                                 "local_scatter_fold": True, "refresh_only_refresh_equal": True}


def test_graph_parallel_refresh_gathers_all_rows_and_reduce_scatters_back(exchange_ranks):
    world = len(exchange_ranks)
    x_global = np.random.default_rng(SEED).normal(size=(N, FEAT))
    w_sum = sum(np.array(r["graph_parallel"]["w"]) for r in exchange_ranks)
    for rank, r in enumerate(exchange_ranks):
        gp = r["graph_parallel"]
        np.testing.assert_allclose(gp["out"], np.concatenate([x_global, [[-1.0 - rank] * FEAT]]), rtol=0, atol=0)
        ids = np.array(gp["owned_ids"])
        want = np.concatenate([w_sum[ids], [np.array(gp["w"])[N]]])       # owned rows: summed over exchange_ranks
        np.testing.assert_allclose(gp["grad"], want, rtol=1e-12, atol=1e-12, err_msg=f"rank {rank}")
    assert sorted(i for r in exchange_ranks for i in r["graph_parallel"]["owned_ids"]) == list(range(N)) and world > 1

# ------------------------------------------------------------------ sums over atoms (meaning_worker.py, 2 ranks)
# Sums over atoms of halo ShardTensors in a real 2-process job: owned rows once, identity adjoint.
#
# tests/torch/meaning_worker.py runs on both ranks (inside the shared all_workers.py launch); every rank's result is
# compared with numpy sums of the global values (ghost rows not counted again),
# and every rank's gradient with exactly one on owned rows (not the world size).


@pytest.fixture(scope="module")
def meaning_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return read_ranks(front_door_run(2, tmp_path_factory) / "meaning_worker", 2)


def _values() -> np.ndarray:
    return np.random.default_rng(3).normal(size=(40, 2))  # meaning_worker.values()


def test_ranks_have_ghosts(meaning_ranks):
    assert sum(r["n_owned"] for r in meaning_ranks) == 40 and all(r["n_ghost"] > 0 for r in meaning_ranks)


@pytest.mark.parametrize("name", ["sum", "sum0", "index_add_", "scatter_add", "system_sum"])
def test_sums_over_atoms_equal_numpy_on_every_rank_with_unit_gradient(meaning_ranks, name):
    v = _values()
    per_system = np.zeros((3, 2))
    np.add.at(per_system, np.arange(40) % 3, v)
    want = {"sum": v.sum(), "sum0": v.sum(0)}.get(name, per_system)
    for r in meaning_ranks:
        got = r[name]
        assert got["layout"] == "replicated"
        np.testing.assert_allclose(got["value"], want, rtol=1e-12, err_msg=f"rank {r['rank']}")
        grad = np.array(got["grad"])
        np.testing.assert_array_equal(grad[: r["n_owned"]], 1.0)  # not 2 = W: identity adjoint
        np.testing.assert_array_equal(grad[r["n_owned"]:], 0.0)


def test_mean_over_atoms_is_the_global_mean_on_every_rank_with_gradient_one_over_n(meaning_ranks):
    for r in meaning_ranks:
        got = r["mean0"]
        assert got["layout"] == "replicated"
        np.testing.assert_allclose(got["value"], _values().mean(0), rtol=1e-12, err_msg=f"rank {r['rank']}")
        grad = np.array(got["grad"])
        np.testing.assert_allclose(grad[: r["n_owned"]], 1 / 40, rtol=1e-14)  # the job's 40 atoms, not a rank's
        np.testing.assert_array_equal(grad[r["n_owned"]:], 0.0)


def test_all_and_any_over_atoms_are_the_global_answers_on_every_rank(meaning_ranks):
    v = _values()
    want = {"all": bool(np.all(v != 0)), "any0": False, "any_gt1_0": np.any(v > 1, 0).tolist(),
            "all_gt_m1_0": np.all(v > -1, 0).tolist()}
    for r in meaning_ranks:
        assert r["all_any"] == want, f"rank {r['rank']}"  # ghost rows were zeroed: they do not decide


def test_naive_model_raises_on_every_rank_naming_the_op(meaning_ranks):
    for r in meaning_ranks:
        assert r["naive"].startswith(f"torch.Tensor.__getitem__ (aten::index) on a ShardTensor with layout 'halo' "
                                     f"(rank {r['rank']}, argument 0 of shape")
        assert "nvalchemi_jaxbridge.mlip" in r["naive"] and ".to_local()" in r["naive"]


def test_dense_pair_models_on_two_ranks_raise_or_give_the_single_device_energy(meaning_ranks):
    # The held-out case: every pair of the tensor it is given, masked at the cutoff, summed, fed the positions'
    # ShardTensor. Before the catalogue, 'broadcast' returned a per-rank energy on both ranks with no error.
    pos = model.system(40, 7.0, 3)  # meaning_worker.py's system
    outcomes = [r["pairs"] for r in meaning_ranks]
    assert outcomes[0].keys() == outcomes[1].keys() and len(outcomes[0]) == 2 * len(pair_models.MODELS) + 2
    raised = 0
    for key in outcomes[0]:
        name, layout = key.split(":")
        single = pair_models.DensePairModel() if name == "full_tensor" else pair_models.MODELS[name]
        want = float(single(torch.tensor(pos)))  # the model itself on one device, the whole array
        for rank, got in enumerate(o[key] for o in outcomes):
            if "raised" in got:
                raised += 1
                assert got["raised"].startswith("torch."), got["raised"]
                assert f"layout '{layout}' (rank {rank}, argument" in got["raised"]
                assert "(aten::" in got["raised"] and "OpAdapter" in got["raised"], got["raised"]
            else:
                np.testing.assert_allclose(got["energy"], want, rtol=1e-13, err_msg=f"{key} on rank {rank}")
    assert raised == 2 * 2 * len(pair_models.MODELS)  # every dense pair model raised on both ranks
