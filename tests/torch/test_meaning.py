"""No silent per-rank answers: what a row-layout ShardTensor refuses, and the sums it routes (world size 1).

One process still has ghost rows (the periodic images of a small box), so a sum
that counted them, or a scatter that mixed them in, would differ from the
numpy sum of the global values. The 2-process run of the collective parts is
in tests/torch/test_meaning_multiprocess.py.
"""

from __future__ import annotations

import re

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.layout import HaloPlan
from nvalchemi_jaxbridge.torch import ShardTensor
from nvalchemi_jaxbridge.torch.meaning import ShardTensorMeaningError
from tests.torch import model

BOX, N = 6.0, 12


@pytest.fixture(scope="module")
def plan() -> HaloPlan:
    return HaloPlan.build(model.system(N, BOX, 1), np.eye(3) * BOX, cutoff=model.CUTOFF, n_devices=1)


@pytest.fixture(scope="module")
def values() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(N, 3))


@pytest.fixture
def h(plan, values) -> ShardTensor:
    return ShardTensor.from_global(torch.tensor(values), plan, layout="halo", requires_grad=True)


@pytest.fixture
def x(plan, values) -> ShardTensor:
    return ShardTensor.from_global(torch.tensor(values), plan, requires_grad=True)


def _refused(op: str, layout: str) -> str:
    """The pattern every refusal matches: the op and its dispatcher name, the layout, the argument, then the fixes."""
    return (rf"^{re.escape(op)} \((aten|jbtest)::\w+\) on a ShardTensor with layout '{layout}' "
            r"\(rank 0(, argument \S+ of shape \([\d, ]*\))?\) .*not known.*"
            r"nvalchemi_jaxbridge\.mlip.*OpAdapter.*\.system_sum\(\).*\.full_tensor\(\).*\.to_local\(\)")


def test_the_test_block_has_ghost_rows(h):
    assert h.n_ghost > 0 and h.shape[0] == h.n_owned + h.n_ghost


IDX = torch.tensor([0, 1, 1, 3, 5])
REFUSED = {
    # reductions over atoms other than a sum
    "nanmean": (lambda t: t.nanmean(), "torch.Tensor.nanmean"),
    "amax0": (lambda t: t.amax(0), "torch.Tensor.amax"),
    "max": (lambda t: torch.max(t), "torch.max"),
    "max0": (lambda t: t.max(dim=0), "torch.Tensor.max"),
    "norm": (lambda t: t.norm(), "torch.Tensor.norm"),
    "std0": (lambda t: torch.std(t, 0), "torch.std"),
    # contractions of the row dimension
    "einsum": (lambda t: torch.einsum("ij,ij->j", t, t), "torch.einsum"),
    "transpose": (lambda t: t.T @ t, "torch.Tensor.T"),
    "matvec": (lambda t: torch.ones(t.shape[0], dtype=t.dtype) @ t, "torch.Tensor.matmul"),
    "dot": (lambda t: torch.dot(t[:, 0].contiguous(), t[:, 1].contiguous()), "torch.dot"),
    # ops that mix rows along the atom dimension
    "cumsum": (lambda t: t.cumsum(0), "torch.Tensor.cumsum"),
    "softmax": (lambda t: torch.softmax(t, 0), "torch.softmax"),
    # scatter / index reductions
    "index_add_into": (lambda t: torch.zeros_like(t).index_add_(0, IDX, torch.ones(5, 3, dtype=t.dtype)),
                       "torch.Tensor.index_add_"),
    "scatter_add_into": (lambda t: t.detach().clone().scatter_add_(0, IDX[:, None].expand(5, 3),
                                                                   torch.ones(5, 3, dtype=t.dtype)),
                         "torch.Tensor.scatter_add_"),
    "scatter_reduce": (lambda t: torch.zeros(2, 3, dtype=t.dtype).scatter_reduce(
        0, torch.zeros_like(t, dtype=torch.long), t, "amax"), "torch.Tensor.scatter_reduce"),
    "index_reduce": (lambda t: torch.zeros(2, 3, dtype=t.dtype).index_reduce_(
        0, torch.zeros(t.shape[0], dtype=torch.long), t.detach(), "prod"), "torch.Tensor.index_reduce_"),
    "index_put_acc": (lambda t: torch.zeros(2, 3, dtype=t.dtype).index_put_(
        (torch.zeros(t.shape[0], dtype=torch.long),), t.detach(), accumulate=True), "torch.Tensor.index_put_"),
    "bincount": (lambda t: torch.bincount((t[:, 0] > 0).long()), "torch.bincount"),
    "setitem": (lambda t: torch.zeros(2, 3, dtype=t.dtype).__setitem__(torch.zeros(t.shape[0], dtype=torch.long),
                                                                      t.detach()), "torch.Tensor.__setitem__"),
    # a per-rank block read as a Python / host value
    "item": (lambda t: t.item(), "torch.Tensor.item"),  # refused before torch looks at the size
    "float": (lambda t: float(t), "torch.Tensor.__float__"),
    "tolist": (lambda t: t.tolist(), "torch.Tensor.tolist"),
    "numpy": (lambda t: t.detach().numpy(), "torch.Tensor.numpy"),
    "array": (lambda t: np.asarray(t.detach()), "torch.Tensor.__array__"),
    # index gathers whose result leaves the row layout
    "getitem": (lambda t: t[IDX], "torch.Tensor.__getitem__"),
    "mask": (lambda t: t[t[:, 0] > 0], "torch.Tensor.__getitem__"),
    "index_select": (lambda t: t.index_select(0, IDX), "torch.Tensor.index_select"),
    "gather": (lambda t: t.gather(0, IDX[:, None].expand(5, 3)), "torch.Tensor.gather"),
    "take": (lambda t: torch.take(t, IDX), "torch.take"),
    # other results that leave the row layout
    "flatten": (lambda t: t.reshape(-1), "torch.Tensor.reshape"),
    "iterate": (lambda t: list(t), "torch.Tensor.unbind"),
    "stack0": (lambda t: torch.stack([t, t]), "torch.stack"),
    "custom_op": (lambda t: torch.ops.jbtest.system_sum(t), "jbtest.system_sum"),
}


