"""Kernel call: one torch op called from a jitted JAX program, against the same call in torch (one device).

Ops: `x * 2` on 1024 floats (a Python custom op, `jaxbridge_bench::times2`), `x + x` (the C++ ATen op, to
tell a Python op's dispatch from the rest), its gradient (`jax.grad` of the sum, op with a backward formula),
and the demo Lennard-Jones op on a dense fcc argon block. Runs, all timed in turns call by call, each call
followed by a synchronisation: native torch; the bridge's FFI and callback paths (`TorchOpKernel` under
`jax.jit`); wrap-torch2jax (if its extension is built, see `build_torch2jax`); `jax.pure_callback` (host
copies); a pure XLA `x * 2` (JAX's own dispatch floor). Then the same op as N dependent calls inside one
program (time / N), which leaves JAX's dispatch out. Every result is checked against native torch.
"""

from __future__ import annotations

import glob
import os
import pathlib
import sys
import zipfile
from typing import Any

import numpy as np

from benchmarks import common as cm

T2J_CACHE = pathlib.Path("~/.cache/jaxbridge-bench").expanduser()
_LIB: list = []


def times2_ops():
    """`jaxbridge_bench::times2(x) = x * 2` and `times2_grad` (the same with a backward formula), defined once."""
    import torch

    if not _LIB:
        lib = torch.library.Library("jaxbridge_bench", "DEF")
        for name in ("times2", "times2_grad"):
            lib.define(f"{name}(Tensor x) -> Tensor")
            lib.impl(name, lambda x: x * 2, "CompositeExplicitAutograd")
            torch.library.register_fake(f"jaxbridge_bench::{name}", lambda x: torch.empty_like(x), lib=lib)
        torch.library.register_autograd("jaxbridge_bench::times2_grad", lambda ctx, g: g * 2, lib=lib)
        _LIB.append(lib)
    return torch.ops.jaxbridge_bench.times2.default, torch.ops.jaxbridge_bench.times2_grad.default


def torch2jax_module():
    """wrap_torch2jax: installed, or unpacked from `.whl/wrap_torch2jax-*.whl` (once)."""
    try:
        import wrap_torch2jax

        return wrap_torch2jax
    except ImportError:
        pass
    wheels = sorted(glob.glob(str(cm.ROOT / ".whl" / "wrap_torch2jax-*.whl")))
    if not wheels:
        raise ImportError("wrap_torch2jax is not installed and no wheel is in .whl/; fetch it with `python3 -m pip "
                          "download --no-deps -d .whl wrap-torch2jax==0.9.0` on a machine with a package index.")
    target = T2J_CACHE / pathlib.Path(wheels[-1]).stem
    if not (target / "wrap_torch2jax").is_dir():
        target.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extractall(target)
    sys.path.insert(0, str(target))
    import wrap_torch2jax

    return wrap_torch2jax


def torch2jax_built() -> bool:
    """Whether wrap-torch2jax's C++/CUDA extension for these jax/torch versions is compiled already."""
    import jax
    import torch

    pat = f"~/.cache/torch2jax/*--jax-{jax.__version__}--torch-{torch.__version__}--*/torch2jax_cpp*.so"
    return bool(glob.glob(os.path.expanduser(pat)))


def build_torch2jax() -> bool:
    """Compile wrap-torch2jax's extension (minutes; run once per machine before the suite to compare with it)."""
    mod = torch2jax_module()
    try:
        mod.compile_and_import_module()
    except Exception as e:  # noqa: BLE001 - registering may fail on a CPU-only JAX; the build is what counts
        print(f"wrap_torch2jax: after the build: {type(e).__name__}: {e}", flush=True)
    return torch2jax_built()


def _flat(out: Any) -> list[np.ndarray]:
    import torch

    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [np.asarray(o.detach().cpu() if isinstance(o, torch.Tensor) else o, np.float64) for o in outs]


def _same(got: Any, want: list[np.ndarray]) -> bool:
    return all(np.allclose(g, w, rtol=1e-4, atol=1e-5 * (1 + np.abs(w).max())) for g, w in zip(_flat(got), want))


def _cases(opt, dev) -> list[dict[str, Any]]:
    """Each op: name, size, the op (or native callable), its torch arguments, and the bridge's kernel arguments."""
    import torch

    import nvalchemi_jaxbridge.demo.torch_ops  # noqa: F401 - registers jaxbridge_demo::
    from nvalchemi_jaxbridge.demo import argon_fcc

    times2, times2_grad = times2_ops()
    x = torch.arange(1024, dtype=torch.float32, device=dev)
    s = argon_fcc(2 if opt.smoke else 9)
    pos = torch.tensor(s.positions, dtype=torch.float32, device=dev)
    mask = torch.ones(s.n_atoms, dtype=torch.bool, device=dev)

    def native_grad(x):
        x = x.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(times2_grad(x).sum(), x)
        return g

    return [
        {"op": "x*2", "size": "1024 float32", "native": times2, "kernel": times2, "args": (x,), "xla": True},
        {"op": "x+x (ATen add)", "size": "1024 float32", "native": lambda x: torch.ops.aten.add.Tensor(x, x),
         "kernel": torch.ops.aten.add.Tensor, "args": (x,), "kargs": lambda x: (x, x)},
        {"op": "x*2, jax.grad of the sum", "size": "1024 float32", "native": native_grad, "kernel": times2_grad,
         "args": (x,), "grad": True},
        {"op": "LJ", "size": f"{s.n_atoms} atoms, dense block", "native": torch.ops.jaxbridge_demo.lj_energy_forces.default,
         "kernel": torch.ops.jaxbridge_demo.lj_energy_forces.default, "args": (pos, mask), "pure_callback": True},
    ]


