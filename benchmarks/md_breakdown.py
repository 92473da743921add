"""Where an MD step's time goes at 10^4 and 4 x 10^4 atoms: native torch against the bridge, one device.

    PYTHONPATH=. python3 benchmarks/md_breakdown.py --out OUTDIR [--smoke] [--cells 14,22]
        [--kernels torch-cells,triton] [--steps 50]

The steps are `benchmarks/md_step.py`'s (velocity Verlet on LJ argon; native: the torch op on
the one-device halo rows, `index_add_` fold, Verlet in torch; bridge: one jitted program per
step). Each is timed three ways, since an MD loop does not synchronise after every step:
- synced: wall time of one step followed by a device synchronisation (what md_step.py reports
  for the bridge; its native column is the CUDA-event time, given here too);
- pipelined: wall time of `--steps` steps issued back to back, one synchronisation at the end;
- host: wall time until the step call returns (work enqueued, not done).
Then `torch.profiler` (CUPTI: it sees XLA's kernels as well as torch's) records `--steps`
pipelined steps and splits the device time per step into the op's kernels (torch and Triton
kernel names), XLA's kernels, and copies/fills; "idle" is the profiled run's wall time minus device busy time;
"syncs" counts the host's stream/device synchronisations and device-to-host copies per step, and
"waiting" is the host time spent in them. The "op alone" rows call the op in plain torch on the rows
each run hands it (native: the one-device halo rows; bridge: its halo block, padding rows included),
to tell the op's own cost on that block from the cost of calling it.
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile
import time

import _common as cm
import md_step

CELLS = [14, 22]  # 10976 and 42592 argon atoms
SMOKE_CELLS = [2]
KERNELS = ("torch-cells", "triton", "torch")


def is_sync_call(name: str) -> bool:
    """A CUDA runtime/driver call that makes the host wait for the device."""
    return "Synchronize" in name or "DtoH" in name or name in ("cudaMemcpy", "cuMemcpy")


XLA_PREFIXES = ("loop_", "input_", "wrapped_", "copy", "concatenate", "dynamic_", "scatter", "gather", "slice",
                "select", "transpose", "xla")


def is_xla_kernel(name: str) -> bool:
    """A kernel XLA emitted (its fusions and copies); the rest are torch's or Triton's (the op's, or native torch's)."""
    return "fusion" in name or name.startswith(XLA_PREFIXES)


def pipelined(step, sync, steps: int) -> tuple[float, float]:
    """(wall s per step of `steps` back-to-back steps, host s per step until each call returned)."""
    sync(step())
    host = []
    t0 = time.perf_counter()
    for _ in range(steps):
        h0 = time.perf_counter()
        out = step()
        host.append(time.perf_counter() - h0)
    sync(out)
    return (time.perf_counter() - t0) / steps, cm.med(host)


def profile(step, sync, steps: int) -> dict:
    """Device time per step by kind, kernels per step, host synchronisations per step, top kernels."""
    import torch
    from torch.profiler import ProfilerActivity

    sync(step())
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            out = step()
        sync(out)
        wall = time.perf_counter() - t0
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    busy = collections.Counter()
    top: collections.Counter[str] = collections.Counter()
    n_kernels, n_sync, wait = 0, 0, 0.0
    by_kind: collections.Counter[str] = collections.Counter()
    for e in events:
        cat, name, dur = e.get("cat", ""), e.get("name", ""), float(e.get("dur", 0)) * 1e-6
        if cat == "kernel":
            n_kernels += 1
            kind = "xla" if is_xla_kernel(name) else "op"
            by_kind[kind] += 1
            busy[kind] += dur
            top[f"{kind}: {name[:60]}"] += dur
        elif cat in ("gpu_memcpy", "gpu_memset"):
            busy["copy"] += dur
            top[f"copy: {name[:60]}"] += dur
        elif cat in ("cuda_runtime", "cuda_driver") and is_sync_call(name):
            n_sync += 1
            wait += dur
    return {"wall": wall / steps, "busy": {k: v / steps for k, v in busy.items()},
            "kernels": n_kernels / steps, "kernels_op": by_kind["op"] / steps, "kernels_xla": by_kind["xla"] / steps,
            "syncs": n_sync / steps, "wait": wait / steps,
            "top": [(k, v / steps) for k, v in top.most_common(4)]}


def add_md_args(p, default_cells: list[int]) -> None:
    """The options of the one-device MD benchmarks: --cells, --kernels, --dtype, --skin."""
    p.add_argument("--cells", default=None,
                   help=f"cubic cells per axis, comma list (default {','.join(map(str, default_cells))})")
    p.add_argument("--kernels", default="torch-cells,triton", help=f"comma list of {', '.join(KERNELS)}")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--skin", type=float, default=1.0)


def md_choices(a, default_cells: list[int], script: str) -> tuple[list[int], list[str]]:
    """(cells, kernels) asked for by `add_md_args`' options (smoke: SMOKE_CELLS); unknown kernels exit."""
    cells = [int(c) for c in a.cells.split(",")] if a.cells else (SMOKE_CELLS if a.smoke else default_cells)
    kernels = [k for k in a.kernels.split(",") if k]
    if bad := sorted(set(kernels) - set(KERNELS)):
        raise SystemExit(f"{script}: unknown --kernels {bad}; choose from {', '.join(KERNELS)}.")
    return cells, kernels


