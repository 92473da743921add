"""Host cost of a model's layout at 10^4..10^6 atoms: `DistributedMLIP.prepare` and `rebuild`, phase by phase.

Standalone (no other benchmark module). Rattled fcc Cu (a = 3.61 Å) at each size, the MACE setting
(cutoff 5 Å, 2 layers, skin 0.5 Å) through a stand-in wrapper with that cutoff and depth (the
project's MPNN: only the layout is timed, the model never runs, so its memory budget is lifted), for each exchange and device
count on JAX CPU virtual devices. Each case runs in a fresh subprocess, so its max RSS is its own.

A rebuild is timed phase by phase (inclusive times; the phases are the library's functions on the
real call path, wrapped for the run): wall and CPU seconds (`time.process_time`, every thread of
the process), then the same rebuild again under `tracemalloc` for each phase's peak of traced
(numpy and Python) memory above its start. Prints one markdown table with the host, versions and date.

    python benchmarks/layout_scale.py                       # 1e4 1e5 1e6 atoms, both exchanges, 1 and 8 devices
    python benchmarks/layout_scale.py --sizes 1e4 --devices 1 --exchange deep_halo
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
import tracemalloc
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A_CU = 3.61  # Å
CUTOFF, N_LAYERS, SKIN = 5.0, 2, 0.5  # the MACE setting (r_max 5 Å, 2 interaction layers)
PHASES = (  # (label, module, attribute); a name the library no longer has is left out of the table
    ("HaloPlan.build", "nvalchemi_jaxbridge.layout.halo_plan", "HaloPlan.build"),
    ("  coincident check", "nvalchemi_jaxbridge.layout.halo_plan", "check_coincident"),
    ("  partition", "nvalchemi_jaxbridge.layout.halo_plan", "partition"),
    ("    find_ghosts", "nvalchemi_jaxbridge.layout.partition", "find_ghosts"),
    ("  assemble (rows, tables)", "nvalchemi_jaxbridge.layout.halo_plan", "_assemble"),
    ("EdgePlan.build", "nvalchemi_jaxbridge.mlip.edges", "EdgePlan.build"),
    ("device tables (with_plan)", "nvalchemi_jaxbridge.lower.compile", "device_tables"),
    ("node attrs (cs.owned)", "nvalchemi_jaxbridge.lower.compile", "CompiledSpec.owned"),
    ("edge arrays (place)", "nvalchemi_jaxbridge.mlip.jax_model", "place"),
)


def fcc_cu(n_atoms: float, seed: int = 0) -> tuple[Any, Any, Any]:
    """Rattled fcc Cu of about `n_atoms` atoms (a cube of 4 n^3): positions, numbers, cell."""
    import numpy as np

    n = max(1, round((n_atoms / 4) ** (1 / 3)))
    basis = np.array([[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]])
    grid = np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), axis=-1).reshape(-1, 1, 3)
    pos = ((grid + basis[None]).reshape(-1, 3) * A_CU).astype(np.float64)
    pos += np.random.default_rng(seed).normal(scale=0.05, size=pos.shape)
    return pos, np.full(len(pos), 29), np.eye(3) * n * A_CU


class Recorder:
    """Inclusive wall, CPU and (with tracemalloc on) peak traced bytes of the wrapped phases."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, float]] = {}
        self.stack: list[list[float]] = []

    @contextlib.contextmanager
    def phase(self, label: str):
        traced = tracemalloc.is_tracing()
        if traced:
            cur, peak = tracemalloc.get_traced_memory()
            if self.stack:
                self.stack[-1][1] = max(self.stack[-1][1], peak)
            tracemalloc.reset_peak()
            frame = [cur, cur]
            self.stack.append(frame)
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            w, c = time.perf_counter() - w0, time.process_time() - c0
            row = self.rows.setdefault(label, {"wall": 0.0, "cpu": 0.0, "peak": 0.0})
            if traced:
                _, peak = tracemalloc.get_traced_memory()
                frame = self.stack.pop()
                frame[1] = max(frame[1], peak)
                if self.stack:
                    self.stack[-1][1] = max(self.stack[-1][1], frame[1])
                row["peak"] = max(row["peak"], frame[1] - frame[0])
            else:
                row["wall"] += w
                row["cpu"] += c


def _wrap(rec: Recorder) -> None:
    """Wrap every phase function that exists on the call path (module attribute or class method)."""
    import functools
    import importlib

    for label, mod_name, attr in PHASES:
        mod = importlib.import_module(mod_name)
        owner, name = mod, attr
        if "." in attr:
            cls_name, name = attr.split(".")
            owner = getattr(mod, cls_name, None)
        raw = None if owner is None else owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if raw is None:
            continue
        is_cm = isinstance(raw, classmethod)
        fn = raw.__func__ if is_cm else raw

        def timed(*a, _fn=fn, _label=label, **k):
            with rec.phase(_label):
                return _fn(*a, **k)

        functools.update_wrapper(timed, fn)
        setattr(owner, name, classmethod(timed) if is_cm else timed)


