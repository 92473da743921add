"""Kernel-call overhead: a torch op called natively, through the bridge, wrap-torch2jax and pure_callback.

    PYTHONPATH=. python3 benchmarks/kernel_overhead.py --out OUTDIR [--smoke]
    PYTHONPATH=. python3 benchmarks/kernel_overhead.py --out OUTDIR --breakdown [--before /tmp/before]
    PYTHONPATH=. python3 benchmarks/kernel_overhead.py --prebuild-torch2jax   # compile its extension only

Two ops on one device: a trivial one (`x * 2` on 1024 floats, a custom op
defined here) and a realistic one (the demo Lennard-Jones op
`jaxbridge_demo::lj_energy_forces` on an fcc argon block of a few thousand
atoms). Each is called
(a) natively in torch (wall clock + synchronize, and CUDA events),
(b) through the bridge: `TorchOpKernel(call_path="callback")` under `jax.jit` (buffer_callback + DLPack),
(b') through the bridge's compiled FFI path: `TorchOpKernel(call_path="ffi")` under `jax.jit`,
(c) through wrap-torch2jax (`torch2jax(..., depth=0)` under `jax.jit`), and
(d) through `jax.pure_callback` (host copies both ways, the op on the device).
The JAX paths are timed by wall clock around the call and `block_until_ready`.

Two more tables compare the bridge's two call paths in one process, calls
alternating: "callback vs FFI" (before = buffer_callback, after = FFI; forward and
`jax.grad`, whose backward runs on the same path as the forward: the callback backward
against the FFI backward; the differentiated forward keeps the op's graph for the
backward, so the grad rows time one forward and one backward call), and "inside one
program": a chain of N dependent calls unrolled in one jitted program (time / N)
for both paths and for native torch (N dependent calls, one synchronize at the
end), which takes the cost of dispatching a program out of the per-call figure.

The breakdown (part of the default run; `--breakdown` runs only it) takes one call
apart under `jax.jit`: (i) pure XLA, (ii) `buffer_callback` with an empty callback,
(iii) + DLPack views of the buffers, (iv) + torch on XLA's stream and device (GPU
only), (v) + the op call, (v') + the copy into XLA's outputs, (vi) the whole
`TorchOpKernel`, (vii) its gradient (callback backward; (vii') FFI backward). Where the package changed a mechanism, the
old and the new variant are both timed. `--before PATH` also times the
`TorchOpKernel` of another checkout (e.g. `git worktree add /tmp/before <commit>`)
against this one, interleaved in one process.

wrap-torch2jax is imported if installed, else taken from `.whl/wrap_torch2jax-*.whl`
(unpacked to ~/.cache/jaxbridge-bench); on first use it compiles a C++/CUDA
extension into ~/.cache/torch2jax (minutes). `--torch2jax cached` uses it only if
that extension is already built.
"""

from __future__ import annotations

import glob
import os
import pathlib
import sys
import zipfile
from typing import Any

import _common as cm
import numpy as np

T2J_CACHE = pathlib.Path("~/.cache/jaxbridge-bench").expanduser()
SMOKE_CHAIN = 4  # unrolled calls in the smoke run's one-program chain: the path, not the per-call figure


def _t2j_module():
    """Import wrap_torch2jax: installed, or from the wheel in .whl/ (unpacked once)."""
    try:
        import wrap_torch2jax

        return wrap_torch2jax
    except ImportError:
        pass
    wheels = sorted(glob.glob(str(cm.ROOT / ".whl" / "wrap_torch2jax-*.whl")))
    if not wheels:
        raise ImportError(
            "wrap_torch2jax is not installed and no wheel is in .whl/; fetch it with `python3 -m pip "
            "download --no-deps -d .whl wrap-torch2jax==0.9.0` on a machine with a package index."
        )
    target = T2J_CACHE / pathlib.Path(wheels[-1]).stem
    if not (target / "wrap_torch2jax").is_dir():
        target.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extractall(target)
    sys.path.insert(0, str(target))
    import wrap_torch2jax

    return wrap_torch2jax


