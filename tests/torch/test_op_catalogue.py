"""The op catalogue of a row-layout ShardTensor: one case per family, the held-out dense pair models, and a
property test that whatever runs keeps every atom's row to itself (world size 1; the 2-rank run of the pair
models is in tests/torch/meaning_worker.py, judged in tests/torch/test_multiprocess.py).

The oracle for "row-local" is independent of the classifier: change one row of the block and every other
row of the result must stay bit for bit the same (and the result must still carry the layout).
"""

from __future__ import annotations

import pathlib
import re
from unittest import mock

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nvalchemi_jaxbridge.layout import HaloPlan
from nvalchemi_jaxbridge.torch import ShardTensor, ShardTensorMeaningError, reductions
from nvalchemi_jaxbridge.torch.op_catalogue import CATALOGUE
from tests.torch import model, pair_models

BOX, N = 6.0, 12
GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guide.md"
ATEN = r"\((aten|jbtest)::\w+\)"


@pytest.fixture(scope="module")
def pos() -> np.ndarray:
    return model.system(N, BOX, 1)


@pytest.fixture(scope="module")
def plan(pos) -> HaloPlan:
    return HaloPlan.build(pos, np.eye(3) * BOX, cutoff=pair_models.CUTOFF, n_devices=1)


def _block(plan: HaloPlan, values: np.ndarray, layout: str, **kw) -> ShardTensor:
    return ShardTensor.from_global(torch.tensor(values), plan, layout=layout, **kw)


# ---- the held-out case: a dense pairwise model fed the positions' ShardTensor -----------------------


@pytest.mark.parametrize("layout", ["owned", "halo"])
@pytest.mark.parametrize("name", sorted(pair_models.MODELS))
def test_dense_pair_models_raise_naming_the_op_never_a_wrong_energy(name, layout, plan, pos):
    x = _block(plan, pos, layout, positions=True, requires_grad=True)
    got = pair_models.outcome(name, x)
    assert "raised" in got, f"{name} on {layout} positions returned {got} instead of raising"
    head = rf"^torch\.[\w.]+ {ATEN} on a ShardTensor with layout '{layout}' \(rank 0, argument "
    assert re.match(head, got["raised"]), got["raised"]
    assert "OpAdapter" in got["raised"] and ".full_tensor()" in got["raised"]


def test_the_whole_array_route_gives_the_single_device_energy(plan, pos):
    x = _block(plan, pos, "halo", positions=True)
    full = x.full_tensor()  # owned rows of every rank, global order: a plain tensor, the model's own input
    assert type(full) is torch.Tensor
    e = pair_models.DensePairModel()(full)
    assert float(e) == pair_models.reference(pos)


def test_the_held_out_message_says_which_argument_and_where_the_atoms_went(plan, pos):
    x = _block(plan, pos, "owned", positions=True)
    with pytest.raises(ShardTensorMeaningError, match=r"__getitem__ \(aten::unsqueeze\) .* inserts a dimension "
                                                      r"before the atom dimension.*'slicing'"):
        x[None, :, :]
    with pytest.raises(ShardTensorMeaningError, match=r"sub \(aten::sub\) .*argument 0 of shape \(12, 1, 3\)\) "
                                                      r"broadcasts operand 1 of shape \(12, 3\) to \(12, 12, 3\)"):
        x[:, None, :] - x
    with pytest.raises(ShardTensorMeaningError, match=r"torch\.cdist \(aten::cdist\).*pairs every atom row.*"
                                                      r"OpAdapter\(op, gather_inputs=\[\.\.\.\]\)"):
        torch.cdist(x, x)


def test_wrappers_and_transforms_do_not_hide_the_pairs(plan, pos):
    x = _block(plan, pos, "halo", positions=True, requires_grad=True)
    one_row = lambda xi: pair_models._lj(((xi - x) ** 2).sum(-1)).sum()  # noqa: E731 - row i against all rows
    with pytest.raises(ShardTensorMeaningError, match=r"sub \(aten::sub\).*runs under torch\.vmap"):
        torch.vmap(one_row)(x)  # vmap hides the atom dimension in its batch dimension

    class Pairs(torch.autograd.Function):
        @staticmethod
        def forward(ctx, p):
            return pair_models.DensePairModel()(p)

        @staticmethod
        def backward(ctx, g):
            return g

    for wrapped in (lambda: Pairs.apply(x),
                    lambda: torch.utils.checkpoint.checkpoint(pair_models.DensePairModel(), x, use_reentrant=False)):
        with pytest.raises(ShardTensorMeaningError, match=r"__getitem__ \(aten::unsqueeze\)"):
            wrapped()


