"""The PyTorch door with its stages recorded and replayed (`TorchDistributedMLIP(cuda_graphs=)`), one rank.

CI has no GPU, so the stages are recorded by `FakeCapture`, which keeps the CUDA backend's buffers and replay
rules (`kernels/capture_backends.py`). The graphed door runs the block at the layout's capacities
(`mlip/torch_graphs.py`), the eager one at its exact rows and edges: their energy, forces, stress and atomic
energies must agree within 1e-10 relative (float64), on a second geometry of the same layout too (new values in
the same recordings), and on a re-planned layout of the same capacities, which replays rather than records.
Two ranks run in the front door's shared job (tests/mlip/torch_worker.py, cases ending in ":graphs").
The JAX door's versions of these tests are tests/mlip/test_cuda_graphs_door.py.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.kernels import cuda_graphs
from nvalchemi_jaxbridge.kernels.cuda_graphs import FakeCapture
from nvalchemi_jaxbridge.mlip.torch_model import TorchDistributedMLIP
from tests.mlip import cases
from tests.mlip.cases import HostReadingMPNN

KEYS = ("energy", "forces", "stress", "atomic_energies")
LOG = "nvalchemi_jaxbridge.kernels.cuda_graphs"


def args(atoms) -> tuple:
    return atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc


def moved(atoms, seed: int, by: float = 0.1):
    """The structure with every atom moved by up to `by` Å (0.1: within skin/2, the same layout holds)."""
    out = atoms.copy()
    out.positions += np.random.default_rng(seed).uniform(-by, by, size=out.positions.shape)
    return out


def check_same(got: dict, want: dict) -> None:
    """Graphed against eager: 1e-10 relative to each output's largest value."""
    for key in KEYS:
        scale = float(np.abs(want[key]).max())
        assert scale > 1e-6, key  # not a vanishing comparison
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-10 * scale, err_msg=key)


def n_stages(dm: TorchDistributedMLIP) -> int:
    """Recorded functions per evaluation: one per layer with per-layer exchange, one with the deep halo."""
    return dm.wrapper.n_layers if dm.exchange == "per_layer" else 1


@pytest.mark.parametrize("exchange", ["per_layer", "deep_halo"])
def test_mpnn_replays_give_the_eager_numbers_and_only_a_capacity_growth_records_again(exchange):
    atoms = cases.structure("small")
    graphed = TorchDistributedMLIP(cases.wrapper("mpnn"), exchange=exchange, cuda_graphs=FakeCapture())
    eager = TorchDistributedMLIP(cases.wrapper("mpnn"), exchange=exchange, cuda_graphs=False)
    assert eager.stages is None
    g, n = graphed.stages.graphs, n_stages(graphed)
    state_g, state_e = graphed.prepare(*args(atoms)), eager.prepare(*args(atoms))
    for geometry in (atoms, moved(atoms, 1)):
        check_same(graphed.evaluate(*args(geometry), state=state_g), eager.evaluate(*args(geometry), state=state_e))
    assert g.off is None and (g.captures, g.replays, g.eager_backwards) == (n, 2 * n, 0)
    # past skin/2: a new layout, of the same capacities, replays the same recordings
    far = moved(atoms, 2, by=0.4)
    state = graphed.update(state_g, far.positions)
    assert state is not state_g
    assert (state.plan.halo_rows, state.plan.owned_capacity, state.edges.edge_capacity) == \
        (state_g.plan.halo_rows, state_g.plan.owned_capacity, state_g.edges.edge_capacity)
    check_same(graphed.evaluate(*args(far), state=state), eager.evaluate(*args(far)))
    assert (g.captures, g.replays) == (n, 3 * n)
    # more atoms: larger capacities, recorded again
    larger = cases.structure("half")
    check_same(graphed.evaluate(*args(larger)), eager.evaluate(*args(larger)))
    assert (g.captures, g.replays) == (2 * n, 4 * n)


def test_without_stress_the_strain_is_left_out_and_recorded_apart():
    atoms = cases.structure("small")
    graphed = TorchDistributedMLIP(cases.wrapper("mpnn"), cuda_graphs=FakeCapture())
    eager = TorchDistributedMLIP(cases.wrapper("mpnn"), cuda_graphs=False)
    got, want = graphed.evaluate(*args(atoms), stress=False), eager.evaluate(*args(atoms), stress=False)
    assert "stress" not in got
    for key in ("energy", "forces", "atomic_energies"):
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-10 * float(np.abs(want[key]).max()))
    graphed.evaluate(*args(atoms))  # the shifts now require grad: another signature
    n = n_stages(graphed)
    assert graphed.stages.graphs.captures == 2 * n


def test_a_model_that_cannot_be_recorded_runs_eagerly_after_one_log_line(caplog):
    atoms = cases.structure("small")
    graphed = TorchDistributedMLIP(HostReadingMPNN(cases.wrapper("mpnn").model), cuda_graphs=FakeCapture())
    eager = TorchDistributedMLIP(cases.wrapper("mpnn"), cuda_graphs=False)
    with caplog.at_level(logging.WARNING, logger=LOG):
        for geometry in (atoms, moved(atoms, 3)):
            check_same(graphed.evaluate(*args(geometry)), eager.evaluate(*args(geometry)))
    cases.check_fell_back_once(caplog, graphed.stages.graphs, LOG)


def test_auto_is_eager_on_the_cpu_and_true_asks_for_a_gpu():
    w = cases.wrapper("mpnn")
    if cuda_graphs.default_backend(torch.device("cpu")) is not None:  # JAXBRIDGE_TEST_CUDA_GRAPHS=fake (conftest)
        assert isinstance(TorchDistributedMLIP(w).stages.graphs.backend, FakeCapture)
        return
    assert TorchDistributedMLIP(w).stages is None
    with pytest.raises(ValueError, match=r"TorchDistributedMLIP: the stages of model 'mpnn': cuda_graphs=True but "
                                         r"the model's stages run on 'cpu'.*cuda_graphs=\"auto\".*or False"):
        TorchDistributedMLIP(w, cuda_graphs=True)
    with pytest.raises(ValueError, match=r"cuda_graphs must be \"auto\", True or False, got 'yes'"):
        TorchDistributedMLIP(w, cuda_graphs="yes")


def test_tiles_run_eagerly():
    atoms = cases.structure("small")
    graphed = TorchDistributedMLIP(cases.wrapper("mpnn"), exchange="deep_halo", tiles=2, cuda_graphs=FakeCapture())
    eager = TorchDistributedMLIP(cases.wrapper("mpnn"), exchange="deep_halo", tiles=2, cuda_graphs=False)
    check_same(graphed.evaluate(*args(atoms)), eager.evaluate(*args(atoms)))
    assert graphed.stages.graphs.captures == 0


@pytest.mark.slow
def test_mace_replays_give_the_eager_numbers():
    pytest.importorskip("mace", reason="needs mace-torch: pip install 'nvalchemi_jaxbridge[mlip]'")
    atoms = cases.structure("small")
    graphed = TorchDistributedMLIP(cases.wrapper("mace"), cuda_graphs=FakeCapture())
    eager = TorchDistributedMLIP(cases.wrapper("mace"), cuda_graphs=False)
    state_g, state_e = graphed.prepare(*args(atoms)), eager.prepare(*args(atoms))
    for geometry in (atoms, moved(atoms, 4)):
        check_same(graphed.evaluate(*args(geometry), state=state_g), eager.evaluate(*args(geometry), state=state_e))
    g = graphed.stages.graphs
    assert g.off is None and (g.captures, g.replays) == (2, 4)  # MACE's two layers: two recorded stages
