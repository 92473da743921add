"""MACE energy + forces on one device, native and the bridge taking turns call by call (steady ratios).

    PYTHONPATH=.:/tmp/site python3 benchmarks/mace_interleaved.py --out OUTDIR [--sizes 7,14]
        [--dtypes float32,float64] [--hidden "64x0e + 64x1o"] [--rounds 15] [--label after] [--profile] [--cueq]
        [--smoke]

`mace_one_gpu.py` times each run in a block of its own; on a host-bound size (10^3 atoms)
the machine's drift between blocks is as large as the difference looked for. Here the
native call (`model(batch, compute_force=True)`: energy and forces) and the bridge's
(`DistributedMLIP(MACEWrapper(model), n_devices=1, skin=0, headroom=1)`) alternate, each
followed by a synchronisation: the bridge's energy and forces (`energy_and_gradients(...,
strain=False)`, what native computes) and its energy, forces and strain derivative (the
stress, which native leaves out), where the version measured has the first.
The model and structures are mace_one_gpu.py's (random ScaleShiftMACE, TorchScript on,
rattled fcc Cu/Au of reps^3 x 4 atoms); `--cueq` converts it to cuequivariance kernels
(mace-torch's `convert_e3nn_cueq`, same weights) for both sides. `--label` tags the rows, so runs of two versions
of the package (each from its own checkout) can share one table. Every bridge result is
checked against native (energy, forces) and a mismatch marks the row. Peak GPU memory of one call
after the timing: native, torch's `max_memory_allocated`; the bridge's E+F, torch's (the stage ops'
intermediates and kept graphs) plus what the E+F program holds in JAX's pool: its arguments, results and
XLA's temporaries (the stage ops' outputs, gradients), from the compiled program's `memory_analysis()`.
JAX's `peak_bytes_in_use` is shown beside it: the process peak so far, which cannot be reset and also
counts compilation (autotuning scratch), so it is no per-call figure. `--profile` adds, per
size, three calls of each side under `torch.profiler` and what the bridge's E+F runs beyond
native's, by name: kernels (count and device time per call) and torch CPU ops (count per
call; on a GPU the stage ops run on the calling thread, so the profiler sees them).
"""

from __future__ import annotations

import inspect
import sys
import time

import _common as cm
import numpy as np

