"""Stage ops recorded as CUDA graphs on one GPU: the eager numbers, and the time per energy + forces.

    PYTHONPATH=.:/tmp/site python3 scripts/gpu_cuda_graphs.py [--sizes 3,7] [--dtypes float32,float64]
        [--models mace,mpnn] [--rounds 20] [--budget-s 360] [--torchscript on|off] [--cpu]
    PYTHONPATH=.:/tmp/site python3 -m nvalchemi_jaxbridge.torch.launch -n 1 scripts/gpu_cuda_graphs.py --door torch

Put the checkout first on the path (the mace-torch wheel ships a top-level `tests` package; nothing of
`tests` is imported here). Cases run MACE float32 first (108 then 1,372 atoms), then MACE float64, then
the MPNN; each one alone (a failing case is reported and the next one runs; no case starts after
`--budget-s`); every line is printed as it is known. The first case also builds the FFI extension where
it is not cached yet (about 30 s).

Per case (model, dtype, fcc reps: 3 -> 108 atoms, 7 -> 1,372), two bridges of the same model on one GPU,
`DistributedMLIP(wrapper, n_devices=1, skin=0, headroom=1)` (the block holds the pairs within the
cutoff, as MACE's own neighbour list) with `cuda_graphs=True` and with `cuda_graphs=False`:

(a) CHECK: energy, node energies, dE/dpositions and dE/dstrain (`energy_and_gradients`) of the graphed
    bridge equal the eager bridge's, at the structure and at the same layout with every atom moved by up
    to 0.02 Å (the replays read new values); the stages must have been recorded (no fallback). Relative to
    the largest value: <= 1e-9 (float64) or 5e-4 (float32). The graphed bridge is also compared with
    MACE's own forward (printed, not checked: float32 totals accumulate differently).
(b) TIME: energy + forces per call (`energy_and_gradients(..., strain=False)`; MACE: native
    `model(batch, compute_force=True)` too), the runs taking turns call by call, median of `--rounds`
    wall times after 3 warm-up rounds (block_until_ready / synchronize after each call); GPU busy =
    the device time of one call under torch.profiler (kernels, copies and memsets summed; CUPTI sees
    XLA's and the replayed graphs' kernels too), mean of 5 calls.

`--door torch` (under the launcher, one process): the same cases on the PyTorch door,
`TorchDistributedMLIP(wrapper, skin=0.1, headroom=1)` with `cuda_graphs=True` / `False`: (a) energy, forces,
stress and atomic energies (`evaluate`) at the structure and, on the same state, with every atom moved by up to
0.02 Å (within skin/2); (b) energy + forces per call (`evaluate(state=..., stress=False, as_tensors=True)`, the
door's structure check and exchanges included) against native MACE.

Prints a markdown table at the end; exits 1 if any check fails (mismatch, no recording, an error), 0 else.
MACE: random ScaleShiftMACE as benchmarks/mace_interleaved.py (2 layers, r_max 5 Å, hidden
"64x0e + 64x1o", max_ell 3, correlation 3, 8 Bessel, radial MLP [64, 64, 64], e3nn with TorchScript on).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

SPECIES = (29, 79)
TOL = {"float64": 1e-9, "float32": 5e-4}
MACE_CFG = dict(r_max=5.0, num_interactions=2, correlation=3, hidden_irreps="64x0e + 64x1o", max_ell=3,
                num_bessel=8, mlp_irreps="16x0e", radial_mlp=(64, 64, 64), seed=0)


def say(*parts) -> None:
    print(*parts, flush=True)


def alloy(reps: int, a: float = 3.75, rattle: float = 0.1, seed: int = 0):
    """Rattled fcc Cu/Au, reps^3 cubic cells (4 reps^3 atoms), random species, periodic."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=a, cubic=True).repeat((reps,) * 3)
    rng = np.random.default_rng(seed)
    atoms.numbers = rng.choice(np.asarray(SPECIES), len(atoms))
    atoms.positions += rng.normal(scale=rattle, size=atoms.positions.shape)
    return atoms


