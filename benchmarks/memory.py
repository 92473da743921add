"""Memory: host RSS over a long loop of one op's calls, on both call paths (the main job's soak: soak.py).

Call loop: one velocity Verlet step per call of a jitted program on one device, the demo LJ op (fcc argon,
   dense block, float64) through `TorchOpKernel(call_path=...)`, forces returned by the op ("op forces") or as
   -dE/dR by `jax.grad` (the differentiated forward keeps the op's torch graph for the backward). Each run
in a process of its own (`python -m benchmarks.memory loop ...`); RSS (VmRSS) sampled every few steps; the
table gives RSS after warm-up, at the end and the least-squares slope (flat reads below ~0.1 MB per 1000
steps, CPU and H200).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks import common as cm  # noqa: E402
from benchmarks import soak as job  # noqa: E402

MASS_AR = 39.948 * 1.0364269e-4  # argon, eV fs^2 / A^2
MARK = "SOAK "


def rss_mb() -> float:
    """This process's VmRSS in MB."""
    return job.rss_mb(os.getpid())


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs, per 1000 xs (NaN with fewer than 2 points)."""
    return 1000.0 * float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0]) if len(xs) >= 2 else float("nan")


def call_loop(path: str, forces: str, *, steps: int, warmup: int, sample: int, cells: int = 3) -> dict[str, float]:
    """Run the loop in this process: RSS after warm-up, at the end, the slope, and the step time."""
    import jax
    import jax.numpy as jnp
    import torch

    import nvalchemi_jaxbridge.demo.torch_ops  # noqa: F401 - registers jaxbridge_demo::
    from nvalchemi_jaxbridge.demo import argon_fcc
    from nvalchemi_jaxbridge.kernels import TorchOpKernel

    k = TorchOpKernel(torch.ops.jaxbridge_demo.lj_energy_forces.default, call_path=path)
    pos0 = jnp.asarray(argon_fcc(cells).positions, jnp.float64)
    mask = jnp.ones(len(pos0), bool)

    def force(p):
        return k(p, mask)[1] if forces == "op forces" else -jax.grad(lambda q: k(q, mask)[0])(p)

    @jax.jit
    def step(p, v, f):
        v = v + 0.5 * f / MASS_AR
        p = p + v
        f = force(p)
        return p, v + 0.5 * f / MASS_AR, f

    state, xs, ys, rss_warm, t0 = (pos0, jnp.zeros_like(pos0), force(pos0)), [], [], float("nan"), time.perf_counter()
    for i in range(1, steps + 1):
        state = jax.block_until_ready(step(*state))  # as an MD loop that reads each step's results
        if i % sample == 0 or i == warmup:
            if i == warmup:
                rss_warm, t0 = rss_mb(), time.perf_counter()
            if i >= warmup:
                xs.append(i)
                ys.append(rss_mb())
    if not bool(jnp.all(jnp.isfinite(state[0]))):
        raise RuntimeError(f"{path}/{forces}: positions went non-finite")
    return {"rss_warm": rss_warm, "rss_end": rss_mb(), "slope": slope(xs, ys),
            "step_s": (time.perf_counter() - t0) / max(1, steps - warmup)}


def _loop_child(platform: str, path: str, forces: str, steps: int, warmup: int, sample: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(cm.ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "benchmarks.memory", "loop", platform, path, forces, str(steps), str(warmup), str(sample)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(MARK)]
    if p.returncode or not lines:
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"{path}/{forces}: the loop's process exited {p.returncode}:\n{tail}")
    return json.loads(lines[-1][len(MARK):])


def run(rep: cm.Report, opt) -> None:
    steps = opt.steps or (60 if opt.smoke else 1000)
    warmup, sample = max(min(200, steps // 2), steps // 10), max(1, min(50, steps // 4))
    rep.setting("call loop", f"fcc argon, 108 atoms, LJ dense block, float64, one device; {steps} steps, fit from "
                f"step {warmup}, RSS every {sample} steps" + ("; smoke: in this process" if opt.smoke else
                                                                "; one process per run"))
    table = rep.table("Host RSS over a loop of jitted MD steps calling a torch op",
                      ["path", "forces", "steps", "RSS after warm-up (MB)", "RSS at end (MB)",
                       "slope (MB / 1000 steps)", "step (ms)"])
    worst = 0.0
    for path in ("ffi", "callback"):
        for forces in ("op forces", "jax.grad"):
            if rep.time_left() < 0:
                rep.note(f"Call loop: {path} / {forces} not run (budget spent).")
                continue
            with rep.section(f"call loop {path} {forces}"):
                r = (call_loop(path, forces, steps=steps, warmup=warmup, sample=sample) if opt.smoke
                     else _loop_child(opt.platform, path, forces, steps, warmup, sample))
                table.add(path, forces, steps, f"{r['rss_warm']:.1f}", f"{r['rss_end']:.1f}", f"{r['slope']:+.3f}",
                          f"{1e3 * r['step_s']:.3g}")
                worst = max(worst, r["rss_end"] - r["rss_warm"])
    if not opt.smoke:
        rep.target("torch call paths: RSS flat over a long loop, within 50 MB after warm-up (issue 14)",
                   f"largest growth {worst:.1f} MB over {steps - warmup} steps", worst <= 50)


if __name__ == "__main__" and sys.argv[1:2] == ["loop"]:
    platform, path, forces, steps, warmup, sample = sys.argv[2:8]
    cm.setup(platform, cpu_devices=1)
    res = call_loop(path, forces, steps=int(steps), warmup=int(warmup), sample=int(sample))
    print(MARK + json.dumps(res), flush=True)