def _t2j_built() -> bool:
    """Whether wrap-torch2jax's extension for these jax/torch versions is already compiled."""
    import jax
    import torch

    pat = f"~/.cache/torch2jax/*--jax-{jax.__version__}--torch-{torch.__version__}--*/torch2jax_cpp*.so"
    return bool(glob.glob(os.path.expanduser(pat)))


_LIB: list = []


def _times2_op():
    """The trivial custom op `jaxbridge_bench::times2(x) = x * 2` (defined once), and
    `times2_grad`, the same with a backward formula (for the gradient rows only: the
    autograd layer adds to every call, so the forward rows use the plain op)."""
    import torch

    if not _LIB:
        lib = torch.library.Library("jaxbridge_bench", "DEF")
        lib.define("times2(Tensor x) -> Tensor")
        lib.impl("times2", lambda x: x * 2, "CompositeExplicitAutograd")
        torch.library.register_fake("jaxbridge_bench::times2", lambda x: torch.empty_like(x), lib=lib)
        lib.define("times2_grad(Tensor x) -> Tensor")
        lib.impl("times2_grad", lambda x: x * 2, "CompositeExplicitAutograd")
        torch.library.register_fake("jaxbridge_bench::times2_grad", lambda x: torch.empty_like(x), lib=lib)
        torch.library.register_autograd("jaxbridge_bench::times2_grad", lambda ctx, g: g * 2, lib=lib)
        _LIB.append(lib)
    return torch.ops.jaxbridge_bench.times2.default


def _cases(smoke: bool, dev):
    """(name, op, torch args, description) for the trivial and the realistic op."""
    import torch

    import nvalchemi_jaxbridge.demo.torch_ops  # noqa: F401 - registers jaxbridge_demo::
    from nvalchemi_jaxbridge.demo import argon_fcc

    x = torch.arange(1024, dtype=torch.float32, device=dev)
    cells = 2 if smoke else 9
    sys_ = argon_fcc(cells)
    pos = torch.tensor(sys_.positions, dtype=torch.float32, device=dev)
    mask = torch.ones(sys_.n_atoms, dtype=torch.bool, device=dev)
    return [
        ("x*2", _times2_op(), (x,), "1024 float32"),
        ("LJ", torch.ops.jaxbridge_demo.lj_energy_forces.default, (pos, mask),
         f"{sys_.n_atoms} atoms, dense block, float32"),
    ]


# ------------------------------------------------------------------ breakdown (issue 7)
#
# Where the bridge's per-call time goes, one mechanism at a time, each under jax.jit on
# the same device buffers. Steps (iii)-(v) are written out here, not imported from the
# package, so the rows measure the mechanisms themselves (and stay comparable across
# versions of the package).


def _grad_op(name: str):
    """The op the gradient rows of case `name` use, or None.

    The demo LJ op's backward calls .item(), so TorchOpKernel's trace-time check (the
    backward on fake tensors) refuses to differentiate it: LJ has no gradient rows.
    """
    import torch

    return torch.ops.jaxbridge_bench.times2_grad.default if name == "x*2" else None


def _interleaved(fns: dict[str, Any], *, warmup: int, iters: int, rounds: int = 10) -> dict[str, list[float]]:
    """Wall seconds per call of each jitted thunk, timed in interleaved rounds (drift hits all alike)."""
    import time

    import jax

    for f in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(f())
    out: dict[str, list[float]] = {k: [] for k in fns}
    per = max(1, iters // rounds)
    for _ in range(rounds):
        for k, f in fns.items():
            for _ in range(per):
                t0 = time.perf_counter()
                jax.block_until_ready(f())
                out[k].append(time.perf_counter() - t0)
    return out


def _stream_steps(gpu: bool):
    """(old, new) ways to put torch on XLA's stream inside a callback: context factories, or None on CPU."""
    if not gpu:
        return None, None
    import contextlib

    import torch

    @contextlib.contextmanager
    def per_call(ctx, buf):  # what TorchOpKernel did before issue 7: new objects and nested contexts per call
        device = torch.device("cuda", int(buf.__dlpack_device__()[1]))
        with torch.cuda.device(device), torch.cuda.stream(torch.cuda.ExternalStream(ctx.stream, device=device)):
            yield

    ids: dict[tuple[int, int], tuple[int, int, int]] = {}

    @contextlib.contextmanager
    def cached(ctx, buf):  # stream ids cached per (pointer, device); torch's C setters, restored after
        index = int(buf.__dlpack_device__()[1])
        sid = ids.get((ctx.stream, index))
        if sid is None:
            s = torch.cuda.ExternalStream(ctx.stream, device=torch.device("cuda", index))
            sid = ids[(ctx.stream, index)] = (s.stream_id, s.device_index, s.device_type)
        prev_dev = torch._C._cuda_getDevice()
        prev = torch._C._cuda_getCurrentStream(sid[1])
        torch._C._cuda_setStream(stream_id=sid[0], device_index=sid[1], device_type=sid[2])
        try:
            yield
        finally:
            torch._C._cuda_setStream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])
            if prev_dev != sid[1]:
                torch._C._cuda_setDevice(prev_dev)

    return per_call, cached


