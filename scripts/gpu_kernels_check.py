"""GPU check of the kernels layer: torch and Triton ops through both call paths.

Each check runs once per call path of `TorchOpKernel`: "callback" (buffer_callback + DLPack)
and "ffi" (the compiled XLA FFI handler calling the op through torch's dispatcher; built on
first use, which needs a C++ compiler and the CUDA headers).

Run on a machine with 1-2 CUDA GPUs (jax with CUDA, torch with CUDA, triton):

    python scripts/gpu_kernels_check.py

Checks (each prints PASS/FAIL; exit status 1 if any FAIL):
  parity-torch / parity-triton   TorchOpKernel under jit and grad vs torch eager on one GPU
  parity-2gpu                    the same inside shard_map over a 2-GPU mesh (if 2 GPUs)
  stream-rule                    a 300-step XLA matmul loop feeds the op; the op must see the
                                 finished values (it runs on XLA's stream via ExternalStream)
  zero-copy                      data_ptr() inside the op == unsafe_buffer_pointer() of the input
  dlpack                         torch <-> jax round trip shares memory; misaligned views refused
  errors                         an op that raises, an op whose fake lies about a shape, and a
                                 backward that raises: each must reach JAX as an error naming the
                                 op (each case in a child process, so a crash is a FAIL, not the end)
An INFO line shows what the same callback gives without ExternalStream (expected to race).
No pytest needed. Works with jax 0.11.2+ (no 0.12-only APIs).
`--paths callback` (or `ffi`) runs one path only; `--error-case CASE[,CASE...]` is the child process of `errors`
(each case on each of `--paths`, in this one process: the CPU test runs them all in one child).
"""

from __future__ import annotations

import os
import subprocess
import sys

ERROR_CASE_NAMES = ("raises", "lies", "backward-raises")
if "--error-case" in sys.argv:  # refuse an unknown case before the imports below (seconds each)
    _unknown = [c for c in sys.argv[sys.argv.index("--error-case") + 1].split(",") if c not in ERROR_CASE_NAMES]
    if _unknown:
        print(f"unknown --error-case {_unknown[0]!r}; the cases are: {', '.join(ERROR_CASE_NAMES)}", file=sys.stderr)
        sys.exit(2)

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax initialises
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from torch.library import triton_op, wrap_triton  # noqa: E402

jax.config.update("jax_enable_x64", True)

from nvalchemi_jaxbridge.kernels import DLPackError, TorchOpKernel, jax_to_torch, torch_to_jax  # noqa: E402

FAILED: list[str] = []
PATHS = ["callback", "ffi"]
CUTOFF, SIGMA = 2.0, 1.0


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""), flush=True)
    if not ok:
        FAILED.append(name)


