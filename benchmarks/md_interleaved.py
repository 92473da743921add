"""MD steps on one device, native torch and the bridge taking turns (steady ratios on a noisy machine).

    PYTHONPATH=. python3 benchmarks/md_interleaved.py --out OUTDIR [--cells 14,22,35]
        [--kernels torch-cells,triton] [--rounds 20] [--steps 20] [--label after] [--smoke]

The steps are `md_step.py`'s velocity Verlet on LJ argon (8.5 A cutoff, skin 1 A, headroom 1.0;
native: the torch op on the one-device halo rows, `index_add_` fold, Verlet in torch; bridge: one
jitted program per step). `md_step.py` and `md_breakdown.py` time each run in a block of its own,
and blocks drifted on the GPU machine by more than the 0-10 % looked for at 10^4 atoms. Here
every round runs, in turns, one synchronised step of each side, then a pipelined block of
`--steps` steps of each side (issued back to back, one synchronisation at the end: what an MD
loop does), and the medians over the rounds give the ratios. A third run, "bridge loop", issues
the same `--steps` steps as one program (`lax.fori_loop` over the step: one dispatch per block, as
JAX MD codes run), its own trajectory from the same start. The first-step forces of the bridge
are checked against native's (a mismatch stops the run), and the loop's positions after one
block against as many steps of the step program.
"""

from __future__ import annotations

import sys

import _common as cm
import md_breakdown
import md_step
import numpy as np

CELLS = [14, 22, 35]  # 10976, 42592 and 171500 argon atoms


def check_loop(b_step, info: dict, loop, steps: int) -> float:
    """Max |dx| (A) between one block of the loop and `steps` calls of the step program, both from the start."""
    for _ in range(steps):
        b_step()
    x_steps = np.asarray(info["args"]()[1])
    x_loop = np.asarray(loop[0]())
    return float(np.abs(x_loop - x_steps).max())


def looped(info: dict, steps: int):
    """`(run, sync)`: `steps` of the bridge's step program as one jitted `lax.fori_loop`, its own state."""
    import jax

    prog = info["program"]
    cs, x, v, f, q = info["args"]()

    @jax.jit
    def loop(cs, x, v, f, q):
        def body(_, c):
            return prog(cs, *c, q)[:3]

        return jax.lax.fori_loop(0, steps, body, (x, v, f))

    state = [x, v, f]

    def run():
        state[:] = loop(cs, *state, q)
        return state[0]

    return run, jax.block_until_ready


def main(argv: list[str] | None = None) -> int:
    p = cm.base_parser(__doc__.splitlines()[0])
    md_breakdown.add_md_args(p, CELLS)
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 20, smoke 2)")
    p.add_argument("--steps", type=int, default=None, help="steps per pipelined block (default 20, smoke 2)")
    p.add_argument("--label", default="", help="a tag for the rows (e.g. the version measured)")
    a = p.parse_args(argv)
    platform = cm.setup(a.platform)
    import jax
    import torch

    cells, kernels = md_breakdown.md_choices(a, CELLS, "md_interleaved")
    rounds = a.rounds or (2 if a.smoke else 20)
    steps = a.steps or (2 if a.smoke else 20)
    dev = torch.device("cuda", 0) if platform == "gpu" else torch.device("cpu")
    torch_sync = (lambda _: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda _: None)
    settings = {"dtype": a.dtype, "cutoff": f"{md_step.SMOKE_CUTOFF} A (smoke)" if a.smoke else "8.5 A",
                "plan": f"HaloPlan headroom 1.0, skin {a.skin} A, built once",
                "timing": (f"median of {rounds} rounds after 2 warm-up rounds; each round, in turns: one step of "
                           f"each side followed by a synchronisation, then {steps} steps of each side back to back "
                           "and one synchronisation (wall clock)"),
                "label": a.label or "-"}
    rep = cm.Report("md_interleaved", "MD step, native and bridge in turns, one device", a.out,
                    cm.context(platform), settings)
    rows = rep.table("Per step", ["label", "kernel", "atoms", "native synced ms", "bridge synced ms",
                                  "bridge/native (synced)", "native pipelined ms", "bridge pipelined ms",
                                  "bridge/native (pipelined)", f"bridge loop ms ({steps} steps per program)",
                                  "bridge loop/native", "max |dF| / max |F| first step; loop max |dx| (A)"])
    for kernel in kernels:
        for c in cells:
            case = md_step.make_case("lj", kernel, c, md_step.SMOKE_CUTOFF if a.smoke else None)
            with rep.section(f"{kernel}/{case.n} atoms"):
                t_step, f_nat, _, _ = md_step.torch_stepper(case, a.dtype, dev, a.skin)
                b_step, f_br, _, b_info = md_step.bridge_stepper(case, 1, a.dtype, a.skin)
                loop = looped(b_info, steps)
                loop_err = check_loop(b_step, b_info, loop, steps)
                if loop_err > (1e-3 if a.dtype == "float32" else 1e-9):
                    raise AssertionError(f"{kernel}, {case.n} atoms: {steps} looped steps move atoms {loop_err:.1e} A "
                                         "away from as many step calls")
                f_nat = f_nat.double().cpu().numpy()
                err = float(np.abs(f_br - f_nat).max() / max(np.abs(f_nat).max(), 1e-30))
                if err > (1e-4 if a.dtype == "float32" else 1e-10):
                    raise AssertionError(f"{kernel}, {case.n} atoms: first-step forces differ by {err:.1e}")
                runs = {"native": (t_step, torch_sync), "bridge": (b_step, jax.block_until_ready),
                        "native block": cm.pipelined(t_step, torch_sync, steps),
                        "bridge block": cm.pipelined(b_step, jax.block_until_ready, steps), "bridge loop": loop}
                t = {k: cm.med(v) for k, v in cm.time_interleaved(runs, warmup=2, iters=rounds).items()}
                tn, tb = t["native"], t["bridge"]
                pn, pb, pl = t["native block"] / steps, t["bridge block"] / steps, t["bridge loop"] / steps
                rep.row(rows, [a.label or "-", kernel, case.n, cm.ms(tn), cm.ms(tb), f"{tn / tb:.3f}x",
                               cm.ms(pn), cm.ms(pb), f"{pn / pb:.3f}x", cm.ms(pl), f"{pn / pl:.3f}x",
                               f"{err:.1e}, {loop_err:.1e}"])
                del runs, t_step, b_step
    rep.note("bridge/native > 1: the bridge is faster. Issue 15's target: >= 1.0x from 10^4 atoms.")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
