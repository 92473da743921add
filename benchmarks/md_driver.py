"""MD step through the library's driver: `mlip.dynamics.nve` on one device, wall time per step of whole runs.

The project's plain-torch MPNN (3 layers, cutoff 4 A, 16 features) through `DistributedMLIP(..., n_devices=1,
skin=1.0)` on rattled fcc Cu/Au at 300 K, velocity Verlet at 1 fs. A run is one `nve(..., steps,
check_every=10)` call (the driver brings the positions to the host every 10 steps, checks the skin and
records the energies, as a user's run does). After one warm-up run, the timed runs give the wall time per
step, the XLA compilations each still made (count and seconds, from JAX's compile events: 0 once the driver
keeps its programs), the time per step without them, the layouts built and the total-energy drift of the
last run (NVE keeps it: a broken driver shows here).
"""

from __future__ import annotations

import time

from benchmarks import common as cm


def run(rep: cm.Report, opt) -> None:
    import torch

    from nvalchemi_jaxbridge.demo.systems import maxwell_boltzmann
    from nvalchemi_jaxbridge.mlip import MPNN, DistributedMLIP, MPNNWrapper
    from nvalchemi_jaxbridge.mlip.dynamics import nve
    from tests.compile_events import backend_compiles
    from tests.mlip._reference import alloy

    dev = torch.device("cuda", 0) if opt.platform == "gpu" else torch.device("cpu")
    dtype = opt.dtypes_or(["float64"])[-1]
    steps, runs = opt.steps or (2 if opt.smoke else 200), opt.repeats_or(3, 1)
    check = 1 if opt.smoke else 10  # a smoke run: one chunk length, one program
    rep.setting("MD driver", f"nve(steps={steps}, dt=1 fs, check_every={check}) of the MPNN (3 layers, cutoff 4 A), "
                f"{dtype}, DistributedMLIP(n_devices=1, skin=1.0), 300 K; median of {runs} runs after one warm-up run")
    table = rep.table("The MD driver nve on one device: time per step", [
        "atoms", "steps", "ms per step", "compiles per run (s)", "ms per step without compiles", "layouts built",
        "|E_tot drift| / atom (eV)"])
    model = MPNN([29, 79], cutoff=4.0, dtype=getattr(torch, dtype)).to(dev)
    bridge = DistributedMLIP(MPNNWrapper(model), n_devices=1, skin=1.0)
    for reps in [3] if opt.smoke else [7, 14]:
        if rep.time_left() < 0:
            rep.note(f"MD driver: {4 * reps ** 3} atoms and larger not run (budget spent).")
            break
        with rep.section(f"nve, {4 * reps ** 3} atoms"):
            atoms = alloy(reps=(reps,) * 3)
            masses = atoms.get_masses()
            v = maxwell_boltzmann(masses, 300.0, seed=1)

            def one():
                return nve(bridge, atoms.positions, v, masses, atoms.numbers, atoms.cell.array, atoms.pbc,
                           steps=steps, dt=1.0, check_every=check)

            one()  # compiles the chunk programs
            walls, compiled, out = [], [], None
            for _ in range(runs):
                with backend_compiles() as seen:
                    t0 = time.perf_counter()
                    out = one()
                    walls.append(time.perf_counter() - t0)
                compiled.append(seen)
            total = {k: out["energy"][k] + out["kinetic"][k] for k in out["energy"]}
            drift = abs(total[max(total)] - total[0]) / len(atoms)
            n_comp = cm.med([len(c) for c in compiled])
            rest = cm.med([w - sum(c) for w, c in zip(walls, compiled)])
            table.add(len(atoms), steps, cm.ms(cm.med(walls) / steps), f"{n_comp:g} ({cm.med([sum(c) for c in compiled]):.2f})",
                      cm.ms(rest / steps), out["rebuilds"], f"{drift:.1e}")
            if n_comp or drift > (1e-6 if dtype == "float64" else 1e-3):
                rep.fail(f"nve, {len(atoms)} atoms: a run after the first compiled {n_comp:g} program(s) (want 0), "
                         f"or the total energy drifted {drift:.1e} eV/atom")