def _breakdown_paths(name, op, targs, jargs, gpu: bool, kernel_cls) -> dict[str, tuple[Any, str]]:
    """Step label -> (jitted thunk, what its result is compared with: "native", "grad" or "")."""
    import contextlib

    import jax
    import jax.numpy as jnp
    import torch
    from jax.experimental.buffer_callback import buffer_callback

    res = op(*targs)
    res = res if isinstance(res, tuple) else (res,)
    specs = tuple(jax.ShapeDtypeStruct(tuple(r.shape), jnp.dtype(str(r.dtype).removeprefix("torch."))) for r in res)
    old_stream, new_stream = _stream_steps(gpu)
    nullctx = contextlib.nullcontext()

    def make(wrap, stream, call_op: bool, copy: bool):
        def cb(ctx, outs, *ins):
            with stream(ctx, outs[0]) if stream is not None else nullctx:
                t_out = [wrap(b) for b in outs]
                t_in = [wrap(b) for b in ins]
                if not call_op:
                    return
                grad = torch.is_grad_enabled()
                torch._C._set_grad_enabled(False)
                try:
                    r = op(*t_in)
                finally:
                    torch._C._set_grad_enabled(grad)
                if copy:
                    for o, x in zip(t_out, r if isinstance(r, tuple) else (r,)):
                        o.copy_(x)

        f = jax.jit(buffer_callback(cb, specs))
        return lambda: f(*jargs)

    by_buffer = torch.from_dlpack  # torch asks for its current stream per buffer on a GPU
    by_capsule = lambda b: torch.from_dlpack(b.__dlpack__())  # noqa: E731 - Buffer ignores `stream=`
    empty = jax.jit(buffer_callback(lambda ctx, outs, *ins: None, specs))
    paths: dict[str, tuple[Any, str]] = {}
    if name == "x*2":
        xla = jax.jit(lambda x: x * 2)
        paths["(i) pure XLA x*2"] = (lambda: xla(*jargs), "native")
    paths["(ii) buffer_callback, empty callback (jaxlib floor)"] = (lambda: empty(*jargs), "")
    paths["(iii) + torch.from_dlpack(buffer) per buffer (before)"] = (make(by_buffer, None, False, False), "")
    paths["(iii') + torch.from_dlpack(buffer.__dlpack__()) (after)"] = (make(by_capsule, None, False, False), "")
    if gpu:
        paths["(iv) + per-call ExternalStream, device + stream contexts (before)"] = (
            make(by_capsule, old_stream, False, False), "")
        paths["(iv') + cached stream ids, torch._C stream setters (after)"] = (
            make(by_capsule, new_stream, False, False), "")
    paths["(v) + op call (grad off), results dropped"] = (make(by_capsule, new_stream, True, False), "")
    paths["(v') + copy_ of the results into XLA's outputs"] = (make(by_capsule, new_stream, True, True), "native")
    k = kernel_cls(op, call_path="callback")
    fk = jax.jit(lambda *xs: k(*xs))
    paths["(vi) TorchOpKernel under jit (forward, callback path)"] = (lambda: fk(*jargs), "native")
    kf = kernel_cls(op, call_path="ffi")
    ff = jax.jit(lambda *xs: kf(*xs))
    paths["(vi') TorchOpKernel under jit (forward, FFI path)"] = (lambda: ff(*jargs), "native")
    if _grad_op(name) is not None:
        kg = kernel_cls(_grad_op(name), outputs=(0,), call_path="callback")
        g = jax.jit(jax.grad(lambda x, *rest: jnp.sum(kg(x, *rest))))
        # one forward (keeping the op's graph) and one backward call, as torch's own backward
        paths["(vii) jax.grad of sum(output 0), TorchOpKernel, op with a backward formula (backward callback)"] = (lambda: g(*jargs), "grad")
        kgf = kernel_cls(_grad_op(name), outputs=(0,), call_path="ffi")
        gf = jax.jit(jax.grad(lambda x, *rest: jnp.sum(kgf(x, *rest))))
        # an older checkout (--before) has no backward_path_of: its backward was the callback
        bwd = kgf.backward_path_of(*jargs) if hasattr(kgf, "backward_path_of") else "callback"
        bwd = "FFI backward" if bwd == "ffi" else f"callback backward ({bwd})"
        paths[f"(vii') jax.grad of sum(output 0), FFI path ({bwd})"] = (lambda: gf(*jargs), "grad")
    return paths


