"""Sums over atoms of halo ShardTensors in a real 2-process job: owned rows once, identity adjoint.

tests/torch/meaning_worker.py runs on both ranks; here every rank's result is
compared with numpy sums of the global values (ghost rows not counted again),
and every rank's gradient with exactly one on owned rows (not the world size).
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from tests._launch import run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "torch" / "meaning_worker.py"

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(WORKER, 2, tmp_path_factory.mktemp("meaning"))


def _values() -> np.ndarray:
    return np.random.default_rng(3).normal(size=(40, 2))  # meaning_worker.values()


def test_ranks_have_ghosts(ranks):
    assert sum(r["n_owned"] for r in ranks) == 40 and all(r["n_ghost"] > 0 for r in ranks)


@pytest.mark.parametrize("name", ["sum", "sum0", "index_add_", "scatter_add", "system_sum"])
def test_sums_over_atoms_equal_numpy_on_every_rank_with_unit_gradient(ranks, name):
    v = _values()
    per_system = np.zeros((3, 2))
    np.add.at(per_system, np.arange(40) % 3, v)
    want = {"sum": v.sum(), "sum0": v.sum(0)}.get(name, per_system)
    for r in ranks:
        got = r[name]
        assert got["layout"] == "replicated"
        np.testing.assert_allclose(got["value"], want, rtol=1e-12, err_msg=f"rank {r['rank']}")
        grad = np.array(got["grad"])
        np.testing.assert_array_equal(grad[: r["n_owned"]], 1.0)  # not 2 = W: identity adjoint
        np.testing.assert_array_equal(grad[r["n_owned"]:], 0.0)


def test_naive_model_raises_on_every_rank_naming_the_op(ranks):
    for r in ranks:
        assert r["naive"].startswith(f"torch.Tensor.__getitem__ on a ShardTensor with layout 'halo' (rank {r['rank']})")
        assert "nvalchemi_jaxbridge.mlip" in r["naive"] and ".to_local()" in r["naive"]
