"""A wrapper that breaks the protocol is refused, naming the wrapper, the method, what it returned and the fix.

Each case below ran without an error before and gave a wrong number (a `(rows, 1)` layer energy:
-15461 eV for -58.7; a scalar one: a result that depends on the device count; a cutoff below the
model's: forces 10 % off; 29.7 read as Cu; float16: a non-finite stress). Both doors are covered:
the JAX door's stage ops (at trace time, before anything runs) and the PyTorch door's `StagedModel`
(its forward, which every rank runs; no exchange is needed to reach the checks).
"""

from __future__ import annotations

import copy

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.mlip import MPNN, DistributedMLIP, MPNNWrapper
from nvalchemi_jaxbridge.mlip.contract import ShapeRecord, WrapperContractError, atomic_numbers
from nvalchemi_jaxbridge.mlip.protocol import BlockGraph
from nvalchemi_jaxbridge.mlip.torch_model import StagedModel
from tests.mlip import cases
from tests.mlip._reference import alloy


class Bent(MPNNWrapper):
    """The project's MPNN with one stage result bent out of the protocol (`bend(kind, value, g)`)."""

    def __init__(self, model, bend, **attrs):
        super().__init__(model)
        self.bend = bend
        self.__dict__.update(attrs)

    def embed(self, g):
        return self.bend("embed", super().embed(g), g)

    def interaction(self, i, g, h):
        h, e = super().interaction(i, g, h)
        return self.bend("h", h, g), self.bend("e", e, g)


def _only(kind, fn):
    return lambda k, x, g: fn(x, g) if k == kind else x


@pytest.fixture(scope="module")
def model():
    return cases.wrapper("mpnn").model


@pytest.fixture(scope="module")
def atoms():
    return alloy(reps=(2, 2, 2))  # 32 atoms


def _jax_door(wrapper, atoms, n_devices=2):
    dm = DistributedMLIP(wrapper, n_devices=n_devices)
    return dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)


def _torch_door(wrapper, atoms):
    """The PyTorch door's forward on the whole structure as one block (no exchange needed for the checks)."""
    from tests.mlip._reference import graph

    ei, unit = graph(atoms, wrapper.cutoff)
    attrs = torch.tensor(wrapper.node_attrs(atoms.numbers))
    g = BlockGraph(torch.tensor(atoms.positions), attrs, torch.tensor(ei),
                   torch.tensor(unit @ atoms.cell.array), n_receivers=len(atoms) - 4)
    return StagedModel(wrapper)(g)


BENT = {
    "(rows, 1) layer energy": (_only("e", lambda e, g: e[:, None]), r"interaction\(0, g, h\).*shape \((\d+), 1\)"
                               r".*expects shape \(\1,\).*e\[:, 0\]"),
    "scalar layer energy": (_only("e", lambda e, g: e.sum()), r"interaction\(0, g, h\).*shape \(\).*scalar would be "
                            "added to every row"),
    "energy of receiver rows only": (_only("e", lambda e, g: e[: g.receiver_rows]), r"interaction\(0, g, h\).*to_rows"),
    "float32 energy of a float64 model": (_only("e", lambda e, g: e.float()), r"interaction\(0, g, h\).*e\.to\("
                                          r"torch\.float64\)"),
    "features without rows": (_only("h", lambda h, g: h.sum(0)), r"interaction\(0, g, h\).*node features.*\("
                              r"\d+, \.\.\.\)"),
    "embed returns a list of nothing": (_only("embed", lambda h, g: []), r"embed\(g\).*returned a list of 0"),
}


@pytest.mark.parametrize("case", list(BENT))
def test_a_stage_result_off_the_protocol_is_refused_on_both_doors(case, model, atoms):
    bend, match = BENT[case]
    wrapper = Bent(model, bend)
    with pytest.raises(WrapperContractError, match=r"Bent\('mpnn'\)\." + match.split(".*", 1)[0]) as jax_err:
        _jax_door(wrapper, atoms)
    assert "JAX door" in str(jax_err.value) or "shape probe" in str(jax_err.value)
    with pytest.raises(WrapperContractError, match=match) as torch_err:
        _torch_door(wrapper, atoms)
    assert "PyTorch door" in str(torch_err.value)


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(shape=st.lists(st.integers(0, 40), min_size=0, max_size=3))
def test_only_a_rows_vector_passes_as_layer_energy(shape, model, atoms):
    """Any energy shape but exactly (rows,) is refused (the torch door's forward: a property of the checks)."""
    rows = len(atoms)
    wrapper = Bent(model, _only("e", lambda e, g: torch.zeros(shape, dtype=e.dtype) if tuple(shape) != (rows,)
                                else e))
    if tuple(shape) == (rows,):
        ref = MPNNWrapper(model)
        torch.testing.assert_close(_torch_door(wrapper, atoms), _torch_door(ref, atoms))
    else:
        with pytest.raises(WrapperContractError, match=rf"expects shape \({rows},\)"):
            _torch_door(wrapper, atoms)