def _torch_grad(op, targs):
    """d sum(output 0) / d input 0 by torch autograd (the reference for row vii)."""
    import torch

    x = targs[0].detach().clone().requires_grad_(True)
    out = op(x, *targs[1:])
    out = out[0] if isinstance(out, tuple) else out
    (g,) = torch.autograd.grad(out.sum(), x)
    return g


def _run_breakdown(rep, cases, jdev, gpu: bool, warmup: int, iters: int, flat) -> None:
    """The breakdown table: one row per step, with its cost over the step before."""
    import jax
    import numpy as np

    from nvalchemi_jaxbridge.kernels import TorchOpKernel

    rows = rep.table("Breakdown of one call (each step adds to the one before; ' marks the variant in use)",
                     ["op", "step", "median (us)", "added (us)", "check"])
    if not gpu:
        rep.note("Breakdown on the CPU: steps (iv)/(iv') (torch on XLA's CUDA stream) do not apply and are left out.")
    base_of = {"(iii)": "(ii)", "(iii')": "(ii)", "(iv)": "(iii')", "(iv')": "(iii')", "(v)": "(iv')" if gpu else "(iii')",
               "(v')": "(v)", "(vi)": "(ii)", "(vi')": "(ii)", "(vii)": "(vi)", "(vii')": "(vi')"}
    for name, op, targs, _ in cases:
        with rep.section(f"{name}: breakdown"):
            jargs = [jax.device_put(np.asarray(t.cpu()), jdev) for t in targs]
            paths = _breakdown_paths(name, op, targs, jargs, gpu, TorchOpKernel)
            want = {"native": flat(op(*targs))}
            if _grad_op(name) is not None:
                want["grad"] = flat(_torch_grad(_grad_op(name), targs))
            times = _interleaved({k: f for k, (f, _) in paths.items()}, warmup=warmup, iters=iters)
            med = {k.split(" ")[0]: cm.med(v) for k, v in times.items()}
            for label, (f, ref) in paths.items():
                tag = label.split(" ")[0]
                base = base_of.get(tag)
                added = cm.us(med[tag] - med[base]) if base in med else "-"
                check = "-"
                if ref:
                    ok = all(np.allclose(g, w, rtol=1e-4, atol=1e-5 * (1 + np.abs(w).max()))
                             for g, w in zip(flat(f()), want[ref]))
                    check = "same result" if ok else "MISMATCH"
                rep.row(rows, [name, label, cm.us(med[tag]), f"{added} (over {base})" if base in med else "-", check])
                if check == "MISMATCH":
                    raise AssertionError(f"{name}, breakdown step {label}: result differs from torch")


# ------------------------------------------------------------------ call paths (issue 7)

B_CALLBACK = "(b) bridge: TorchOpKernel under jit (callback path)"
B_FFI = "(b') bridge: TorchOpKernel under jit (FFI path)"


