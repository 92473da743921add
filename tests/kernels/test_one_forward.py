"""jax.grad through a torch op runs the op's forward once (issue 15): the differentiated forward keeps
its torch graph for the backward, on both call paths. Counted with ops that count their own forward
runs; gradients against torch.autograd.grad on the same op; a pullback called twice, a forward whose
pullback never runs (the graph table's cap), and chained torch_function stages as mlip builds them.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P

from nvalchemi_jaxbridge.kernels import TorchOpKernel, torch_op
from nvalchemi_jaxbridge.kernels.torch_fn import torch_function
from nvalchemi_jaxbridge.kernels.graph_table import GRAPH_CAP, GraphTable

NS = "kt1fwd"
PATHS = ["ffi", "callback"]


class Counter:
    """Forward runs of an op's real implementation (its fake one does not count), thread-safe."""

    def __init__(self) -> None:
        self.n = 0
        self._lock = threading.Lock()

    def tick(self) -> None:
        with self._lock:
            self.n += 1


@pytest.fixture(autouse=True)
def _no_env_path(monkeypatch):
    monkeypatch.delenv(torch_op.ENV_CALL_PATH, raising=False)


# ------------------------------------------------------------------ test ops

RUNS = Counter()


@torch.library.custom_op(f"{NS}::pair_sq", mutates_args=())
def pair_sq(x: torch.Tensor, a: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(E = a sum_i |x_i|^2 (0-d), per-row e_i = a |x_i|^2 (n,)); counts its runs."""
    RUNS.tick()
    e = a * (x * x).sum(-1)
    return e.sum(), e


pair_sq.register_fake(lambda x, a: (x.new_empty(()), x.new_empty(x.shape[:1])))


def _pair_sq_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.a = inputs[1]


def _pair_sq_backward(ctx, g_total, g_rows):
    (x,) = ctx.saved_tensors
    return 2.0 * ctx.a * x * (g_total + g_rows)[:, None], None


pair_sq.register_autograd(_pair_sq_backward, setup_context=_pair_sq_setup)

SQ_RUNS = Counter()
_lib = torch.library.Library(NS, "DEF")
# a mutated argument, differentiable through the decomposition: out += b x^3 in place, returns sin(x) out
_lib.define("acc_cube(Tensor x, Tensor(a!) out, float b) -> Tensor")


def _acc_cube(x, out, b):
    SQ_RUNS.tick()
    out.add_(x * x * x, alpha=b)
    return torch.sin(x) * out


_lib.impl("acc_cube", _acc_cube, "CompositeImplicitAutograd")
PAIR_SQ = torch.ops.kt1fwd.pair_sq.default
ACC_CUBE = torch.ops.kt1fwd.acc_cube.default


def _torch_pair_sq_grad(x, a, c_total, c_rows):
    """d(c_total E + c_rows . e)/dx by torch autograd through pair_sq's own backward formula."""
    t = torch.tensor(x, requires_grad=True)
    total, rows = PAIR_SQ(t, a)
    (g,) = torch.autograd.grad(c_total * total + (rows * torch.from_numpy(c_rows)).sum(), t)
    return g.numpy()


def _x(n=6, dtype=np.float64, seed=0):
    return np.random.default_rng(seed).normal(size=(n, 3)).astype(dtype)


def _runs_per_call(counter: Counter, f, *args) -> int:
    """Forward runs of one execution of the jitted `f` (compiled and run once before counting)."""
    jax.block_until_ready(f(*args))
    before = counter.n
    jax.block_until_ready(f(*args))
    return counter.n - before


# ------------------------------------------------------------------ one forward per call


@pytest.mark.parametrize("path", PATHS)
def test_value_and_grad_runs_the_forward_once_inside_jit(path):
    k = TorchOpKernel(PAIR_SQ, call_path=path)
    assert k.backward_path_of(_x(), 1.5).startswith(path)
    x = _x()
    energy = lambda x: k(x, 1.5)[0]  # noqa: E731
    assert _runs_per_call(RUNS, jax.jit(jax.value_and_grad(energy)), x) == 1
    assert _runs_per_call(RUNS, jax.jit(jax.grad(energy)), x) == 1
    assert _runs_per_call(RUNS, jax.jit(energy), x) == 1  # undifferentiated: the plain forward
    e, g = jax.jit(jax.value_and_grad(energy))(x)
    np.testing.assert_allclose(float(e), 1.5 * np.sum(x * x), rtol=1e-13)
    np.testing.assert_allclose(np.asarray(g), _torch_pair_sq_grad(x, 1.5, 1.0, np.zeros(len(x))), rtol=1e-13)
    assert k.kept_graphs() == 0  # every backward took its graph


@pytest.mark.parametrize("path", PATHS)
def test_one_forward_per_device_inside_shard_map(path):
    """8 CPU devices call the op concurrently, each keeping and taking its own graph."""
    n_dev = 8
    mesh = jax.make_mesh((n_dev,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    k = TorchOpKernel(PAIR_SQ, call_path=path)
    x = _x(4 * n_dev, seed=1)
    w = np.random.default_rng(2).normal(size=len(x))

    def per_device(xb, wb):
        total, rows = k(xb, 0.5)
        return jax.lax.psum(2.0 * total + jnp.vdot(rows, wb), "x")

    sm = jax.shard_map(per_device, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P())
    f = jax.jit(jax.value_and_grad(sm))
    assert _runs_per_call(RUNS, f, x, w) == n_dev
    _, g = f(x, w)
    want = np.concatenate([_torch_pair_sq_grad(x[b : b + 4], 0.5, 2.0, w[b : b + 4]) for b in range(0, len(x), 4)])
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-13)
    assert k.kept_graphs() == 0
    assert k.token_reads() == (0 if path == "ffi" else 3 * n_dev)  # 3 runs; the FFI: each device found its graph


# ------------------------------------------------------------------ where the backward finds its graph


def test_ffi_backwards_in_the_forwards_program_find_their_graph_without_reading_the_token():
    """By where the token was written (run, device, buffer): no read back, in one program, in an MD-like
    loop of steps and on 8 devices; a pullback run as a program of its own reads the token."""
    k = TorchOpKernel(PAIR_SQ, call_path="ffi")
    x = _x(6, seed=11)
    energy = lambda x: k(x, 1.5)[0]  # noqa: E731
    for _ in range(3):
        e, g = jax.jit(jax.value_and_grad(energy))(x)
        np.testing.assert_allclose(np.asarray(g), 3.0 * x, rtol=1e-13)

    def step(_, carry):
        y, acc = carry
        e, g = jax.value_and_grad(energy)(y)
        return y - 0.01 * g, acc + e

    y, acc = jax.jit(lambda x: jax.lax.fori_loop(0, 5, step, (x, 0.0)))(x)
    ref, ref_acc = x.copy(), 0.0
    for _ in range(5):
        ref_acc += 1.5 * np.sum(ref * ref)
        ref = ref - 0.01 * 3.0 * ref
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-13)
    np.testing.assert_allclose(float(acc), ref_acc, rtol=1e-13)
    assert k.token_reads() == 0 and k.kept_graphs() == 0

    _, pullback = jax.vjp(energy, x)  # two programs: the backward's run is not the forward's
    (g,) = pullback(jnp.asarray(1.0))
    np.testing.assert_allclose(np.asarray(g), 3.0 * x, rtol=1e-13)
    assert k.token_reads() == 1 and k.kept_graphs() == 0


def test_callback_backwards_read_their_token():
    k = TorchOpKernel(PAIR_SQ, call_path="callback")
    x = _x(6, seed=12)
    for _ in range(2):
        jax.block_until_ready(jax.jit(jax.grad(lambda x: k(x, 1.5)[0]))(x))
    assert k.token_reads() == 2


# ------------------------------------------------------------------ only what JAX differentiates


@pytest.mark.parametrize("path", PATHS)
def test_torch_differentiates_only_the_arrays_jax_asks_about(path):
    """An array JAX does not differentiate (not in argnums, behind stop_gradient) is no torch leaf; the
    gradients asked for still match torch's."""
    seen: list[tuple[bool, bool]] = []

    def fn(x, y):
        if torch.is_grad_enabled():  # the runs under autograd (not the shape probe's)
            seen.append((x.requires_grad, y.requires_grad))
        return (x * x * y[:, None]).sum().reshape(1)

    k = torch_function(fn, 2, 1, label=f"leaves_{path}", call_path=path)
    rng = np.random.default_rng(13)
    x, y = rng.normal(size=(5, 3)), rng.normal(size=5)
    energy = lambda x, y: k(x, y)[0]  # noqa: E731
    for argnums, want in [(0, (True, False)), (1, (False, True)), ((0, 1), (True, True))]:
        seen.clear()
        g = jax.jit(jax.grad(energy, argnums=argnums))(x, y)
        assert seen and set(seen) == {want}, (argnums, seen)
        gx, gy = 2.0 * x * y[:, None], (x * x).sum(1)
        for got, ref in zip(g if isinstance(argnums, tuple) else (g,),
                            [gx, gy] if argnums == (0, 1) else [gx if argnums == 0 else gy]):
            np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-13)
    seen.clear()
    g = jax.jit(jax.grad(lambda x, y: energy(x, jax.lax.stop_gradient(2.0 * y))))(x, y)
    assert set(seen) == {(True, False)}
    np.testing.assert_allclose(np.asarray(g), 4.0 * x * y[:, None], rtol=1e-13)