def build_model(name: str, dtype, device, torchscript: bool):
    if name == "mpnn":
        from nvalchemi_jaxbridge.mlip import MPNN, MPNNWrapper

        return MPNNWrapper(MPNN(list(SPECIES), cutoff=4.0, dtype=dtype).to(device)), None
    import e3nn

    from nvalchemi_jaxbridge.mlip.mace import MACEWrapper, random_mace

    old = e3nn.get_optimization_defaults()["jit_script_fx"]
    e3nn.set_optimization_defaults(jit_script_fx=torchscript)
    try:
        model = random_mace(list(SPECIES), dtype=dtype, **MACE_CFG).to(device)
    finally:
        e3nn.set_optimization_defaults(jit_script_fx=old)
    return MACEWrapper(model), model


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want), initial=0.0)) / max(float(np.max(np.abs(want), initial=0.0)), 1e-300)


def gpu_busy_ms(call, sync, calls: int = 5) -> float:
    """Device time per call under torch.profiler (CUDA events: kernels, copies, memsets), mean over `calls`."""
    import torch
    from torch.profiler import ProfilerActivity

    sync(call())
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            sync(call())
    return sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type.name == "CUDA") / 1e3 / calls


def interleaved(runs: dict, warmup: int, rounds: int) -> dict[str, float]:
    """Median wall ms per call of each `(fn, sync)`, the runs taking turns call by call (`benchmarks.common`)."""
    from benchmarks.common import time_interleaved

    out = time_interleaved(runs, warmup=warmup, iters=rounds)
    return {k: 1e3 * statistics.median(v) for k, v in out.items()}


def time_runs(runs: dict, row: dict, label: str, rounds: int, gpu: bool) -> None:
    """Median ms per call of each run (in turns) into `row`, and on a GPU each run's busy time (`busy_<run>`)."""
    row.update(interleaved(runs, warmup=3, rounds=rounds))
    say(f"  [{label}] TIME ms per E+F: " + ", ".join(f"{k} {row[k]:.2f}" for k in runs))
    if gpu:
        for k in runs:
            try:
                row[f"busy_{k}"] = gpu_busy_ms(*runs[k])
            except Exception as e:  # noqa: BLE001 - a profiler problem is reported, not a failed check
                say(f"  [{label}] profiler failed for {k}: {type(e).__name__}: {e}")
        say(f"  [{label}] GPU busy ms per E+F: " + ", ".join(
            f"{k} {row[f'busy_{k}']:.2f}" for k in runs if f"busy_{k}" in row))