def _run_paths(rep, cases, jdev, warmup: int, iters: int, flat) -> None:
    """Callback path (before) against FFI path (after): forward and jax.grad, timed interleaved."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from nvalchemi_jaxbridge.kernels import TorchOpKernel

    rows = rep.table("Callback path (before) vs FFI path (after), same process, interleaved",
                     ["op", "call", "callback (us)", "FFI (us)", "FFI/callback", "saved (us)", "check"])
    for name, op, targs, _ in cases:
        with rep.section(f"{name}: callback vs FFI"):
            jargs = [jax.device_put(np.asarray(t.cpu()), jdev) for t in targs]
            # gradient of sum(output 0) w.r.t. input 0: x*2 through its twin with a backward formula
            gop = _grad_op(name) or op
            want = {"forward": flat(op(*targs)), "grad": flat(_torch_grad(gop, targs))}
            fns, bwd_paths = {}, {}
            for path in ("callback", "ffi"):
                k = TorchOpKernel(op, call_path=path)
                f = jax.jit(lambda *xs, k=k: k(*xs))
                fns[path, "forward"] = lambda f=f: f(*jargs)
                kg = TorchOpKernel(gop, outputs=(0,), call_path=path)
                g = jax.jit(jax.grad(lambda x, *rest, kg=kg: jnp.sum(kg(x, *rest))))
                fns[path, "grad"] = lambda g=g: g(*jargs)
                bwd_paths[path] = kg.backward_path_of(*jargs)
            times = _interleaved(fns, warmup=warmup, iters=iters)
            for call in ("forward", "grad"):
                ok = all(np.allclose(g, w, rtol=1e-4, atol=1e-5 * (1 + np.abs(w).max()))
                         for path in ("callback", "ffi") for g, w in zip(flat(fns[path, call]()), want[call]))
                b, a = cm.med(times["callback", call]), cm.med(times["ffi", call])
                ffi_bwd = "FFI" if bwd_paths["ffi"] == "ffi" else bwd_paths["ffi"]
                label = "forward" if call == "forward" else (
                    f"jax.grad of sum(output 0) (the backward call: callback vs {ffi_bwd})")
                rep.row(rows, [name, label, cm.us(b), cm.us(a), f"{a / b:.2f}", cm.us(b - a),
                               "same result" if ok else "MISMATCH"])
                if not ok:
                    raise AssertionError(f"{name} {call}: callback or FFI result differs from torch")


def _chain_step(name: str):
    """The next input of a dependent chain, from the inputs and the op's outputs (same rule in torch and JAX)."""
    if name == "x*2":
        return lambda args, out: (out,)  # y <- 2 y: x 2^N stays finite in float32 for N < ~100
    return lambda args, out: (args[0] + 1e-6 * out[1],) + tuple(args[1:])  # LJ: move along the forces


