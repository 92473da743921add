"""MACE energy + forces on one GPU: through the JAX front door (`DistributedMLIP`) vs MACE's own forward.

    PYTHONPATH=. python3 benchmarks/mace_one_gpu.py --out OUTDIR [--smoke] [--budget-s 480]
        [--sizes 7,14,20,29] [--dtypes float32,float64] [--hidden "128x0e + 128x1o"]
        [--modes native,bridge,bridge-tight] [--no-breakdown] [--torchscript off|on]
        [--fail-fast] [--probe-only | --no-scatter-probe]

On the GPU machine, with the wheels of benchmarks/RESULTS.md in /tmp/site, put the
checkout first (`PYTHONPATH=.:/tmp/site`): the mace-torch wheel ships a top-level
`tests` package.

A random `ScaleShiftMACE` (`random_mace([29, 79], r_max=5, num_interactions=2,
correlation=3, max_ell=3, ...)`, widths as given) on rattled fcc Cu/Au
(`tests.mlip._reference.alloy`, reps^3 x 4 atoms), per size and dtype:

- `native`: `model(batch, compute_force=True)` on the GPU, with MACE's own data
  pipeline (`AtomicData.from_config`, matscipy neighbour list) built once per size
  outside the timed loop. Wall clock around the call + `torch.cuda.synchronize`
  (CUDA-event time shown beside it).
- `bridge`: `DistributedMLIP(MACEWrapper(model), n_devices=1)` (defaults: skin 0.5 A,
  headroom 1.2), `state = prepare(...)` once, then `energy_and_gradients(state,
  pos_owned)` per call (one jitted shard_map program; wall clock + block_until_ready).
- `bridge-tight`: the same with skin 0 and headroom 1.0: the block's edge list is
  exactly the pairs within the cutoff (as natively), no spare capacity; a one-shot
  layout (an MD run needs the skin).
- `bridge-tight-all-rows`: bridge-tight with the product basis and readouts run on
  every row of the block (ghosts and padding too), as before they ran on the
  receiver rows only: the before row of that change, in the same run.

Every bridge run is checked first against the native run of the same size and
dtype (relative energy difference, of the totals and of the float64 sums of the
node energies; largest force difference over the largest native force component)
and a mismatch is marked in the table. A scatter probe (before the ladder;
`--probe-only` runs it alone) times `index_add_` and `index_put_(accumulate=True)`
(the backward of `x[idx]`) of the 10976-atom default bridge's edge count with its
padding edges on one row, as the block holds them, against the same edges spread. With
`--breakdown` (default) the energy alone is timed too (native `compute_force=False`,
bridge `jax.jit(energy_fn)`), to show what the backward costs (one forward per
energy + forces on both sides: a stage's backward differentiates the graph its
forward kept). Sizes grow until the time budget is spent or a run
runs out of memory (later sizes of that run and dtype are then skipped); rows
are written as they are measured, so a timeout leaves a partial table.

TorchScript: `--torchscript off` (default) sets PYTORCH_JIT=0 and e3nn's
`jit_script_fx=False`, so the model runs eagerly for both native and bridge runs;
`--torchscript on` keeps e3nn's TorchScript (MACE's usual setting) for both. The
bridge's stage ops find their output shapes by one run on zero-filled device
tensors (`TorchOpKernel(shape_probe="real")`), since TorchScript fusion groups
cannot run on fake tensors on a GPU (RESULTS.md, "MACE on one H200 after three fixes").

Memory: native, `torch.cuda.max_memory_allocated` over its runs; bridge, torch's
peak over its runs (the stages' intermediates) plus JAX's `peak_bytes_in_use`,
which is the process peak so far (it cannot be reset): sizes run in increasing
order so it is, in practice, this size's peak.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from typing import Any

import _common as cm
import numpy as np

SPECIES = (29, 79)
LADDER = [7, 14, 20, 29]  # fcc reps: 1372, 10976, 32000, 97556 atoms
SMOKE_LADDER = [3]  # 108 atoms
MODES = ("native", "bridge", "bridge-tight", "bridge-tight-all-rows")
BRIDGE_KW = {"bridge": dict(skin=0.5, headroom=1.2), "bridge-tight": dict(skin=0.0, headroom=1.0),
             "bridge-tight-all-rows": dict(skin=0.0, headroom=1.0)}


def model_config(a: Any) -> dict[str, Any]:
    """`random_mace` keyword arguments from the command line (smoke: tiny widths)."""
    if a.smoke and not a.hidden_given:
        return dict(r_max=5.0, num_interactions=2, correlation=3, hidden_irreps="8x0e + 8x1o", max_ell=3,
                    num_bessel=8, mlp_irreps="16x0e", radial_mlp=(16, 16), seed=0)
    return dict(r_max=5.0, num_interactions=2, correlation=3, hidden_irreps=a.hidden, max_ell=3, num_bessel=8,
                mlp_irreps="16x0e", radial_mlp=(64, 64, 64), seed=0)


# ------------------------------------------------------------------ native


def run_native(model: Any, batch: dict[str, Any], dev: Any, a: Any, breakdown: bool) -> dict[str, Any]:
    """Energy + forces through MACE's forward: timings, results, peak memory."""
    import torch

    def ef():
        return model(batch, training=False, compute_force=True)

    t0 = time.perf_counter()
    out = ef()
    sync(dev)
    first = time.perf_counter() - t0
    energy = float(out["energy"][0].detach())
    e_nodes = float(out["node_energy"].detach().double().sum())  # the same node energies summed in float64
    forces = out["forces"].detach().double().cpu().numpy()
    del out
    iters = n_iters(first, a)
    wall, ev = cm.time_torch(ef, warmup=a.warmup, iters=iters, device=dev)
    res = {"t": cm.med(wall), "t_event": cm.med(ev), "iters": iters, "first": first, "energy": energy,
           "e_nodes": e_nodes, "forces": forces}
    if breakdown:
        def e_only():
            return model(batch, training=False, compute_force=False)["energy"]

        w2, e2 = cm.time_torch(e_only, warmup=1, iters=iters, device=dev)
        res["t_fwd"] = cm.med(w2)
    if dev.type == "cuda":
        res["peak_torch"] = torch.cuda.max_memory_allocated(dev)
    return res


