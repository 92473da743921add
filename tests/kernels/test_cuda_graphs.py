"""Recorded-and-replayed functions (`kernels.cuda_graphs`) against the same function run eagerly.

CI has no GPU: the recording logic runs with `FakeCapture`, which keeps the CUDA backend's buffers
and replay rules (inputs copied into static buffers, static outputs handed out, the backward reading
the last forward's activations). Every check compares with the function itself run eagerly in torch.
"""

from __future__ import annotations

import itertools
import logging

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.kernels import cuda_graphs as cg
from nvalchemi_jaxbridge.kernels.torch_fn import torch_function

LOG = "nvalchemi_jaxbridge.kernels.cuda_graphs"


def _layer(dtype=torch.float64) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 4, dtype=dtype)


def stage_of(lin: torch.nn.Linear):
    """Two float outputs (one not depending on `y`) and an integer one, as a stage returns."""

    def stage(x, y):
        h = torch.tanh(lin(x)) * y[:, None]
        return h, (x**2).sum(1), torch.argmax(h, dim=1)

    return stage


def eager_grads(fn, xs, cts):
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
    outs = fn(*leaves)
    pairs = [(o, c) for o, c in zip(outs, cts) if o.requires_grad]
    return [o.detach() for o in outs], torch.autograd.grad([o for o, _ in pairs], leaves,
                                                            [c for _, c in pairs], allow_unused=True)


def graphed(fn, backend=None, weights=tuple):
    graphs = cg.StageGraphs(backend or cg.FakeCapture(), "test", weights)
    return graphs.wrap(fn, "stage", checks_weights=True), graphs


@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(rows=st.sampled_from([3, 5]), seeds=st.lists(st.integers(0, 99), min_size=2, max_size=4))
def test_replays_give_the_eager_values_and_gradients_on_new_inputs(rows, seeds):
    fn = stage_of(_layer())
    g, graphs = graphed(fn)
    for seed in seeds:  # later calls replay the recording on new values
        rng = np.random.default_rng(seed)
        x, y = (torch.tensor(rng.normal(size=s)) for s in ((rows, 3), (rows,)))
        cts = [torch.tensor(rng.normal(size=(rows, 4))), torch.tensor(rng.normal(size=rows))]
        want, want_g = eager_grads(fn, (x, y), cts)
        with torch.no_grad():
            plain = g(x, y)
        xl, yl = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
        outs = g(xl, yl)
        got_g = torch.autograd.grad(outs[:2], (xl, yl), cts)
        for a, b in itertools.chain(zip(plain, want), zip(outs, want), zip(got_g, want_g)):
            assert torch.equal(a, b)
        assert not outs[2].requires_grad and outs[0].requires_grad
    assert graphs.captures == 2 and graphs.replays == 2 * len(seeds) and graphs.off is None  # grad and no grad


def test_a_new_shape_dtype_or_grad_mask_records_again():
    lin32, lin64 = _layer(torch.float32), _layer()
    g, graphs = graphed(lambda x, y: stage_of(lin64 if x.dtype == torch.float64 else lin32)(x, y))
    calls = [((5, 3), torch.float64, (True, True)), ((5, 3), torch.float64, (True, True)),  # same: replay
             ((8, 3), torch.float64, (True, True)),   # a grown capacity
             ((8, 3), torch.float32, (True, True)),   # another dtype
             ((8, 3), torch.float32, (True, False))]  # y not differentiated
    for n, (shape, dtype, req) in enumerate(calls):
        x = torch.randn(shape, dtype=dtype, requires_grad=req[0])
        y = torch.randn(shape[0], dtype=dtype, requires_grad=req[1])
        h = g(x, y)[0]
        assert torch.equal(h, stage_of(lin64 if dtype == torch.float64 else lin32)(x, y)[0])
        (h**2).sum().backward()
    assert graphs.captures == 4


