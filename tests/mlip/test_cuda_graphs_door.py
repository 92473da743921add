"""The JAX front door with its stage ops recorded and replayed (`cuda_graphs=`), against eager and references.

CI has no GPU, so the stages are recorded by `FakeCapture`, which keeps the CUDA backend's buffers and
replay rules (`kernels/capture_backends.py`). Each model runs a second geometry on the same layout (new
values in the same recordings): graphed results equal the eager driver's to the last bits and the
independent references (ASE neighbour list; MACE's own forward) within the acceptance tolerances.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest

from nvalchemi_jaxbridge.kernels.cuda_graphs import FakeCapture
from nvalchemi_jaxbridge.mlip import DistributedMLIP
from tests.mlip import cases
from tests.mlip.cases import HostReadingMPNN
from tests.mlip._reference import mace_reference, reference

KEYS = ("energy", "forces", "stress", "atomic_energies")
LOG = "nvalchemi_jaxbridge.kernels.cuda_graphs"


@functools.cache
def eager_model(name: str, n_devices: int) -> DistributedMLIP:
    return DistributedMLIP(cases.wrapper(name), n_devices=n_devices, cuda_graphs=False)


def moved(atoms, seed: int):
    """The structure with every atom moved by up to 0.1 Å (within skin/2: the same layout holds)."""
    out = atoms.copy()
    out.positions += np.random.default_rng(seed).uniform(-0.1, 0.1, size=out.positions.shape)
    return out


def evaluate(dm: DistributedMLIP, atoms, state):
    return dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc, state=state)


def prepare(dm: DistributedMLIP, atoms):
    return dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)


def check_same(got: dict, want: dict) -> None:
    for key in KEYS:
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-12, err_msg=key)


def check_reference(out: dict, want: dict) -> None:
    assert abs(out["energy"] - want["energy"]) <= 1e-9 * abs(want["energy"])
    np.testing.assert_allclose(out["forces"], want["forces"], rtol=0, atol=1e-8)
    np.testing.assert_allclose(out["stress"], want["stress"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(out["atomic_energies"], want["atomic_energies"], rtol=0, atol=1e-9)


def mpnn_reference(atoms) -> dict:
    w = cases.wrapper("mpnn")
    return reference(w.model, atoms, w.cutoff, w.node_attrs(atoms.numbers))


@pytest.mark.parametrize("n_devices", [1, 2])
def test_mpnn_replayed_stages_give_the_eager_numbers_and_a_grown_capacity_records_again(n_devices):
    atoms = cases.structure("small")
    graphed, eager = DistributedMLIP(cases.wrapper("mpnn"), n_devices=n_devices, cuda_graphs=FakeCapture()), \
        eager_model("mpnn", n_devices)
    state_g, state_e = prepare(graphed, atoms), prepare(eager, atoms)
    for geometry in (atoms, moved(atoms, 1)):
        got = evaluate(graphed, geometry, state_g)
        check_same(got, evaluate(eager, geometry, state_e))
        check_reference(got, mpnn_reference(geometry))
    g = graphed.stages.graphs
    n_ops = len(graphed.stages.for_receivers(state_g.cs.tables.owned_capacity).named())
    # XLA's CPU devices are one torch device: they share each op's recording, so with two of them a backward
    # may find its activations replayed over by the other device's forward, and runs eagerly (same numbers)
    assert g.off is None and g.captures == n_ops and g.replays == 2 * n_ops * n_devices
    assert g.eager_backwards == 0 if n_devices == 1 else g.eager_backwards <= 2 * n_ops * n_devices
    if n_devices == 1:  # more atoms: larger capacities, recorded again
        larger = cases.structure("half")  # 225 atoms
        got = evaluate(graphed, larger, None)
        check_reference(got, mpnn_reference(larger))
        check_same(got, evaluate(eager, larger, None))
        assert g.captures == 2 * n_ops


def test_a_model_that_cannot_be_recorded_runs_eagerly_after_one_log_line(caplog):
    mpnn = cases.wrapper("mpnn")
    atoms = cases.structure("small")
    graphed = DistributedMLIP(HostReadingMPNN(mpnn.model), n_devices=1, cuda_graphs=FakeCapture())
    with caplog.at_level(logging.WARNING, logger=LOG):
        for geometry in (atoms, moved(atoms, 2)):
            got = evaluate(graphed, geometry, None)
            check_same(got, evaluate(eager_model("mpnn", 1), geometry, None))
    cases.check_fell_back_once(caplog, graphed.stages.graphs, LOG)


def test_auto_is_eager_on_the_cpu_and_true_asks_for_a_gpu():
    import torch

    from nvalchemi_jaxbridge.kernels.cuda_graphs import default_backend

    w = cases.wrapper("mpnn")
    if default_backend(torch.device("cpu")) is not None:  # JAXBRIDGE_TEST_CUDA_GRAPHS=fake (tests/mlip/conftest.py)
        assert isinstance(DistributedMLIP(w, n_devices=1).stages.graphs.backend, FakeCapture)
        return
    assert DistributedMLIP(w, n_devices=1).stages.graphs is None
    with pytest.raises(ValueError, match=r"cuda_graphs=True but the model's stages run on 'cpu'"):
        DistributedMLIP(w, n_devices=1, cuda_graphs=True)


@pytest.mark.slow
def test_mace_replayed_stages_give_the_eager_numbers():
    pytest.importorskip("mace", reason="needs mace-torch: pip install 'nvalchemi_jaxbridge[mlip]'")
    atoms = cases.structure("small")
    graphed, eager = DistributedMLIP(cases.wrapper("mace"), n_devices=1, cuda_graphs=FakeCapture()), \
        eager_model("mace", 1)
    state_g, state_e = prepare(graphed, atoms), prepare(eager, atoms)
    for geometry in (atoms, moved(atoms, 3)):
        check_same(evaluate(graphed, geometry, state_g), evaluate(eager, geometry, state_e))
    check_reference(evaluate(graphed, atoms, state_g), mace_reference(cases.wrapper("mace").model, atoms))
    g = graphed.stages.graphs
    assert g.off is None and g.captures == 2 and g.replays == 6  # MACE's two layers: two ops