@pytest.mark.parametrize("layout", ["halo", "owned"])
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_ops_without_a_known_meaning_raise_naming_op_layout_and_fix(case, layout, h, x):
    fn, op = REFUSED[case]
    t = h if layout == "halo" else x
    with pytest.raises(ShardTensorMeaningError, match=_refused(op, layout)):
        fn(t)


def test_the_error_says_why_for_each_family_and_survives_binary_operators(h):
    with pytest.raises(ShardTensorMeaningError, match=r"reduces over the atom dimension \(dim 0\).*x\.sum\(0\)"):
        h.std(0)
    with pytest.raises(ShardTensorMeaningError, match=r"accumulates into this rank's atom rows by index; whether"):
        torch.zeros_like(h).index_add_(0, IDX, torch.ones(5, 3, dtype=h.dtype))
    with pytest.raises(ShardTensorMeaningError, match=r"gathers rows with an index tensor; the result leaves"):
        h[IDX]
    with pytest.raises(ShardTensorMeaningError, match=r"a per-rank partial, not the global value.*x\.full_tensor\(\)"):
        h.tolist()
    with pytest.raises(ShardTensorMeaningError, match=r"reshape \(aten::reshape\).*merges or splits the atom dim"):
        h.reshape(-1)
    assert issubclass(ShardTensorMeaningError, RuntimeError)  # torch turns a TypeError in `@` into NotImplemented
    with pytest.raises(ShardTensorMeaningError, match=_refused("torch.Tensor.matmul", "halo")):
        torch.ones(h.shape[0], dtype=h.dtype) @ h
    for same_length in (torch.arange(h.shape[0]), torch.ones(h.shape[0], dtype=torch.bool)):
        with pytest.raises(ShardTensorMeaningError, match="gathers rows with an index tensor"):
            h[same_length]  # a gather is a new row space even when its length happens to match


def test_metadata_queries_and_escape_hatches_keep_working(h, plan, values):
    assert (h.shape, h.dtype, h.device, h.size(), h.dim(), len(h), h.requires_grad) == (
        torch.Size([h.shape[0], 3]), torch.float64, torch.device("cpu"), h.shape, 2, h.shape[0], True)
    assert repr(h).startswith("ShardTensor(layout=halo, rank=0") and f"{h}" == repr(h)
    for y in (h.detach(), h.clone(), h.to(torch.float32), h.contiguous(), h.cpu(), h.double()):
        assert isinstance(y, ShardTensor) and y.layout == "halo"
    assert type(h.to_local()) is torch.Tensor and h.to_local().tolist()  # the escape hatch
    np.testing.assert_array_equal(h.full_tensor().detach().numpy(), values)
    assert type(h.new_zeros(5)) is torch.Tensor  # a factory: a fresh tensor, no rows of h