@pytest.mark.parametrize("path", PATHS)
def test_outputs_outside_the_differentiated_loss_give_the_right_gradients(path):
    """The op's results reach value_and_grad only as aux, or through stop_gradient (then no graph is kept:
    JAX does not differentiate the op at all)."""
    k = TorchOpKernel(PAIR_SQ, call_path=path)
    x = _x(4, seed=14)
    stop = jax.jit(jax.grad(lambda x: jnp.sum(jax.lax.stop_gradient(k(x, 1.0)[1])) + jnp.sum(x)))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(stop(x)), np.ones_like(x))
    assert k.kept_graphs() == 0
    aux = jax.jit(jax.value_and_grad(lambda x: (jnp.sum(x * x), k(x, 1.0)[1]), has_aux=True))
    (_, rows), g = aux(x)
    np.testing.assert_allclose(np.asarray(rows), np.sum(x * x, 1), rtol=1e-13)
    np.testing.assert_allclose(np.asarray(g), 2.0 * x, rtol=1e-13)


# ------------------------------------------------------------------ gradients against torch


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("path", PATHS)
def test_multi_output_and_per_row_gradients_match_torch(path, dtype):
    k = TorchOpKernel(PAIR_SQ, call_path=path)
    x = _x(7, dtype, seed=3)
    c_rows = np.random.default_rng(4).normal(size=len(x)).astype(dtype)

    def loss(x):
        total, rows = k(x, -0.75)
        return 3.0 * total + jnp.vdot(rows, c_rows)

    g = jax.jit(jax.grad(loss))(x)
    assert g.dtype == dtype
    rtol = 1e-5 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(np.asarray(g), _torch_pair_sq_grad(x, -0.75, 3.0, c_rows), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("path", PATHS)
def test_mutated_argument_gradients_match_torch_with_one_forward(path, dtype):
    """acc_cube: (sin(x) out', out' = out + b x^3); gradients for x and out's initial value."""
    k = TorchOpKernel(ACC_CUBE, call_path=path)
    rng = np.random.default_rng(5)
    x, out0 = rng.normal(size=5).astype(dtype), rng.normal(size=5).astype(dtype)
    ct0, ct1 = rng.normal(size=5).astype(dtype), rng.normal(size=5).astype(dtype)

    def loss(x, o):
        r, o2 = k(x, o, 0.25)
        return jnp.vdot(r, ct0) + jnp.vdot(o2, ct1)

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    assert _runs_per_call(SQ_RUNS, f, x, out0) == 1
    _, (gx, go) = f(x, out0)
    tx, to = torch.tensor(x, requires_grad=True), torch.tensor(out0, requires_grad=True)
    o = to.clone()
    r = ACC_CUBE(tx, o, 0.25)
    want = torch.autograd.grad((r * torch.from_numpy(ct0)).sum() + (o * torch.from_numpy(ct1)).sum(), (tx, to))
    rtol = 1e-5 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(np.asarray(gx), want[0].numpy(), rtol=rtol, atol=rtol)
    np.testing.assert_allclose(np.asarray(go), want[1].numpy(), rtol=rtol, atol=rtol)
    assert gx.dtype == dtype and go.dtype == dtype


# ------------------------------------------------------------------ pullbacks twice, and never


@pytest.mark.parametrize("path", PATHS)
def test_pullback_called_twice_gives_the_same_gradient(path):
    """The first pullback takes the kept graph; the second finds it gone and re-runs the forward."""
    k = TorchOpKernel(PAIR_SQ, call_path=path)
    x = _x(5, seed=6)
    c_rows = np.linspace(-1.0, 1.0, len(x))
    (total, rows), pullback = jax.vjp(lambda x: k(x, 2.0), x)
    assert k.kept_graphs() == 1
    before = RUNS.n
    (g1,) = pullback((jnp.asarray(1.0), jnp.asarray(c_rows)))
    assert RUNS.n == before and k.kept_graphs() == 0  # the graph was used, no re-run
    (g2,) = pullback((jnp.asarray(1.0), jnp.asarray(c_rows)))
    assert RUNS.n == before + 1  # gone: the op again on the saved inputs
    want = _torch_pair_sq_grad(x, 2.0, 1.0, c_rows)
    np.testing.assert_allclose(np.asarray(g1), want, rtol=1e-13)
    np.testing.assert_array_equal(np.asarray(g2), np.asarray(g1))


def test_ffi_pullback_on_copies_of_the_forwards_inputs_runs_the_op_again():
    """The FFI forward reads XLA's input buffers in place, so its graph may hold them: a backward that gets
    other buffers (here: the residuals copied) must not use it. It re-runs the op on what it got, exactly."""
    k = TorchOpKernel(PAIR_SQ, call_path="ffi")
    x = _x(5, seed=13)
    c_rows = np.linspace(-1.0, 1.0, len(x))
    want = _torch_pair_sq_grad(x, 2.0, 1.0, c_rows)
    before = RUNS.n
    (total, rows), pullback = jax.vjp(lambda x: k(x, 2.0), x)
    moved = jax.tree.map(lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array) else a, pullback)
    (g,) = moved((jnp.asarray(1.0), jnp.asarray(c_rows)))
    assert RUNS.n == before + 2 and k.kept_graphs() == 0  # the forward, then again: the graph was dropped
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-13)
    (total, rows), pullback = jax.vjp(lambda x: k(x, 2.0), x)  # the residuals themselves: the graph is used
    (g2,) = pullback((jnp.asarray(1.0), jnp.asarray(c_rows)))
    assert RUNS.n == before + 3 and k.kept_graphs() == 0
    np.testing.assert_array_equal(np.asarray(g2), np.asarray(g))


