"""The library's MD driver, `mlip.dynamics.nve`, on one device: wall time per step of whole runs.

    PYTHONPATH=. python3 benchmarks/nve_steps.py --out OUTDIR [--sizes 7,14] [--dtype float64] [--steps 200]
        [--check-every 10] [--runs 3] [--label after] [--smoke]

The model is the project's plain-torch MPNN (`mlip.MPNN`, 3 layers, cutoff 4 A, 16 features) through
`DistributedMLIP(MPNNWrapper(model), n_devices=1, skin=1.0)` on rattled fcc Cu/Au (reps^3 x 4
atoms) at 300 K, velocity Verlet at 1 fs. A run is one `nve(..., steps, check_every)` call: every
`check_every` steps the driver brings the positions to the host, checks the skin and records the
energies, as a user's run does. After one warm-up run (compilation), `--runs` runs are timed;
the table gives the median wall time per step, the XLA compilations each timed run still made (count
and seconds, from JAX's compile events) and the time per step without them, the layouts built and
the total-energy drift of the last run (NVE keeps it: a broken driver shows here). `--label` tags the rows, so runs of two
versions of the package (each from its own checkout) can share one table: a before/after of a
change to the driver.
"""

from __future__ import annotations

import sys
import time

import _common as cm


def main(argv: list[str] | None = None) -> int:
    p = cm.base_parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default=None, help="fcc reps per axis, comma list (default 7,14; smoke 3)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 200, smoke 10)")
    p.add_argument("--check-every", type=int, default=10, help="steps between the driver's checks (default 10)")
    p.add_argument("--runs", type=int, default=None, help="timed runs (default 3, smoke 1)")
    p.add_argument("--label", default="", help="a tag for the rows (e.g. the version measured)")
    a = p.parse_args(argv)
    platform = cm.setup(a.platform)
    import torch

    from nvalchemi_jaxbridge.demo.systems import maxwell_boltzmann
    from nvalchemi_jaxbridge.mlip import MPNN, DistributedMLIP, MPNNWrapper
    from nvalchemi_jaxbridge.mlip.dynamics import nve
    from tests.compile_events import backend_compiles
    from tests.mlip._reference import alloy

    dev = torch.device("cuda", 0) if platform == "gpu" else torch.device("cpu")
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else ([3] if a.smoke else [7, 14])
    steps, runs = a.steps or (10 if a.smoke else 200), a.runs or (1 if a.smoke else 3)
    settings = {"model": f"MPNN (3 layers, cutoff 4 A, 16 features), {a.dtype}",
                "run": f"nve(steps={steps}, dt=1 fs, check_every={a.check_every}), DistributedMLIP(n_devices=1, "
                       "skin=1.0), 300 K",
                "timing": f"median of {runs} runs after one warm-up run, wall clock of the whole call",
                "label": a.label or "-"}
    rep = cm.Report("nve_steps", "The MD driver nve on one device: time per step", a.out, cm.context(platform),
                    settings)
    rows = rep.table("nve runs", ["label", "atoms", "steps", "check every", "ms per step", "compiles per run (s)",
                                  "ms per step without compiles", "layouts built", "|E_tot drift| / atom (eV)"])
    model = MPNN([29, 79], cutoff=4.0, dtype=getattr(torch, a.dtype)).to(dev)
    bridge = DistributedMLIP(MPNNWrapper(model), n_devices=1, skin=1.0)
    for reps in sizes:
        with rep.section(f"{reps}"):
            atoms = alloy(reps=(reps,) * 3)
            masses = atoms.get_masses()
            v = maxwell_boltzmann(masses, 300.0, seed=1)

            def run():
                return nve(bridge, atoms.positions, v, masses, atoms.numbers, atoms.cell.array, atoms.pbc,
                           steps=steps, dt=1.0, check_every=a.check_every)

            run()  # compiles the chunk programs
            walls, compiled, out = [], [], None
            for _ in range(runs):
                with backend_compiles() as seen:
                    t0 = time.perf_counter()
                    out = run()
                    walls.append(time.perf_counter() - t0)
                compiled.append(seen)
            total = {k: out["energy"][k] + out["kinetic"][k] for k in out["energy"]}
            drift = abs(total[max(total)] - total[0]) / len(atoms)
            n_comp = cm.med([len(c) for c in compiled])
            s_comp = cm.med([sum(c) for c in compiled])
            rest = cm.med([w - sum(c) for w, c in zip(walls, compiled)])
            rep.row(rows, [a.label or "-", len(atoms), steps, a.check_every, cm.ms(cm.med(walls) / steps),
                           f"{n_comp:g} ({s_comp:.2f})", cm.ms(rest / steps), out["rebuilds"], f"{drift:.1e}"])
    rep.note("drift: |E_tot(last check) - E_tot(0)| per atom, E_tot = potential + kinetic energy (eV).")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