def main(argv: list[str] | None = None) -> int:
    p = cm.base_parser(__doc__.splitlines()[0])
    add_md_args(p, CELLS)
    p.add_argument("--steps", type=int, default=None, help="steps per pipelined run (default 50, smoke 3)")
    a = p.parse_args(argv)
    platform = cm.setup(a.platform)
    import jax
    import torch

    cells, kernels = md_choices(a, CELLS, "md_breakdown")
    steps = a.steps or (3 if a.smoke else 50)
    iters, warmup = (3, 1) if a.smoke else (10, 2)
    dev = torch.device("cuda", 0) if platform == "gpu" else torch.device("cpu")
    torch_sync = (lambda _: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda _: None)
    settings = {"dtype": a.dtype, "cutoff": f"{md_step.SMOKE_CUTOFF} A (smoke)" if a.smoke else "8.5 A",
                "plan": f"HaloPlan headroom 1.0, skin {a.skin} A, built once",
                "pipelined": f"{steps} steps back to back, one synchronisation at the end",
                "synced": f"median of {iters} steps after {warmup} warm-up, each followed by a synchronisation"}
    rep = cm.Report("md_breakdown", "MD step breakdown, one device (issue 15 item 1)", a.out,
                    cm.context(platform), settings)
    rows = rep.table("Per step", ["kernel", "atoms", "run", "synced ms (events)", "pipelined ms",
                                  "bridge/native (pipelined)", "host ms until return", "device busy ms: op / xla / copy",
                                  "idle ms", "kernels", "host syncs (waiting ms)", "top kernels (ms)"])
    for kernel in kernels:
        for c in cells:
            case = md_step.make_case("lj", kernel, c, md_step.SMOKE_CUTOFF if a.smoke else None)
            with rep.section(f"{kernel}/{case.n} atoms"):
                t_step, _, _, t_info = md_step.torch_stepper(case, a.dtype, dev, a.skin)
                b_step, _, _, b_info = md_step.bridge_stepper(case, 1, a.dtype, a.skin)
                op = md_step.op_for(case.kind, kernel)
                b_args = [torch.from_dlpack(x) for x in b_info["op_args"]()]
                runs = {"native": (t_step, torch_sync), "bridge": (b_step, jax.block_until_ready),
                        "op alone, native rows": (lambda: op(*t_info["op_args"](), cutoff=case.cutoff), torch_sync),
                        "op alone, bridge rows": (lambda: op(*b_args, cutoff=case.cutoff), torch_sync)}
                native = None
                for name, (step, sync) in runs.items():
                    if name != "bridge":
                        wall, ev = cm.time_torch(step, warmup=warmup, iters=iters, device=dev)
                    else:
                        wall, ev = cm.time_jax(step, warmup=warmup, iters=iters), []
                    synced = cm.ms(cm.med(wall)) + (f" ({cm.ms(cm.med(ev))})" if ev else "")
                    t_pipe, t_host = pipelined(step, sync, steps)
                    native = native or t_pipe
                    prof = profile(step, sync, steps) if platform == "gpu" else None
                    busy = (" / ".join(cm.ms(prof["busy"].get(k, 0.0)) for k in ("op", "xla", "copy"))
                            if prof else "n/a (CPU)")
                    idle = cm.ms(max(prof["wall"] - sum(prof["busy"].values()), 0.0)) if prof else "-"
                    top = "; ".join(f"{k} {v * 1e3:.3f}" for k, v in prof["top"]) if prof else "-"
                    rep.row(rows, [kernel, case.n, name, synced, cm.ms(t_pipe), f"{native / t_pipe:.2f}x",
                                   cm.ms(t_host), busy, idle, f"{prof['kernels']:.0f}" if prof else "-",
                                   f"{prof['syncs']:.1f} ({cm.ms(prof['wait'])})" if prof else "-", top])
                del runs, t_step, b_step
    rep.note("bridge/native > 1: the bridge is faster. Device busy time is the sum of kernel (and copy) "
             "durations per step; idle = the profiled run's wall time (profiler overhead included) - busy: the time the device waits for the host.")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