def _run_chain(rep, cases, jdev, dev, n: int, warmup: int, iters: int, flat) -> None:
    """N dependent calls in one jitted program (time / N) against N dependent native calls (one sync)."""
    import jax
    import numpy as np
    import torch

    from nvalchemi_jaxbridge.kernels import TorchOpKernel

    rows = rep.table(f"Inside one program: {n} dependent calls unrolled in one jit (per call = time / {n})",
                     ["op", "path", "per call (us)", "above native (us)", "check"])
    rep.note(f"Inside one program: native = {n} dependent torch calls and one synchronize at the end, / {n}; "
             f"the JAX rows are one jitted program of {n} calls, / {n}. Between calls: x*2 feeds its output straight "
             f"back, LJ moves the positions by 1e-6 * forces (one elementwise step, in torch and in JAX alike).")
    gpu = dev.type == "cuda"
    for name, op, targs, _ in cases:
        with rep.section(f"{name}: inside one program"):
            step = _chain_step(name)

            def native(targs=targs, op=op, step=step):
                args = tuple(targs)
                for _ in range(n):
                    args = step(args, op(*args))
                if gpu:
                    torch.cuda.synchronize(dev)
                return args

            fns = {"native torch": lambda native=native: (native(), None)[1]}
            for path in ("callback", "ffi"):
                k = TorchOpKernel(op, call_path=path)

                def chain(*args, k=k, step=step):
                    for _ in range(n):
                        args = step(args, k(*args))
                    return args

                f = jax.jit(chain)
                jargs = [jax.device_put(np.asarray(t.cpu()), jdev) for t in targs]
                fns[path] = lambda f=f, jargs=jargs: f(*jargs)
            times = _interleaved(fns, warmup=warmup, iters=iters)
            want = flat(native()[0])
            nat = cm.med(times["native torch"]) / n
            for label, key in (("native torch", "native torch"), ("bridge, callback path", "callback"),
                               ("bridge, FFI path", "ffi")):
                per = cm.med(times[key]) / n
                check = "-"
                if key != "native torch":
                    got = flat(fns[key]()[0])
                    ok = all(np.allclose(g, w, rtol=1e-4, atol=1e-5 * (1 + np.abs(w).max())) for g, w in zip(got, want))
                    check = "same result" if ok else "MISMATCH"
                    if not ok:
                        raise AssertionError(f"{name}, chain of {n} via {key}: result differs from torch")
                rep.row(rows, [name, label, cm.us(per), "-" if key == "native torch" else cm.us(per - nat), check])


# ------------------------------------------------------------------ before/after (issue 7)


def _kernel_class_from(root: pathlib.Path):
    """`TorchOpKernel` of another checkout (e.g. a git worktree of an older commit), loaded beside ours."""
    import importlib
    import types

    kdir = root / "nvalchemi_jaxbridge" / "kernels"
    if not (kdir / "torch_op.py").is_file():
        raise FileNotFoundError(
            f"--before {root}: no nvalchemi_jaxbridge/kernels/torch_op.py there; pass the root of a checkout, "
            f"e.g. `git worktree add /tmp/before <commit>` then --before /tmp/before."
        )
    name = "_jaxbridge_before_kernels"  # a package of its own, so its modules do not replace ours
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(kdir)]
        sys.modules[name] = pkg
    return importlib.import_module(f"{name}.torch_op").TorchOpKernel