def _bridge(case: dict, path: str):
    """The jitted bridge call of `case` on `path`: the kernel, or `jax.grad` of the sum of its output."""
    import jax
    import jax.numpy as jnp

    from nvalchemi_jaxbridge.kernels import TorchOpKernel

    kargs = case.get("kargs", lambda *a: a)
    if case.get("grad"):
        k = TorchOpKernel(case["kernel"], outputs=(0,), call_path=path)
        return jax.jit(jax.grad(lambda x: jnp.sum(k(*kargs(x)))))
    k = TorchOpKernel(case["kernel"], call_path=path)
    return jax.jit(lambda *xs: k(*kargs(*xs)))


def _pure_callback(op, targs, dev):
    import jax
    import jax.numpy as jnp
    import torch

    shapes = jax.tree.map(lambda t: jax.ShapeDtypeStruct(tuple(t.shape), jnp.dtype(str(t.dtype).split(".")[1])),
                          op(*targs))

    def host(*xs):
        return jax.tree.map(lambda t: t.cpu().numpy(), op(*[torch.from_numpy(np.asarray(x)).to(dev) for x in xs]))

    return jax.jit(lambda *xs: jax.pure_callback(host, shapes, *xs))


def run(rep: cm.Report, opt) -> None:
    import jax
    import torch

    gpu = opt.platform == "gpu"
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    iters, warmup = opt.repeats_or(500, 2), 1 if opt.smoke else 50
    chain = 2 if opt.smoke else 32
    rep.setting("kernel call timing", f"median of {iters} calls of each run in turns after {warmup} warm-up, each "
                f"call followed by a synchronisation (JAX: block_until_ready; torch: cuda.synchronize); inside one "
                f"program: {chain} dependent calls in one jit, time / {chain}")
    t2j = None
    if gpu and not opt.smoke:
        try:
            t2j = torch2jax_module() if torch2jax_built() else None
        except ImportError as e:
            rep.note(f"wrap-torch2jax: not measured ({e}).")
        if t2j is None:
            rep.note("wrap-torch2jax: not measured, its extension is not built here; build it once with "
                     "`python -c \"import benchmarks.kernel_call as k; k.build_torch2jax()\"` (minutes).")
    table = rep.table("Per call, dispatched (all runs of an op in turns)",
                      ["op", "size", "run", "median (us)", "above native (us)", "check"])
    jdev = jax.devices()[0]
    t: dict[tuple[str, str], float] = {}
    cases = _cases(opt, dev)
    for case in cases:
        with rep.section(f"{case['op']}: per call"):
            targs = case["args"]
            jargs = [jax.device_put(np.asarray(a.cpu()), jdev) for a in targs]
            want = _flat(case["native"](*targs))
            runs = {"native torch": (lambda c=case, a=targs: c["native"](*a), cm.torch_sync(dev))}
            if case.get("xla"):
                xla = jax.jit(lambda x: x * 2)
                runs["pure XLA x * 2 (no torch)"] = (lambda f=xla, a=jargs: f(*a), cm.jax_sync)
            for path in ("ffi", "callback"):
                runs[f"bridge, {path} path"] = (lambda f=_bridge(case, path), a=jargs: f(*a), cm.jax_sync)
            if t2j is not None and not case.get("grad") and "kargs" not in case:
                g = jax.jit(t2j.torch2jax(lambda *ts, op=case["kernel"]: op(*ts), *targs, depth=0))
                runs["wrap-torch2jax"] = (lambda f=g, a=jargs: f(*a), cm.jax_sync)
            if case.get("pure_callback"):
                h = _pure_callback(case["kernel"], targs, dev)
                runs["jax.pure_callback (host copies)"] = (lambda f=h, a=jargs: f(*a), cm.jax_sync)
            times = cm.medians(runs, warmup=warmup, iters=iters)
            native = times["native torch"]
            for name, (fn, sync) in runs.items():
                t[case["op"], name] = times[name]
                got = fn()
                sync(got)
                ok = name.startswith("pure XLA") or _same(got, want)
                table.add(case["op"], case["size"], name, cm.us(times[name]),
                          "-" if name == "native torch" else cm.us(times[name] - native), "same result" if ok else "MISMATCH")
                if not ok:
                    rep.fail(f"{case['op']} via {name}: the result differs from native torch")
            ev = cm.time_events(lambda c=case: c["native"](*targs), warmup=warmup, iters=iters, device=dev)
            if ev:
                table.add(case["op"], case["size"], "native torch (CUDA events, no host time)", cm.us(cm.med(ev)), "-", "-")
    _components(rep, t)
    _chain(rep, [c for c in cases if c["op"] in ("x*2", "LJ")], dev, chain, warmup, max(2 if opt.smoke else 10, iters // 5), t)
    _targets(rep, t, t2j is not None)


def _components(rep: cm.Report, t: dict) -> None:
    """The dispatched x*2's time above native, split by the rows of the same run."""
    need = [("x*2", "pure XLA x * 2 (no torch)"), ("x+x (ATen add)", "native torch"), ("x*2", "native torch"),
            ("x+x (ATen add)", "bridge, ffi path"), ("x*2", "bridge, ffi path")]
    if any(k not in t for k in need):
        return
    xla, n_aten, n_py = t["x*2", "pure XLA x * 2 (no torch)"], t["x+x (ATen add)", "native torch"], t["x*2", "native torch"]
    b_aten, b_py = t["x+x (ATen add)", "bridge, ffi path"], t["x*2", "bridge, ffi path"]
    comp = rep.table("Where a dispatched x*2 spends its time above native (FFI path, same run)",
                     ["component", "measured as", "us"])
    for name, how, v in (("JAX's dispatch of a one-kernel program, above a torch call", "pure XLA - native ATen", xla - n_aten),
                         ("the FFI call into torch (buffers wrapped, stream set, op run, result copied)",
                          "bridge ATen - pure XLA", b_aten - xla),
                         ("a Python custom op's dispatch inside the bridge", "bridge x*2 - bridge ATen", b_py - b_aten),
                         ("the same in native torch", "native x*2 - native ATen", n_py - n_aten),
                         ("total: bridge x*2 above native x*2", "target <= 30 us", b_py - n_py)):
        comp.add(name, how, cm.us(v))


def _chain(rep: cm.Report, cases: list, dev, n: int, warmup: int, iters: int, t: dict) -> None:
    """N dependent calls in one jitted program (time / N) against N dependent native calls and one sync."""
    import jax

    from nvalchemi_jaxbridge.kernels import TorchOpKernel

    table = rep.table(f"Inside one program: {n} dependent calls in one jit (per call = time / {n})",
                      ["op", "run", "per call (us)", "above native (us)", "check"])
    for case in cases:
        op, targs = case["kernel"], case["args"]
        # between calls: x*2 feeds its output back; LJ moves the positions by 1e-6 x its forces
        step = (lambda a, out: (out,)) if case["op"] == "x*2" else (lambda a, out: (a[0] + 1e-6 * out[1],) + a[1:])
        with rep.section(f"{case['op']}: inside one program"):
            def native(step=step, op=op, targs=targs):
                args = tuple(targs)
                for _ in range(n):
                    args = step(args, op(*args))
                return args

            runs = {"native torch": (native, cm.torch_sync(dev))}
            jargs = [jax.device_put(np.asarray(a.cpu()), jax.devices()[0]) for a in targs]
            for path in ("ffi", "callback"):
                k = TorchOpKernel(op, call_path=path)

                def body(*args, k=k, step=step):
                    for _ in range(n):
                        args = step(args, k(*args))
                    return args

                f = jax.jit(body)
                runs[f"bridge, {path} path"] = (lambda f=f: f(*jargs), cm.jax_sync)
            times = cm.medians(runs, warmup=warmup, iters=iters)
            want = _flat(native()[0])
            nat = times["native torch"] / n
            for name, (fn, sync) in runs.items():
                per = times[name] / n
                t[case["op"], f"chain: {name}"] = per
                ok = name == "native torch" or _same(jax.block_until_ready(fn())[0], want)
                table.add(case["op"], name, cm.us(per), "-" if name == "native torch" else cm.us(per - nat),
                          "-" if name == "native torch" else ("same result" if ok else "MISMATCH"))
                if not ok:
                    rep.fail(f"{case['op']}, {n} calls in one program via {name}: the result differs from torch")


def _targets(rep: cm.Report, t: dict, t2j: bool) -> None:
    over = {op: t[op, "chain: bridge, ffi path"] - t[op, "chain: native torch"]
            for op in ("x*2", "LJ") if (op, "chain: bridge, ffi path") in t}
    if over:
        rep.target("kernel call <= 20 us above native torch inside one program (FFI path; issue 7)",
                   ", ".join(f"{op} {cm.us(v)} us" for op, v in over.items()), max(over.values()) <= 20e-6)
    if ("x*2", "bridge, ffi path") in t:
        v = t["x*2", "bridge, ffi path"] - t["x*2", "native torch"]
        rep.target("dispatched x*2 <= 30 us above native torch (FFI path; issues 7, 15)", f"{cm.us(v)} us", v <= 30e-6)
    if t2j:
        pairs = {op: (t[op, "bridge, ffi path"], t[op, "wrap-torch2jax"]) for op in ("x*2", "LJ")
                 if (op, "wrap-torch2jax") in t}
        rep.target("kernel call below wrap-torch2jax, same run (issue 7)",
                   ", ".join(f"{op} {cm.us(b)} vs {cm.us(w)} us" for op, (b, w) in pairs.items()),
                   all(b < w for b, w in pairs.values()))
