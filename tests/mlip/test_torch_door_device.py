"""Model level, PyTorch front door: the model must be on the rank's device, or it is refused naming both.

In this process the front door is a world of one CPU rank, so no evaluation runs: the check comes first, at the
first evaluation (or `device`). A model elsewhere is faked with a `meta` parameter, or the rank's device is
made a GPU's by monkeypatching `rank_device`. The multi-process side (every stage input on the model's device,
tensor results) is tests/mlip/test_torch_door.py.
"""

from __future__ import annotations

import pytest
import torch

from nvalchemi_jaxbridge.mlip import MPNN, MPNNWrapper
from nvalchemi_jaxbridge.mlip import torch_model
from nvalchemi_jaxbridge.mlip.torch_model import TorchDistributedMLIP, model_devices, wrapper_modules
from tests.mlip import cases


def _mpnn() -> MPNNWrapper:
    """A fresh MPNN of its own (these tests move models around)."""
    return MPNNWrapper(MPNN([29, 79], cutoff=4.0, features=4, n_layers=2))


def _evaluate(dm: TorchDistributedMLIP) -> dict:
    atoms = cases.structure("small")
    return dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)


def test_a_model_on_another_device_is_refused_at_the_first_evaluation():
    w = _mpnn()
    w.model.to("meta")
    dm = TorchDistributedMLIP(w)  # the rank's device is not asked for before the first evaluation
    with pytest.raises(ValueError, match=r"parameters or buffers are on meta but this rank's device is 'cpu'"
                       r".*MPNN.*device='cpu'.*model\.to\('cpu'\)"):
        _evaluate(dm)


def test_a_cpu_model_on_a_gpu_rank_is_refused(monkeypatch):
    monkeypatch.setattr(torch_model, "rank_device", lambda: torch.device("cuda", 0))
    dm = TorchDistributedMLIP(_mpnn())
    with pytest.raises(ValueError, match=r"on cpu but this rank's device is 'cuda:0'.*model\.to\('cuda:0'\)"):
        dm.device


def test_the_device_option_moves_the_model_and_must_be_the_rank_device():
    w = _mpnn()
    dm = TorchDistributedMLIP(w, device="meta")
    assert model_devices(w) == {torch.device("meta")}  # moved at construction
    with pytest.raises(ValueError, match=r"device='meta' but this rank's device is 'cpu'.*device='cpu' or device=None"):
        _evaluate(dm)
    assert TorchDistributedMLIP(_mpnn(), device="cpu").device == torch.device("cpu")


def test_parameters_are_found_on_module_attributes_or_on_a_module_wrapper():
    w = _mpnn()
    assert wrapper_modules(w) == [w.model]
    assert model_devices(w) == {torch.device("cpu")}
    net = torch.nn.Linear(2, 2, device="meta")
    assert wrapper_modules(net) == [net] and model_devices(net) == {torch.device("meta")}


class _Hidden(MPNNWrapper):
    """An MPNN wrapper that keeps its model in a list, where the device check does not look."""

    def __init__(self, model: MPNN) -> None:
        super().__init__(model)
        self.parts = [self.__dict__.pop("model")]

    def __getattr__(self, name: str):
        if name == "model":
            return self.parts[0]
        raise AttributeError(name)


def test_a_wrapper_whose_modules_are_not_found_is_not_refused():
    model = MPNN([29, 79], cutoff=4.0, features=4, n_layers=2).to("meta")
    w = _Hidden(model)
    assert wrapper_modules(w) == [] and model_devices(w) == set()
    assert TorchDistributedMLIP(w).device == torch.device("cpu")