def test_basic_slicing_exactly_the_owned_rows_is_an_owned_block(plan, values, h):
    n = h.n_owned
    owned = h[:n]
    assert isinstance(owned, ShardTensor) and owned.layout == "owned" and owned.shape[0] == n
    for subset, aten in ((lambda: h[:3], "slice"), (lambda: h[0], "select"), (lambda: h[2:n], "slice"),
                         (lambda: h[::2], "slice")):  # a subset of atom rows is no layout: refused, not plain
        with pytest.raises(ShardTensorMeaningError, match=rf"\(aten::{aten}\).*(subset of the atom rows|one atom row)"):
            subset()
    assert h[: h.shape[0]].layout == "halo" and h[:n, 0].layout == "owned"
    pos = ShardTensor.from_global(torch.tensor(model.system(N, BOX, 1)), plan, layout="halo", positions=True)
    assert type(pos[:n]) is torch.Tensor  # owned rows of halo positions are in the wrapped frame
    padded = torch.cat([owned, torch.full((1, 3), 1e6, dtype=owned.dtype)])  # the "+1" pad row
    assert padded.layout == "owned" and padded.pad_rows == 1
    np.testing.assert_allclose(padded.sum(0).to_local().detach().numpy(), values.sum(0), rtol=1e-12)
    with pytest.raises(ShardTensorMeaningError, match=_refused("torch.cat", "owned")):
        torch.cat([torch.zeros(1, 3, dtype=owned.dtype), owned])  # rows shifted: no longer the layout


@pytest.mark.parametrize("form", ["sum()", "sum(0)", "torch.sum(dim=0)", "sum((0, 1))", "nansum(0)",
                                  "system_sum()"])
def test_sum_over_atoms_is_owned_rows_then_all_reduce_with_unit_gradient(form, h, values):
    f = {"sum()": lambda t: t.sum(), "sum(0)": lambda t: t.sum(0), "torch.sum(dim=0)": lambda t: torch.sum(t, dim=0),
         "sum((0, 1))": lambda t: t.sum((0, 1)), "nansum(0)": lambda t: t.nansum(0),
         "system_sum()": lambda t: t.system_sum()}[form]
    want = values.sum() if form in ("sum()", "sum((0, 1))") else values.sum(0)
    got = f(h)
    assert isinstance(got, ShardTensor) and got.layout == "replicated" and got.shape == np.shape(want)
    np.testing.assert_allclose(got.to_local().detach().numpy(), want, rtol=1e-12)  # ghosts not counted
    got.sum().backward()
    grad = h.grad.to_local().numpy()
    np.testing.assert_array_equal(grad[: h.n_owned], 1.0)  # exactly one: identity adjoint, not W
    np.testing.assert_array_equal(grad[h.n_owned:], 0.0)


@pytest.mark.parametrize("form", ["mean()", "mean(0)", "mean((0, 1))", "torch.mean(dim=0, keepdim=True)"])
def test_mean_over_atoms_is_the_owned_sum_over_the_job_count(form, h, values):
    f = {"mean()": lambda t: t.mean(), "mean(0)": lambda t: t.mean(0), "mean((0, 1))": lambda t: t.mean((0, 1)),
         "torch.mean(dim=0, keepdim=True)": lambda t: torch.mean(t, dim=0, keepdim=True)}[form]
    want = {"mean()": values.mean(), "mean(0)": values.mean(0), "mean((0, 1))": values.mean(),
            "torch.mean(dim=0, keepdim=True)": values.mean(0, keepdims=True)}[form]
    got = f(h)
    assert isinstance(got, ShardTensor) and got.layout == "replicated" and got.shape == np.shape(want)
    np.testing.assert_allclose(got.to_local().detach().numpy(), want, rtol=1e-12)  # ghosts not counted
    got.sum().backward()
    per = values.size if form in ("mean()", "mean((0, 1))") else values.shape[0]
    grad = h.grad.to_local().numpy()
    np.testing.assert_allclose(grad[: h.n_owned], 1.0 / per, rtol=1e-14)
    np.testing.assert_array_equal(grad[h.n_owned:], 0.0)
    assert h.mean(-1).layout == "halo"  # over features: row by row


