"""Tiles on one GPU: MACE energy + forces through `DistributedMLIP(tiles=T)` against native MACE, and past native's size.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python scripts/gpu_tiles.py [--cases 14:1,14:4,24:1,24:8,40:32]
        [--dtype float32] [--rounds 2]

Each case is `reps:tiles` (rattled fcc Cu/Au of 4 reps^3 atoms, a = 3.75 Å). The model is the benchmarks' MACE:
random ScaleShiftMACE, 2 layers, r_max 5 Å, hidden 64x0e + 64x1o, max_ell 3, correlation 3, e3nn with TorchScript.
For each case: the host layout time (prepare), the first call (compilation included), the median of `--rounds`
timed calls, torch's peak memory in the call (the tiles' intermediates) and JAX's bytes in use, and, where native
MACE fits (`--native-max` atoms), native's time, peak memory and the parity of energy and forces. A markdown row
is printed as soon as a case ends, so a run stopped by a time limit keeps what it measured. Exits 1 on a parity
miss.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def build_mace(dtype):
    import e3nn

    from nvalchemi_jaxbridge.mlip.mace import random_mace

    old = e3nn.get_optimization_defaults()["jit_script_fx"]
    e3nn.set_optimization_defaults(jit_script_fx=True)
    try:
        return random_mace((29, 79), r_max=5.0, num_interactions=2, correlation=3, hidden_irreps="64x0e + 64x1o",
                           max_ell=3, num_bessel=8, mlp_irreps="16x0e", radial_mlp=(64, 64, 64), seed=0, dtype=dtype)
    finally:
        e3nn.set_optimization_defaults(jit_script_fx=old)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="14:1,14:4,24:1,24:8,40:32")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--native-max", type=int, default=60000, help="run native MACE up to this many atoms")
    p.add_argument("--cuda-graphs", default="false", choices=["auto", "true", "false"],
                   help="the bridge's cuda_graphs= (default off: these sizes are device-bound, and each recording "
                        "keeps a memory pool of a tile's size)")
    a = p.parse_args(argv)
    import jax
    import torch

    from nvalchemi_jaxbridge.mlip import DistributedMLIP
    from nvalchemi_jaxbridge.mlip.mace import MACEWrapper, mace_input
    from tests.mlip._reference import alloy

    gpu = jax.default_backend() == "gpu"
    graphs = {"auto": "auto", "true": True, "false": False}[a.cuda_graphs]
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    tdt = getattr(torch, a.dtype)
    model = build_mace(tdt).to(dev)
    name = torch.cuda.get_device_name(0) if gpu else platform.processor()
    print(f"# tiles on one device: {name}; jax {jax.__version__}, torch {torch.__version__}, python "
          f"{platform.python_version()}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; {a.dtype}",
          flush=True)
    print("| atoms | tiles | rows per tile (max) | edges per tile (max) | layout s | first call s | E+F s | "
          "torch peak GiB | JAX in use GiB | native E+F s | native peak GiB | bridge/native time | dE/E, max dF |",
          flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    models: dict[int, DistributedMLIP] = {}
    bad = 0
    for case in a.cases.split(","):
        reps, tiles = (int(x) for x in case.split(":"))
        atoms = alloy(reps=(reps,) * 3, species=(29, 79))
        n = len(atoms)
        try:
            dm = models.setdefault(tiles, DistributedMLIP(MACEWrapper(model), n_devices=1, exchange="deep_halo",
                                                          skin=0.0, headroom=1.0, tiles=tiles,
                                                          cuda_graphs=graphs))
            t0 = time.perf_counter()
            state = dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
            t_layout = time.perf_counter() - t0
            pos = state.cs.owned(np.asarray(atoms.positions).astype(a.dtype), positions=True)

            def call():
                return jax.block_until_ready(dm.energy_and_gradients(state, pos, strain=False))

            if gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            energy, _, g_pos, _ = call()
            t_first = time.perf_counter() - t0
            times = []
            for _ in range(a.rounds):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            t_call = float(np.median(times))
            peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else float("nan")
            in_use = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use", 0) / 2**30 if gpu else float("nan")
            r = state.rows_per_device()[0]
            t_rows, t_edges = r.get("tile_rows", r["owned"] + r["ghost"]), r.get("tile_edges", r["edges"])
            native = ["-", "-", "-", "-"]
            if n <= a.native_max:
                batch = mace_input(model, atoms, dtype=tdt, device=dev)
                if gpu:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                out = model(batch, training=False, compute_force=True)
                nt = []
                for _ in range(a.rounds):
                    t0 = time.perf_counter()
                    model(batch, training=False, compute_force=True)
                    if gpu:
                        torch.cuda.synchronize()
                    nt.append(time.perf_counter() - t0)
                n_peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else float("nan")
                f_nat = out["forces"].detach().double().cpu().numpy()
                f_br = -np.asarray(state.cs.to_global(g_pos), dtype=np.float64)
                de = abs(float(energy) - float(out["energy"][0])) / abs(float(out["energy"][0]))
                df = float(np.abs(f_br - f_nat).max())
                ok = de < (3e-4 if a.dtype == "float32" else 1e-10) and df < (2e-3 if a.dtype == "float32" else 1e-8)
                bad += not ok
                native = [f"{np.median(nt):.3f}", f"{n_peak:.2f}", f"{t_call / np.median(nt):.2f}",
                          f"{de:.1e}, {df:.1e}" + ("" if ok else " MISMATCH")]
                del out, batch
            print(f"| {n:,} | {tiles} | {t_rows:,} | {t_edges:,} | {t_layout:.1f} | {t_first:.1f} | {t_call:.3f} | "
                  f"{peak:.2f} | {in_use:.2f} | " + " | ".join(native) + " |", flush=True)
            del state, pos
        except Exception as e:  # one case's failure (e.g. out of memory) is reported, the next runs
            print(f"| {n:,} | {tiles} | FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]} |", flush=True)
            bad += 1
        if gpu:
            torch.cuda.empty_cache()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