def guarded(name: str, fn) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a crash is a FAIL line, the other checks still run
        report(name, False, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")


# ------------------------------------------------------------------ ops (same maths as the CPU tests)


def _weights(pos, cutoff, sigma):
    d = pos[:, None, :] - pos[None, :, :]
    s = (d * d).sum(-1)
    x = s / cutoff**2
    keep = (x < 1.0) & ~torch.eye(pos.shape[0], dtype=torch.bool, device=pos.device)
    om = torch.where(keep, 1.0 - x, torch.zeros_like(x))
    ex = torch.exp(-s / sigma**2)
    dw = torch.where(keep, ex * (-om * om / sigma**2 - 2.0 * om / cutoff**2), torch.zeros_like(x))
    return d, ex * om * om, dw


@torch.library.custom_op("gpucheck::gauss", mutates_args=())
def gauss(positions: torch.Tensor, cutoff: float, sigma: float) -> torch.Tensor:
    return 0.5 * _weights(positions, cutoff, sigma)[1].sum(1)


gauss.register_fake(lambda positions, cutoff, sigma: positions.new_empty(positions.shape[0]))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.cutoff, ctx.sigma = inputs[1], inputs[2]


def _bwd(ctx, g):
    (pos,) = ctx.saved_tensors
    d, _, dw = _weights(pos, ctx.cutoff, ctx.sigma)
    return (((g[:, None] + g[None, :]) * dw)[..., None] * d).sum(1), None, None


gauss.register_autograd(_bwd, setup_context=_setup)

BLOCK = 32


@triton.jit
def _fwd_kernel(pos_ptr, out_ptr, n, inv_rc2, inv_s2, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mi = i < n
    xi = tl.load(pos_ptr + 3 * i, mask=mi, other=0.0)
    yi = tl.load(pos_ptr + 3 * i + 1, mask=mi, other=0.0)
    zi = tl.load(pos_ptr + 3 * i + 2, mask=mi, other=0.0)
    acc = xi * 0.0
    for j0 in range(0, n, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        mj = j < n
        dx = xi[:, None] - tl.load(pos_ptr + 3 * j, mask=mj, other=0.0)[None, :]
        dy = yi[:, None] - tl.load(pos_ptr + 3 * j + 1, mask=mj, other=0.0)[None, :]
        dz = zi[:, None] - tl.load(pos_ptr + 3 * j + 2, mask=mj, other=0.0)[None, :]
        s = dx * dx + dy * dy + dz * dz
        om = 1.0 - s * inv_rc2
        ok = mi[:, None] & mj[None, :] & (i[:, None] != j[None, :]) & (om > 0.0)
        acc += tl.sum(tl.where(ok, tl.exp(-s * inv_s2) * om * om, 0.0), axis=1)
    tl.store(out_ptr + i, 0.5 * acc, mask=mi)


@triton_op("gpucheck::gauss_tri", mutates_args=())
def gauss_tri(positions: torch.Tensor, cutoff: float, sigma: float) -> torch.Tensor:
    n = positions.shape[0]
    out = positions.new_empty(n)
    wrap_triton(_fwd_kernel)[(triton.cdiv(n, BLOCK),)](positions, out, n, 1.0 / cutoff**2, 1.0 / sigma**2, BLOCK=BLOCK)
    return out


gauss_tri.register_autograd(_bwd, setup_context=_setup)  # backward in torch: checks the grad path too


@torch.library.custom_op("gpucheck::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


double.register_fake(lambda x: torch.empty_like(x))
SEEN: dict[str, int] = {}


@torch.library.custom_op("gpucheck::record_ptr", mutates_args=())
def record_ptr(x: torch.Tensor) -> torch.Tensor:
    SEEN["ptr"] = x.data_ptr()
    SEEN["device"] = x.device.index
    return x + 1


record_ptr.register_fake(lambda x: torch.empty_like(x))


@torch.library.custom_op("gpucheck::fails", mutates_args=())
def fails(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("boom from gpucheck::fails")


fails.register_fake(lambda x: torch.empty_like(x))


@torch.library.custom_op("gpucheck::liar", mutates_args=())
def liar(x: torch.Tensor) -> torch.Tensor:
    return x[:-1] * 2  # one row fewer than its fake says


liar.register_fake(lambda x: torch.empty_like(x))


@torch.library.custom_op("gpucheck::bad_bwd", mutates_args=())
def bad_bwd(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def _bad_bwd_backward(ctx, g):
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(g, FakeTensor):  # the bridge's trace-time check that the op is differentiable passes
        return g * 3
    raise RuntimeError("boom in the backward of gpucheck::bad_bwd")


bad_bwd.register_fake(lambda x: torch.empty_like(x))
bad_bwd.register_autograd(_bad_bwd_backward)

# case -> (op, differentiate, text the JAX error must hold)
ERROR_CASES = {
    "raises": ("fails", False, "boom from gpucheck::fails"),
    "lies": ("liar", False, "return 0 is [3]"),
    "backward-raises": ("bad_bwd", True, "boom in the backward of gpucheck::bad_bwd"),
}
assert tuple(ERROR_CASES) == ERROR_CASE_NAMES


# ------------------------------------------------------------------ checks


def _torch_ref(pos: np.ndarray, w: np.ndarray, dev: torch.device):
    t = torch.tensor(pos, device=dev, requires_grad=True)
    e = torch.ops.gpucheck.gauss(t, CUTOFF, SIGMA)
    (g,) = torch.autograd.grad((e * torch.tensor(w, device=dev, dtype=t.dtype)).sum(), t)
    return e.detach().cpu().numpy(), g.cpu().numpy()


def check_parity(name: str, op, dtype, rtol: float, path: str) -> None:
    gpu = jax.devices("gpu")[0]
    rng = np.random.default_rng(0)
    pos = rng.uniform(0.0, 6.0, (500, 3)).astype(dtype)
    w = rng.normal(size=500).astype(dtype)
    k = TorchOpKernel(op, call_path=path)
    x = jax.device_put(pos, gpu)
    e = jax.jit(lambda p: k(p, CUTOFF, SIGMA))(x)
    g = jax.jit(jax.grad(lambda p: jnp.sum(k(p, CUTOFF, SIGMA) * w)))(x)
    e_ref, g_ref = _torch_ref(pos, w, torch.device("cuda", 0))
    err_e = np.abs(np.asarray(e) - e_ref).max() / max(np.abs(e_ref).max(), 1e-30)
    err_g = np.abs(np.asarray(g) - g_ref).max() / max(np.abs(g_ref).max(), 1e-30)
    report(f"{name}-{np.dtype(dtype).name}-{path}", err_e < rtol and err_g < rtol, f"rel err energy {err_e:.2e}, grad {err_g:.2e}")


def check_two_gpus(path: str) -> None:
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        print("SKIP parity-2gpu: only one GPU", flush=True)
        return
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=gpus[:2])
    for name, op in (("torch", torch.ops.gpucheck.gauss.default), ("triton", torch.ops.gpucheck.gauss_tri.default)):
        k = TorchOpKernel(op, call_path=path)
        pos = np.random.default_rng(1).uniform(0.0, 5.0, (2 * 300, 3))
        body = lambda p: jax.lax.psum(k(p, CUTOFF, SIGMA).sum(), "x")  # noqa: E731 (blocks are independent systems)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=True))
        x = jax.device_put(pos, NamedSharding(mesh, P("x")))
        e = float(f(x))
        g = np.asarray(jax.grad(f)(x))
        e_ref, g_ref = 0.0, []
        for b in range(2):
            eb, gb = _torch_ref(pos[300 * b : 300 * (b + 1)], np.ones(300), torch.device("cuda", b))
            e_ref += eb.sum()
            g_ref.append(gb)
        g_ref = np.concatenate(g_ref)
        err = max(abs(e - e_ref) / abs(e_ref), np.abs(g - g_ref).max() / np.abs(g_ref).max())
        report(f"parity-2gpu-{name}-{path}", err < 1e-9, f"rel err {err:.2e}")


def check_stream_rule(path: str) -> None:
    gpu = jax.devices("gpu")[0]
    n = 4096
    eye = jax.device_put(jnp.eye(n, dtype=jnp.float32), gpu)
    k = TorchOpKernel(torch.ops.gpucheck.double.default, call_path=path)

    def slow_then_op(m):
        a = jax.lax.fori_loop(0, 300, lambda i, a: a @ m + 1.0, jnp.zeros((n, n), jnp.float32))  # a == 300
        return k(a)

    got = float(jnp.mean(jax.jit(slow_then_op)(eye)))
    report(f"stream-rule-{path}", got == 600.0, f"mean {got} (expected 600.0)")
    if path != "callback":
        return

    # the same callback without ExternalStream, for contrast: torch works on its own stream
    from jax.experimental.buffer_callback import buffer_callback

    def unsafe(ctx, out, x):
        torch.mul(torch.from_dlpack(x), 2, out=torch.from_dlpack(out[0]))

    cb = buffer_callback(unsafe, (jax.ShapeDtypeStruct((n, n), jnp.float32),))

    def slow_then_unsafe(m):
        a = jax.lax.fori_loop(0, 300, lambda i, a: a @ m + 1.0, jnp.zeros((n, n), jnp.float32))
        return cb(a)[0]

    bad = float(jnp.mean(jax.jit(slow_then_unsafe)(eye)))
    print(f"INFO stream-rule without ExternalStream: mean {bad} ({'raced' if bad != 600.0 else 'did not race this time'})", flush=True)


def check_zero_copy(path: str) -> None:
    gpu = jax.devices("gpu")[0]
    x = jax.device_put(jnp.arange(1024.0), gpu)
    SEEN.clear()
    k = TorchOpKernel(torch.ops.gpucheck.record_ptr.default, call_path=path)
    y = k(x)
    ok = SEEN.get("ptr") == x.unsafe_buffer_pointer() and np.allclose(np.asarray(y), np.arange(1024.0) + 1)
    ok = ok and k.call_path_of(x).startswith(path)
    report(f"zero-copy-{path}", ok, f"path {k.call_path_of(x)}; torch saw {SEEN.get('ptr', 0):#x}, jax input {x.unsafe_buffer_pointer():#x}")


def check_dlpack() -> None:
    t = torch.arange(64.0, device="cuda:0")
    a = torch_to_jax(t, name="t")
    back = jax_to_torch(a)
    ok = a.unsafe_buffer_pointer() == t.data_ptr() == back.data_ptr() and torch.equal(back, t)
    try:
        torch_to_jax(t[1:], name="t[1:]")  # 8 bytes off: GPU needs 16-byte alignment
        refused = False
    except DLPackError:
        refused = True
    report("dlpack", ok and refused, f"shared={ok}, misaligned view refused={refused}")


def error_case(case: str, path: str) -> int:
    """In a child process: run one failing op on the default device; 0 if JAX raised with the op's message."""
    op, differentiate, text = ERROR_CASES[case]
    k = TorchOpKernel(getattr(torch.ops.gpucheck, op).default, call_path=path)
    x = jnp.ones(4, jnp.float64)
    try:
        if differentiate:
            jax.block_until_ready(jax.jit(jax.grad(lambda x: k(x).sum()))(x))
        else:
            jax.block_until_ready(jax.jit(k)(x))
    except jax.errors.JaxRuntimeError as e:
        if text in str(e):
            return 0
        print(f"{case} on {path}: the error does not name the op's failure: {str(e)[:300]}", flush=True)
        return 3
    print(f"{case} on {path}: no error raised", flush=True)
    return 4


def error_cases(cases: list[str], paths: list[str]) -> int:
    """Every case on every path in this process; the first failure's code (0: every one raised as it should)."""
    codes = [error_case(case, path) for path in paths for case in cases]
    return next((c for c in codes if c), 0)


def check_errors(path: str) -> None:
    for case in ERROR_CASES:
        res = subprocess.run([sys.executable, os.path.abspath(__file__), "--error-case", case, "--paths", path],
                             capture_output=True, text=True, timeout=300)
        if res.returncode == 0:
            detail = "raised in JAX with the op's message"
        elif res.returncode < 0:
            detail = f"the process died of signal {-res.returncode}: {res.stderr.strip()[-300:]}"
        else:
            detail = (res.stdout.strip() or res.stderr.strip())[-300:]
        report(f"errors-{case}-{path}", res.returncode == 0, detail)


def main() -> int:
    if "--paths" in sys.argv:
        PATHS[:] = sys.argv[sys.argv.index("--paths") + 1].split(",")
    if "--error-case" in sys.argv:  # the child process of check_errors
        return error_cases(sys.argv[sys.argv.index("--error-case") + 1].split(","), PATHS)
    print(f"jax {jax.__version__}, torch {torch.__version__}, triton {triton.__version__}, devices {jax.devices()}", flush=True)
    try:
        has_gpu = bool(jax.devices("gpu"))
    except RuntimeError:
        has_gpu = False
    if not has_gpu or not torch.cuda.is_available():
        print("FAIL setup: needs a CUDA GPU visible to both jax and torch", flush=True)
        return 1
    for path in PATHS:
        guarded(f"parity-torch-{path}", lambda: check_parity("parity-torch", torch.ops.gpucheck.gauss.default, np.float64, 1e-9, path))
        guarded(f"parity-triton-{path}", lambda: check_parity("parity-triton", torch.ops.gpucheck.gauss_tri.default, np.float64, 1e-9, path))
        guarded(f"parity-triton-{path}", lambda: check_parity("parity-triton", torch.ops.gpucheck.gauss_tri.default, np.float32, 1e-4, path))
        guarded(f"parity-2gpu-{path}", lambda: check_two_gpus(path))
        guarded(f"stream-rule-{path}", lambda: check_stream_rule(path))
        guarded(f"zero-copy-{path}", lambda: check_zero_copy(path))
        guarded(f"errors-{path}", lambda: check_errors(path))
    guarded("dlpack", check_dlpack)
    print(f"{'FAIL' if FAILED else 'PASS'} all: {len(FAILED)} failed {FAILED if FAILED else ''}", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
