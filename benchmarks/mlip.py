"""MLIP energy + forces: MACE through the JAX front door against MACE's own forward, one device.

A random ScaleShiftMACE (`random_mace`: 2 layers, r_max 5 A, correlation 3, max_ell 3, hidden 64x0e + 64x1o,
e3nn with TorchScript, MACE's usual setting; `--kernels mlip=cueq`: the same weights converted to
cuequivariance kernels by mace-torch's `convert_e3nn_cueq`) on rattled fcc Cu/Au of 4 n^3 atoms. Native:
`model(batch, compute_force=True)` on MACE's own batch (its data pipeline and neighbour list, built once).
Bridge: `DistributedMLIP(MACEWrapper(model), n_devices=1, skin=0, headroom=1)`: `energy_and_gradients(...,
strain=False)`, what native computes, and with the strain derivative (the stress) too. The three take turns
call by call, each call synchronised. Every bridge result is checked against native's (energy by the
float64 sums of the node energies, forces). On a GPU: the device busy time of one call of each side
(`torch.profiler`, kernels summed: what a CUDA graph of the call would take), and each side's peak memory of
one call (native: torch's; bridge: torch's, the stage ops' intermediates, plus what the E+F program holds
in JAX's pool: arguments, results, XLA's temporaries, from `memory_analysis()`).
"""

from __future__ import annotations

import numpy as np

from benchmarks import common as cm

SPECIES = (29, 79)
ENERGY_TOL = {"float64": 1e-9, "float32": 1e-4}  # relative, of the float64 sums of the node energies
FORCE_TOL = {"float64": 1e-8, "float32": 1e-3}  # eV/A


_MODELS: dict = {}


def model_config(smoke: bool) -> dict:
    """`random_mace` keyword arguments: issue 31's model (a smoke run: the tests' MACE, `max_ell=2`, 8x0e + 8x1o)."""
    if smoke:
        return dict(max_ell=2, seed=0)
    return dict(r_max=5.0, num_interactions=2, correlation=3, hidden_irreps="64x0e + 64x1o", max_ell=3, num_bessel=8,
                mlp_irreps="16x0e", radial_mlp=(64, 64, 64), seed=0)


def build_model(dtype: str, kernels: str, dev, smoke: bool):
    """The benchmark's MACE in `dtype` on `dev`: e3nn (TorchScript, except in a smoke run) or cuequivariance.

    Built once per process: the mlip question's parts share it (a smoke run also converts it between dtypes).
    """
    import copy

    import e3nn
    import torch

    from nvalchemi_jaxbridge.mlip.mace import random_mace

    key = (dtype, kernels, str(dev), smoke)
    if key in _MODELS:
        return _MODELS[key]
    other = next((m for (d, k, v, s), m in _MODELS.items() if (k, v, s) == key[1:]), None)
    if other is not None and smoke:  # the same weights in the other dtype
        _MODELS[key] = copy.deepcopy(other).to(getattr(torch, dtype))
        return _MODELS[key]
    old = e3nn.get_optimization_defaults()["jit_script_fx"]
    e3nn.set_optimization_defaults(jit_script_fx=not smoke)
    try:
        model = random_mace(SPECIES, dtype=getattr(torch, dtype), **model_config(smoke)).to(dev)
    finally:
        e3nn.set_optimization_defaults(jit_script_fx=old)
    if kernels == "cueq":
        from mace.cli.convert_e3nn_cueq import run as e3nn_to_cueq

        default = torch.get_default_dtype()
        try:  # the converter sets torch's default dtype to the model's
            model = e3nn_to_cueq(model, device=dev.type, return_model=True).to(dev)
        finally:
            torch.set_default_dtype(default)
    _MODELS[key] = model
    return model


def atoms_of(n: int):
    """Rattled fcc Cu/Au of 4 reps^3 atoms, reps chosen to come closest to `n`."""
    from tests.mlip._reference import alloy

    return alloy(reps=(max(1, round((n / 4) ** (1 / 3))),) * 3, species=SPECIES)


def parity(energy: float, nodes: float, forces, n_energy: float, n_nodes: float, n_forces, dtype: str
           ) -> tuple[str, bool]:
    """'dE/E a [b], max dF c' of the bridge against native, and whether it passes.

    a: the totals; b: the float64 sums of the node energies, which the verdict takes (in float32 MACE's
    scatter_sum accumulates the total in float32, XLA's reduction pairwise).
    """
    scale = max(abs(n_nodes), 1e-30)
    de, de_nodes = abs(energy - n_energy) / scale, abs(nodes - n_nodes) / scale
    df = float(np.abs(forces - n_forces).max())
    ok = de_nodes <= ENERGY_TOL[dtype] and df <= FORCE_TOL[dtype] and bool(np.isfinite(forces).all())
    return f"{de:.1e} [{de_nodes:.1e}], {df:.1e}" + ("" if ok else " MISMATCH"), ok