# ------------------------------------------------------------------ bridge


def run_bridge(bridge: Any, atoms: Any, np_dtype: Any, a: Any, breakdown: bool) -> dict[str, Any]:
    """Energy + forces through `DistributedMLIP.energy_and_gradients`: timings, results, layout."""
    import jax
    import jax.numpy as jnp

    t0 = time.perf_counter()
    state = bridge.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    pos_owned = state.cs.owned(np.asarray(atoms.positions, dtype=np.float64).astype(np_dtype), positions=True)
    jax.block_until_ready(pos_owned)
    t_layout = time.perf_counter() - t0

    def ef():
        return bridge.energy_and_gradients(state, pos_owned)

    t0 = time.perf_counter()
    energy, node_e, g_pos, _ = jax.block_until_ready(ef())
    first = time.perf_counter() - t0
    res = {"energy": float(energy), "forces": -np.asarray(state.cs.to_global(g_pos), dtype=np.float64),
           "e_nodes": float(np.sum(np.asarray(state.cs.to_global(node_e), dtype=np.float64))),
           "layout_s": t_layout, "first": first}
    del energy, node_e, g_pos
    t1 = time.perf_counter()
    jax.block_until_ready(ef())
    iters = n_iters(time.perf_counter() - t1, a)
    res["t"] = cm.med(cm.time_jax(ef, warmup=max(a.warmup - 1, 0), iters=iters))
    res["iters"] = iters
    if breakdown:
        fwd = jax.jit(bridge.energy_fn)
        strain = jnp.zeros((3, 3), pos_owned.dtype)
        res["t_fwd"] = cm.med(cm.time_jax(lambda: fwd(state, pos_owned, strain)[0], warmup=1, iters=iters))
        del fwd
    tab = state.cs.tables
    rpd = state.rows_per_device()[0]
    res.update(rows=rpd, halo_rows=int(tab.halo_rows), edge_capacity=int(state.edges.edge_capacity))
    del state, pos_owned
    return res


def build_model(random_mace: Any, dtype: Any, cfg: dict[str, Any], script: bool) -> Any:
    """`random_mace(...)` with e3nn's `jit_script_fx` set to `script` while its modules are generated."""
    import e3nn

    old = e3nn.get_optimization_defaults()["jit_script_fx"]
    e3nn.set_optimization_defaults(jit_script_fx=script)
    try:
        return random_mace(SPECIES, dtype=dtype, **cfg)
    finally:
        e3nn.set_optimization_defaults(jit_script_fx=old)


