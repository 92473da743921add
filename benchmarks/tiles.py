"""Tiles: MACE energy + forces through `DistributedMLIP(tiles="auto")` on one device, past native's memory (issue 30).

The suite's MACE (`benchmarks.mlip.build_model`: random ScaleShiftMACE, 2 layers, r_max 5 A, 64x0e + 64x1o,
max_ell 3, correlation 3, e3nn with TorchScript, float32; `--kernels tiles=cueq`: cuequivariance kernels; a
smoke run: the tests' small MACE in float64) on rattled fcc Cu/Au of 4 n^3 atoms. At each size:

- bridge: `DistributedMLIP(n_devices=1, exchange="deep_halo", tiles="auto", skin=0, headroom=1,
  cuda_graphs=False, memory_budget=--memory-budget)`: the tile count the memory model chose, the largest
  tile's rows and edges, the layout time, the first call, the median E+F of the rounds, atom-steps/s; the
  predicted peak (`model.tile_choice`, one tile's intermediates) against the measured one: on a GPU
  torch's peak above what it held before one call, on the CPU `memory_probe.evaluation_peak` of the largest
  tile (torch's profiler does not see the allocations of ops XLA calls from its own threads);
- one NVE step with the MD driver (`mlip.dynamics.nve`, 1 fs, 300 K, a model of default skin and
  headroom, tiles="auto" again, the memory model shared): the step's time (no compilation in it), the whole
  call's (layout and compilation in it), and its positions against velocity Verlet's closed form from the
  E+F forces, x1 = x0 + v0 dt + F0 dt^2 / 2m;
- native: `model(batch, compute_force=True)` on MACE's own batch, its time and torch's peak, and the
  bridge's parity against it, up to the first size that runs out of memory (no larger size is tried).

A row is added as each size ends and the plot (OUT/tiles_<kernels>_<dtype>.svg: atom-steps/s and peak
memory against atoms, log-log, native beside the bridge; the bridge's memory is a tile's peak plus what JAX
holds, its tables) is redrawn, so a run stopped by its time limit keeps what it measured.
A smoke run's sizes are one tile each (a tile's deep halo, 2 x 5 A, spans their whole box, so tiles would
not shrink them): it checks the code paths, the parity and the memory model on a real block.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks import common as cm
from benchmarks.mlip import SPECIES, atoms_of, build_model, parity
from benchmarks.tiles_plot import Point, write_plot

GPU_SIZES = (1372, 10976, 55296, 256000, 1000188)
SMOKE_SIZES = (32, 108)
NVE_TOL = {"float32": 1e-4, "float64": 1e-9}  # A, one step against the closed form


def run(rep: cm.Report, opt) -> None:
    import torch

    from nvalchemi_jaxbridge.mlip.mace import MACEWrapper
    from nvalchemi_jaxbridge.mlip.memory_probe import probe_cost

    gpu = opt.platform == "gpu"
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    for mod in ("mace", "e3nn") + (("cuequivariance_torch",) if gpu else ()):
        rep.ctx[mod] = cm.version(mod)
    kernels = opt.kernels_for("tiles", ["e3nn"], ["e3nn", "cueq"])
    sizes = opt.sizes_for("tiles", SMOKE_SIZES if opt.smoke else GPU_SIZES)
    dtypes, rounds = opt.dtypes_or(["float64"] if opt.smoke else ["float32"]), opt.repeats_or(3, 2)
    budget = opt.memory_budget
    rep.setting("tiles", "DistributedMLIP(n_devices=1, exchange='deep_halo', tiles='auto', skin=0, headroom=1, "
                "cuda_graphs=False); memory budget " + (f"{cm.human_bytes(budget)} per device" if budget else
                                                       "the library's default for tiles='auto' (80 % of the device's memory)") +
                f"; E+F median of {rounds} rounds after the first call (2 where a call takes > 10 s); native up to "
                "its first out-of-memory")
    table = rep.table("MACE energy + forces in tiles on one device, native beside it", [
        "kernels", "dtype", "atoms", "tiles", "largest tile rows / edges", "layout s", "first call s", "E+F s",
        "atom-steps/s", "predicted peak", "measured peak", "measured / predicted", "JAX in use",
        "NVE step s (whole call s)", "NVE step vs closed form (A)", "native E+F s", "native peak",
        "native atom-steps/s", "bridge / native time", "parity dE/E [node sums], max dF (eV/A)"])
    for kernel in kernels:
        for dtype in dtypes:
            model = build_model(dtype, kernel, dev, opt.smoke)
            t0 = time.perf_counter()
            cost = probe_cost(MACEWrapper(model), np.asarray(SPECIES), dev)  # what tiles="auto" measures once
            rep.setting(f"memory model ({kernel}, {dtype})", f"{cost.bytes_per_row:,.0f} B per row, "
                        f"{cost.bytes_per_edge:,.0f} B per edge, {cm.human_bytes(cost.fixed)} fixed (probe "
                        f"{time.perf_counter() - t0:.1f} s)")
            points: list[Point] = []
            shared: dict = {"cost": cost, "native": True}
            for n in sizes:
                if rep.time_left() < 0:
                    rep.note(f"Tiles: {kernel} {dtype} at {n} atoms and larger not run (budget spent).")
                    break
                before = len(points)
                with rep.section(f"tiles {kernel} {dtype}, {n} atoms"):
                    points.append(_size(rep, table, model, kernel, dtype, n, rounds, budget, shared, opt, dev))
                    write_plot(points, opt.out / f"tiles_{kernel}_{dtype}.svg",
                               f"MACE ({kernel}, {dtype}) on {rep.ctx['device']}")
                cm.free_memory(gpu)
                if len(points) == before:  # the bridge failed at this size: larger ones would too
                    break
            _targets(rep, kernel, dtype, points)


def _size(rep: cm.Report, table: cm.Table, model, kernel: str, dtype: str, n: int, rounds: int, budget,
          shared: dict, opt, dev) -> Point:
    """One system size: the bridge, one NVE step and (while it fits) native; its row of `table`."""
    import jax

    from nvalchemi_jaxbridge.mlip import DistributedMLIP
    from nvalchemi_jaxbridge.mlip.mace import MACEWrapper

    gpu = opt.platform == "gpu"
    atoms = atoms_of(n)
    where = f"tiles {kernel} {dtype}, {len(atoms)} atoms"

    def phase(text: str) -> None:  # where a long size spends its time, as it goes
        print(f"[{time.strftime('%H:%M:%S')}] {where}: {text}", flush=True)

    wrapper = MACEWrapper(model)
    bridge = DistributedMLIP(wrapper, n_devices=1, exchange="deep_halo", tiles="auto", skin=0.0, headroom=1.0,
                             cuda_graphs=False, memory_budget=budget)
    bridge.model_cost = shared["cost"]  # measured once per model, as the first prepare would
    t0 = time.perf_counter()
    state = bridge.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    t_layout = time.perf_counter() - t0
    choice = bridge.tile_choice
    phase(f"layout {t_layout:.1f} s, {choice.tiles} tiles; the first call ...")
    pos = state.cs.owned(np.asarray(atoms.positions, np.float64).astype(dtype), positions=True)

    def call():
        return jax.block_until_ready(bridge.energy_and_gradients(state, pos, strain=False))

    t0 = time.perf_counter()
    energy, node_e, g_pos, _ = call()
    t_first = time.perf_counter() - t0
    phase(f"first call {t_first:.1f} s; the timed rounds ...")
    measured, times = _rounds(call, min(rounds, 2) if t_first > 10 else rounds, dev if gpu else None)
    t_call = cm.med(times)
    if not gpu:
        measured = _largest_tile_peak(state, wrapper, atoms, shared["cost"])
    in_use = float((jax.devices()[0].memory_stats() or {}).get("bytes_in_use", 0)) if gpu else 0.0
    r = state.rows_per_device()[0]
    rows, edges = r.get("tile_rows", r["owned"] + r["ghost"]), r.get("tile_edges", r["edges"])
    forces = -np.asarray(state.cs.to_global(g_pos), np.float64)
    nodes = float(np.asarray(state.cs.to_global(node_e), np.float64).sum())
    energy = float(energy)
    del bridge, state, pos, call, g_pos, node_e
    cm.free_memory(gpu)
    phase(f"E+F {t_call:.3g} s; one nve step ...")
    try:  # a failed step is recorded; the size's other measurements stay
        nve_step, nve_call, nve_dx = _nve_step(wrapper, atoms, forces, dtype, budget, shared["cost"])
    except Exception as e:  # noqa: BLE001
        nve_step = nve_call = nve_dx = float("nan")
        rep.fail(f"{where}: one nve step: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    if nve_dx > NVE_TOL[dtype]:
        rep.fail(f"{where}: one nve step lands {nve_dx:.1e} A from velocity Verlet's closed form")
    cm.free_memory(gpu)
    if shared["native"]:
        phase("native MACE ...")
    nat = _native(rep, model, atoms, dtype, rounds, dev, gpu) if shared["native"] else None
    shared["native"] = nat is not None
    par, n_t, n_peak = "-", float("nan"), float("nan")
    if nat is not None:
        n_t, n_peak, n_energy, n_nodes, n_forces = nat
        par, ok = parity(energy, nodes, forces, n_energy, n_nodes, n_forces, dtype)
        if not ok:
            rep.fail(f"{where}: the bridge differs from native ({par})")
    predicted = choice.predicted_bytes
    native = (["-"] * 4 if nat is None else
              [f"{n_t:.4g}", cm.human_bytes(n_peak), f"{len(atoms) / n_t:,.0f}", cm.ratio(t_call, n_t)])
    table.add(kernel, dtype, len(atoms), choice.tiles, f"{rows:,} / {edges:,}", f"{t_layout:.3g}", f"{t_first:.3g}",
              f"{t_call:.4g}", f"{len(atoms) / t_call:,.0f}", cm.human_bytes(predicted), cm.human_bytes(measured),
              f"{measured / predicted:.3f}", cm.human_bytes(in_use) if gpu else "n/a",
              f"{nve_step:.4g} ({nve_call:.3g})", f"{nve_dx:.1e}", *native, par)
    return Point(len(atoms), choice.tiles, t_call, predicted, measured, in_use, nve_step, n_t, n_peak)


def _rounds(call, rounds: int, gpu_dev) -> tuple[float, list[float]]:
    """Seconds of each of `rounds` calls (each waits for its result) and, on the GPU `gpu_dev`, torch's peak
    bytes above what it held before them (one call's intermediates: the calls are alike); NaN off the GPU."""
    import torch

    if gpu_dev is not None:
        torch.cuda.synchronize(gpu_dev)
        base = torch.cuda.memory_allocated(gpu_dev)
        torch.cuda.reset_peak_memory_stats(gpu_dev)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    if gpu_dev is None:
        return float("nan"), times
    torch.cuda.synchronize(gpu_dev)
    return float(torch.cuda.max_memory_allocated(gpu_dev) - base), times


def _largest_tile_peak(state, wrapper, atoms, cost) -> float:
    """`memory_probe.evaluation_peak` of the block's largest tile (the whole block without tiles), real rows only."""
    import torch

    from nvalchemi_jaxbridge.mlip.memory_probe import evaluation_peak

    plan, tiles, hr = state.plan, state.tiles, state.plan.halo_rows
    pos = plan.to_halo(atoms.positions, positions=True).reshape(plan.n_devices, hr, 3)[0]
    attrs = plan.to_halo(wrapper.node_attrs(atoms.numbers)).reshape(plan.n_devices, hr, -1)[0]
    if tiles is None:
        rows, ids = np.arange(int(state.edges.pad_row[0])), np.arange(int(state.edges.n_edges[0]))
        pairs = state.edges.edges[0, ids]
    else:
        t = int(np.argmax(cost.predict(tiles.n_rows[0], tiles.n_edges[0])))  # the tile the prediction is of
        rows, ids = tiles.rows[0, t, :tiles.n_rows[0, t]], tiles.edge_ids[0, t, :tiles.n_edges[0, t]]
        pairs = tiles.edges[0, t, :tiles.n_edges[0, t]]
    f = dict(dtype=wrapper.dtype)
    return evaluation_peak(wrapper, (torch.as_tensor(pos[rows], **f), torch.as_tensor(attrs[rows], **f),
                                     torch.as_tensor(np.asarray(pairs, np.int32)),
                                     torch.as_tensor(state.edges.shift[0, ids], **f)))


def _nve_step(wrapper, atoms, forces: np.ndarray, dtype: str, budget, cost) -> tuple[float, float, float]:
    """One `nve` step: its time without compilation, the whole call's, and max |x1 - closed form| (A)."""
    from nvalchemi_jaxbridge.demo.systems import maxwell_boltzmann
    from nvalchemi_jaxbridge.demo.units import MVV2E
    from nvalchemi_jaxbridge.mlip import DistributedMLIP
    from nvalchemi_jaxbridge.mlip.dynamics import nve

    md_model = DistributedMLIP(wrapper, n_devices=1, exchange="deep_halo", tiles="auto", cuda_graphs=False,
                               memory_budget=budget)
    md_model.model_cost = cost
    masses = atoms.get_masses()
    v0 = maxwell_boltzmann(masses, 300.0, seed=1)
    out = nve(md_model, atoms.positions, v0, masses, atoms.numbers, atoms.cell.array, atoms.pbc, steps=1, dt=1.0,
              check_every=1)
    steady_steps, steady_s, whole_s = out["timing"]
    want = atoms.positions + v0 + 0.5 * forces / (MVV2E * masses[:, None])
    d = np.asarray(out["positions"][1], np.float64) - want
    cell = np.asarray(atoms.cell.array, np.float64)
    frac = d @ np.linalg.inv(cell)
    frac -= np.where(np.asarray(atoms.pbc), np.round(frac), 0.0)  # positions may come back wrapped
    return (steady_s / steady_steps if steady_steps else float("nan")), whole_s, float(np.abs(frac @ cell).max())


def _native(rep: cm.Report, model, atoms, dtype: str, rounds: int, dev, gpu: bool):
    """Native MACE's median E+F time, peak bytes, energy, node-energy sum and forces; None once out of memory."""
    import torch

    from nvalchemi_jaxbridge.mlip.mace import mace_input

    try:
        batch = mace_input(model, atoms, dtype=getattr(torch, dtype), device=dev)
        sync = cm.torch_sync(dev)

        def call():
            out = model(batch, training=False, compute_force=True)
            sync(out)
            return out

        call()
        peak, times = _rounds(call, rounds, dev if gpu else None)
        peak = peak if gpu else _cpu_peak(call)
        out = call()
        return (cm.med(times), peak, float(out["energy"][0].detach()),
                float(out["node_energy"].detach().double().sum()), out["forces"].detach().double().cpu().numpy())
    except Exception as e:  # noqa: BLE001 - out of memory ends native's sizes; anything else is a failure
        if not cm.is_oom(e):
            raise
        rep.note(f"Native MACE at {len(atoms)} atoms: out of memory ({str(e).splitlines()[0][:160]}); "
                 "larger sizes not tried.")
        return None


def _cpu_peak(call) -> float:
    """Peak bytes torch allocates on the CPU over one call, as `memory_probe` reads them (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    steps = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events())
    return float(max(np.cumsum([b for _, b in steps]).max(), 0.0)) if steps else float("nan")




def _targets(rep: cm.Report, kernel: str, dtype: str, points: list[Point]) -> None:
    if not points:
        return
    big = points[-1]
    native = [p for p in points if p.native_s == p.native_s]
    if kernel == "e3nn":
        rep.target(f"MACE ({kernel}, {dtype}) >= 10^6 atoms through the bridge on one GPU, E+F and one NVE step "
                   "(issue 30)", f"{big.atoms:,} atoms, {_tiles(big)}: E+F {big.time_s:.3g} s, NVE step "
                   f"{big.nve_s:.3g} s", big.atoms >= 10**6 and big.nve_s == big.nve_s)
    if native:  # native's largest lies between the last size that fit and the first that did not
        fit = native[-1].atoms
        oom = points[len(native)].atoms if len(native) < len(points) else None
        # certain when the bridge's largest is under 10x what fit, or over 10x what did not; else undecided
        verdict = False if big.atoms < 10 * fit else (True if oom is not None and big.atoms >= 10 * oom else None)
        rep.target(f"MACE ({kernel}, {dtype}) through the bridge >= 10x native's largest system (issue 30)",
                   f"{big.atoms:,} atoms: {big.atoms / fit:.1f}x native's {fit:,}, which fit" +
                   (f", {big.atoms / oom:.1f}x its {oom:,}, out of memory" if oom else
                    " (native never ran out of memory: its largest is not known)"),
                   verdict)
        at = native[-1]
        rep.target(f"MACE ({kernel}, {dtype}) throughput at native's largest size >= 0.75x native (issue 30)",
                   f"{at.atoms:,} atoms, {_tiles(at)}: {at.native_s / at.time_s:.2f}x native",
                   at.native_s / at.time_s >= 0.75)
    worst = max(points, key=lambda p: abs(p.measured / p.predicted - 1))
    rep.target(f"MACE ({kernel}, {dtype}) peak memory within 10 % of the memory model's prediction at every size "
               "(issue 30)", ", ".join(f"{p.measured / p.predicted:.2f}x at {p.atoms:,}" for p in points),
               abs(worst.measured / worst.predicted - 1) <= 0.1)


def _tiles(p: Point) -> str:
    return f"{p.tiles} tile" + ("s" if p.tiles > 1 else "")