@pytest.mark.parametrize("path", PATHS)
def test_gradient_through_a_scan_of_the_op_is_exact(path):
    """`jax.grad` of a `lax.scan` runs every forward first and the backwards after, in reverse, on the
    stacked residuals (copies of what each forward read); more steps than a table keeps graphs."""
    k = TorchOpKernel(PAIR_SQ, call_path=path)
    energy = lambda x: k(x, 1.5)[0]  # noqa: E731
    steps = GRAPH_CAP + 8

    def loss(x, e):
        def body(c, _):
            return c * 0.99 + 0.001 * jnp.sin(c), e(c)

        c, es = jax.lax.scan(body, x, None, length=steps)
        return jnp.sum(es) + e(c)

    x = _x(6, seed=14)
    got = jax.jit(jax.grad(lambda x: loss(x, energy)))(x)
    want = jax.grad(lambda x: loss(x, lambda c: 1.5 * jnp.sum(c * c)))(x)  # the op's energy in plain JAX
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12)
    assert k.kept_graphs() == 0


@pytest.mark.parametrize("path", PATHS)
def test_forwards_whose_pullback_never_runs_keep_at_most_the_cap(path):
    k = TorchOpKernel(PAIR_SQ, call_path=path)
    x = _x(3, seed=7)
    f = lambda x: k(x, 1.0)[0]  # noqa: E731
    pullbacks = [jax.vjp(f, x + i)[1] for i in range(GRAPH_CAP + 5)]
    assert k.kept_graphs() == GRAPH_CAP
    # the oldest was evicted: its pullback re-runs the op and is still right; the newest takes its graph
    for i in (0, GRAPH_CAP + 4):
        (g,) = pullbacks[i](jnp.asarray(1.0))
        np.testing.assert_allclose(np.asarray(g), 2.0 * (x + i), rtol=1e-14)
    assert k.kept_graphs() == GRAPH_CAP - 1