def run_case(name: str, dtype: str, reps: int, a, device, gpu: bool, built: dict) -> dict:
    import jax
    import torch

    from nvalchemi_jaxbridge.mlip import DistributedMLIP

    tdt = getattr(torch, dtype)
    atoms = alloy(reps)
    label = f"{name} {dtype} {len(atoms)} atoms"
    row: dict = {"case": label, "fail": []}
    if (name, dtype) not in built:  # one model per (model, dtype), shared by its sizes
        t0 = time.perf_counter()
        built[name, dtype] = build_model(name, tdt, device, a.torchscript == "on")
        say(f"  [{label}] model built ({time.perf_counter() - t0:.1f} s)")
    wrapper, native = built[name, dtype]
    kw = dict(n_devices=1, skin=0.0, headroom=1.0)
    if gpu:
        graphs = True
    else:  # the dry run: the CPU stand-in, with the same buffers and replay rules
        from nvalchemi_jaxbridge.kernels.cuda_graphs import FakeCapture

        graphs = FakeCapture()
    graphed = DistributedMLIP(wrapper, cuda_graphs=graphs, **kw)
    eager = DistributedMLIP(wrapper, cuda_graphs=False, **kw)
    args = (atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    sg, se = graphed.prepare(*args), eager.prepare(*args)
    np_dtype = np.dtype(dtype)
    rng = np.random.default_rng(1)
    geometries = [atoms.positions, atoms.positions + rng.uniform(-0.02, 0.02, atoms.positions.shape)]

    # (a) graphed == eager, at two sets of values on one layout
    for k, pos in enumerate(geometries):
        pg = sg.cs.owned(np.asarray(pos, np.float64).astype(np_dtype), positions=True, check=False)
        pe = se.cs.owned(np.asarray(pos, np.float64).astype(np_dtype), positions=True, check=False)
        t0 = time.perf_counter()
        got = jax.block_until_ready(graphed.energy_and_gradients(sg, pg))
        t_first = time.perf_counter() - t0
        want = jax.block_until_ready(eager.energy_and_gradients(se, pe))
        errs = {}
        for key, g, w in zip(("energy", "node energies", "dE/dpos", "dE/dstrain"), got, want):
            g = np.asarray(sg.cs.to_global(g)) if key in ("node energies", "dE/dpos") else np.asarray(g)
            w = np.asarray(se.cs.to_global(w)) if key in ("node energies", "dE/dpos") else np.asarray(w)
            errs[key] = rel_err(g, w)
        bad = [f"{key} {e:.1e}" for key, e in errs.items() if not e <= TOL[dtype]]
        text = ", ".join(f"{key} {e:.1e}" for key, e in errs.items())
        what = "structure" if k == 0 else "moved atoms (replay on new values)"
        say(f"  [{label}] CHECK graphed vs eager at the {what}: {text}"
            + (f" (first graphed call {t_first:.1f} s, recording included)" if k == 0 else ""))
        if bad:
            row["fail"].append(f"graphed != eager at the {what}: {', '.join(bad)} > {TOL[dtype]:g}")
    g = graphed.stages.graphs
    if g is None or g.off is not None or g.captures == 0:
        row["fail"].append("the stages were not recorded: " + ("no backend" if g is None else str(g.off)))
    else:
        say(f"  [{label}] recordings {g.captures}, replays {g.replays}, eager backwards {g.eager_backwards}")

    batch = None
    if native is not None:
        from nvalchemi_jaxbridge.mlip.mace import mace_input

        batch = mace_input(native, atoms, dtype=tdt, device=device)
        out = native(batch, training=False, compute_force=True)
        pg = sg.cs.owned(np.asarray(atoms.positions, np.float64).astype(np_dtype), positions=True, check=False)
        energy, _, g_pos, _ = graphed.energy_and_gradients(sg, pg, strain=False)
        f_b = -np.asarray(sg.cs.to_global(g_pos), np.float64)
        say(f"  [{label}] info: graphed bridge vs MACE's own forward: |dE|/|E| "
            f"{abs(float(energy) - float(out['energy'][0].detach())) / abs(float(out['energy'][0].detach())):.1e}, "
            "forces "
            f"{rel_err(f_b, out['forces'].detach().double().cpu().numpy()):.1e} (relative to the largest)")
        del out

    # (b) time per energy + forces
    pg = sg.cs.owned(np.asarray(atoms.positions, np.float64).astype(np_dtype), positions=True, check=False)
    pe = se.cs.owned(np.asarray(atoms.positions, np.float64).astype(np_dtype), positions=True, check=False)
    sync_t = (lambda _: torch.cuda.synchronize(device)) if gpu else (lambda _: None)
    runs = {"graphs": (lambda: graphed.energy_and_gradients(sg, pg, strain=False), jax.block_until_ready),
            "eager": (lambda: eager.energy_and_gradients(se, pe, strain=False), jax.block_until_ready)}
    if native is not None:
        runs["native"] = (lambda: native(batch, training=False, compute_force=True), sync_t)
    time_runs(runs, row, label, a.rounds, gpu)
    del graphed, eager
    if gpu:
        torch.cuda.empty_cache()
    return row


def run_torch_case(name: str, dtype: str, reps: int, a, device, gpu: bool, built: dict) -> dict:
    """`run_case` on the PyTorch door (`TorchDistributedMLIP`, this process's rank)."""
    import torch

    from nvalchemi_jaxbridge.mlip.torch_model import TorchDistributedMLIP

    tdt = getattr(torch, dtype)
    atoms = alloy(reps)
    label = f"torch door {name} {dtype} {len(atoms)} atoms"
    row: dict = {"case": label, "fail": []}
    if (name, dtype) not in built:
        t0 = time.perf_counter()
        built[name, dtype] = build_model(name, tdt, device, a.torchscript == "on")
        say(f"  [{label}] model built ({time.perf_counter() - t0:.1f} s)")
    wrapper, native = built[name, dtype]
    if gpu:
        graphs = True
    else:
        from nvalchemi_jaxbridge.kernels.cuda_graphs import FakeCapture

        graphs = FakeCapture()
    kw = dict(skin=0.1, headroom=1.0)
    graphed = TorchDistributedMLIP(wrapper, cuda_graphs=graphs, **kw)
    eager = TorchDistributedMLIP(wrapper, cuda_graphs=False, **kw)
    args = (atoms.numbers, atoms.cell.array, atoms.pbc)
    sg, se = graphed.prepare(atoms.positions, *args), eager.prepare(atoms.positions, *args)
    rng = np.random.default_rng(1)
    geometries = [atoms.positions, atoms.positions + rng.uniform(-0.02, 0.02, atoms.positions.shape)]
    for k, pos in enumerate(geometries):  # (a) graphed == eager, at two sets of values on one layout
        t0 = time.perf_counter()
        got = graphed.evaluate(pos, *args, state=sg)
        t_first = time.perf_counter() - t0
        want = eager.evaluate(pos, *args, state=se)
        errs = {key: rel_err(got[key], want[key]) for key in ("energy", "forces", "stress", "atomic_energies")}
        bad = [f"{key} {e:.1e}" for key, e in errs.items() if not e <= TOL[dtype]]
        what = "structure" if k == 0 else "moved atoms (replay on new values)"
        say(f"  [{label}] CHECK graphed vs eager at the {what}: " + ", ".join(f"{key} {e:.1e}" for key, e in errs.items())
            + (f" (first graphed call {t_first:.1f} s, recording included)" if k == 0 else ""))
        if bad:
            row["fail"].append(f"graphed != eager at the {what}: {', '.join(bad)} > {TOL[dtype]:g}")
    g = None if graphed.stages is None else graphed.stages.graphs
    if g is None or g.off is not None or g.captures == 0:
        row["fail"].append("the stages were not recorded: " + ("no backend" if g is None else str(g.off)))
    else:
        say(f"  [{label}] recordings {g.captures}, replays {g.replays}, eager backwards {g.eager_backwards}")
    sync_t = (lambda _: torch.cuda.synchronize(device)) if gpu else (lambda _: None)
    runs = {"graphs": (lambda: graphed.evaluate(atoms.positions, *args, state=sg, stress=False, as_tensors=True),
                       sync_t),
            "eager": (lambda: eager.evaluate(atoms.positions, *args, state=se, stress=False, as_tensors=True),
                      sync_t)}
    if native is not None:
        from nvalchemi_jaxbridge.mlip.mace import mace_input

        batch = mace_input(native, atoms, dtype=tdt, device=device)
        runs["native"] = (lambda: native(batch, training=False, compute_force=True), sync_t)
    time_runs(runs, row, label, a.rounds, gpu)
    del graphed, eager
    if gpu:
        torch.cuda.empty_cache()
    return row


def fmt(x) -> str:
    return "-" if x is None or x != x else f"{x:.2f}"


def table(rows: list[dict]) -> str:
    head = ("| case | native eager ms | bridge eager ms | bridge graphs ms | GPU busy ms: native / bridge graphs | "
            "graphs vs native | graphs vs bridge eager | graphs / native GPU busy | checks |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        n, e, g = r.get("native"), r.get("eager"), r.get("graphs")
        bn, bg = r.get("busy_native"), r.get("busy_graphs")
        lines.append("| " + " | ".join([
            r["case"], fmt(n), fmt(e), fmt(g), f"{fmt(bn)} / {fmt(bg)}",
            f"{n / g:.2f}x" if n and g else "-", f"{e / g:.2f}x" if e and g else "-",
            f"{g / bn:.2f}" if g and bn else "-", "FAIL: " + "; ".join(r["fail"]) if r["fail"] else "ok"]) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="3,7", help="fcc reps per axis (atoms = 4 reps^3): 3 -> 108, 7 -> 1372")
    p.add_argument("--dtypes", default="float32,float64")
    p.add_argument("--models", default="mace,mpnn")
    p.add_argument("--rounds", type=int, default=20, help="timed calls per run (after 3 warm-up rounds)")
    p.add_argument("--budget-s", type=float, default=360.0, help="start no case after this many seconds")
    p.add_argument("--torchscript", choices=("on", "off"), default="on", help="e3nn's TorchScript (MACE)")
    p.add_argument("--cpu", action="store_true", help="a dry run on the CPU (FakeCapture instead of CUDA graphs)")
    p.add_argument("--door", choices=("jax", "torch"), default="jax",
                   help="the bridge timed: DistributedMLIP (jax) or TorchDistributedMLIP (torch; under the launcher)")
    a = p.parse_args()
    t_start = time.perf_counter()
    if a.torchscript == "off":
        os.environ["PYTORCH_JIT"] = "0"  # read when torch is imported

    import torch

    gpu = torch.cuda.is_available() and not a.cpu
    if not gpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    if a.door == "torch":  # this process is the front door's rank (GPU LOCAL_RANK)
        from nvalchemi_jaxbridge.torch import distributed

        distributed.initialize(platform=None if gpu else "cpu", timeout_s=120)
    import jax

    jax.config.update("jax_enable_x64", True)
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    versions = {"jax": jax.__version__, "torch": torch.__version__}
    for mod in ("mace", "e3nn"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            versions[mod] = "absent"
    say(f"gpu_cuda_graphs: device {torch.cuda.get_device_name(0) if gpu else 'cpu'}, jax devices {jax.devices()}, "
        + ", ".join(f"{k} {v}" for k, v in versions.items()))
    models = [m for m in a.models.split(",") if m]
    if "mace" in models and versions["mace"] == "absent":
        say("SKIP mace: mace-torch is not importable")
        models.remove("mace")
    cases = [(m, d, int(r)) for m in models for d in a.dtypes.split(",") for r in a.sizes.split(",")]
    rows, failed, not_run, built = [], 0, [], {}
    for name, dtype, reps in cases:
        label = f"{name} {dtype} {4 * reps**3} atoms"
        if time.perf_counter() - t_start > a.budget_s:
            not_run.append(label)
            continue
        say(f"case {label} ...")
        t0 = time.perf_counter()
        try:
            row = (run_torch_case if a.door == "torch" else run_case)(name, dtype, reps, a, device, gpu, built)
        except Exception as e:  # noqa: BLE001 - one case's failure is reported and the next case runs
            first = (str(e).strip().splitlines() or [""])[0][:300]
            row = {"case": label, "fail": [f"{type(e).__name__}: {first}"]}
            say(traceback.format_exc(limit=8))
        rows.append(row)
        failed += bool(row["fail"])
        say(f"{'FAIL' if row['fail'] else 'PASS'} {label} ({time.perf_counter() - t0:.0f} s)"
            + (": " + "; ".join(row["fail"]) if row["fail"] else ""))
    say("\n### Energy + forces per call, CUDA graphs on vs off (one GPU, same run)\n")
    bridge = ("TorchDistributedMLIP(skin=0.1, headroom=1)" if a.door == "torch"
              else "DistributedMLIP(n_devices=1, skin=0, headroom=1)")
    say(f"{versions}; bridges: {bridge}, cuda_graphs=True / False; "
        f"median of {a.rounds} interleaved rounds; GPU busy: torch.profiler device time per call (mean of 5)\n")
    say(table(rows))
    for label in not_run:
        say(f"NOT RUN (budget {a.budget_s:.0f} s spent): {label}")
    from nvalchemi_jaxbridge.kernels.ffi import target

    ext, why = target.loaded_or_failed()
    say(f"FFI extension: {'loaded, CUDA ' + str(bool(ext.cuda)) if ext else 'not loaded: ' + str(why)}")
    say(f"\n{'PASS' if failed == 0 else 'FAIL'}: {len(rows) - failed} passed, {failed} failed, "
        f"{len(not_run)} not run, {time.perf_counter() - t_start:.0f} s")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