def test_all_and_any_over_atoms_count_owned_rows_of_every_rank(plan, h, values):
    local = h.detach().to_local().clone()
    local[h.n_owned:] = 0.0  # ghost rows that disagree with their owners: they must not decide
    g = ShardTensor.from_local(local, plan, layout="halo")
    for got, want in ((g.all(), np.all(values != 0)), ((g == 0).any(), False), ((g > 1).any(), np.any(values > 1)),
                      (torch.all(g > -1, dim=0), np.all(values > -1, axis=0)), ((g > 1).any(0, keepdim=True),
                                                                                np.any(values > 1, 0, keepdims=True))):
        assert isinstance(got, ShardTensor) and got.layout == "replicated" and got.dtype == torch.bool
        np.testing.assert_array_equal(got.to_local().numpy(), want)
    assert bool(g.all()) is True  # a replicated value: a host read is fine
    assert (g > 0).all(-1).layout == "halo"  # over features: row by row


def test_sum_over_features_only_is_row_wise(h):
    s = h.sum(-1)
    assert s.layout == "halo" and s.shape == (h.shape[0],)
    torch.testing.assert_close(s.to_local(), h.to_local().sum(-1))


@pytest.fixture
def batch(plan, h) -> torch.Tensor:
    """Per-row system index of the halo block (ghosts carry their owner's system): atoms g % 3."""
    hg = np.asarray(plan.halo_global)[0, : h.shape[0]]
    return torch.tensor(hg % 3)


def _per_system(values: np.ndarray) -> np.ndarray:
    out = np.zeros((3, values.shape[1]))
    np.add.at(out, np.arange(len(values)) % 3, values)
    return out


@pytest.mark.parametrize("form", ["index_add_", "torch.index_add", "scatter_add_", "scatter_add",
                                  "system_sum(batch)"])
def test_per_system_sum_into_n_systems_rows(form, h, batch, values):
    acc = torch.zeros(3, 3, dtype=torch.float64)
    ix = batch[:, None].expand(-1, 3)
    got = {"index_add_": lambda: acc.index_add_(0, batch, h),
           "torch.index_add": lambda: torch.index_add(acc, 0, batch, h),
           "scatter_add_": lambda: acc.scatter_add_(0, ix, h),
           "scatter_add": lambda: acc.scatter_add(0, ix, h),
           "system_sum(batch)": lambda: h.system_sum(batch, n_systems=3)}[form]()
    assert isinstance(got, ShardTensor) and got.layout == "replicated"
    np.testing.assert_allclose(got.to_local().detach().numpy(), _per_system(values), rtol=1e-12)
    if form.endswith("_"):  # in place: the accumulator itself holds the sum (the return value may be ignored)
        np.testing.assert_allclose(acc.detach().numpy(), _per_system(values), rtol=1e-12)
    got.sum().backward()
    grad = h.grad.to_local().numpy()
    np.testing.assert_array_equal(grad[: h.n_owned], 1.0)
    np.testing.assert_array_equal(grad[h.n_owned:], 0.0)


def test_per_system_sum_errors(h, batch, plan):
    with pytest.raises(ValueError, match=r"system_sum: batch given without n_systems; pass n_systems="):
        h.system_sum(batch)
    with pytest.raises(ValueError, match=r"batch has shape \(3,\) but rank 0 needs one system index per row"):
        h.system_sum(batch[:3], n_systems=3)
    rep = h.sum(0)
    with pytest.raises(TypeError, match=r"system_sum: this ShardTensor is replicated"):
        rep.system_sum()
    with pytest.raises(ShardTensorMeaningError, match=r"as many rows as the atom block.*system_sum\(batch, n_systems"):
        torch.zeros(h.n_owned, 3, dtype=h.dtype).index_add_(0, torch.arange(h.shape[0]) % h.n_owned, h)
    with pytest.raises(ShardTensorMeaningError, match=_refused("torch.Tensor.index_add_", "halo")):
        torch.zeros(3, 3, dtype=h.dtype).index_add_(0, ShardTensor.from_local(batch, plan, layout="halo"),
                                                    torch.ones(h.shape[0], 3, dtype=h.dtype))  # plain source