def test_output_shapes_that_depend_on_values_are_refused_naming_the_stage(model):
    # What each stage op does with its results: the shapes of the call that traced the program
    # (zero-filled inputs) are kept per input shapes, and a later call that differs is refused.
    record = ShapeRecord(MPNNWrapper(model), "'mpnn_layer_0' of the JAX door")
    inputs = (torch.zeros((6, 3)), torch.zeros((9, 2), dtype=torch.int32))
    record.check(inputs, (torch.zeros((6, 16)), torch.zeros(6)))
    record.check(inputs, (torch.ones((6, 16)), torch.ones(6)))  # same shapes: fine
    record.check(inputs[:1], (torch.zeros(6),))  # other input shapes: another record
    with pytest.raises(WrapperContractError, match=r"MPNNWrapper\('mpnn'\) \(stage 'mpnn_layer_0' of the JAX door\) "
                       r"returned shapes \[\(6, 16\), \(4,\)\].*\[\(6, 16\), \(6,\)\] when the program was traced"):
        record.check(inputs, (torch.zeros((6, 16)), torch.zeros(4)))


@pytest.mark.parametrize("attrs, match", [
    (dict(n_layers=0), r"n_layers is 0; the protocol needs an int >= 1"),
    (dict(n_layers=2.0), r"n_layers is 2\.0"),
    (dict(cutoff=float("nan")), r"cutoff is nan"),
    (dict(cutoff=3.5), r"cutoff is 3\.5 Å but its model's own cutoff is 4 Å.*Set the wrapper's cutoff to 4"),
    (dict(n_layers=2), r"n_layers is 2 but its model has 3 interaction layers"),
    (dict(dtype=torch.float16), r"dtype is torch\.float16.*non-finite stress.*model\.to\(torch\.float32\)"),
    (dict(dtype=torch.bfloat16), r"dtype is torch\.bfloat16"),
    (dict(dtype=torch.float32), r"parameters are torch\.float64 but the wrapper's dtype is torch\.float32"),
])
def test_declarations_off_the_protocol_are_refused_at_construction(attrs, match, model):
    wrapper = Bent(model, lambda k, x, g: x, **attrs)
    with pytest.raises(WrapperContractError, match=match):
        DistributedMLIP(wrapper, n_devices=2)
    with pytest.raises(WrapperContractError, match=match):
        from nvalchemi_jaxbridge.mlip import TorchDistributedMLIP

        TorchDistributedMLIP(wrapper)


def test_a_float16_model_is_refused_with_the_fix():
    wrapper = MPNNWrapper(MPNN([29, 79], dtype=torch.float16))
    with pytest.raises(WrapperContractError, match=r"MPNNWrapper\('mpnn'\)\.dtype is torch\.float16.*Convert"):
        DistributedMLIP(wrapper, n_devices=1)


def test_a_cutoff_above_the_models_is_allowed_and_exact(model, atoms):
    """The model's own envelope is zero beyond its cutoff, so a larger wrapper cutoff changes nothing."""
    want = _jax_door(MPNNWrapper(model), atoms)
    got = _jax_door(Bent(model, lambda k, x, g: x, cutoff=4.6), atoms)
    np.testing.assert_allclose(got["energy"], want["energy"], rtol=1e-12)
    np.testing.assert_allclose(got["forces"], want["forces"], atol=1e-10)


def test_maces_cutoff_is_checked_against_its_r_max():
    pytest.importorskip("mace")
    wrapper = copy.copy(cases.wrapper("mace"))
    wrapper.cutoff = wrapper.model_reach()[0] - 1.0
    with pytest.raises(WrapperContractError, match=r"MACEWrapper\('mace'\)\.cutoff is 4 Å but its model's own "
                                                   r"cutoff is 5 Å"):
        DistributedMLIP(wrapper, n_devices=2)


def test_non_integral_atomic_numbers_are_refused_naming_the_atoms(model, atoms):
    numbers = atoms.numbers.astype(np.float64)
    numbers[[3, 17]] = [29.7, np.nan]
    with pytest.raises(WrapperContractError, match=r"2 are not \(atom 3: .*29\.7.*atom 17: .*nan\)"):
        DistributedMLIP(MPNNWrapper(model), n_devices=2).prepare(atoms.positions, numbers, atoms.cell.array)
    with pytest.raises(WrapperContractError, match="atom 0"):
        MPNNWrapper(model).node_attrs(np.array([28.5]))
    with pytest.raises(WrapperContractError, match="dtype <U2"):
        atomic_numbers(np.array(["Cu"]), "here")
    np.testing.assert_array_equal(atomic_numbers(np.array([29.0, 79.0]), "here"), [29, 79])  # whole floats pass
