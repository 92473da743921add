"""Per-layer exchange against the deep halo: rows per device and time per energy + forces, side by side.

For each model (the project's MPNN, a random MACE) and device count, one system
is evaluated with a halo of one cutoff (+ skin, refresh between layers) and with
a halo of n_layers cutoffs (the model as one op); the table gives the largest
block per device (owned + ghost rows), its edges, the median time of one jitted
energy + forces + stress program, and the ratio deep / per-layer from the same run.

    PYTHONPATH=. python3 benchmarks/mlip_exchange.py --platform cpu --out /tmp/bench [--smoke]
"""

from __future__ import annotations

import time

import _common as cm


def _median_s(fn, *, warmup: int = 1, iters: int = 3) -> float:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> int:
    p = cm.base_parser(__doc__.splitlines()[0])
    p.add_argument("--devices", default="2,4,8", help="device counts (comma-separated)")
    p.add_argument("--reps", type=int, default=5, help="fcc cells per edge (4 atoms each)")
    args = p.parse_args()
    platform = cm.setup(args.platform)
    import numpy as np

    from nvalchemi_jaxbridge.mlip import MPNN, DistributedMLIP, MPNNWrapper
    from tests.mlip._reference import alloy

    reps = 3 if args.smoke else args.reps
    devices = [2] if args.smoke else [int(d) for d in args.devices.split(",")]
    atoms = alloy((reps,) * 3, triclinic=True)
    models = {"mpnn": MPNNWrapper(MPNN([29, 79], cutoff=4.0))}
    try:
        from nvalchemi_jaxbridge.mlip.mace import MACEWrapper, random_mace

        models["mace"] = MACEWrapper(random_mace([29, 79]))
    except ImportError:
        pass
    report = cm.Report("mlip_exchange", "Per-layer exchange vs deep halo (model level, JAX front door)", args.out,
                       cm.context(platform), {"system": f"{len(atoms)} atoms, rattled triclinic fcc Cu/Au",
                                              "dtype": "float64", "skin": "0.5 A", "repeats": "median of 3"})
    cols = ["model", "devices", "exchange", "max rows/device", "max edges/device", "ms per E+F+stress",
            "deep / per-layer", "max |dF| vs per-layer"]
    with report.section("per-layer exchange vs deep halo"):
        table = report.table("one jitted energy + forces + stress program", cols)
        for name, wrapper in models.items():
            for d in devices:
                times, forces = {}, {}
                for exchange in ("per_layer", "deep_halo"):
                    dm = DistributedMLIP(wrapper, n_devices=d, exchange=exchange)
                    state = dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
                    x = state.cs.owned(atoms.positions, positions=True)
                    times[exchange] = _median_s(lambda: dm.energy_and_gradients(state, x),
                                                iters=1 if args.smoke else 3)
                    forces[exchange] = state.cs.to_global(dm.energy_and_gradients(state, x)[2])
                    rows = state.rows_per_device()
                    deep = exchange == "deep_halo"
                    report.row(table, [
                        name, d, exchange, max(r["owned"] + r["ghost"] for r in rows), max(r["edges"] for r in rows),
                        f"{1e3 * times[exchange]:.0f}", f"{times['deep_halo'] / times['per_layer']:.2f}" if deep else "",
                        f"{np.abs(forces[exchange] - forces['per_layer']).max():.1e}" if deep else ""])
    return report.finish()


if __name__ == "__main__":
    raise SystemExit(main())