@hypothesis.settings(max_examples=12)
@hypothesis.given(n=st.integers(3, 16), tail=st.sampled_from([(), (1,), (4,), (2, 3)]), seed=st.integers(0, 99),
                  layout=st.sampled_from(["owned", "halo"]))
def test_row_wise_ops_keep_rows_values_and_metadata(n, tail, seed, layout):
    rng = np.random.default_rng(seed)
    plan = HaloPlan.build(rng.uniform(0, BOX, (n, 3)), np.eye(3) * BOX, cutoff=2.0, n_devices=1)
    x = ShardTensor.from_global(torch.tensor(rng.normal(size=(n, *tail))), plan, layout=layout)
    a = x.to_local()
    w = torch.tensor(rng.normal(size=(tail[-1] if tail else 1, 2)))
    cases = {
        "affine": (lambda t: 2 * t + 1, lambda t: 2 * t + 1),
        "sin": (torch.sin, torch.sin),
        "where": (lambda t: torch.where(t > 0, t, -t), lambda t: torch.where(t > 0, t, -t)),
        "rows": (lambda t: t.reshape(t.shape[0], -1), lambda t: t.reshape(t.shape[0], -1)),
        "unsqueeze": (lambda t: t.unsqueeze(-1), lambda t: t.unsqueeze(-1)),
        "matmul": (lambda t: t.reshape(t.shape[0], -1)[:, : w.shape[0]] @ w,
                   lambda t: t.reshape(t.shape[0], -1)[:, : w.shape[0]] @ w),
        "feature_sum": (lambda t: t.reshape(t.shape[0], -1).sum(-1), lambda t: t.reshape(t.shape[0], -1).sum(-1)),
    }
    for name, (f, ref) in cases.items():
        y = f(x)
        assert isinstance(y, ShardTensor) and y.layout == layout and y.shape[0] == x.shape[0], name
        torch.testing.assert_close(y.to_local(), ref(a), rtol=0, atol=0)


# ---- the naive route: a message-passing model written for one device -------------------------


def toy_mpnn(pos: torch.Tensor, h: torch.Tensor, edges: torch.Tensor, *, gather: str = "getitem") -> torch.Tensor:
    """One message-passing layer and an energy, as a single-device model writes it."""
    src, dst = edges
    take = (lambda t, i: t[i]) if gather == "getitem" else (lambda t, i: t.index_select(0, i))
    r = (take(pos, dst) - take(pos, src)).norm(dim=-1, keepdim=True)
    msg = take(h, src) * torch.exp(-r)
    out = torch.zeros_like(h).index_add_(0, dst, msg)
    return (out * h).sum()


@pytest.fixture
def graph(plan) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.tensor(model.system(N, BOX, 1))
    n_pad = int(plan.n_owned[0] + plan.n_ghost[0])
    edges = torch.tensor(np.array([[i, (i + 1) % n_pad] for i in range(n_pad)]).T)
    return pos, edges


@pytest.mark.parametrize("gather, op", [("getitem", "torch.Tensor.__getitem__"),
                                        ("index_select", "torch.Tensor.index_select")])
def test_naive_model_on_shard_tensors_raises_instead_of_a_wrong_energy(gather, op, plan, graph, values):
    pos, edges = graph
    xp = ShardTensor.from_global(pos, plan, layout="halo", positions=True, requires_grad=True)
    xh = ShardTensor.from_global(torch.tensor(values), plan, layout="halo")
    e_plain = toy_mpnn(xp.to_local(), xh.to_local(), edges, gather=gather)  # plain tensors: runs, per rank
    assert type(e_plain) is torch.Tensor
    with pytest.raises(ShardTensorMeaningError, match=_refused(op, "halo")):
        toy_mpnn(xp, xh, edges, gather=gather)


def test_naive_scatter_into_the_halo_rows_raises_even_after_a_local_gather(plan, graph, values):
    pos, edges = graph
    xh = ShardTensor.from_global(torch.tensor(values), plan, layout="halo")
    src, dst = edges
    msg = xh.to_local()[src]  # the gather taken on the local block: the user's responsibility
    with pytest.raises(ShardTensorMeaningError, match=_refused("torch.Tensor.index_add_", "halo")):
        torch.zeros_like(xh).index_add_(0, dst, msg)