def one_case(n_atoms: float, n_devices: int, exchange: str) -> dict[str, Any]:
    """Time prepare and rebuild of one case in this process; a dict for the table."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_x64", True)
    import numpy as np

    from nvalchemi_jaxbridge.mlip import MPNN, DistributedMLIP, MPNNWrapper

    pos, numbers, cell = fcc_cu(n_atoms)
    model = DistributedMLIP(MPNNWrapper(MPNN([29], cutoff=CUTOFF, n_layers=N_LAYERS)), n_devices=n_devices,
                            exchange=exchange, skin=SKIN, memory_budget=1e15)  # the model never runs
    rec = Recorder()
    _wrap(rec)
    w0, c0 = time.perf_counter(), time.process_time()
    with rec.phase("prepare (total)"):
        state = model.prepare(pos, numbers, cell, True)
    prepare = (time.perf_counter() - w0, time.process_time() - c0)
    moved = pos + np.random.default_rng(1).normal(scale=0.05, size=pos.shape)
    w0 = time.perf_counter()
    model.needs_rebuild(state, moved)
    check = time.perf_counter() - w0
    rec.rows.clear()
    with rec.phase("rebuild (total)"):
        new = model.rebuild(state, moved)
    jax.block_until_ready(new.edge_table)
    rows = new.rows_per_device()
    del new  # an MD run holds the state and its rebuild, no more
    tracemalloc.start()
    with rec.phase("rebuild (total)"):
        new = model.rebuild(state, moved)
    tracemalloc.stop()
    return dict(
        atoms=len(pos), devices=n_devices, exchange=exchange, prepare=prepare, needs_rebuild=check,
        phases=rec.rows, max_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        rows=max(r["owned"] + r["ghost"] for r in rows), edges=max(r["edges"] for r in rows),
    )


def _context() -> dict[str, str]:
    import jax
    import numpy as np
    import scipy

    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": f"{platform.node()}, {os.cpu_count()} CPUs {cpu}".strip(),
        "load average (1 min)": f"{os.getloadavg()[0]:.1f}",
        "python": platform.python_version(), "numpy": np.__version__, "scipy": scipy.__version__,
        "jax": jax.__version__,
        # tall (N, 3) @ (3, 3) products go through OpenBLAS, whose idle threads spin on CPU time on a busy host
        "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "unset"),
        "setting": f"rattled fcc Cu a={A_CU} Å, cutoff {CUTOFF} Å, {N_LAYERS} layers, skin {SKIN} Å; JAX CPU devices",
    }


def _table(results: list[dict[str, Any]]) -> str:
    labels = ["prepare (total)", "rebuild (total)"] + [p[0] for p in PHASES]
    head = "| phase | " + " | ".join(f"{r['atoms']:.0e} {r['exchange']} D={r['devices']}" for r in results) + " |"
    lines = [head, "|---|" + "---|" * len(results)]
    lines.append("| rows / edges (max per device) | " + " | ".join(f"{r['rows']} / {r['edges']}" for r in results) + " |")
    for label in labels:
        cells = []
        for r in results:
            p = r["phases"].get(label)
            if label == "prepare (total)":
                cells.append(f"{r['prepare'][0]:.2f} s (cpu {r['prepare'][1]:.2f})")
            elif p is None:
                cells.append("-")
            else:
                cells.append(f"{p['wall']:.2f} s (cpu {p['cpu']:.2f}), {p['peak'] / 2**20:.0f} MiB")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| needs_rebuild | " + " | ".join(f"{r['needs_rebuild']:.3f} s" for r in results) + " |")
    lines.append("| max RSS (process) | " + " | ".join(f"{r['max_rss'] / 2**30:.2f} GiB" for r in results) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[1e4, 1e5, 1e6], help="atoms (about; fcc cubes)")
    p.add_argument("--devices", type=int, nargs="+", default=[1, 8])
    p.add_argument("--exchange", nargs="+", default=["per_layer", "deep_halo"], choices=["per_layer", "deep_halo"])
    p.add_argument("--one", nargs=3, metavar=("ATOMS", "DEVICES", "EXCHANGE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one_case(float(args.one[0]), int(args.one[1]), args.one[2])))
        return 0
    results = []
    for n in args.sizes:
        for exchange in args.exchange:
            for d in args.devices:
                env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                           JAX_PLATFORMS="cpu")
                out = subprocess.run([sys.executable, __file__, "--one", str(n), str(d), exchange], env=env,
                                     capture_output=True, text=True)
                if out.returncode:
                    print(f"{n:.0e} {exchange} D={d} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                    continue
                results.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"done {n:.0e} {exchange} D={d}", file=sys.stderr, flush=True)
    print("\n".join(f"- {k}: {v}" for k, v in _context().items()))
    print()
    print(_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