def profile_by_name(call, sync, calls: int = 3) -> tuple[dict, dict, dict]:
    """Per call, by name: kernel launches, device seconds, torch CPU ops (`torch.profiler`, CUPTI on a GPU)."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync(call())
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            sync(call())
    n_kernels, device_s, cpu_ops = collections.Counter(), collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":  # a kernel, copy or memset (CUPTI)
            n_kernels[e.name[:90]] += 1 / calls
            device_s[e.name[:90]] += e.time_range.elapsed_us() * 1e-6 / calls
        elif e.name.startswith("aten::"):
            cpu_ops[e.name] += 1 / calls
    return n_kernels, device_s, cpu_ops


def program_bytes(fn, *args) -> float:
    """Device bytes one call of `jax.jit(fn)` holds: arguments + results + XLA temporaries - aliased (memory_analysis)."""
    import jax

    m = jax.jit(fn).lower(*args).compile().memory_analysis()
    return float(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def peak_memory(run, platform: str) -> tuple[float, float]:
    """(torch's peak bytes, JAX's process peak bytes so far) over one call of `run` (`(fn, sync)`); NaN on a CPU."""
    import mace_one_gpu as base
    import torch

    fn, sync = run
    base.reset_torch_peak(platform)
    sync(fn())
    return (float(torch.cuda.max_memory_allocated(0)) if platform == "gpu" else float("nan"),
            base.jax_peak(platform))


def extra_rows(bridge: tuple[dict, dict, dict], native: tuple[dict, dict, dict], top: int = 12) -> list[list[str]]:
    """Rows of what the bridge runs beyond native: kernels by device time, then CPU ops by count."""
    (bk, bt, bo), (nk, nt, no) = bridge, native
    rows = [["total", f"{sum(bk.values()) - sum(nk.values()):+.0f} kernels",
             f"{1e3 * (sum(bt.values()) - sum(nt.values())):+.3f} ms", f"{sum(bo.values()) - sum(no.values()):+.0f} ops"]]
    names = sorted(set(bt) | set(nt), key=lambda k: -(bt.get(k, 0.0) - nt.get(k, 0.0)))[:top]
    rows += [[f"kernel: {k}", f"{bk.get(k, 0) - nk.get(k, 0):+.0f}", f"{1e3 * (bt.get(k, 0) - nt.get(k, 0)):+.3f} ms", ""]
             for k in names]
    ops = sorted(set(bo) | set(no), key=lambda k: -(bo.get(k, 0) - no.get(k, 0)))[:top]
    rows += [[f"op: {k}", "", "", f"{bo.get(k, 0) - no.get(k, 0):+.0f}"] for k in ops]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = cm.base_parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default=None, help="fcc reps per axis, comma list (default 7,14; smoke 2)")
    p.add_argument("--dtypes", default="float32,float64")
    p.add_argument("--hidden", default="64x0e + 64x1o", help="hidden irreps")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 15, smoke 2)")
    p.add_argument("--label", default="", help="a tag for the rows (e.g. the version measured)")
    p.add_argument("--profile", action="store_true", help="also profile each side and list the bridge's extra work")
    p.add_argument("--cueq", action="store_true", help="the model converted to cuequivariance kernels, both sides")
    a = p.parse_args(argv)
    a.hidden_given = True
    platform = cm.setup(a.platform)
    import jax
    import torch

    import mace_one_gpu as base
    from nvalchemi_jaxbridge.mlip import DistributedMLIP
    from nvalchemi_jaxbridge.mlip.mace import MACEWrapper, mace_input, random_mace
    from tests.mlip._reference import alloy

    dev = torch.device("cuda", 0) if platform == "gpu" else torch.device("cpu")
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else ([2] if a.smoke else [7, 14])
    rounds = a.rounds or (2 if a.smoke else 15)
    cfg = base.model_config(a)
    kernels = "cuequivariance (convert_e3nn_cueq)" if a.cueq else "e3nn, TorchScript on"
    settings = {"model": f"random ScaleShiftMACE as mace_one_gpu.py, hidden \"{cfg['hidden_irreps']}\", {kernels}",
                "runs": "native: model(batch, compute_force=True); bridge: DistributedMLIP(..., n_devices=1, skin=0, "
                        "headroom=1).energy_and_gradients: E+F (strain=False) and E+F+dE/dstrain",
                "timing": f"median of {rounds} rounds after 3 warm-up rounds; each round one call of each run, in "
                          "turns, each followed by a synchronisation (wall clock)",
                "label": a.label or "-"}
    rep = cm.Report("mace_interleaved", "MACE energy + forces, native and bridge in turns", a.out,
                    cm.context(platform), settings)
    rows = rep.table("Energy + forces per call", ["label", "dtype", "atoms", "rows (owned + ghost)", "native E+F ms",
                                                  "bridge E+F ms", "bridge/native", "bridge E+F+dE/dstrain ms",
                                                  "bridge/native", "parity (dE/E [node sums], max dF)",
                                                  "peak GiB: native / bridge (torch + JAX program)", "mem / native",
                                                  "JAX process peak GiB"])
    for dtype in [d for d in a.dtypes.split(",") if d]:
        tdt = getattr(torch, dtype)
        model = base.build_model(random_mace, tdt, cfg, True).to(dev)
        if a.cueq:
            model = base.to_cueq(model, dev)
        bridge = DistributedMLIP(MACEWrapper(model), n_devices=1, skin=0.0, headroom=1.0)
        for reps in sizes:
            with rep.section(f"{dtype}/{reps}"):
                atoms = alloy(reps=(reps,) * 3, species=base.SPECIES)
                batch = mace_input(model, atoms, dtype=tdt, device=dev)
                state = bridge.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
                pos = state.cs.owned(np.asarray(atoms.positions, dtype=np.float64).astype(dtype), positions=True)
                sync = (lambda _: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda _: None)
                runs = {"native": (lambda: model(batch, training=False, compute_force=True), sync),
                        "bridge+strain": (lambda: bridge.energy_and_gradients(state, pos), jax.block_until_ready)}
                if "strain" in inspect.signature(bridge.energy_and_gradients).parameters:  # older versions: no
                    runs["bridge"] = (lambda: bridge.energy_and_gradients(state, pos, strain=False),
                                      jax.block_until_ready)
                t0 = time.perf_counter()
                times = cm.time_interleaved(runs, warmup=3, iters=rounds)
                nat = model(batch, training=False, compute_force=True)
                energy, node_e, g_pos, _ = bridge.energy_and_gradients(state, pos)
                f_nat = nat["forces"].detach().double().cpu().numpy()
                f_br = -np.asarray(state.cs.to_global(g_pos), dtype=np.float64)
                nodes_br = float(np.asarray(state.cs.to_global(node_e), dtype=np.float64).sum())
                nodes_nat = float(nat["node_energy"].detach().double().sum())
                de, de_nodes, ok_e = base.energy_parity(float(energy), float(nat["energy"][0]), nodes_br, nodes_nat,
                                                        dtype)
                df = float(np.abs(f_br - f_nat).max())
                ok = ok_e and df <= (1e-3 if dtype == "float32" else 1e-8)  # eV/A, absolute
                tn, ts = cm.med(times["native"]), cm.med(times["bridge+strain"])
                tb = cm.med(times["bridge"]) if "bridge" in times else float("nan")
                mem_n = peak_memory(runs["native"], platform)[0]
                torch_b, process_b = peak_memory(runs.get("bridge", runs["bridge+strain"]), platform)
                lean = {"strain": False} if "bridge" in runs else {}
                jax_b = program_bytes(lambda s, x: bridge.energy_and_gradients(s, x, **lean), state, pos)
                r = state.rows_per_device()[0]
                rep.row(rows, [a.label or "-", dtype, len(atoms), f"{r['owned']} + {r['ghost']}", cm.ms(tn),
                               cm.ms(tb) if tb == tb else "-", f"{tn / tb:.3f}x" if tb == tb else "-", cm.ms(ts),
                               f"{tn / ts:.3f}x", f"{de:.1e} [{de_nodes:.1e}], {df:.1e}" + ("" if ok else " MISMATCH"),
                               f"{mem_n / 2**30:.3g} / {torch_b / 2**30:.3g} + {jax_b / 2**30:.2g}"
                               if platform == "gpu" else f"n/a (CPU; JAX program {jax_b / 2**30:.2g})",
                               f"{(torch_b + jax_b) / mem_n:.2f}" if platform == "gpu" else "-",
                               f"{process_b / 2**30:.2g}" if platform == "gpu" else "-"])
                if not ok:
                    raise AssertionError(f"{len(atoms)} atoms {dtype}: bridge vs native dE/E {de:.1e} (node sums "
                                         f"{de_nodes:.1e}), max dF {df:.1e}")
                if a.profile:
                    lean = runs.get("bridge", runs["bridge+strain"])
                    diff = rep.table(f"{dtype}, {len(atoms)} atoms: the bridge's E+F beyond native's, per call",
                                     ["what", "kernels", "device time", "torch CPU ops"])
                    for row in extra_rows(profile_by_name(*lean), profile_by_name(*runs["native"])):
                        rep.row(diff, row)
                    if platform == "cpu":
                        rep.note("On the CPU the stage ops run on XLA's threads, which torch.profiler does not see "
                                 "here: the op counts above are native's alone (not a comparison).")
                rep.note(f"{dtype} {len(atoms)} atoms: {time.perf_counter() - t0:.0f} s")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
