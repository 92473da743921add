"""`mlip.load_model`: a model file to what `DistributedMLIP` takes, the trust rule, and the errors that say why not.

The MACE route (file -> `DistributedMLIP` -> ASE calculator) is checked against MACE's own forward of the model
object that was saved, not the loaded one.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.mlip import MPNN, DistributedMLIP, MPNNWrapper, load_model
from nvalchemi_jaxbridge.mlip.model_files import ModelFileError, is_mliap_model
from nvalchemi_jaxbridge.mlip.mpnn import MPNNWrapper as _Base
from tests.mlip._reference import alloy, mace_reference


class FakeMLIAP:
    """The shape of a LAMMPS ML-IAP unified model (module level, so that it pickles)."""

    def __init__(self):
        self.element_types, self.rcutfac, self.ndescriptors, self.nparams = ["Cu", "Au"], 2.5, 1, 1

    def compute_forces(self, data):
        pass


class OwnWrapper(_Base):
    """A user's own wrapper (not one `load_model` builds)."""


@pytest.fixture(scope="module")
def mace_file(tmp_path_factory):
    pytest.importorskip("mace", reason="needs mace-torch: pip install 'nvalchemi_jaxbridge[mlip]'")
    from nvalchemi_jaxbridge.mlip.mace import random_mace

    model = random_mace((29, 79), hidden_irreps="4x0e + 4x1o", max_ell=2, correlation=2, seed=3,
                        dtype=torch.float64)
    path = tmp_path_factory.mktemp("mace") / "small.model"
    torch.save(model, path)  # what MACE's training writes as *.model
    return path, model


@pytest.mark.slow
def test_a_mace_model_file_becomes_an_ase_calculator_that_matches_maces_own_forward(mace_file):
    from nvalchemi_jaxbridge.integrations.ase_calculator import JaxBridgeCalculator
    from nvalchemi_jaxbridge.mlip.mace import MACEWrapper

    path, saved = mace_file
    atoms = alloy((2, 2, 2), seed=5)
    # the three lines of the guide
    model = load_model(path, trust=True)
    atoms.calc = JaxBridgeCalculator(DistributedMLIP(model, n_devices=2))
    energy, forces = atoms.get_potential_energy(), atoms.get_forces()

    assert isinstance(model, MACEWrapper) and model.dtype == torch.float64
    assert all(p.device.type == "cpu" for p in model.model.parameters())
    want = mace_reference(saved, atoms)
    np.testing.assert_allclose(energy, want["energy"], rtol=1e-9)
    np.testing.assert_allclose(forces, want["forces"], rtol=0, atol=1e-8)


def test_a_whole_model_file_needs_trust_and_the_error_names_its_class(mace_file):
    path, _ = mace_file
    with pytest.raises(ModelFileError, match=r"holds a pickled mace\.modules\.models\.ScaleShiftMACE .*trust=True"):
        load_model(path)


def test_an_mpnn_file_gives_its_wrapper_in_the_dtype_it_was_saved_in(tmp_path):
    model = MPNN((29, 79), seed=4, features=8, n_layers=2, dtype=torch.float32)
    path = tmp_path / "mpnn.pt"
    torch.save(model, path)
    with pytest.raises(ModelFileError, match=r"pickled nvalchemi_jaxbridge\.mlip\.mpnn\.MPNN"):
        load_model(path)
    w = load_model(path, trust=True)
    assert type(w) is MPNNWrapper and w.dtype == torch.float32 and w.n_layers == 2
    for (k, a), b in zip(model.state_dict().items(), w.model.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_saved_wrapper_and_an_mliap_object_come_back_as_they_are(tmp_path):
    own = OwnWrapper(MPNN((29, 79), features=4, n_layers=1))
    torch.save(own, tmp_path / "own.pt")
    got = load_model(tmp_path / "own.pt", trust=True)
    assert type(got) is OwnWrapper and got.model.n_layers == 1

    torch.save(FakeMLIAP(), tmp_path / "mliap.pt")  # LAMMPS reads both forms
    with open(tmp_path / "mliap.pkl", "wb") as f:
        pickle.dump(FakeMLIAP(), f)
    for name in ("mliap.pt", "mliap.pkl"):
        with pytest.raises(ModelFileError, match=r"pickled tests\.mlip\.test_model_files\.FakeMLIAP"):
            load_model(tmp_path / name)
        got = load_model(tmp_path / name, trust=True)
        assert type(got) is FakeMLIAP and is_mliap_model(got) and got.rcutfac == 2.5
    assert not is_mliap_model(FakeMLIAP) and not is_mliap_model(own)


def test_weights_alone_are_refused_with_how_to_save_the_whole_model(tmp_path):
    model = MPNN((29, 79), features=4, n_layers=1)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    torch.save({"model": model.state_dict(), "epoch": 3}, tmp_path / "ckpt.pt")
    torch.save(torch.zeros(2, 3), tmp_path / "t.pt")
    for trust in (False, True):  # read without running code either way
        with pytest.raises(ModelFileError, match=r"holds a state_dict \(\d+ tensors.*torch\.save\(model, path\)"):
            load_model(tmp_path / "sd.pt", trust=trust)
        with pytest.raises(ModelFileError, match=r"holds a dict with keys \['model', 'epoch'\].*load_state_dict"):
            load_model(tmp_path / "ckpt.pt", trust=trust)
        with pytest.raises(ModelFileError, match=r"holds a tensor of shape \(2, 3\), not a model"):
            load_model(tmp_path / "t.pt", trust=trust)
    torch.save(torch.nn.Linear(2, 2), tmp_path / "lin.pt")
    with pytest.raises(ModelFileError, match=r"torch\.nn\.modules\.linear\.Linear, a torch module .*MessagePassingWrapper"):
        load_model(tmp_path / "lin.pt", trust=True)


def test_files_that_are_not_model_files_say_what_they_are(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no file '.*nope\.model'.*torch\.save\(model, path\)"):
        load_model(tmp_path / "nope.model", trust=True)
    (tmp_path / "notes.model").write_text("energy: -3.2 eV\n")
    with pytest.raises(ModelFileError, match=r"is not a torch\.save or pickle file \(it starts with 'energy: -3\.2"):
        load_model(tmp_path / "notes.model", trust=True)
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(ModelFileError, match=r"is empty \(0 bytes\)"):
        load_model(tmp_path / "empty.pt")
    with pytest.raises(ModelFileError, match=r"is a directory"):
        load_model(tmp_path)
    torch.save(MPNN((29, 79), features=4, n_layers=1), tmp_path / "whole.pt")
    data = (tmp_path / "whole.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])  # an interrupted download
    with pytest.raises(ModelFileError, match=r"damaged or cut-short torch file.*download it again"):
        load_model(tmp_path / "cut.pt", trust=True)
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), tmp_path / "compiled.model")
    with pytest.raises(ModelFileError, match=r"is a TorchScript archive .*the \*\.model file MACE training writes"):
        load_model(tmp_path / "compiled.model", trust=True)


def test_a_class_from_a_package_not_installed_names_the_package(tmp_path):
    (tmp_path / "other.pkl").write_bytes(b"\x80\x02cno_such_package_xyz\nModel\nq\x00)\x81q\x01.")
    with pytest.raises(ModelFileError, match=r"pickled no_such_package_xyz\.Model"):
        load_model(tmp_path / "other.pkl")
    with pytest.raises(ImportError, match=r"module 'no_such_package_xyz', which is not installed"):
        load_model(tmp_path / "other.pkl", trust=True)