# ---- one case per family: what runs keeps rows apart, what is refused names the op -----------------

IDX = torch.tensor([0, 2, 2, 5])
ALLOWED = {  # family -> ops that run on a (rows, 3) block and must keep rows apart
    "queries": [lambda t: t.new_zeros(0) + t.shape[0] + t.numel() + t.dim() + int(t.is_leaf) + 0 * t[:, :1]],
    "elementwise": [lambda t: torch.where(t > 0, t.sin(), 2 - t) ** 2, lambda t: F.silu(t).clamp(min=-1) / 3,
                    lambda t: t.to(torch.float32).double() + torch.zeros_like(t), lambda t: t * torch.ones(1, 3),
                    lambda t: torch.maximum(t, t.flip(1)),
                    lambda t: torch.max(torch.zeros(3, dtype=t.dtype), t), lambda t: t.masked_fill(t < 0, 0.5)],
    "reshape": [lambda t: t[:, None, :].expand(-1, 4, -1).reshape(t.shape[0], -1), lambda t: t.unsqueeze(-1).squeeze(),
                lambda t: t.view(-1, 3, 1).flatten(1), lambda t: t.repeat(1, 2).unflatten(1, (2, 3)).permute(0, 2, 1),
                lambda t: torch.cat([t, 2 * t], dim=1), lambda t: torch.stack([t, t.cos()], dim=-1).transpose(1, 2),
                lambda t: t.split(1, dim=1)[2], lambda t: t.narrow(1, 1, 2)],
    "slicing": [lambda t: t[:, 1:], lambda t: t[..., [2, 0]], lambda t: t[:, None, 0]],
    "sum over atoms": [lambda t: t.sum(-1), lambda t: torch.sum(t * t, dim=1, keepdim=True)],
    "other reductions": [lambda t: t.norm(dim=-1), lambda t: t.max(dim=1).values, lambda t: torch.logsumexp(t, -1),
                         lambda t: torch.linalg.vector_norm(t, dim=1)],
    "along dim": [lambda t: torch.softmax(t, -1), lambda t: t.cumsum(1), lambda t: t.sort(dim=1).values,
                  lambda t: torch.linalg.cross(t, t.roll(1, 1))],
    "products": [lambda t: t @ torch.arange(6.0, dtype=t.dtype).view(3, 2),
                 lambda t: F.linear(t, torch.ones(4, 3, dtype=t.dtype)),
                 lambda t: t[:, :, None] @ t[:, None, :],
                 lambda t: torch.einsum("ij,jk->ik", t, torch.eye(3, dtype=t.dtype)),
                 lambda t: F.layer_norm(t, (3,)),
                 lambda t: torch.linalg.det(t[:, :, None] * torch.eye(3, dtype=t.dtype))],
    "gathers": [lambda t: torch.tensor([[1.0], [2.0], [3.0]], dtype=t.dtype)[(t[:, 0] > 0).long() + 1] * t,
                lambda t: F.embedding((t[:, 1] > 0).long(), torch.ones(2, 2, dtype=t.dtype)) + t[:, :2],
                lambda t: t.gather(1, torch.zeros(t.shape[0], 2, dtype=torch.long))],
    "scatters": [lambda t: t.clone().index_copy_(1, torch.tensor([2, 0]), torch.ones(t.shape[0], 2, dtype=t.dtype))],
    "factories": [lambda t: t.new_ones(3) + 0 * t],
}
NO_ATOM = torch.zeros((N, 3), dtype=torch.long)
REFUSED = {  # family -> (op, its aten name, call)
    "queries": [],
    "elementwise": [("sub", "sub", lambda t: t[:, None] - t),
                    ("add_", "add_", lambda t: torch.zeros(t.shape).add_(t)),
                    ("mul", "mul", lambda t: torch.mul(t, 2, out=torch.empty(t.shape)))],
    "reshape": [("unsqueeze", "unsqueeze", lambda t: t.unsqueeze(0)), ("view", "view", lambda t: t.view(1, -1, 3)),
                ("flatten", "flatten", lambda t: t.flatten()), ("T", "permute", lambda t: t.T),
                ("expand", "expand", lambda t: t.expand(2, -1, -1)), ("tile", "tile", lambda t: t.tile(2, 1)),
                ("stack", "stack", lambda t: torch.stack([t, t])), ("cat", "cat", lambda t: torch.cat([t, t])),
                ("squeeze", "squeeze", lambda t: t[:, :1].squeeze(0)), ("chunk", "chunk", lambda t: t.chunk(2))],
    "slicing": [("__getitem__", "select", lambda t: t[3]), ("__getitem__", "slice", lambda t: t[1:4]),
                ("__getitem__", "unsqueeze", lambda t: t[None]), ("__getitem__", "index", lambda t: t[IDX])],
    "sum over atoms": [],
    "other reductions": [("std", "std", lambda t: t.std(0)),
                         ("logsumexp", "logsumexp", lambda t: torch.logsumexp(t, 0)),
                         ("vector_norm", "linalg_vector_norm", lambda t: torch.linalg.vector_norm(t))],
    "along dim": [("sort", "sort", lambda t: t.sort(0)), ("cumsum", "cumsum", lambda t: t.cumsum(0)),
                  ("roll", "roll", lambda t: t.roll(1, 0))],
    "products": [("matmul", "matmul", lambda t: torch.ones(t.shape[0], dtype=t.dtype) @ t),
                 ("outer", "outer", lambda t: torch.outer(t[:, 0], t[:, 1])),
                 ("einsum", "einsum", lambda t: torch.einsum("id,jd->ij", t, t)),
                 ("layer_norm", "layer_norm", lambda t: F.layer_norm(t, t.shape))],
    "pairs": [("cdist", "cdist", lambda t: torch.cdist(t, t)), ("pdist", "pdist", lambda t: F.pdist(t)),
              ("tensordot", "tensordot", lambda t: torch.tensordot(t, t, dims=([1], [1])))],
    "gathers": [("index_select", "index_select", lambda t: t.index_select(0, IDX)),
                ("take", "take", lambda t: torch.take(t, IDX)),
                ("embedding", "embedding", lambda t: F.embedding(IDX, t))],
    "per-system sums": [("index_add_", "index_add_",
                         lambda t: torch.zeros_like(t).index_add_(0, IDX, torch.ones(4, 3)))],
    "scatters": [("scatter_reduce", "scatter_reduce",
                  lambda t: torch.zeros(2, 3).scatter_reduce(0, NO_ATOM[: t.shape[0]], t, "amax"))],
    "host reads": [("tolist", "_local_scalar_dense", lambda t: t.tolist()),
                   ("equal", "equal", lambda t: torch.equal(t, t))],
    "factories": [("new_tensor", "_to_copy", lambda t: t.new_tensor(t))],
    "custom ops": [("jbtest.system_sum", "jbtest::system_sum", lambda t: torch.ops.jbtest.system_sum(t))],
    "anything else": [("as_strided", "as_strided", lambda t: t.as_strided((2, 2), (1, 1))),
                      ("pad", "pad", lambda t: F.pad(t, (0, 0, 1, 0))),
                      ("fft", "fft_fft", lambda t: torch.fft.fft(t, dim=0))],
}