def kernels_here(opt) -> list[str]:
    """e3nn, and cueq where cuequivariance_torch imports on a GPU (unless --kernels mlip=... says otherwise)."""
    default = ["e3nn"]
    if opt.platform == "gpu" and not opt.smoke:
        try:
            import cuequivariance_torch  # noqa: F401

            default.append("cueq")
        except ImportError:
            pass
    return opt.kernels_for("mlip", default, ["e3nn", "cueq"])


def run(rep: cm.Report, opt) -> None:
    import jax
    import torch

    from nvalchemi_jaxbridge.mlip import DistributedMLIP
    from nvalchemi_jaxbridge.mlip.mace import MACEWrapper, mace_input

    gpu = opt.platform == "gpu"
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    for mod in ("mace", "e3nn", "ase", "matscipy") + (("cuequivariance_torch",) if gpu else ()):
        rep.ctx[mod] = cm.version(mod)
    kernels = kernels_here(opt)
    if gpu and "cueq" not in kernels:
        rep.note("MACE with cuequivariance kernels: not run (cuequivariance_torch does not import; carry its wheels "
                 "as benchmarks/RESULTS.md says).")
    sizes = opt.sizes_for("mlip", [32] if opt.smoke else [108, 1372, 10976])
    dtypes, rounds = opt.dtypes_or(["float32", "float64"]), opt.repeats_or(10, 2)
    cfg = model_config(opt.smoke)
    rep.setting("MACE", f"random ScaleShiftMACE, hidden \"{cfg.get('hidden_irreps', '8x0e + 8x1o')}\", max_ell {cfg['max_ell']}, "
                f"{'eager e3nn (smoke)' if opt.smoke else 'e3nn with TorchScript'}; bridge skin 0, headroom 1; median of "
                f"{rounds} rounds after 3 warm-up rounds, one call of each run per round, each synchronised")
    table = rep.table("MACE energy + forces per call, native and the bridge in turns", [
        "kernels", "dtype", "atoms", "rows (owned + ghost)", "native E+F ms", "bridge E+F ms", "bridge/native",
        "bridge E+F+dE/dstrain ms", "bridge/native (with stress)", "GPU busy ms: native / bridge",
        "bridge / native GPU busy", "parity dE/E [node sums], max dF (eV/A)",
        "peak memory: native / bridge (torch + JAX program)", "mem / native"])
    results: list[dict] = []
    for kernel in kernels:
        for dtype in dtypes:
            model = build_model(dtype, kernel, dev, opt.smoke)
            bridge = DistributedMLIP(MACEWrapper(model), n_devices=1, skin=0.0, headroom=1.0)
            for n in sizes:
                if rep.time_left() < 0:
                    rep.note(f"MACE: {kernel} {dtype} at {n} atoms and later not run (budget spent).")
                    break
                with rep.section(f"MACE {kernel} {dtype}, {n} atoms"):
                    atoms = atoms_of(n)
                    batch = mace_input(model, atoms, dtype=getattr(torch, dtype), device=dev)
                    state = bridge.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
                    pos = state.cs.owned(np.asarray(atoms.positions, np.float64).astype(dtype), positions=True)
                    ef = jax.jit(lambda s, x: bridge.energy_and_gradients(s, x, strain=False))  # one program each
                    efs = jax.jit(lambda s, x: bridge.energy_and_gradients(s, x))
                    runs = {"native": (lambda: model(batch, training=False, compute_force=True), cm.torch_sync(dev)),
                            "bridge": (lambda: ef(state, pos), cm.jax_sync)}
                    if not opt.smoke:  # a smoke run leaves out the stress program (the model level's tests have it)
                        runs["bridge+strain"] = (lambda: efs(state, pos), cm.jax_sync)
                    t = cm.medians(runs, warmup=0 if opt.smoke else 3, iters=rounds)
                    t.setdefault("bridge+strain", float("nan"))
                    nat = model(batch, training=False, compute_force=True)
                    energy, node_e, g_pos, _ = ef(state, pos)
                    par, ok = parity(float(energy), float(np.asarray(state.cs.to_global(node_e), np.float64).sum()),
                                     -np.asarray(state.cs.to_global(g_pos), np.float64),
                                     float(nat["energy"][0].detach()), float(nat["node_energy"].detach().double().sum()),
                                     nat["forces"].detach().double().cpu().numpy(), dtype)
                    del nat
                    busy = {k: cm.profile(*runs[k], 3)["busy_total"] for k in ("native", "bridge")} if gpu else {}
                    mem_n, mem_b = _peak(runs["native"], opt.platform), _peak(runs["bridge"], opt.platform)
                    jax_b = cm.program_bytes(ef, state, pos)
                    r = state.rows_per_device()[0]
                    bn, bb = busy.get("native", float("nan")), busy.get("bridge", float("nan"))
                    table.add(kernel, dtype, len(atoms), f"{r['owned']} + {r['ghost']}", cm.ms(t["native"]),
                              cm.ms(t["bridge"]), cm.ratio(t["native"], t["bridge"]), cm.ms(t["bridge+strain"]),
                              cm.ratio(t["native"], t["bridge+strain"]), f"{cm.ms(bn)} / {cm.ms(bb)}",
                              cm.ratio(t["bridge"], bn), par,
                              f"{cm.human_bytes(mem_n)} / {cm.human_bytes(mem_b)} + {cm.human_bytes(jax_b)}" if gpu
                              else f"n/a (CPU; JAX program {cm.human_bytes(jax_b)})", cm.ratio(mem_b + jax_b, mem_n))
                    if not ok:
                        rep.fail(f"MACE {kernel} {dtype}, {len(atoms)} atoms: the bridge differs from native ({par})")
                    results.append({"kernel": kernel, "dtype": dtype, "n": len(atoms), "ratio": t["native"] / t["bridge"],
                                    "busy": t["bridge"] / bn, "mem": (mem_b + jax_b) / mem_n})
                    if gpu and kernel == "e3nn" and dtype == dtypes[0] and n == sizes[0]:
                        _extra_work(rep, runs, f"{kernel} {dtype}, {len(atoms)} atoms")
            del bridge
    _targets(rep, results)


