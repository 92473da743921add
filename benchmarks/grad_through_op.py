"""Energy + forces of an autograd-force torch function through the bridge against native `autograd.grad`.

    PYTHONPATH=. python3 benchmarks/grad_through_op.py --out OUTDIR [--smoke] [--sizes 1000,10000] [--profile]
        [--timeline]

The function is what a message-passing model's energy looks like to autograd: a Lennard-Jones
energy summed over a fixed edge list (positions (N, 3) and edges (E, 2) in, a scalar out), with
no backward formula of its own. Native: `e = fn(x, edges); torch.autograd.grad(e, x)`. Bridge:
`jax.jit(jax.value_and_grad(kernel))` of the same function as a torch op (`torch_function`), on
the FFI and the callback call paths. The table counts how many times the function's forward ran
per energy + forces (native: 1) and gives bridge/native throughput (target >= 0.95x, issue 15), for
calls waited for one by one (synchronised after each) and for `--block` calls issued back to back
with one synchronisation (pipelined: what an MD or optimiser loop does, the host issuing the next
evaluation while the device works), each side's blocks in turns.
`--label` tags the rows, so runs of two versions of the package can share one table. `--profile`
adds, per size, 30 back-to-back calls of each side under `torch.profiler` (CUPTI sees XLA's kernels
too): kernels per call (the function's, XLA's), device busy time per call by source, host
synchronisations per call, and the wall time of a call in that loop (`md_breakdown.profile`).
`--timeline` adds, per size, where a call's host time goes (medians of the calls, in turns): until the
torch function starts, in it, from its end until the call returns, and the synchronisation, for the
energy alone and energy + forces of each side, and for a jitted XLA program with no torch in it (JAX's
own cost of a call on this machine).
"""

from __future__ import annotations

import sys
import time

import _common as cm
import numpy as np

SIZES = [1000, 4000, 10000, 40000, 100000]
SMOKE_SIZES = [200]
NEIGHBOURS = 48  # edges per atom: a MACE-like graph at r_max 5 A in a metal
SIGMA, EPSILON = 1.0, 0.01


