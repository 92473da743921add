"""MLIP MD step: MACE's velocity Verlet step through the library's driver against a native torch loop (issue 31).

Native: a torch velocity Verlet loop around `model(batch, compute_force=True)` on MACE's own batch (neighbour
list built once: the run is short, atoms move far less than a skin). Bridge: `mlip.dynamics.nve` through
`DistributedMLIP(MACEWrapper(model), n_devices=1)` (defaults: skin 0.5 A, headroom 1.2; the steps between
two checks as one program). Same model, start, time step (1 fs) and number of steps; the two runs take
turns; per step = wall time of a whole run / steps (both include the first force call). The final positions
are checked against each other. On a GPU the device busy time of one native E+F (`torch.profiler`) gives
what a step could take at best.
"""

from __future__ import annotations

import numpy as np

from benchmarks import common as cm
from benchmarks.mlip import atoms_of, build_model


def run(rep: cm.Report, opt) -> None:
    import torch

    from nvalchemi_jaxbridge.demo.systems import maxwell_boltzmann
    from nvalchemi_jaxbridge.demo.units import MVV2E
    from nvalchemi_jaxbridge.mlip import DistributedMLIP
    from nvalchemi_jaxbridge.mlip.dynamics import nve
    from nvalchemi_jaxbridge.mlip.mace import MACEWrapper, mace_input

    gpu = opt.platform == "gpu"
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    sizes = [n for n in opt.sizes_for("mlip", [32] if opt.smoke else [108, 1372]) if n <= 2000]
    dtype = opt.dtypes_or(["float32"])[0]
    steps, rounds, check = opt.steps or (2 if opt.smoke else 50), opt.repeats_or(3, 1), 1 if opt.smoke else 10
    rep.setting("MACE MD step", f"{steps} steps of 1 fs at 300 K, {dtype}, e3nn; nve(check_every={check}) vs a torch "
                f"Verlet loop; median of {rounds} runs of each in turns after one warm-up run")
    table = rep.table("MACE MD step: nve through the bridge against a native torch Verlet loop", [
        "dtype", "atoms", "steps", "native loop ms/step", "nve ms/step", "native/nve", "native E+F GPU busy ms",
        "nve step / GPU busy", "final max |dx| (A)"])
    model = build_model(dtype, "e3nn", dev, opt.smoke)
    bridge = DistributedMLIP(MACEWrapper(model), n_devices=1)
    results = []
    for n in sizes:
        if rep.time_left() < 0:
            rep.note(f"MACE MD step: {n} atoms and larger not run (budget spent).")
            break
        with rep.section(f"MACE MD step, {n} atoms"):
            atoms = atoms_of(n)
            masses = atoms.get_masses()
            v0 = maxwell_boltzmann(masses, 300.0, seed=1)
            batch = mace_input(model, atoms, dtype=getattr(torch, dtype), device=dev)
            tdt = getattr(torch, dtype)
            inv_m = (1.0 / (MVV2E * torch.as_tensor(masses, dtype=tdt, device=dev)))[:, None]
            x0, v0_t = batch["positions"].detach().clone(), torch.as_tensor(v0, dtype=tdt, device=dev)

            def forces(x):
                return model({**batch, "positions": x}, training=False, compute_force=True)["forces"].detach()

            def native():
                x, v = x0.clone(), v0_t.clone()
                f = forces(x)
                for _ in range(steps):
                    v = v + 0.5 * f * inv_m
                    x = x + v
                    f = forces(x)
                    v = v + 0.5 * f * inv_m
                return x

            def bridged():
                return nve(bridge, atoms.positions, v0, masses, atoms.numbers, atoms.cell.array, atoms.pbc,
                           steps=steps, dt=1.0, check_every=check)["positions"][steps]

            t = cm.medians({"native": (native, cm.torch_sync(dev)), "nve": (bridged, lambda _: None)},
                           warmup=1, iters=rounds)
            dx = float(np.abs(native().detach().double().cpu().numpy() - bridged()).max())
            busy = cm.profile(lambda: forces(x0), cm.torch_sync(dev), 3)["busy_total"] if gpu else float("nan")
            tn, tb = t["native"] / steps, t["nve"] / steps
            table.add(dtype, len(atoms), steps, cm.ms(tn), cm.ms(tb), cm.ratio(tn, tb), cm.ms(busy), cm.ratio(tb, busy),
                      f"{dx:.1e}")
            if dx > (1e-3 if dtype == "float32" else 1e-8):
                rep.fail(f"MACE MD step, {len(atoms)} atoms: nve and the torch loop end {dx:.1e} A apart")
            results.append((len(atoms), tn / tb, tb / busy))
    for (lo, hi, want) in ((100, 200, 5.0), (1000, 2000, 1.5)):
        for n, speed, over_busy in (r for r in results if lo <= r[0] < hi):
            rep.target(f"MACE MD step (nve) at {n} atoms within 1.2x of one E+F's GPU-busy time, >= {want:g}x a "
                       "native eager Verlet loop (issue 31)", f"{over_busy:.2f}x busy, {speed:.2f}x native",
                       None if over_busy != over_busy else (over_busy <= 1.2 and speed >= want))