def test_every_family_is_tested_and_listed_in_the_guide():
    keys = [f.key for f in CATALOGUE]
    assert sorted(keys) == sorted(set(ALLOWED) | set(REFUSED)) == sorted(set(keys))
    assert all(ALLOWED.get(k) or REFUSED.get(k) for k in keys)
    guide = GUIDE.read_text()
    missing = [k for k in keys if f"| {k} |" not in guide]
    assert not missing, f"families missing from the table in docs/guide.md: {missing}"


def _row_local(f, plan: HaloPlan, layout: str, seed: int) -> None:
    """`f` on the block carries the layout, equals `f` on the plain block, and row k of the input reaches
    only row k of the output."""
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(N, 3))
    x = _block(plan, values, layout)
    y = f(x)
    assert isinstance(y, ShardTensor) and y.layout == layout and y.shape[0] == x.shape[0], (type(y), y.shape)
    base = y.to_local()
    k = int(rng.integers(x.shape[0]))
    bumped = x.to_local().clone()
    bumped[k] += torch.tensor(rng.normal(size=3))
    y2 = f(ShardTensor.from_local(bumped, plan, layout=layout)).to_local()
    others = torch.arange(x.shape[0]) != k
    torch.testing.assert_close(y2[others], base[others], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("layout", ["owned", "halo"])
@pytest.mark.parametrize("family, i", [(k, i) for k, fs in ALLOWED.items() for i in range(len(fs))])
def test_allowed_ops_keep_rows_apart(family, i, layout, plan):
    _row_local(ALLOWED[family][i], plan, layout, seed=i)


@pytest.mark.parametrize("layout", ["owned", "halo"])
@pytest.mark.parametrize("family, i", [(k, i) for k, cs in REFUSED.items() for i in range(len(cs))])
def test_refused_ops_name_the_op_its_aten_name_and_the_family(family, i, layout, plan):
    op, aten, call = REFUSED[family][i]
    x = _block(plan, np.random.default_rng(i).normal(size=(N, 3)), layout)
    want = rf"^[\w.]*{re.escape(op)} \({'' if '::' in aten else 'aten::'}{re.escape(aten)}\) on a ShardTensor " \
           rf"with layout '{layout}' \(rank 0, argument .*\) .*op family '{re.escape(family)}'.*Fix: "
    with pytest.raises(ShardTensorMeaningError, match=want):
        call(x)


def test_squeeze_without_a_dim_keeps_the_atom_dimension_even_for_one_row():
    plan = HaloPlan.build(np.array([[1.0, 1.0, 1.0]]), np.eye(3) * BOX, cutoff=2.0, n_devices=1)
    x = ShardTensor.from_global(torch.ones(1, 1, 3), plan)
    y = x.squeeze()  # on the whole array (many atoms) this drops only the singleton feature dim
    assert y.layout == "owned" and y.shape == (1, 3)


def test_an_undeclared_custom_op_is_refused_even_when_its_result_keeps_the_rows(plan, pos):
    # jbtest.pair_energy is a pair kernel: on an owned block without its adapter it would miss every pair
    # that crosses ranks, and its (rows,) result looks row-wise. Default deny refuses it.
    x = _block(plan, pos, "owned", positions=True)
    with pytest.raises(ShardTensorMeaningError, match=r"jbtest\.pair_energy \(jbtest::pair_energy\).*no OpAdapter"):
        torch.ops.jbtest.pair_energy(x, x.n_owned, model.CUTOFF)


# ---- property: whatever a random chain of shape and elementwise ops lets through is row-local ---------

STEPS = [lambda t: t[:, None], lambda t: t.unsqueeze(-1), lambda t: t.unsqueeze(0), lambda t: t[None],
         lambda t: t.transpose(0, -1), lambda t: t.transpose(-1, -2) if t.ndim > 2 else t, lambda t: t.flatten(),
         lambda t: t.flatten(1), lambda t: t.reshape(t.shape[0], -1), lambda t: t.reshape(-1, 1), lambda t: t.T,
         lambda t: t - t[:, None], lambda t: t[:, None] - t, lambda t: t * t.sum(-1, keepdim=True),
         lambda t: t.expand(2, *t.shape), lambda t: t.sum(0), lambda t: t.mean(-1), lambda t: t.cumsum(0),
         lambda t: t.cumsum(-1), lambda t: torch.cat([t, t], 0), lambda t: torch.cat([t, t], -1),
         lambda t: t.roll(1, -1), lambda t: t.roll(1), lambda t: t.exp(), lambda t: t @ t.mT if t.ndim > 2 else t,
         lambda t: t.mT @ t if t.ndim > 2 else t, lambda t: t.repeat(1, *([2] * (t.ndim - 1))),
         lambda t: t.repeat(2, *([1] * (t.ndim - 1))), lambda t: t[1:], lambda t: t.flip(0),
         lambda t: t.flip(-1), lambda t: t.amax(-1), lambda t: t.amax(0), lambda t: torch.stack([t, t], 1),
         lambda t: t @ torch.ones(t.shape[-1], 2, dtype=t.dtype), lambda t: t.unsqueeze(-1) @ t.unsqueeze(-2),
         lambda t: torch.ones(2, t.shape[0], dtype=t.dtype) @ t, lambda t: torch.einsum("i...->...i", t),
         lambda t: torch.einsum("i...,i...->i", t, t), lambda t: t.mean(), lambda t: t.std(-1),
         lambda t: t[..., None, :1], lambda t: t.squeeze(), lambda t: t.repeat_interleave(2, dim=-1)]


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(chain=st.lists(st.integers(0, len(STEPS) - 1), min_size=1, max_size=4),
                  layout=st.sampled_from(["owned", "halo"]), seed=st.integers(0, 99))
def test_random_chains_either_raise_or_keep_rows_apart(plan, chain, layout, seed):
    def f(t):
        for i in chain:
            t = STEPS[i](t)
            hypothesis.assume(t.numel() <= 10**5)
        return t

    routed = [mock.patch.object(reductions, n, wraps=getattr(reductions, n))
              for n in ("owned_sum", "owned_mean", "owned_all_any")]
    with routed[0] as s, routed[1] as m, routed[2] as a:
        try:
            f(_block(plan, np.zeros((N, 3)), layout))
        except ShardTensorMeaningError as e:
            assert re.match(rf"^torch\.[\w.]+ {ATEN} on a ShardTensor", str(e)), str(e)
            return
        except (RuntimeError, IndexError):  # torch's own shape error: a chain that is not valid torch
            hypothesis.reject()
        if s.called or m.called or a.called:
            return  # a sum over atoms (owned rows, then an all-reduce) mixes rows by design: test_meaning.py
    _row_local(f, plan, layout, seed)
