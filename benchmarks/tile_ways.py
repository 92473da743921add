"""Tile ways: per-layer tiles (a prototype, `benchmarks.perlayer`) beside the deep-halo tiles and native MACE.

Issue 30 asked to measure the other way on one size before choosing. At one size (default 55,296 atoms of
the suite's rattled fcc Cu/Au; `--sizes tile-ways=...`) and a few tile counts (default 1,2,4,8;
`--kernels tile-ways=...`), the suite's MACE (`benchmarks.mlip.build_model`, e3nn, float32; a smoke run:
the tests' small MACE in float64, 32 atoms, 2 tiles), three ways of one energy + forces:

- native: `model(batch, compute_force=True)` on MACE's own batch;
- deep halo: `DistributedMLIP(n_devices=1, exchange="deep_halo", tiles=T, skin=0, headroom=1,
  cuda_graphs=False)`, the library's tiles (each with `n_layers x cutoff` of rows it reads);
- per layer: `perlayer.energy_and_forces`, eager torch: the node features of all atoms kept between
  layers, each layer's edge work tile by tile (one cutoff of rows) under checkpoints, recomputed in the
  backward.

For each tile count the three take turns call by call (one warm call each, then `--repeats` rounds,
default 3): the median seconds, and on a GPU torch's peak above what it held before the call (reset before
every call; the largest over the rounds). The rows held over all tiles and the largest tile's rows and
edges say what each way pays for its halo. Parity: each way against native's warm call (energy by the
float64 sums of the node energies, forces), a failure where it is off.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks import common as cm
from benchmarks import perlayer
from benchmarks.mlip import atoms_of, build_model, parity

GPU_SIZE, SMOKE_SIZE = 55296, 32
GPU_TILES, SMOKE_TILES = ("1", "2", "4", "8"), ("2",)
WAYS = ("native", "deep halo", "per layer")


def run(rep: cm.Report, opt) -> None:
    import torch

    from nvalchemi_jaxbridge.mlip.mace import MACEWrapper, mace_input

    gpu = opt.platform == "gpu"
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    for mod in ("mace", "e3nn"):
        rep.ctx[mod] = cm.version(mod)
    sizes = opt.sizes_for("tile-ways", [SMOKE_SIZE if opt.smoke else GPU_SIZE])
    counts = [int(t) for t in opt.kernels_for("tile-ways", SMOKE_TILES if opt.smoke else GPU_TILES,
                                              [str(t) for t in range(1, 1025)])]
    dtype, rounds = opt.dtypes_or(["float64"] if opt.smoke else ["float32"])[0], opt.repeats_or(3, 1)
    rep.setting("tile ways", f"MACE e3nn {dtype}; per tile count: native, deep halo (DistributedMLIP(n_devices=1, "
                "exchange='deep_halo', tiles=T, skin=0, headroom=1, cuda_graphs=False)) and per layer (benchmarks."
                f"perlayer, eager torch, checkpoints) in turns: one warm call each, then {rounds} rounds; median "
                "E+F seconds; peak: torch's above what it held before the call (GPU only)")
    table = rep.table("MACE energy + forces three ways on one device: native, deep-halo tiles, per-layer tiles", [
        "atoms", "tiles", "way", "rows held / atoms", "largest tile rows / edges", "layout s", "first call s",
        "E+F s", "atom-steps/s", "x native time (same rounds)", "peak (torch, one call)",
        "parity dE/E [node sums], max dF (eV/A)"])
    budget = opt.memory_budget or (0.9 * torch.cuda.get_device_properties(dev).total_memory if gpu else None)
    rep.setting("deep halo's memory budget", "the library's default" if budget is None else
                f"{cm.human_bytes(budget)} per device" + ("" if opt.memory_budget else " (90 % of the GPU's memory: "
                                                          "tiles=1 holds what native does)"))
    model = build_model(dtype, "e3nn", dev, opt.smoke)
    for n in sizes:
        with rep.section(f"tile ways, {n} atoms: MACE's batch and the whole graph"):
            t0 = time.perf_counter()
            atoms = atoms_of(n)
            batch = mace_input(model, atoms, dtype=getattr(torch, dtype), device=dev)
            t1 = time.perf_counter()
            whole = perlayer.system(MACEWrapper(model), atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                    dev)
            rep.note(f"{len(atoms):,} atoms: MACE's batch in {t1 - t0:.3g} s, the per-layer way's whole graph "
                     f"({whole.edge_index.shape[1]:,} edges) in {time.perf_counter() - t1:.3g} s (once for all tile "
                     "counts).")
        for t in counts:
            if rep.time_left() < 0:
                rep.note(f"Tile ways: {n} atoms, {t} tiles and after not run (budget spent).")
                return
            with rep.section(f"tile ways, {len(atoms)} atoms, {t} tiles"):
                _one(rep, table, model, dtype, atoms, batch, whole, t, rounds, budget, opt, dev)
            cm.free_memory(gpu)
        del batch, whole


def _one(rep: cm.Report, table: cm.Table, model, dtype: str, atoms, batch, whole, n_tiles: int, rounds: int,
         budget, opt, dev) -> None:
    """One tile count at one size: the three ways in turns, three rows of `table`."""
    import jax
    import torch

    from nvalchemi_jaxbridge.mlip import DistributedMLIP
    from nvalchemi_jaxbridge.mlip.mace import MACEWrapper

    n = len(atoms)
    wrapper = MACEWrapper(model)
    sync = cm.torch_sync(dev)
    info: dict[str, dict] = {w: {} for w in WAYS}

    def native():
        out = model(batch, training=False, compute_force=True)
        return out["energy"][0].detach(), out["node_energy"].detach(), out["forces"].detach()

    info["native"].update(rows=n, largest="-", layout=0.0)

    t0 = time.perf_counter()
    bridge = DistributedMLIP(wrapper, n_devices=1, exchange="deep_halo", tiles=n_tiles, skin=0.0, headroom=1.0,
                             cuda_graphs=False, memory_budget=budget)
    try:
        state = bridge.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    except Exception as e:  # noqa: BLE001 - a refused layout leaves the other two ways
        if not _expected(e):
            raise
        state = None
        info["deep halo"].update(rows=float("nan"), largest="-", error=_said(e))
    info["deep halo"]["layout"] = time.perf_counter() - t0
    pos_jax = None if state is None else state.cs.owned(np.asarray(atoms.positions, np.float64).astype(dtype),
                                                        positions=True)
    if state is not None and state.tiles is None:
        r = state.rows_per_device()[0]
        info["deep halo"].update(rows=r["owned"] + r["ghost"], largest=f"{r['owned'] + r['ghost']:,} / {r['edges']:,}")
    elif state is not None:
        k = int(np.argmax(state.tiles.n_rows[0]))
        info["deep halo"].update(rows=int(state.tiles.n_rows[0].sum()),
                                 largest=f"{int(state.tiles.n_rows[0, k]):,} / {int(state.tiles.n_edges[0].max()):,}")

    def deep_halo():
        return jax.block_until_ready(bridge.energy_and_gradients(state, pos_jax, strain=False))[:3]

    def deep_halo_numbers(out):  # the block's rows in atom order (outside the timed call)
        energy, node_e, g_pos = out
        return energy, state.cs.to_global(node_e), -np.asarray(state.cs.to_global(g_pos), np.float64)

    t0 = time.perf_counter()
    tiles = perlayer.layer_tiles(whole, n_tiles)
    info["per layer"]["layout"] = time.perf_counter() - t0
    c = tiles.counts()
    info["per layer"].update(rows=c["rows"], largest=f"{c['largest_rows']:,} / {c['largest_edges']:,}")
    pos_torch = torch.as_tensor(np.asarray(atoms.positions), dtype=getattr(torch, dtype), device=dev)

    def per_layer():
        return perlayer.energy_and_forces(wrapper, whole, pos_torch, tiles)

    calls = {"native": native, "deep halo": deep_halo, "per layer": per_layer}
    if state is None:
        del calls["deep halo"]
    results, times, peaks = _turns(calls, rounds, sync, dev if opt.platform == "gpu" else None, info)
    if "deep halo" in results:
        results["deep halo"] = deep_halo_numbers(results["deep halo"])
    want = _numbers(results["native"])
    base_t = cm.med(times["native"])
    for way in WAYS:
        got, i = results.get(way), info[way]
        par = "-"
        if way != "native" and got is not None:
            par, ok = parity(*_numbers(got), *want, dtype)
            if not ok:
                rep.fail(f"tile ways, {n} atoms, {n_tiles} tiles: {way} differs from native ({par})")
        elif got is None:
            par = i.get("error", "failed")
        t, peak, rows = cm.med(times[way]), peaks[way], i["rows"]
        table.add(n, n_tiles, way, f"{rows / n:.3f}" if rows == rows else "-", i["largest"], f"{i['layout']:.3g}",
                  f"{i.get('first', float('nan')):.3g}", f"{t:.4g}", f"{n / t:,.0f}" if t == t else "-",
                  cm.ratio(t, base_t) if way != "native" else "1", cm.human_bytes(peak) if peak == peak else "n/a",
                  par)
    del bridge, state, pos_jax, tiles, results


def _turns(calls: dict, rounds: int, sync, gpu_dev, info: dict) -> tuple[dict, dict, dict]:
    """Each call once (warm; its result kept), then `rounds` rounds of one call each: results, seconds and peaks.

    A way that fails (out of memory, a refused layout) is left out of the rounds; its error is kept in `info`."""
    import torch

    results: dict = {}
    live = []
    for way, fn in calls.items():
        try:
            t0 = time.perf_counter()
            results[way] = out = fn()
            sync(out)
            info[way]["first"] = time.perf_counter() - t0
            live.append(way)
        except Exception as e:  # noqa: BLE001 - one way out of memory must not lose the others
            if way == "native" or not _expected(e):
                raise
            info[way]["error"] = _said(e)
            cm.free_memory(gpu_dev is not None)
    times = {way: [] for way in WAYS}
    peaks = {way: float("nan") for way in WAYS}
    for _ in range(rounds):
        for way in live:
            if gpu_dev is not None:
                torch.cuda.synchronize(gpu_dev)
                base = torch.cuda.memory_allocated(gpu_dev)
                torch.cuda.reset_peak_memory_stats(gpu_dev)
            t0 = time.perf_counter()
            sync(calls[way]())
            times[way].append(time.perf_counter() - t0)
            if gpu_dev is not None:
                peak = float(torch.cuda.max_memory_allocated(gpu_dev) - base)
                peaks[way] = peak if peaks[way] != peaks[way] else max(peaks[way], peak)
    return results, times, peaks


def _expected(e: BaseException) -> bool:
    """Out of memory, or a layout refused by the memory budget: recorded in the row, not a failure."""
    from nvalchemi_jaxbridge.layout.budget import LayoutBudgetError

    return cm.is_oom(e) or isinstance(e, LayoutBudgetError)


def _said(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def _numbers(out) -> tuple[float, float, np.ndarray]:
    """(energy, float64 sum of the node energies, forces) of one way's result."""
    energy, node_e, forces = out
    as_np = lambda x: np.asarray(x.double().cpu() if hasattr(x, "double") else x, np.float64)  # noqa: E731
    return float(as_np(energy)), float(as_np(node_e).sum()), as_np(forces)