def _peak(run: cm.Run, platform: str) -> float:
    """torch's peak bytes over one call of `run` (NaN on the CPU)."""
    fn, sync = run
    cm.reset_peaks(platform)
    sync(fn())
    return cm.torch_peak(platform)


def _extra_work(rep: cm.Report, runs: dict, what: str, top: int = 10) -> None:
    """What the bridge's E+F runs beyond native's per call, by kernel name (GPU profiler, 3 calls each)."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity

    def by_name(fn, sync):
        sync(fn())
        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                sync(fn())
        n, s = collections.Counter(), collections.Counter()
        for e in prof.events():
            if e.device_type.name == "CUDA":
                n[e.name[:90]] += 1 / 3
                s[e.name[:90]] += e.time_range.elapsed_us() * 1e-6 / 3
        return n, s

    (bn, bs), (nn, ns) = by_name(*runs["bridge"]), by_name(*runs["native"])
    table = rep.table(f"MACE {what}: the bridge's E+F beyond native's, per call (GPU kernels by name)",
                      ["kernel", "launches", "device time"])
    table.add("total", f"{sum(bn.values()) - sum(nn.values()):+.0f}", f"{1e3 * (sum(bs.values()) - sum(ns.values())):+.3f} ms")
    for k in sorted(set(bs) | set(ns), key=lambda k: -(bs.get(k, 0.0) - ns.get(k, 0.0)))[:top]:
        table.add(k, f"{bn.get(k, 0) - nn.get(k, 0):+.0f}", f"{1e3 * (bs.get(k, 0.0) - ns.get(k, 0.0)):+.3f} ms")


def _targets(rep: cm.Report, results: list[dict]) -> None:
    for kernel in sorted({r["kernel"] for r in results}):
        rs = [r for r in results if r["kernel"] == kernel]
        big = [r for r in rs if r["n"] >= 1000]
        if big:
            rep.target(f"MACE ({kernel}) E+F >= 0.95x native from 10^3 atoms (issue 15)",
                       ", ".join(f"{r['ratio']:.2f}x {r['dtype']} {r['n']}" for r in big),
                       min(r["ratio"] for r in big) >= 0.95)
            mems = [r["mem"] for r in rs if r["mem"] == r["mem"]]
            if mems:
                rep.target(f"MACE ({kernel}) peak memory <= 1.1x native (issue 15)", f"{min(mems):.2f}x-{max(mems):.2f}x",
                           max(mems) <= 1.1)
        busy = [r for r in rs if r["busy"] == r["busy"]]
        if busy:
            rep.target(f"MACE ({kernel}) E+F through the bridge <= 1.15x native's GPU-busy time, 10^2-10^4 atoms (issue 31)",
                       ", ".join(f"{r['busy']:.2f}x {r['dtype']} {r['n']}" for r in busy), max(r["busy"] for r in busy) <= 1.15)
            for lo, hi, want in ((100, 200, 5.0), (1000, 2000, 1.5)):
                at = [r for r in rs if lo <= r["n"] < hi]
                if at:
                    rep.target(f"MACE ({kernel}) E+F >= {want:g}x native eager at {at[0]['n']} atoms (issue 31)",
                               ", ".join(f"{r['ratio']:.2f}x {r['dtype']}" for r in at), min(r["ratio"] for r in at) >= want)