def to_cueq(model: Any, dev: Any) -> Any:
    """The same MACE with cuequivariance kernels (mace-torch's converter; weights transferred)."""
    import torch
    from mace.cli.convert_e3nn_cueq import run as e3nn_to_cueq

    dtype = torch.get_default_dtype()
    try:  # the converter sets torch's default dtype to the model's
        return e3nn_to_cueq(model, device=dev.type, return_model=True).to(dev)
    finally:
        torch.set_default_dtype(dtype)


def all_rows(wrapper_cls: Any) -> Any:
    """`wrapper_cls` with every block row taken as a receiver: node-wise work on ghost rows too."""
    import dataclasses

    class AllRows(wrapper_cls):
        def interaction(self, i: int, g: Any, h: Any) -> Any:
            return super().interaction(i, dataclasses.replace(g, n_receivers=None), h)

    return AllRows


def make_bridge(cls: Any, wrapper_cls: Any, model: Any, mode: str) -> Any:
    """`DistributedMLIP(MACEWrapper(model), n_devices=1, **kw)` of `mode` (the mesh's one device holds the model)."""
    wrapper_cls = all_rows(wrapper_cls) if mode.endswith("all-rows") else wrapper_cls
    return cls(wrapper_cls(model), n_devices=1, **BRIDGE_KW[mode])


def scatter_probe(dev: Any, dtype: Any, n_rows: int, n_real: int, n_total: int, width: int,
                  iters: int) -> list[float]:
    """Median seconds of scattering `(n_total, width)` rows: padding spread over rows vs on one row.

    Both index lists are sorted (the block's edges are sorted by receiver) and the
    `n_real` real edges land on random rows; `spread` sends the others to random rows
    too, `padded` sends them all to one padding row, as the block's padding edges do.
    Two kernels: `index_add_` (atomics: `index_select`'s backward, MACE's scatter_sum)
    and `index_put_(accumulate=True)` (the backward of advanced indexing `x[idx]`, as in
    `node_feats[sender]`, which sorts the indices and walks each run of equal ones).
    Returns `[add spread, add padded, put spread, put padded]`.
    """
    import torch

    g = torch.Generator().manual_seed(0)
    real = torch.randint(0, n_rows, (n_real,), generator=g)
    spread = torch.sort(torch.cat([real, torch.randint(0, n_rows, (n_total - n_real,), generator=g)]))[0].to(dev)
    padded = torch.cat([torch.sort(real)[0], torch.full((n_total - n_real,), n_rows)]).to(dev)
    src = torch.randn((n_total, width), generator=g, dtype=dtype).to(dev)
    out = torch.zeros((n_rows + 1, width), dtype=dtype, device=dev)
    res = []
    for kernel in ("add", "put"):
        for idx in (spread, padded):
            if kernel == "add":
                fn = lambda: out.index_add_(0, idx, src)  # noqa: E731
            else:
                fn = lambda: out.index_put_((idx,), src, accumulate=True)  # noqa: E731
            wall, ev = cm.time_torch(fn, warmup=2, iters=iters, device=dev)
            res.append(cm.med(ev) if ev else cm.med(wall))
    del src, out
    return res


def call_paths(bridge: Any) -> str:
    """Forward call path of every stage op so far (the backward follows the forward's path)."""
    got: dict[str, str] = {}
    for ops in bridge.stages.defined():
        for name, k in ops.named():
            if paths := k.paths_taken():
                got[name] = "/".join(paths)
    kinds = set(got.values())
    if len(kinds) == 1:
        return f"{kinds.pop()} (all {len(got)} stage ops)"
    return ", ".join(f"{n}: {p}" for n, p in got.items())


# ------------------------------------------------------------------ helpers


def sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def n_iters(t_one: float, a: Any) -> int:
    """Timed calls: about `a.seconds` of them, at least 3 (1 in smoke runs), at most `a.iters`."""
    lo = 1 if a.smoke else 3
    return max(lo, min(a.iters, int(a.seconds / max(t_one, 1e-9))))


def reset_torch_peak(platform: str) -> None:
    if platform == "gpu":
        import torch

        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(0)