def _run_compare(rep, cases, jdev, before: pathlib.Path, warmup: int, iters: int, flat) -> None:
    """The same calls through the other checkout's TorchOpKernel and ours, timed interleaved."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from nvalchemi_jaxbridge.kernels import TorchOpKernel

    old_cls = _kernel_class_from(before)
    rep.note(f"Before/after: TorchOpKernel from {before} (before) and from {cm.ROOT} (after), "
             f"timed in interleaved rounds in one process.")
    rows = rep.table("Before/after (same process, interleaved)",
                     ["op", "call", "before (us)", "after (us)", "after/before", "check"])
    for name, op, targs, _ in cases:
        with rep.section(f"{name}: before/after"):
            jargs = [jax.device_put(np.asarray(t.cpu()), jdev) for t in targs]
            calls = ("forward", "grad") if _grad_op(name) is not None else ("forward",)
            want = {"forward": flat(op(*targs))}
            fns, checks = {}, {}
            for tag, cls in (("before", old_cls), ("after", TorchOpKernel)):
                k = cls(op)
                f = jax.jit(lambda *xs, k=k: k(*xs))
                fns[tag, "forward"] = lambda f=f: f(*jargs)
                if "grad" in calls:
                    want["grad"] = flat(_torch_grad(_grad_op(name), targs))
                    kg = cls(_grad_op(name), outputs=(0,))
                    g = jax.jit(jax.grad(lambda x, *rest, kg=kg: jnp.sum(kg(x, *rest))))
                    fns[tag, "grad"] = lambda g=g: g(*jargs)
            times = _interleaved(fns, warmup=warmup, iters=iters)
            for call in calls:
                for tag in ("before", "after"):
                    checks[tag] = all(np.allclose(g, w, rtol=1e-4, atol=1e-5 * (1 + np.abs(w).max()))
                                      for g, w in zip(flat(fns[tag, call]()), want[call]))
                b, a = cm.med(times["before", call]), cm.med(times["after", call])
                label = "forward" if call == "forward" else "jax.grad of sum(output 0)"
                ok = all(checks.values())
                rep.row(rows, [name, label, cm.us(b), cm.us(a), f"{a / b:.2f}", "same result" if ok else "MISMATCH"])
                if not ok:
                    raise AssertionError(f"{name} {call}: before/after results differ from torch ({checks})")


def main(argv: list[str] | None = None) -> int:
    p = cm.base_parser(__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=None, help="timed calls (default 200, smoke 10)")
    p.add_argument("--torch2jax", choices=("auto", "cached", "skip"), default="auto",
                   help="auto: build its extension if needed (minutes); cached: only if already built")
    p.add_argument("--prebuild-torch2jax", action="store_true", help="compile wrap-torch2jax's extension and exit")
    p.add_argument("--breakdown", action="store_true",
                   help="only the breakdown of one call (and --before's table); the default run includes it")
    p.add_argument("--before", type=pathlib.Path, default=None,
                   help="root of another checkout whose TorchOpKernel is timed against this one's")
    p.add_argument("--chain", type=int, default=None,
                   help="dependent calls unrolled in one program for the 'inside one program' table "
                        f"(default 32, smoke {SMOKE_CHAIN})")
    a = p.parse_args(argv)
    platform = cm.setup(a.platform, cpu_devices=1)  # one device is all this benchmark uses
    if a.prebuild_torch2jax:
        mod = _t2j_module()
        try:
            mod.compile_and_import_module()
        except Exception as e:  # noqa: BLE001 - registering may fail on a CPU-only JAX; the build is what counts
            print(f"wrap_torch2jax: after the build: {type(e).__name__}: {e}", flush=True)
        built = _t2j_built()
        print(f"wrap_torch2jax {mod.__version__}: extension {'built' if built else 'NOT built'}", flush=True)
        return 0 if built else 1
    import jax
    import jax.numpy as jnp
    import torch

    from nvalchemi_jaxbridge.kernels import TorchOpKernel

    iters = a.iters or (10 if a.smoke else 200)
    warmup = 3 if a.smoke else 20
    dev = torch.device("cuda", 0) if platform == "gpu" else torch.device("cpu")
    jdev = jax.devices()[0]
    settings = {"timing": f"median of {iters} calls after {warmup} warm-up",
                "overhead": "median(path) - median(native, wall clock); JAX paths: wall + block_until_ready",
                "pure_callback": "numpy in -> torch on the device -> numpy out",
                "torch2jax": f"mode {a.torch2jax}, depth=0 (no VJP)",
                "breakdown": "steps timed in 10 interleaved rounds; median per step"}
    rep = cm.Report("kernel_overhead", "Kernel-call overhead (1 device)", a.out, cm.context(platform), settings)
    results: dict[tuple[str, str], float] = {}

    def flat(out):
        return [np.asarray(o.detach().cpu() if isinstance(o, torch.Tensor) else o, np.float64)
                for o in (out if isinstance(out, (tuple, list)) else (out,))]

    cases = []
    with rep.section("inputs"):
        cases = _cases(a.smoke, dev)
    if not a.breakdown:
        rows = rep.table("Per call", ["op", "size", "path", "median (us)", "above native (us)", "check"])
        t2j = None
        with rep.section("wrap-torch2jax import"):
            # The peer is optional: a checkout without its wheel (a fresh clone, CI) records
            # why it was not measured instead of failing the benchmark.
            try:
                if a.torch2jax == "skip":
                    rep.note("wrap-torch2jax: skipped (--torch2jax skip).")
                elif a.torch2jax == "cached" and not _t2j_built():
                    rep.note("wrap-torch2jax: skipped, its extension is not built here (--torch2jax cached).")
                else:
                    t2j = _t2j_module()
                    rep.note(f"wrap-torch2jax {t2j.__version__} from {pathlib.Path(t2j.__file__).parent}")
            except ImportError as e:
                rep.note(f"wrap-torch2jax: not measured, not available here ({e})")

        for name, op, targs, desc in cases:
            jargs = [jax.device_put(np.asarray(t.cpu()), jdev) for t in targs]
            want = flat(op(*targs))
            native = float("nan")

            def add(path: str, t: float, got) -> None:
                results[name, path] = t
                ok = all(np.allclose(g, w, rtol=1e-4, atol=1e-5 * (1 + np.abs(w).max())) for g, w in zip(flat(got), want))
                rep.row(rows, [name, desc, path, cm.us(t), "-" if path.startswith("(a)") else cm.us(t - native),
                               "same result" if ok else "MISMATCH"])
                if not ok:
                    raise AssertionError(f"{name} via {path}: result differs from the native torch call")

            with rep.section(f"{name}: native torch"):
                wall, ev = cm.time_torch(lambda: op(*targs), warmup=warmup, iters=iters, device=dev)
                native = cm.med(wall)
                add("(a) native torch (wall)", native, op(*targs))
                if ev:
                    rep.row(rows, [name, desc, "(a) native torch (CUDA events)", cm.us(cm.med(ev)), "-", "-"])
            with rep.section(f"{name}: bridge"):
                k = TorchOpKernel(op, call_path="callback")
                f = jax.jit(lambda *xs: k(*xs))
                add(B_CALLBACK, cm.med(cm.time_jax(lambda: f(*jargs), warmup=warmup, iters=iters)), f(*jargs))
            with rep.section(f"{name}: bridge, FFI path"):
                kf = TorchOpKernel(op, call_path="ffi")
                ff = jax.jit(lambda *xs: kf(*xs))
                add(B_FFI, cm.med(cm.time_jax(lambda: ff(*jargs), warmup=warmup, iters=iters)), ff(*jargs))
            with rep.section(f"{name}: wrap-torch2jax"):
                if t2j is None:
                    rep.row(rows, [name, desc, "(c) wrap-torch2jax", "not run", "-", "see note"])
                else:
                    g = jax.jit(t2j.torch2jax(lambda *ts: op(*ts), *targs, depth=0))
                    add("(c) wrap-torch2jax under jit",
                        cm.med(cm.time_jax(lambda: g(*jargs), warmup=warmup, iters=iters)), g(*jargs))
            with rep.section(f"{name}: pure_callback"):
                shapes = jax.tree.map(lambda t: jax.ShapeDtypeStruct(tuple(t.shape), jnp.dtype(str(t.dtype).split(".")[1])),
                                      op(*targs))

                def host(*xs):
                    out = op(*[torch.from_numpy(np.asarray(x)).to(dev) for x in xs])
                    return jax.tree.map(lambda t: t.cpu().numpy(), out)

                h = jax.jit(lambda *xs: jax.pure_callback(host, shapes, *xs))
                add("(d) jax.pure_callback under jit",
                    cm.med(cm.time_jax(lambda: h(*jargs), warmup=warmup, iters=iters)), h(*jargs))

    _run_breakdown(rep, cases, jdev, platform == "gpu", warmup, iters, flat)
    _run_paths(rep, cases, jdev, warmup, iters, flat)
    _run_chain(rep, cases, jdev, dev, a.chain or (SMOKE_CHAIN if a.smoke else 32), warmup, max(10, iters // 2), flat)
    if a.before is not None:
        _run_compare(rep, cases, jdev, a.before, warmup, iters, flat)
    with rep.section("targets"):
        for name, *_ in cases:
            nat = results.get((name, "(a) native torch (wall)"))
            tj = results.get((name, "(c) wrap-torch2jax under jit"))
            for label in (B_CALLBACK, B_FFI):
                br = results.get((name, label))
                if nat is None or br is None:
                    continue
                over = br - nat
                vs = "wrap-torch2jax not measured" if tj is None else (
                    f"bridge {'below' if br < tj else 'NOT below'} wrap-torch2jax ({cm.us(br)} vs {cm.us(tj)} us)")
                rep.note(f"Target ({name}, {label.split(' ')[0]} {label.rsplit('(', 1)[-1].rstrip(')')}): bridge "
                         f"overhead <= 20 us above native -> {cm.us(over)} us, "
                         f"{'MET' if over <= 20e-6 else 'NOT MET'}; {vs}.")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
