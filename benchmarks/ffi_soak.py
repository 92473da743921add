"""Memory soak of the torch call paths: RSS over a long MD-like loop of one jitted step, FFI vs callback.

    PYTHONPATH=. python3 benchmarks/ffi_soak.py --out OUTDIR [--steps 10000] [--smoke] [--before PATH]

One velocity Verlet step per call of a jitted program on one device (CPU or GPU,
`--platform`; RSS is host memory either way): the demo
Lennard-Jones op (`jaxbridge_demo::lj_energy_forces`, fcc argon, dense block)
through `TorchOpKernel(call_path=...)`, forces either returned by the op
("op forces": the plain forward) or as -dE/dR by `jax.grad` of its energy
("jax.grad": the differentiated forward, which keeps the op's torch graph, and
the backward, which takes it). Each (path, forces) run goes in its own child
process, so one run's memory cannot hide in another's, and samples the
process's resident set (VmRSS from /proc/self/status) every --sample steps; the
first --warmup steps (default 10 %, at least 200) are left out of the fit. The
table gives RSS after warm-up, at the end, and the least-squares slope in MB per
1000 steps (flat reads below ~0.1 MB per 1000 steps here, CPU and H200).
`--before PATH` also runs each case with another checkout of the package first
on `sys.path` (e.g. `git worktree add /tmp/before <commit>`): a before/after table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import _common as cm
import numpy as np

PATHS = ("ffi", "callback")
FORCES = ("op forces", "jax.grad")
MASS_AR = 39.948 * 1.0364269e-4  # argon, eV fs^2 / A^2
DT = 1.0  # fs


def _rss_mb() -> float:
    """This process's resident set size in MB (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS line in /proc/self/status (Linux only)")


def _slope(steps: list[int], rss: list[float]) -> float:
    """Least-squares slope of RSS against step, in MB per 1000 steps."""
    if len(steps) < 2:
        return float("nan")
    return 1000.0 * float(np.polyfit(np.asarray(steps, float), np.asarray(rss, float), 1)[0])


def soak(path: str, forces: str, *, steps: int, warmup: int, sample: int, cells: int) -> dict[str, float]:
    """Run the loop in this process; returns RSS after warm-up, at the end, the slope and the step time."""
    import jax
    import jax.numpy as jnp
    import torch

    import nvalchemi_jaxbridge.demo.torch_ops  # noqa: F401 - registers jaxbridge_demo::
    from nvalchemi_jaxbridge.demo import argon_fcc
    from nvalchemi_jaxbridge.kernels import TorchOpKernel

    k = TorchOpKernel(torch.ops.jaxbridge_demo.lj_energy_forces.default, call_path=path)
    system = argon_fcc(cells)
    pos0 = jnp.asarray(system.positions, jnp.float64)
    mask = jnp.ones(len(pos0), bool)

    def force(p):
        if forces == "op forces":
            return k(p, mask)[1]
        return -jax.grad(lambda q: k(q, mask)[0])(p)

    @jax.jit
    def step(p, v, f):
        v = v + 0.5 * DT * f / MASS_AR
        p = p + DT * v
        f = force(p)
        return p, v + 0.5 * DT * f / MASS_AR, f

    state = (pos0, jnp.zeros_like(pos0), force(pos0))
    xs, ys = [], []
    rss_warm = float("nan")
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        state = jax.block_until_ready(step(*state))  # as an MD loop that reads each step's results
        if i % sample == 0 or i == warmup:
            rss = _rss_mb()
            if i == warmup:
                rss_warm = rss
                t0 = time.perf_counter()
            if i >= warmup:
                xs.append(i)
                ys.append(rss)
    jax.block_until_ready(state)
    per_step = (time.perf_counter() - t0) / max(1, steps - warmup)
    if not bool(jnp.all(jnp.isfinite(state[0]))):
        raise RuntimeError(f"{path}/{forces}: positions went non-finite; lower DT")
    return {"rss_warm": rss_warm, "rss_end": _rss_mb(), "slope": _slope(xs, ys), "step_s": per_step}


def _child(a) -> int:
    """The --child mode: one soak, its result as one JSON line on stdout."""
    cm.setup(a.platform, cpu_devices=1)
    res = soak(a.path, a.forces, steps=a.steps, warmup=a.warmup, sample=a.sample, cells=a.cells)
    print("SOAK " + json.dumps(res), flush=True)
    return 0


def _run_child(a, path: str, forces: str, package_root: str | None) -> dict[str, float]:
    """One soak in a fresh process (with `package_root` first on sys.path when given)."""
    env = dict(os.environ)
    roots = [package_root] if package_root else []
    env["PYTHONPATH"] = os.pathsep.join([*roots, str(cm.ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, __file__, "--child", "--platform", a.platform, "--path", path, "--forces", forces,
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--sample", str(a.sample), "--cells", str(a.cells)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.child_timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SOAK ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"{path}/{forces}: the soak process exited {proc.returncode}:\n{tail}")
    return json.loads(lines[-1][len("SOAK "):])


def main(argv: list[str] | None = None) -> int:
    p = cm.base_parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="MD steps per run (default 10000; smoke 300)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the fit (default 10 %%, >= 200)")
    p.add_argument("--sample", type=int, default=50, help="read RSS every this many steps")
    p.add_argument("--cells", type=int, default=3, help="fcc cells per side (4 atoms each)")
    p.add_argument("--before", default=None, help="another checkout's root: its package is run too (before/after)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"call paths to soak, comma list of {', '.join(PATHS)}")
    p.add_argument("--child-timeout-s", type=float, default=1800.0)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one soak, run by the parent
    p.add_argument("--path", choices=PATHS, default="ffi", help=argparse.SUPPRESS)
    p.add_argument("--forces", choices=FORCES, default="op forces", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.steps = a.steps or (300 if a.smoke else 10000)
    a.warmup = a.warmup or max(min(200, a.steps // 2), a.steps // 10)
    a.sample = max(1, min(a.sample, a.steps // 4))
    if a.child:
        return _child(a)
    a.platform = cm.setup(a.platform, cpu_devices=1)
    settings = {
        "system": f"fcc argon, {4 * a.cells ** 3} atoms, LJ dense block, float64, one {a.platform.upper()} device",
        "steps": f"{a.steps} (fit from step {a.warmup}; RSS every {a.sample} steps; one process per run)",
        "note": "RSS is the whole process (Python, JAX, torch); slope = least squares over the samples",
    }
    rep = cm.Report("ffi_soak", "Torch call-path memory soak (RSS over MD steps)", a.out, cm.context(a.platform),
                    settings)
    rows = rep.table("RSS over the loop", ["package", "path", "forces", "steps", "RSS after warm-up (MB)",
                                           "RSS at end (MB)", "slope (MB / 1000 steps)", "step (ms)"])
    packages = [("before", a.before), ("this checkout", None)] if a.before else [("this checkout", None)]
    paths = [x for x in a.paths.split(",") if x]
    if bad := sorted(set(paths) - set(PATHS)):
        raise SystemExit(f"ffi_soak: unknown --paths {bad}; choose from {', '.join(PATHS)}.")
    for label, root in packages:
        for path in paths:
            for forces in FORCES:
                with rep.section(f"{label} {path} {forces}"):
                    r = _run_child(a, path, forces, root)
                    rep.row(rows, [label, path, forces, a.steps, f"{r['rss_warm']:.1f}", f"{r['rss_end']:.1f}",
                                   f"{r['slope']:+.3f}", f"{1e3 * r['step_s']:.3g}"])
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
