"""Exchange at the model level: per-layer exchange against the deep halo, rows per device and time per E+F.

Each model (the project's MPNN; a random MACE where mace-torch imports) evaluates one system (rattled
triclinic fcc Cu/Au, float64) on each device count with a halo of one cutoff (+ skin, refreshed between
layers) and with a halo of n_layers cutoffs (the model as one op): the largest block per device, its edges,
the median time of one jitted energy + forces + stress program, the ratio deep / per-layer of the same run,
and the largest force difference between the two (they must agree).
"""

from __future__ import annotations

import numpy as np

from benchmarks import common as cm


def run(rep: cm.Report, opt) -> None:
    import jax

    from nvalchemi_jaxbridge.mlip import MPNN, DistributedMLIP, MPNNWrapper
    from tests.mlip._reference import alloy

    counts = [d for d in (opt.devices or ([2] if opt.smoke else [2, 4, 8])) if 2 <= d <= len(jax.devices())]
    if not counts:
        rep.note(f"Per-layer exchange vs deep halo: not run, it needs 2 or more devices (JAX sees "
                 f"{len(jax.devices())}).")
        return
    reps = 3 if opt.smoke else 5
    dev = "cuda" if opt.platform == "gpu" else "cpu"  # the models live where JAX runs
    atoms = alloy((reps,) * 3, triclinic=True)
    # a smoke run: two layers are enough for a refresh between layers, against a halo of two cutoffs
    models = {"mpnn": MPNNWrapper(MPNN([29, 79], cutoff=4.0, n_layers=2 if opt.smoke else 3).to(dev))}
    try:
        from nvalchemi_jaxbridge.mlip.mace import MACEWrapper, random_mace

        if not opt.smoke:  # the smoke run checks the MPNN alone: MACE's two programs cost more than the rest
            models["mace"] = MACEWrapper(random_mace([29, 79]).to(dev))
    except ImportError:
        rep.note("Per-layer exchange vs deep halo: MACE not run (mace-torch is not importable here).")
    repeats = opt.repeats_or(3, 1)
    rep.setting("model exchanges", f"{len(atoms)} atoms, rattled triclinic fcc Cu/Au, float64, skin 0.5 A; median "
                f"of {repeats} jitted energy + forces + stress calls")
    table = rep.table("Per-layer exchange vs deep halo (model level, JAX front door)",
                      ["model", "devices", "exchange", "max rows/device", "max edges/device", "ms per E+F+stress",
                       "deep / per-layer", "max |dF| vs per-layer (eV/A)"])
    for name, wrapper in models.items():
        for d in counts:
            if rep.time_left() < 0:
                rep.note(f"Per-layer exchange vs deep halo: {name} on {d} devices and later not run (budget spent).")
                return
            with rep.section(f"{name} on {d} devices"):
                times, forces = {}, {}
                for exchange in ("per_layer", "deep_halo"):
                    dm = DistributedMLIP(wrapper, n_devices=d, exchange=exchange)
                    state = dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
                    x = state.cs.owned(atoms.positions, positions=True)
                    call = lambda dm=dm, state=state, x=x: dm.energy_and_gradients(state, x)  # noqa: E731
                    times[exchange] = cm.medians({"": (call, cm.jax_sync)}, warmup=1, iters=repeats)[""]
                    forces[exchange] = state.cs.to_global(np.asarray(call()[2]))
                    rows = state.rows_per_device()
                    deep = exchange == "deep_halo"
                    df = float(np.abs(forces[exchange] - forces["per_layer"]).max())
                    table.add(name, d, exchange, max(r["owned"] + r["ghost"] for r in rows), max(r["edges"] for r in rows),
                              cm.ms(times[exchange]), cm.ratio(times["deep_halo"], times["per_layer"]) if deep else "",
                              f"{df:.1e}" if deep else "")
                    if deep and df > 1e-8:
                        rep.fail(f"{name} on {d} devices: deep halo and per-layer forces differ by {df:.1e} eV/A")
