"""The wrapper's copies for stage ops on other devices (`mlip.replicas`), against the original.

On the CPU every JAX device is torch's one CPU device, so a stage never needs a copy here; the
copies are made for the `meta` device (placement and caching) and for the CPU itself through
`copy_to` (values, and how a copy follows the original). The H200 check runs a model whose weights
stay on the host through `DistributedMLIP` on the GPU (scripts/gpu_replicas.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.mlip import DistributedMLIP, MPNN, MPNNWrapper
from nvalchemi_jaxbridge.mlip.replicas import WrapperReplicas, copy_to
from nvalchemi_jaxbridge.mlip.torch_device import weights
from tests.mlip import cases

META, CPU = torch.device("meta"), torch.device("cpu")


def _mpnn() -> MPNNWrapper:
    torch.manual_seed(0)
    return MPNNWrapper(MPNN([29, 79], cutoff=4.0))


def test_the_weights_device_gets_the_wrapper_itself_and_another_device_one_copy():
    w = _mpnn()
    rep = WrapperReplicas(w)
    assert rep.on(CPU) is w and rep.copies() == {}
    meta = rep.on(META)
    assert meta is not w and rep.on(META) is meta and rep.on(META, check=False) is meta
    assert {t.device for t in weights(meta)} == {META} and {t.device for t in weights(w)} == {CPU}
    assert [t.shape for t in weights(meta)] == [t.shape for t in weights(w)]
    assert meta.cutoff == w.cutoff and meta.n_layers == w.n_layers and list(rep.copies()) == [META]


def test_a_copy_computes_what_the_original_does_and_follows_its_weights():
    w, (pos, numbers, cell, pbc) = _mpnn(), _structure()
    copied = copy_to(w, CPU)
    assert all(a is not b and torch.equal(a, b) for a, b in zip(weights(copied), weights(w)))
    rep = WrapperReplicas(w)
    rep._copies[CPU] = (copied, ())  # as if CPU were another device than the weights'
    with torch.no_grad():
        for t in weights(w):
            t.mul_(1.01)  # an optimiser step: in place, a new version
    rep._refresh(copied, weights(w), CPU)
    assert all(torch.equal(a, b) for a, b in zip(weights(copied), weights(w)))
    e = DistributedMLIP(w, n_devices=1).evaluate(pos, numbers, cell, pbc)["energy"]
    e_copy = DistributedMLIP(copied, n_devices=1).evaluate(pos, numbers, cell, pbc)["energy"]
    assert e_copy == pytest.approx(e, rel=1e-12)


def test_an_in_place_change_is_seen_at_the_next_check_only():
    w = _mpnn()
    rep = WrapperReplicas(w)
    meta = rep.on(META)
    seen = []
    rep._refresh = lambda replica, own, device: seen.append(device)  # meta tensors hold no values to compare
    with torch.no_grad():
        weights(w)[0].add_(1.0)
    assert rep.on(META, check=False) is meta and seen == []  # a later op of the same evaluation
    assert rep.on(META) is meta and seen == [META]  # the first op of the next evaluation
    assert rep.on(META) is meta and seen == [META]  # nothing changed since


def test_the_wrappers_other_attributes_follow_the_original():
    w = _mpnn()
    w.scale, w.table = 1.0, torch.ones(3, dtype=torch.float64)
    rep = WrapperReplicas(w)
    meta = rep.on(META)
    assert meta.scale == 1.0 and meta.table.device == META
    w.scale = 2.0  # set again
    assert rep.on(META, check=False).scale == 1.0 and rep.on(META).scale == 2.0
    before = meta.table
    w.table.mul_(2.0)  # changed in place
    assert rep.on(META).table is not before and meta.table.device == META
    w.layers = [w.model]  # a container of the model's own modules: the copy's modules, not new ones
    assert rep.on(META).layers[0] is meta.model
    assert {t.device for t in weights(meta)} == {META} and rep.copies() == {META: meta}


def test_a_model_moved_after_its_first_check_is_followed():
    w = _mpnn()
    rep = WrapperReplicas(w)
    assert rep.on(CPU) is w
    w.model.to(META)  # its weights now live where a meta stage runs, and no longer on the CPU
    assert rep.on(META) is w and rep.copies() == {}


def test_a_reshaped_parameter_under_a_live_copy_is_refused_naming_the_model():
    w = _mpnn()
    rep = WrapperReplicas(w)
    rep.on(META)
    p = weights(w)[0]
    p.data = torch.zeros(p.shape[0] + 1, *p.shape[1:], dtype=p.dtype)
    with pytest.raises(RuntimeError, match=r"model 'mpnn'.*changed in number, shape or dtype.*build a new "
                                           r"DistributedMLIP"):
        rep.on(META)


def _structure():
    atoms = cases.structure("small")
    return np.asarray(atoms.positions), atoms.numbers, np.asarray(atoms.cell), atoms.pbc