def jax_peak(platform: str) -> float:
    if platform != "gpu":
        return float("nan")
    import jax

    st = jax.local_devices()[0].memory_stats() or {}
    return float(st.get("peak_bytes_in_use", float("nan")))


def is_oom(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return "out of memory" in text or "resource_exhausted" in text or "outofmemory" in text


ENERGY_TOL = {"float64": 1e-9, "float32": 1e-4}  # relative, of the float64 sums of the node energies


def energy_parity(e_bridge: float, e_native: float, nodes_bridge: float, nodes_native: float, dtype: str
                  ) -> tuple[float, float, bool]:
    """(dE of the totals, dE of the float64 node-energy sums, both relative to native's; whether the sums agree).

    In float32 a total is a sum of ~N terms of a few eV: MACE's scatter_sum accumulates it in
    float32 (rounding grows with N), XLA's reduction pairwise, so the verdict takes the node sums.
    """
    scale = max(abs(nodes_native), 1e-30)
    de_nodes = abs(nodes_bridge - nodes_native) / scale
    return abs(e_bridge - e_native) / scale, de_nodes, de_nodes <= ENERGY_TOL[dtype]


def parity(b: dict[str, Any], n: dict[str, Any], dtype: str) -> tuple[str, bool]:
    """'dE/|E| a [b], max|dF| c eV/A (d of max|F|) ok|MISMATCH' and whether it passed.

    a compares the two programs' total energies; b the float64 sums of their node
    energies, which the verdict takes (`energy_parity`).
    """
    de, de_nodes, ok_e = energy_parity(b["energy"], n["energy"], b["e_nodes"], n["e_nodes"], dtype)
    df = float(np.abs(b["forces"] - n["forces"]).max())
    fmax = float(np.abs(n["forces"]).max())
    rel_f = df / max(fmax, 1e-30)
    tol_f = 1e-8 if dtype == "float64" else 1e-3
    ok_f = rel_f <= tol_f and bool(np.isfinite(b["forces"]).all())
    ok = ok_f and ok_e
    verdict = "ok" if ok and de <= ENERGY_TOL[dtype] else ("ok (node sums)" if ok else "MISMATCH")
    return f"{de:.1e} [{de_nodes:.1e}], {df:.1e} ({rel_f:.0e}) {verdict}", ok


def fmt_mem(x: float) -> str:
    return "n/a" if x != x else cm.human_bytes(x)


def main(argv: list[str] | None = None) -> int:
    p = cm.base_parser(__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="start no new size/dtype after this many seconds (or when its estimate would overrun)")
    p.add_argument("--sizes", default=None, help="comma list of fcc reps per axis (atoms = 4 reps^3); "
                   f"default {','.join(map(str, LADDER))}, smoke {','.join(map(str, SMOKE_LADDER))}")
    p.add_argument("--dtypes", default="float32,float64")
    p.add_argument("--hidden", default=None, help='hidden irreps (default "128x0e + 128x1o", MACE-MP medium)')
    p.add_argument("--modes", default="native,bridge,bridge-tight", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--no-breakdown", action="store_true", help="skip the energy-only timings")
    p.add_argument("--seconds", type=float, default=None, help="timed seconds per run (default 2, smoke 0)")
    p.add_argument("--iters", type=int, default=20, help="most timed calls per run")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls after the first (default 2, smoke 0)")
    p.add_argument("--torchscript", choices=("off", "on"), default="off",
                   help="off (default): PYTORCH_JIT=0 and e3nn jit_script_fx=False, the model runs eagerly; "
                        "on: e3nn's TorchScript defaults (MACE's usual setting), native and bridge")
    p.add_argument("--probe-only", action="store_true", help="run the scatter probe alone (no model runs)")
    p.add_argument("--no-scatter-probe", action="store_true", help="skip the index_add_ padding-row probe")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failed (not out-of-memory) section")
    p.add_argument("--cueq", action="store_true",
                   help="convert the model to cuequivariance kernels (mace's convert_e3nn_cueq) for native and bridge")
    a = p.parse_args(argv)
    a.hidden_given = a.hidden is not None
    a.hidden = a.hidden or "128x0e + 128x1o"
    a.seconds = (0.0 if a.smoke else 2.0) if a.seconds is None else a.seconds
    a.warmup = (0 if a.smoke else 2) if a.warmup is None else a.warmup
    if a.torchscript == "off":
        os.environ["PYTORCH_JIT"] = "0"  # read when torch is imported: @torch.jit.script becomes a no-op
    platform = cm.setup(a.platform)
    import jax
    import torch

    from nvalchemi_jaxbridge.mlip import DistributedMLIP
    from nvalchemi_jaxbridge.mlip.mace import MACEWrapper, mace_input, random_mace
    from tests.mlip._reference import alloy

    modes = [m for m in a.modes.split(",") if m]
    if bad := sorted(set(modes) - set(MODES)):
        raise SystemExit(f"mace_one_gpu: unknown --modes {bad}; choose from {', '.join(MODES)}.")
    if "native" not in modes:
        raise SystemExit("mace_one_gpu: --modes must include native (the reference every bridge run is checked on).")
    dtypes = [d for d in a.dtypes.split(",") if d]
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else (SMOKE_LADDER if a.smoke else LADDER)
    dev = torch.device("cuda", 0) if platform == "gpu" else torch.device("cpu")
    cfg = model_config(a)
    breakdown = not a.no_breakdown

    ctx = cm.context(platform)
    for mod, name in (("mace", "mace-torch"), ("e3nn", "e3nn"), ("ase", "ase"), ("matscipy", "matscipy")):
        ctx[name] = cm._version(mod)
    probe = build_model(random_mace, torch.float64, cfg, a.torchscript == "on")
    n_params = sum(int(q.numel()) for q in probe.parameters())
    del probe
    settings = {
        "model": (f"random ScaleShiftMACE, species {list(SPECIES)}, r_max {cfg['r_max']} A, "
                  f"{cfg['num_interactions']} interactions, correlation {cfg['correlation']}, hidden irreps "
                  f"\"{cfg['hidden_irreps']}\", max_ell {cfg['max_ell']}, {cfg['num_bessel']} Bessel, MLP "
                  f"\"{cfg['mlp_irreps']}\", radial MLP {list(cfg['radial_mlp'])}, {n_params} parameters"),
        "structures": "rattled fcc Cu/Au (a = 3.75 A, rattle 0.1 A, random species), periodic",
        "runs": ("native: model(batch, compute_force=True) on MACE's own batch; bridge: DistributedMLIP("
                 "MACEWrapper(model), n_devices=1) [skin 0.5 A, headroom 1.2], energy_and_gradients(state, "
                 "pos_owned) (energy, forces and dE/dstrain; native computes no stress); bridge-tight: skin 0, "
                 "headroom 1.0"),
        "timing": (f"median of 3..{a.iters} calls (~{a.seconds:g} s) after the first call and {a.warmup} "
                   "warm-up; wall clock (native: + synchronize, CUDA-event median beside it; bridge: + "
                   "block_until_ready); bridge/native = native time / bridge time (atom-steps/s ratio)"),
        "parity": ("bridge vs native of the same size and dtype: |dE|/|E| of the total energies [of the float64 "
                   "sums of their node energies], max |dF| (eV/A) and (its ratio to max |F|); ok if <= 1e-9 / 1e-8 "
                   "(float64) or 1e-4 / 1e-3 (float32); 'ok (node sums)': only the float32 totals differ more "
                   "(MACE's scatter_sum accumulates the total in float32)"),
        "memory": ("native: torch max_memory_allocated; bridge: torch max_memory_allocated (stage "
                   "intermediates) + JAX peak_bytes_in_use (process peak so far, never reset)"),
        "TorchScript": ("off: PYTORCH_JIT=0 and e3nn jit_script_fx=False, native and bridge run the same eager "
                        "model code" if a.torchscript == "off" else
                        "on: e3nn's defaults (TorchScript tensor products and spherical harmonics), native and bridge"),
        "torch TF32 matmul": str(torch.backends.cuda.matmul.allow_tf32),
        "budget": f"{a.budget_s:.0f} s",
        "cuequivariance": ("on: the model converted by mace.cli.convert_e3nn_cueq (layout ir_mul, conv fusion on "
                           "CUDA), same weights, for native and bridge" if a.cueq else "off"),
    }
    rep = cm.Report("mace_one_gpu", "MACE energy + forces on one device: JAX front door vs native", a.out, ctx,
                    settings)
    cols = ["dtype", "atoms", "run", "edges (within cutoff / computed)", "rows (owned + ghost / held)",
            "setup s (layout, first call)", "E+F ms", "atom-steps/s", "bridge/native", "E-only ms",
            "E+F / E-only", "parity (dE/E, max dF)", "peak GPU memory", "mem / native", "call path"]
    rows = rep.table("Energy + forces per call", cols)

    if not a.no_scatter_probe:
        with rep.section("scatter probe"):
            # the 10976-atom case of the default bridge: 17970 held rows (tight), 462396 edges within the
            # cutoff, 697834 computed (capacity 1.2 x the edges within cutoff + skin)
            shape = (200, 2000, 3000) if a.smoke else (17970, 462396, 697834)
            width = 16 if a.smoke else 256
            probe_rows = rep.table(f"Scatter probe: index_add_ of {shape[2]} x {width} rows into {shape[0]} rows, "
                                   f"{shape[2] - shape[1]} of them padding",
                                   ["dtype", "index_add_: padding spread (ms)", "on one row (ms)", "ratio",
                                    "index_put_(accumulate): padding spread (ms)", "on one row (ms)", "ratio"])
            for dtype in dtypes:
                t = scatter_probe(dev, getattr(torch, dtype), *shape, width, 3 if a.smoke else 10)
                rep.row(probe_rows, [dtype, cm.ms(t[0]), cm.ms(t[1]), f"{t[1] / t[0]:.2f}", cm.ms(t[2]),
                                     cm.ms(t[3]), f"{t[3] / t[2]:.2f}"])
            if platform == "gpu":
                torch.cuda.empty_cache()

    if a.probe_only:
        sizes = []
    t_start = time.perf_counter()
    alive = {(m, d): True for m in modes for d in dtypes}
    last_case: tuple[int, float] | None = None  # (atoms, seconds) of the last size/dtype run
    summary: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    models: dict[str, Any] = {}
    bridges: dict[tuple[str, str], Any] = {}
    stop = False
    for reps in sizes:
        if stop:
            break
        atoms = alloy(reps=(reps, reps, reps), species=SPECIES)
        n = len(atoms)
        for dtype in dtypes:
            elapsed = time.perf_counter() - t_start
            # compile and layout costs hardly grow with the size, the timed calls do: scale by sqrt
            est = 0.0 if last_case is None else last_case[1] * max(n / last_case[0], 1.0) ** 0.5
            if elapsed > a.budget_s or (last_case is not None and elapsed + est > a.budget_s):
                rep.note(f"Not run: {n} atoms {dtype} and later (elapsed {elapsed:.0f} s, estimate {est:.0f} s, "
                         f"budget {a.budget_s:.0f} s).")
                stop = True
                break
            t_case = time.perf_counter()
            tdt = getattr(torch, dtype)
            if dtype not in models:
                models[dtype] = build_model(random_mace, tdt, cfg, a.torchscript == "on").to(dev)
                if a.cueq:
                    models[dtype] = to_cueq(models[dtype], dev)
            model = models[dtype]
            nat: dict[str, Any] | None = None
            native_oom = False
            for mode in modes:
                if not alive[mode, dtype]:
                    if mode == "native":
                        native_oom = True
                    continue
                if mode != "native" and nat is None and not native_oom:
                    continue
                n_failed = len(rep.failures)
                with rep.section(f"{n} atoms/{dtype}/{mode}"):
                    reset_torch_peak(platform)
                    try:
                        if mode == "native":
                            t0 = time.perf_counter()
                            batch = mace_input(model, atoms, dtype=tdt, device=dev)
                            sync(dev)
                            t_data = time.perf_counter() - t0
                            r = run_native(model, batch, dev, a, breakdown)
                            r["layout_s"] = t_data
                            n_edges = int(batch["edge_index"].shape[1])
                            del batch
                        else:
                            key = (mode, dtype)
                            if key not in bridges:
                                bridges[key] = make_bridge(DistributedMLIP, MACEWrapper, model, mode)
                            r = run_bridge(bridges[key], atoms, np.dtype(dtype), a, breakdown)
                    except Exception as e:
                        if not is_oom(e):
                            raise
                        alive[mode, dtype] = False
                        native_oom = native_oom or mode == "native"
                        mem = (f"torch {fmt_mem(torch.cuda.max_memory_allocated(0))}, jax peak "
                               f"{fmt_mem(jax_peak(platform))}" if platform == "gpu" else "n/a")
                        rep.row(rows, [dtype, n, mode, "-", "-", "-", "OOM", "-", "-", "-", "-", "-", mem, "-",
                                       f"out of memory: {str(e).splitlines()[0][:120]}"])
                        rep.note(f"{mode} {dtype}: out of memory at {n} atoms; larger sizes skipped.")
                        gc.collect()
                        if platform == "gpu":
                            torch.cuda.empty_cache()
                        continue
                    fwd = r.get("t_fwd", float("nan"))
                    ratio_fwd = f"{r['t'] / fwd:.2f}" if fwd == fwd else "-"
                    if mode == "native":
                        nat = r
                        mem_total = r.get("peak_torch", float("nan"))
                        ev = r["t_event"]
                        t_cell = cm.ms(r["t"]) + (f" (events {cm.ms(ev)})" if ev == ev else "")
                        rep.row(rows, [dtype, n, mode, f"{n_edges} / {n_edges}", f"{n} / {n}",
                                       f"{r['layout_s']:.1f} (data), {r['first']:.1f}", t_cell,
                                       f"{n / r['t']:.3g}", "1", cm.ms(fwd), ratio_fwd, "-",
                                       fmt_mem(mem_total), "1", "torch (MACE forward + autograd.grad)"])
                    else:
                        if nat is not None:
                            par, ok = parity(r, nat, dtype)
                            if not ok:
                                failed.append(f"{n} atoms {dtype} {mode}: {par}")
                        else:
                            par = f"no native reference (native OOM); E {r['energy']:.6g}"
                        pt = torch.cuda.max_memory_allocated(0) if platform == "gpu" else float("nan")
                        jp = jax_peak(platform)
                        mem_total = pt + jp
                        base_mem = nat.get("peak_torch", float("nan")) if nat is not None else float("nan")
                        mem_ratio = f"{mem_total / base_mem:.2f}" if mem_total == mem_total and base_mem == base_mem else "-"
                        rp = r["rows"]
                        rep.row(rows, [dtype, n, mode, f"{rp['edges']} / {r['edge_capacity']}",
                                       f"{rp['owned']} + {rp['ghost']} / {r['halo_rows']}",
                                       f"{r['layout_s']:.1f}, {r['first']:.1f}", cm.ms(r["t"]),
                                       f"{n / r['t']:.3g}", f"{nat['t'] / r['t']:.2f}x" if nat else "-", cm.ms(fwd),
                                       ratio_fwd,
                                       par, f"{fmt_mem(mem_total)} (torch {fmt_mem(pt)} + jax {fmt_mem(jp)})",
                                       mem_ratio, call_paths(bridges[mode, dtype])])
                        if nat is not None:
                            summary.setdefault(f"{mode}/{dtype}", {}).update(
                                n=n, ratio=nat["t"] / r["t"],
                                mem=mem_total / base_mem if mem_total == mem_total and base_mem == base_mem else None)
                    del r
                    gc.collect()
                    if platform == "gpu":
                        torch.cuda.empty_cache()
                if a.fail_fast and len(rep.failures) > n_failed:
                    rep.note("--fail-fast: stopped after this failure.")
                    stop = True
                    break
            if stop:
                break
            last_case = (n, time.perf_counter() - t_case)

    with rep.section("targets"):
        rep.note("Node-wise work: the embedding and the interaction blocks' own node-wise parts (linear_up, "
                 "the skip tensor product, the message linear) run on every held row of the block (ghosts, "
                 "periodic images here, and padding included); the product basis and readouts on the owned "
                 "rows only (every row in bridge-tight-all-rows); edge-wise work on every computed edge.")
        for k, s in summary.items():
            mem = s.get("mem")
            mem_txt = "n/a" if mem is None else f"{mem:.2f}x ({'MET' if mem <= 1.1 else 'NOT MET'})"
            rep.note(f"{k}, largest size with results ({s['n']} atoms): bridge/native atom-steps/s "
                     f"{s['ratio']:.2f}x (target >= 0.95x: {'MET' if s['ratio'] >= 0.95 else 'NOT MET'}); peak "
                     f"memory vs native {mem_txt} (target <= 1.1x).")
        if failed:
            raise AssertionError("bridge vs native parity failed: " + "; ".join(failed))
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