def test_graph_table_evicts_oldest_and_tells_tokens_apart():
    table = GraphTable(cap=2)
    t1, t2, t3 = (table.keep(f"g{i}") for i in range(3))
    assert len(table) == 2 and table.take(t1) is None  # evicted
    assert table.take((table.salt ^ 1, t2[1])) is None  # another table's (or process's) token
    assert table.take(t3) == "g2" and table.take(t3) is None
    assert table.take(t2) == "g1" and len(table) == 0


# ------------------------------------------------------------------ torch_function stages (as mlip chains them)


@pytest.mark.parametrize("path", PATHS)
def test_chained_torch_function_stages_differentiate_with_one_forward_each(path):
    rng = np.random.default_rng(8)
    w1 = torch.from_numpy(rng.normal(size=(3, 4)))
    w2 = torch.from_numpy(rng.normal(size=(4,)))
    runs = (Counter(), Counter())

    def embed(x):
        runs[0].tick()
        return torch.tanh(x @ w1)

    def readout(h, x):
        runs[1].tick()
        return ((h * h) @ w2 * (x * x).sum(-1)).sum()

    s1 = torch_function(embed, 1, 1, label="embed", call_path=path)
    s2 = torch_function(readout, 2, 1, label="readout", call_path=path)
    x = rng.normal(size=(6, 3))
    f = jax.jit(jax.value_and_grad(lambda x: s2(s1(x), x)))
    jax.block_until_ready(f(x))
    before = (runs[0].n, runs[1].n)
    e, g = f(x)
    assert (runs[0].n - before[0], runs[1].n - before[1]) == (1, 1)
    t = torch.tensor(x, requires_grad=True)
    want_e = readout(embed(t), t)
    (want_g,) = torch.autograd.grad(want_e, t)
    np.testing.assert_allclose(float(e), float(want_e.detach()), rtol=1e-13)
    np.testing.assert_allclose(np.asarray(g), want_g.numpy(), rtol=1e-12)
    assert s1.kept_graphs() == 0 and s2.kept_graphs() == 0
