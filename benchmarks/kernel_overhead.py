"""Kernel-call overhead: a torch op called natively, through the bridge, wrap-torch2jax and pure_callback.

    PYTHONPATH=. python3 benchmarks/kernel_overhead.py --out OUTDIR [--smoke]
    PYTHONPATH=. python3 benchmarks/kernel_overhead.py --prebuild-torch2jax   # compile its extension only

Two ops on one device: a trivial one (`x * 2` on 1024 floats, a custom op
defined here) and a realistic one (the demo Lennard-Jones op
`jaxbridge_demo::lj_energy_forces` on an fcc argon block of a few thousand
atoms). Each is called
(a) natively in torch (wall clock + synchronize, and CUDA events),
(b) through the bridge: `TorchOpKernel` under `jax.jit` (buffer_callback + DLPack),
(c) through wrap-torch2jax (`torch2jax(..., depth=0)` under `jax.jit`), and
(d) through `jax.pure_callback` (host copies both ways, the op on the device).
The JAX paths are timed by wall clock around the call and `block_until_ready`.

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

import _common as cm
import numpy as np

T2J_CACHE = pathlib.Path("~/.cache/jaxbridge-bench").expanduser()


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
    """The trivial custom op `jaxbridge_bench::times2(x) = x * 2` (defined once)."""
    import torch

    if not _LIB:
        lib = torch.library.Library("jaxbridge_bench", "DEF")
        lib.define("times2(Tensor x) -> Tensor")
        lib.impl("times2", lambda x: x * 2, "CompositeExplicitAutograd")
        torch.library.register_fake("jaxbridge_bench::times2", lambda x: torch.empty_like(x), lib=lib)
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


def main(argv: list[str] | None = None) -> int:
    p = cm.base_parser(__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=None, help="timed calls (default 200, smoke 10)")
    p.add_argument("--torch2jax", choices=("auto", "cached", "skip"), default="auto",
                   help="auto: build its extension if needed (minutes); cached: only if already built")
    p.add_argument("--prebuild-torch2jax", action="store_true", help="compile wrap-torch2jax's extension and exit")
    a = p.parse_args(argv)
    platform = cm.setup(a.platform)
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
                "torch2jax": f"mode {a.torch2jax}, depth=0 (no VJP)"}
    rep = cm.Report("kernel_overhead", "Kernel-call overhead (1 device)", a.out, cm.context(platform), settings)
    rows = rep.table("Per call", ["op", "size", "path", "median (us)", "above native (us)", "check"])
    results: dict[tuple[str, str], float] = {}

    cases = []
    with rep.section("inputs"):
        cases = _cases(a.smoke, dev)
    t2j = None
    with rep.section("wrap-torch2jax import"):
        if a.torch2jax == "skip":
            rep.note("wrap-torch2jax: skipped (--torch2jax skip).")
        elif a.torch2jax == "cached" and not _t2j_built():
            rep.note("wrap-torch2jax: skipped, its extension is not built here (--torch2jax cached).")
        else:
            t2j = _t2j_module()
            rep.note(f"wrap-torch2jax {t2j.__version__} from {pathlib.Path(t2j.__file__).parent}")

    def flat(out):
        return [np.asarray(o.detach().cpu() if isinstance(o, torch.Tensor) else o, np.float64)
                for o in (out if isinstance(out, (tuple, list)) else (out,))]

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
            k = TorchOpKernel(op)
            f = jax.jit(lambda *xs: k(*xs))
            add("(b) bridge: TorchOpKernel under jit",
                cm.med(cm.time_jax(lambda: f(*jargs), warmup=warmup, iters=iters)), f(*jargs))
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

    with rep.section("targets"):
        for name, *_ in cases:
            nat = results.get((name, "(a) native torch (wall)"))
            br = results.get((name, "(b) bridge: TorchOpKernel under jit"))
            tj = results.get((name, "(c) wrap-torch2jax under jit"))
            if nat is None or br is None:
                continue
            over = br - nat
            vs = "wrap-torch2jax not measured" if tj is None else (
                f"bridge {'below' if br < tj else 'NOT below'} wrap-torch2jax ({cm.us(br)} vs {cm.us(tj)} us)")
            rep.note(f"Target ({name}): bridge overhead <= 20 us above native -> {cm.us(over)} us, "
                     f"{'MET' if over <= 20e-6 else 'NOT MET'}; {vs}.")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
