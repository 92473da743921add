"""The front door in real multi-process jobs (jax.distributed, gloo, one CPU device per process).

One launch per world size (module-scoped fixture) runs tests/torch/worker.py on
every rank; the tests below compare what the ranks wrote against an
independent numpy reference (energies, forces) and the semantics reference's
golden 2-rank vectors. The golden vectors are checked in a real 2-process
run rather than one process driving two devices, because the front door's
contract is one local block per process: that is the path users run.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

from tests._launch import run_ranks
from tests.torch import model

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "torch" / "worker.py"

pytestmark = pytest.mark.multiprocess


def _run(world: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Launch the worker on `world` processes; the per-rank results (or a failure with the log)."""
    return run_ranks(WORKER, world, tmp_path_factory.mktemp(f"world{world}"))


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