def test_a_second_forward_before_the_first_backward_leaves_that_backward_right():
    fn = stage_of(_layer())
    g, graphs = graphed(fn)
    xs = [torch.randn(4, 3, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    ys = [torch.randn(4, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    outs = [g(x, y) for x, y in zip(xs, ys)]  # the second replay overwrites the first one's activations
    ct = [torch.ones(4, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)]
    for k in (0, 1):  # the first call's backward first: it must not read the second's activations
        got = torch.autograd.grad(outs[k][:2], (xs[k], ys[k]), ct)
        want = eager_grads(fn, (xs[k], ys[k]), ct)[1]
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert graphs.eager_backwards == 1 and graphs.captures == 1


@pytest.mark.parametrize("call_path", ["ffi", "callback"])
def test_two_vjps_through_jax_then_their_pullbacks(call_path):
    """The stage op called from JAX (the FFI handler or buffer_callback keeping torch graphs between forward
    and backward), recorded: two forwards, then their pullbacks in the order that finds stale activations."""
    lin = _layer()
    graphs = cg.StageGraphs(cg.FakeCapture(), "test")

    def fn(x):
        return torch.tanh(lin(x)).sum(1)

    k = torch_function(graphs.wrap(fn, "stage"), 1, 1, label="graphed", call_path=call_path)
    xs = [np.random.default_rng(s).normal(size=(6, 3)) for s in (1, 2)]
    pulls = [jax.vjp(k, jnp.asarray(x)) for x in xs]
    ct = np.linspace(-1.0, 1.0, 6)
    for (y, pull), x in zip(pulls, xs):
        want_y, want_g = eager_grads(lambda t: (fn(t),), (torch.tensor(x),), [torch.tensor(ct)])
        np.testing.assert_array_equal(np.asarray(y), want_y[0].numpy())
        np.testing.assert_array_equal(np.asarray(pull(jnp.asarray(ct))[0]), want_g[0].numpy())
    assert graphs.captures >= 1 and graphs.eager_backwards == 1


def test_a_host_read_turns_recording_off_with_one_log_line(caplog):
    lin = _layer()

    def syncing(x, y):
        if float(x.abs().max()) > 1e6:  # a host synchronisation on a GPU; refused by a capture
            x = x / 2
        return stage_of(lin)(x, y)

    g, graphs = graphed(syncing)
    with caplog.at_level(logging.WARNING, logger=LOG):
        for _ in range(3):
            x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
            for a, b in zip(g(x, y), syncing(x, y)):
                assert torch.equal(a, b)
    lines = [r for r in caplog.records if r.name == LOG]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "__float__" in lines[0].getMessage() and "run eagerly" in lines[0].getMessage()
    assert graphs.off is not None and graphs.captures == 0 and graphs.replays == 0


def test_a_replay_that_differs_from_eager_turns_recording_off(caplog):
    """A function with state between calls gives another answer when replayed: the check after recording
    sees it, and every call is the eager one."""
    counter = itertools.count()

    def drifting(x):
        return x + float(next(counter))

    g, graphs = graphed(drifting)
    with caplog.at_level(logging.WARNING, logger=LOG):
        got = g(torch.zeros(3, dtype=torch.float64))
    assert graphs.off is not None and "differs from an eager run" in graphs.off
    assert len([r for r in caplog.records if r.name == LOG]) == 1
    assert torch.equal(got, torch.full((3,), float(next(counter) - 1), dtype=torch.float64))


def test_weights_changed_in_place_are_read_and_moved_storage_records_again():
    lin = _layer()
    fn = stage_of(lin)
    g, graphs = graphed(fn, weights=lambda: list(lin.parameters()))
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    g(x, y)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # in place: the recording reads it
    assert torch.equal(g(x, y)[0], fn(x, y)[0]) and graphs.captures == 1
    lin.weight.data = torch.randn(4, 3, dtype=torch.float64)  # new storage: recorded again
    assert torch.equal(g(x, y)[0], fn(x, y)[0]) and graphs.captures == 2


def test_shape_probes_and_fake_tensors_are_never_recorded():
    g, graphs = graphed(stage_of(_layer()))
    with cg.eager():
        g(torch.zeros(5, 3, dtype=torch.float64), torch.zeros(5, dtype=torch.float64))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        g(torch.zeros(5, 3, dtype=torch.float64), torch.zeros(5, dtype=torch.float64))
    assert graphs.captures == 0 and graphs.replays == 0


def test_the_option_is_checked_and_auto_is_off_on_the_cpu():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert cg.capture_backend("auto", cpu, "here") is None and cg.capture_backend(False, gpu, "here") is None
    assert isinstance(cg.capture_backend("auto", gpu, "here"), cg.CudaGraphs)
    assert isinstance(cg.capture_backend(True, gpu, "here"), cg.CudaGraphs)
    fake = cg.FakeCapture()
    assert cg.capture_backend(fake, cpu, "here") is fake
    with pytest.raises(ValueError, match=r"here: cuda_graphs=True but the model's stages run on 'cpu'.*False"):
        cg.capture_backend(True, cpu, "here")
    with pytest.raises(ValueError, match=r"cuda_graphs must be \"auto\", True or False, got 'on'"):
        cg.capture_backend("on", cpu, "here")