def edge_list(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Positions of `n` atoms at unit density (a rattled simple cubic lattice) and `NEIGHBOURS` random near pairs."""
    rng = np.random.default_rng(seed)
    side = int(np.ceil(n ** (1 / 3)))
    grid = np.stack(np.meshgrid(*[np.arange(side)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n]
    pos = 1.2 * grid + 0.05 * rng.normal(size=(n, 3))
    # neighbours: atoms within +-2 lattice sites, a fixed count per atom (indices wrap at the ends)
    offsets = rng.integers(-2 * side * side - 2 * side - 2, 2 * side * side + 2 * side + 3, size=(n, NEIGHBOURS))
    offsets[offsets == 0] = 1
    recv = np.repeat(np.arange(n), NEIGHBOURS)
    send = (recv + offsets.reshape(-1)) % n
    return pos, np.stack([send, recv], 1).astype(np.int64)


def make_energy(counter: list[int]):
    """The torch energy function; `counter[0]` counts its forward runs."""
    import torch

    def energy(x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        counter[0] += 1
        d = x[edges[:, 0]] - x[edges[:, 1]]
        r2 = (d * d).sum(1)
        sr6 = (SIGMA * SIGMA / r2) ** 3
        return (4.0 * EPSILON * (sr6 * sr6 - sr6)).sum().reshape(1)

    return energy


def profile_calls(call, sync, calls: int) -> dict:
    """`md_breakdown.profile` of `calls` back-to-back calls (imported here: it pulls in md_step)."""
    import md_breakdown

    return md_breakdown.profile(call, sync, calls)


def timeline_runs(fn, path: str, x_t, e_t, x_j, e_j, torch_sync, warmup: int, iters: int) -> dict:
    """`timeline` of the energy alone and energy + forces, native and through the bridge's `path`, and XLA alone."""
    import jax
    import torch

    from nvalchemi_jaxbridge.kernels.torch_fn import torch_function

    marks: list[tuple[float, float]] = []

    def marked(x, e):
        t0 = time.perf_counter()
        out = fn(x, e)
        marks.append((t0, time.perf_counter()))
        return out

    def native_ef():
        x = x_t.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(marked(x, e_t).sum(), x)
        return g

    k = torch_function(marked, 2, 1, label=f"lj_edges_timeline_{path}", call_path=path)
    energy = jax.jit(lambda x, ed: k(x, ed)[0])
    both = jax.jit(jax.value_and_grad(lambda x, ed: k(x, ed)[0]))
    xla = jax.jit(lambda x, ed: (2 * x).sum())
    runs = {"native E": (lambda: marked(x_t, e_t), torch_sync), "native E+F": (native_ef, torch_sync),
            f"bridge ({path}) E": (lambda: energy(x_j, e_j), jax.block_until_ready),
            f"bridge ({path}) E+F": (lambda: both(x_j, e_j), jax.block_until_ready),
            "XLA alone: jit((2 * x).sum())": (lambda: xla(x_j, e_j), jax.block_until_ready)}
    return timeline(runs, marks, warmup=warmup, iters=iters)


def timeline(runs: dict, marks: list, *, warmup: int, iters: int) -> dict[str, list[float]]:
    """Per run (`(fn, sync)`, in turns): median seconds [total, until the function, in it, until return, sync].

    `marks` is the list the timed torch function appends `(start, end)` to; a run that never calls it
    (an XLA program) counts its whole call as "until return".
    """
    for _ in range(warmup):
        for fn, sync in runs.values():
            sync(fn())
    phases: dict[str, list[list[float]]] = {name: [] for name in runs}
    for _ in range(iters):
        for name, (fn, sync) in runs.items():
            marks.clear()
            t0 = time.perf_counter()
            out = fn()
            t1 = time.perf_counter()
            sync(out)
            t2 = time.perf_counter()
            f0, f1 = marks[0] if marks else (t0, t0)
            phases[name].append([t2 - t0, f0 - t0, f1 - f0, t1 - f1, t2 - t1])
    return {name: list(np.median(np.array(v), axis=0)) for name, v in phases.items()}


def main(argv: list[str] | None = None) -> int:
    p = cm.base_parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default=None, help=f"atoms, comma list (default {','.join(map(str, SIZES))})")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--iters", type=int, default=None, help="timed calls (default 30, smoke 3)")
    p.add_argument("--paths", default="ffi,callback", help="bridge call paths, comma list")
    p.add_argument("--block", type=int, default=10, help="calls per pipelined block (default 10)")
    p.add_argument("--label", default="", help="a tag for the rows (e.g. the package version measured)")
    p.add_argument("--profile", action="store_true", help="also profile each side (torch.profiler, 30 calls)")
    p.add_argument("--timeline", action="store_true", help="also split a call's host time into phases")
    a = p.parse_args(argv)
    platform = cm.setup(a.platform)
    import jax
    import jax.numpy as jnp
    import torch

    from nvalchemi_jaxbridge.kernels.torch_fn import torch_function

    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else (SMOKE_SIZES if a.smoke else SIZES)
    iters, warmup = a.iters or (3 if a.smoke else 30), 2 if a.smoke else 5
    dev = torch.device("cuda", 0) if platform == "gpu" else torch.device("cpu")
    tdt = getattr(torch, a.dtype)
    settings = {"dtype": a.dtype, "graph": f"{NEIGHBOURS} edges per atom, LJ energy summed over edges",
                "timing": (f"median of {iters} calls after {warmup} warm-up, synchronised after each (wall clock); "
                           "native and the bridge's paths take turns call by call"),
                "label": a.label or "-"}
    rep = cm.Report("grad_through_op", "Energy + forces through a torch function: bridge vs native autograd",
                    a.out, cm.context(platform), settings)
    rows = rep.table("Energy + forces", ["label", "atoms", "edges", "run", "forwards per E+F", "E+F (ms)",
                                         "bridge/native", f"pipelined E+F (ms, blocks of {a.block})",
                                         "bridge/native (pipelined)", "token reads per E+F", "max |dF| / max |F|"])
    prof_rows = None
    if a.profile:
        prof_rows = rep.table("Per E+F under the profiler (30 calls back to back)", [
            "label", "atoms", "run", "wall ms per call", "device busy ms: function / xla / copy", "kernels: function / xla",
            "host syncs (waiting ms)"])
    time_rows = None
    if a.timeline:
        time_rows = rep.table("Where a call's host time goes (us, medians)", [
            "label", "atoms", "run", "total", "until the function", "function", "until return", "sync"])
    for n in sizes:
        with rep.section(f"{n} atoms"):
            pos, edges = edge_list(n)
            counter = [0]
            fn = make_energy(counter)
            x_t = torch.tensor(pos, dtype=tdt, device=dev)
            e_t = torch.tensor(edges, device=dev)

            def native():
                x = x_t.detach().requires_grad_(True)
                e = fn(x, e_t).sum()
                (g,) = torch.autograd.grad(e, x)
                return e, g

            torch_sync = (lambda _: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda _: None)
            runs = {"native": (native, torch_sync)}
            x_j = jnp.asarray(pos, dtype=a.dtype)
            e_j = jnp.asarray(edges.astype(np.int32))
            kernels = {}
            paths = [s for s in a.paths.split(",") if s]
            for path in paths:
                kernel = torch_function(fn, 2, 1, label=f"lj_edges_{path}", call_path=path)
                vg = jax.jit(jax.value_and_grad(lambda x, ed, k=kernel: k(x, ed)[0]))
                kernels[f"bridge ({path})"] = (kernel, vg)
                runs[f"bridge ({path})"] = (lambda vg=vg: vg(x_j, e_j), jax.block_until_ready)
            times = {k: cm.med(v) for k, v in cm.time_interleaved(runs, warmup=warmup, iters=iters).items()}
            blocks = {k: cm.pipelined(f, sync, a.block) for k, (f, sync) in runs.items()}
            piped = {k: cm.med(v) / a.block for k, v in cm.time_interleaved(
                blocks, warmup=1, iters=max(3, iters // a.block)).items()}
            t_native, p_native = times["native"], piped["native"]
            counter[0] = 0
            e_ref, g_ref = native()
            f_ref = -g_ref.detach().cpu().numpy()
            rep.row(rows, [a.label or "-", n, len(edges), "native", counter[0], cm.ms(t_native), "1",
                           cm.ms(p_native), "1", "-", "-"])
            for run, (kernel, vg) in kernels.items():
                t = times[run]
                counter[0] = 0
                reads = kernel.token_reads()
                _, g = jax.block_until_ready(vg(x_j, e_j))
                reads = kernel.token_reads() - reads
                err = float(np.abs(-np.asarray(g) - f_ref).max() / max(np.abs(f_ref).max(), 1e-30))
                rep.row(rows, [a.label or "-", n, len(edges), run, counter[0], cm.ms(t),
                               f"{t_native / t:.2f}x", cm.ms(piped[run]), f"{p_native / piped[run]:.2f}x", reads,
                               f"{err:.1e}"])
            if time_rows is not None:
                for run, ph in timeline_runs(fn, paths[0], x_t, e_t, x_j, e_j, torch_sync, warmup, iters).items():
                    rep.row(time_rows, [a.label or "-", n, run, *(f"{1e6 * v:.0f}" for v in ph)])
            profiled = [(run, fn_, sync) for run, (fn_, sync) in runs.items()]
            for run, call, done in profiled if prof_rows is not None else ():
                pr = profile_calls(call, done, 30)
                b = pr["busy"]
                rep.row(prof_rows, [a.label or "-", n, run, cm.ms(pr["wall"]),
                                    " / ".join(cm.ms(b.get(k, 0.0)) for k in ("op", "xla", "copy")),
                                    f"{pr['kernels_op']:.0f} / {pr['kernels_xla']:.0f}",
                                    f"{pr['syncs']:.1f} ({cm.ms(pr['wait'])})"])
    rep.note("forwards per E+F: how many times the energy function ran for one energy + forces call "
             "(native torch: once). Both sides are timed by wall clock around the call and a synchronisation, "
             "taking turns call by call; pipelined: blocks of calls issued back to back and synchronised once, "
             "per call, the sides' blocks taking turns. bridge/native > 1 means the bridge is faster. token reads: "
             "backwards that read their graph's token back from the device (a stream synchronisation each "
             "on a GPU).")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
