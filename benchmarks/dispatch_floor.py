"""The floor of a dispatched program holding one torch op, component by component (issue 15 item 4).

    PYTHONPATH=. python3 benchmarks/dispatch_floor.py --out OUTDIR [--smoke] [--iters 2000]

Every row is one call followed by a synchronisation (torch: `torch.cuda.synchronize`; JAX:
`block_until_ready`), timed in interleaved rounds so that drift hits all rows alike:
- native torch: `x * 2` as a Python custom op (`jaxbridge_bench::times2`, the op of
  kernel_overhead.py) and as a C++ ATen op (`aten::add(x, x)`);
- pure XLA: `jax.jit(lambda x: x * 2)`, the floor of JAX's own dispatch;
- bridge: `jax.jit` of a `TorchOpKernel` of each op, on the FFI and the callback path.
The components read off one run: JAX's dispatch above a torch call (pure XLA - native ATen),
the bridge's call into torch (bridge ATen - pure XLA), and the Python op's own dispatch (bridge
custom op - bridge ATen, native custom op - native ATen).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import _common as cm
import kernel_overhead
import numpy as np

ROUNDS = 20


def interleaved(fns: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]], *, warmup: int,
                iters: int) -> dict[str, float]:
    """Median wall seconds of each (call, sync) pair, in `ROUNDS` interleaved rounds."""
    for f, sync in fns.values():
        for _ in range(warmup):
            sync(f())
    out: dict[str, list[float]] = {k: [] for k in fns}
    per = max(1, iters // ROUNDS)
    for _ in range(ROUNDS):
        for k, (f, sync) in fns.items():
            for _ in range(per):
                t0 = time.perf_counter()
                sync(f())
                out[k].append(time.perf_counter() - t0)
    return {k: cm.med(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = cm.base_parser(__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=None, help="timed calls per row (default 2000, smoke 40)")
    p.add_argument("--size", type=int, default=1024, help="float32 elements of x")
    a = p.parse_args(argv)
    platform = cm.setup(a.platform, cpu_devices=1)
    import jax
    import torch

    from nvalchemi_jaxbridge.kernels import TorchOpKernel

    iters, warmup = a.iters or (40 if a.smoke else 2000), 5 if a.smoke else 100
    dev = torch.device("cuda", 0) if platform == "gpu" else torch.device("cpu")
    x_t = torch.arange(a.size, dtype=torch.float32, device=dev)
    x_j = jax.device_put(np.asarray(x_t.cpu()), jax.devices()[0])
    custom = kernel_overhead._times2_op()
    aten = torch.ops.aten.add.Tensor
    t_sync = (lambda _: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda _: None)
    j_sync = jax.block_until_ready
    pure = jax.jit(lambda x: x * 2)
    fns: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
        "native torch, custom op": (lambda: custom(x_t), t_sync),
        "native torch, ATen op": (lambda: aten(x_t, x_t), t_sync),
        "pure XLA x * 2": (lambda: pure(x_j), j_sync),
    }
    for path in ("ffi", "callback"):
        kc = TorchOpKernel(custom, call_path=path)
        ka = TorchOpKernel(aten, call_path=path)
        jc, ja = jax.jit(lambda x, k=kc: k(x)), jax.jit(lambda x, k=ka: k(x, x))
        fns[f"bridge ({path}), ATen op"] = (lambda f=ja: f(x_j), j_sync)
        fns[f"bridge ({path}), custom op"] = (lambda f=jc: f(x_j), j_sync)
    want = 2 * np.asarray(x_t.cpu())
    for name, (f, sync) in fns.items():
        got = f()
        sync(got)
        got = got.detach().cpu().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
        if not np.array_equal(got, want):
            raise AssertionError(f"dispatch_floor: {name} does not give 2 x")
    settings = {"x": f"{a.size} float32", "timing": f"median of {iters} calls (each synchronised) in {ROUNDS} "
                f"interleaved rounds after {warmup} warm-up"}
    rep = cm.Report("dispatch_floor", "Dispatched call floor (1 device)", a.out, cm.context(platform), settings)
    t = interleaved(fns, warmup=warmup, iters=iters)
    rows = rep.table("Per call", ["run", "median (us)", "above native torch, same op (us)"])
    for name, v in t.items():
        base = t["native torch, ATen op" if "ATen" in name or "XLA" in name else "native torch, custom op"]
        rep.row(rows, [name, cm.us(v), "-" if name.startswith("native") else cm.us(v - base)])
    comp = rep.table("Components of the FFI path's floor", ["component", "measured as", "us"])
    parts = [("JAX's dispatch of a one-kernel program, above a torch call", "pure XLA - native ATen",
              t["pure XLA x * 2"] - t["native torch, ATen op"]),
             ("the FFI call into torch (buffers wrapped, stream set, op dispatched, result copied)",
              "bridge (ffi) ATen - pure XLA", t["bridge (ffi), ATen op"] - t["pure XLA x * 2"]),
             ("a Python custom op's dispatch inside the bridge", "bridge (ffi) custom - bridge (ffi) ATen",
              t["bridge (ffi), custom op"] - t["bridge (ffi), ATen op"]),
             ("the same in native torch", "native custom - native ATen",
              t["native torch, custom op"] - t["native torch, ATen op"]),
             ("total: bridge (ffi) custom op above native custom op", "target <= 30 us",
              t["bridge (ffi), custom op"] - t["native torch, custom op"])]
    for name, how, v in parts:
        rep.row(comp, [name, how, cm.us(v)])
    over = t["bridge (ffi), custom op"] - t["native torch, custom op"]
    rep.note(f"Target: a dispatched x*2 <= 30 us above native -> {cm.us(over)} us, "
             f"{'MET' if over <= 30e-6 else 'NOT MET'}.")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
