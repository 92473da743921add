"""End-to-end MD step: Lennard-Jones argon and charged NaCl (DSF), torch, Triton and cell-list kernels.

    PYTHONPATH=. python3 benchmarks/md_step.py --out OUTDIR [--smoke] [--budget-s 240]
        [--systems lj,dsf] [--kernels torch,triton[,torch-cells]]

For each system, kernel and size three runs of a velocity Verlet step:
- `torch, 1 dev`: no bridge. The torch op on the full periodic system on one
  device: owned atoms plus their periodic ghost images (rows from a one-device
  `HaloPlan`, exactly `n_owned + n_ghost` rows), forces folded back with
  `index_add_`, Verlet in torch. Timed as the bridge runs are: wall clock of a step and a
  synchronisation (CUDA events, which leave out the host's launch and sync time, favoured it).
- `bridge, 1 dev` and `bridge, 2 dev`: one `jax.jit` program per step over the
  `CompiledSpec` pytree (GatherInputs -> torch/Triton op via buffer_callback ->
  ScatterOutputs + AllReduceSum) plus the Verlet update; one process drives both
  devices through a 2-device mesh. Timed by wall clock + `block_until_ready`.
The `torch` and `triton` demo kernels are dense: O(R^2) pairs (and, for the torch
ops, R^2 memory) per block of R rows. `torch-cells` (LJ only) is the cell-list op
`jaxbridge_demo::lj_energy_forces_cells`: O(R) work and memory, chunked, so its
ladder runs from ~10^4 to ~2 x 10^6 atoms. Sizes grow until a step takes longer
than --limit-s, a run runs out of memory, or the time budget is spent; the table
says which.
First-step forces of every bridge run are checked against the no-bridge run.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import _common as cm
import numpy as np

LADDER = {"lj": [14, 18, 22, 28, 35], "dsf": [11, 14, 18, 22, 28]}  # cubic cells; 4 resp. 8 atoms each
# the cell-list op: 10976, 42592, 171500, 500000, 1000188 and 2048000 argon atoms
LADDER_CELLS = [14, 22, 35, 50, 63, 80]
# smoke: 4 argon atoms (one cell, so its ghosts are images of its own atoms; 40 rows, where the Triton
# interpreter runs the dense LJ kernel in a fraction of a second) and 64 ions of rock salt
SMOKE_LADDER = {"lj": [1], "dsf": [2]}
SMOKE_LADDER_CELLS = [2, 3]
KERNELS = ("torch", "triton", "torch-cells")
OP_NAMES = {  # (system, kernel) -> jaxbridge_demo:: op
    ("lj", "torch"): "lj_energy_forces", ("lj", "triton"): "lj_energy_forces_triton",
    ("lj", "torch-cells"): "lj_energy_forces_cells",
    ("dsf", "torch"): "dsf_energy_forces", ("dsf", "triton"): "dsf_energy_forces_triton",
}
SMOKE_CUTOFF = 4.0  # A: past argon's nearest neighbours (3.7 A); small blocks for the Triton interpreter
DT = {"lj": 2.0, "dsf": 1.0}  # fs
MODES = ("torch, 1 dev", "bridge, 1 dev", "bridge, 2 dev")


@dataclasses.dataclass
class Case:
    """One system at one size with its initial state (numpy, global order)."""

    kind: str
    kernel: str
    cells: int
    positions: np.ndarray
    velocities: np.ndarray
    masses: np.ndarray
    charges: np.ndarray | None
    cell: np.ndarray
    cutoff: float

    @property
    def n(self) -> int:
        return len(self.positions)


def make_case(kind: str, kernel: str, cells: int, cutoff: float | None = None) -> Case:
    """Argon (LJ) or rock salt (DSF) with small random displacements and thermal velocities."""
    from nvalchemi_jaxbridge.demo import DSFParams, LJParams, argon_fcc, rock_salt

    s = argon_fcc(cells, temperature=60.0) if kind == "lj" else rock_salt(cells, temperature=300.0)
    rng = np.random.default_rng(cells)
    pos = s.positions + rng.normal(scale=0.05, size=s.positions.shape)
    if cutoff is None:
        cutoff = LJParams().cutoff if kind == "lj" else DSFParams().cutoff
    return Case(kind, kernel, cells, pos, np.asarray(s.velocities), np.asarray(s.masses),
                None if s.charges is None else np.asarray(s.charges), np.asarray(s.cell), cutoff)


def op_for(kind: str, kernel: str):
    """The demo op: jaxbridge_demo::{lj,dsf}_energy_forces[_triton] or lj_energy_forces_cells."""
    import torch

    import nvalchemi_jaxbridge.demo.torch_ops  # noqa: F401 - registers the ops (the cell-list op too)

    if (kind, kernel) not in OP_NAMES:
        have = ", ".join(f"{k}/{kn}" for k, kn in OP_NAMES)
        raise SystemExit(f"md_step: no {kernel!r} kernel for the {kind!r} system; available: {have}.")
    return getattr(torch.ops.jaxbridge_demo, OP_NAMES[kind, kernel]).default


def ladder_for(kind: str, kernel: str, smoke: bool) -> list[int]:
    """Cubic cells per axis of the sizes to run: the cell-list op goes far past the dense ops."""
    if kernel == "torch-cells":
        return SMOKE_LADDER_CELLS if smoke else LADDER_CELLS
    return (SMOKE_LADDER if smoke else LADDER)[kind]


def plan_for(case: Case, n_devices: int, skin: float):
    """A HaloPlan with no spare capacity (headroom 1.0), so kernels see almost no padding rows."""
    from nvalchemi_jaxbridge.layout import HaloPlan

    return HaloPlan.build(case.positions, case.cell, cutoff=case.cutoff, skin=skin, n_devices=n_devices,
                          headroom=1.0)


def _mvv2e() -> float:
    from nvalchemi_jaxbridge.demo.units import MVV2E

    return MVV2E


# ------------------------------------------------------------------ no bridge


def torch_stepper(case: Case, dtype: str, dev, skin: float):
    """(step, first-step forces (N, 3) torch, energy, info) of the no-bridge run; `step()` advances one Verlet step.

    `info["rows"]` is the block's row count, `info["op_args"]()` the op's array arguments at the current state.
    """
    import torch

    plan = plan_for(case, 1, skin)
    n_pad = int(plan.n_owned[0] + plan.n_ghost[0])
    tdt = getattr(torch, dtype)
    ids = torch.as_tensor(np.asarray(plan.halo_global)[0, :n_pad], device=dev)
    shift = torch.as_tensor(np.asarray(plan.halo_offset)[0, :n_pad], dtype=tdt, device=dev)
    mask = torch.arange(n_pad, device=dev) < int(plan.n_owned[0])
    op = op_for(case.kind, case.kernel)
    q_rows = None if case.charges is None else torch.as_tensor(case.charges, dtype=tdt, device=dev)[ids]
    inv_m = (1.0 / (_mvv2e() * torch.as_tensor(case.masses, dtype=tdt, device=dev)))[:, None]
    x = torch.as_tensor(case.positions, dtype=tdt, device=dev)
    v = torch.as_tensor(case.velocities, dtype=tdt, device=dev)
    dt = DT[case.kind]

    def forces(x):
        rows = x.index_select(0, ids) + shift
        e, f_rows = op(rows, mask, cutoff=case.cutoff) if q_rows is None else op(rows, q_rows, mask, cutoff=case.cutoff)
        return e, torch.zeros_like(x).index_add_(0, ids, f_rows)

    e0, f0 = forces(x)
    state = {"x": x, "v": v, "f": f0}

    def step():
        s = state
        v = s["v"] + 0.5 * dt * s["f"] * inv_m
        x = s["x"] + dt * v
        _, f = forces(x)
        state.update(x=x, v=v + 0.5 * dt * f * inv_m, f=f)
        return f

    def op_args():
        rows = state["x"].index_select(0, ids) + shift
        return (rows, mask) if q_rows is None else (rows, q_rows, mask)

    return step, f0, e0, {"rows": n_pad, "op_args": op_args}


def run_torch(case: Case, dtype: str, dev, iters: int, warmup: int, skin: float):
    """(median step s, first-step forces (N, 3) numpy, extra info) of the pure torch run."""
    import torch

    step, f0, e0, info = torch_stepper(case, dtype, dev, skin)
    iters = _iters_for(lambda: (step(), torch.cuda.synchronize(dev) if dev.type == "cuda" else None), iters)
    wall, _ = cm.time_torch(step, warmup=warmup, iters=iters, device=dev)
    t = cm.med(wall)  # as the bridge runs: wall clock of the step and a synchronisation
    return t, f0.double().cpu().numpy(), float(e0), {"rows": info["rows"]}


# ------------------------------------------------------------------ bridge


def bridge_stepper(case: Case, n_dev: int, dtype: str, skin: float):
    """(one, first-step forces (N, 3) numpy, energy, info) through compile() on an n_dev mesh.

    `one()` advances the state one Verlet step: one dispatch of one jitted program. `info["program"]`
    is that program, `info["args"]()` its current arguments and `info["op_args"]()` the op's array
    arguments (halo rows) at the current state.
    """
    import jax

    from nvalchemi_jaxbridge.kernels import compile as kcompile
    from nvalchemi_jaxbridge.lower import make_mesh
    from nvalchemi_jaxbridge.spec import DistributionSpec, OpAdapter
    from nvalchemi_jaxbridge.spec.policies import HaloStoragePolicy

    plan = plan_for(case, n_dev, skin)
    op = op_for(case.kind, case.kernel)
    charged = case.charges is not None
    adapter = OpAdapter(op, gather_inputs=[0, 1] if charged else [0], scatter_outputs=[1], all_reduce_outputs=[0])
    spec = DistributionSpec(policy=HaloStoragePolicy(), custom_ops=(adapter,))
    cs = kcompile(spec, make_mesh(n_dev), plan, positions={adapter: [0]})
    oc, hr, d = cs.tables.owned_capacity, cs.tables.halo_rows, n_dev
    put = lambda a: cs.owned(np.asarray(a, dtype=dtype))  # noqa: E731
    x = cs.owned(case.positions.astype(dtype), positions=True)
    v = put(case.velocities)
    inv_m = _owned_inverse_mass(cs, plan, case.masses, dtype)
    q = put(case.charges) if charged else None
    dt = DT[case.kind]

    def owned_rows(fh):
        return fh.reshape(d, hr, 3)[:, :oc].reshape(d * oc, 3)

    def force(cs, x, q):
        args = (x, q, cs.halo_owned_mask()) if charged else (x, cs.halo_owned_mask())
        e, fh = cs.call(adapter, *args, cutoff=case.cutoff)
        return e, owned_rows(fh)

    @jax.jit
    def first(cs, x, q):
        return force(cs, x, q)

    @jax.jit
    def step(cs, x, v, f, q):
        v = v + 0.5 * dt * f * inv_m
        x = x + dt * v
        e, f = force(cs, x, q)
        return x, v + 0.5 * dt * f * inv_m, f, e

    e0, f0 = first(cs, x, q)
    state = [x, v, f0]

    def one():
        out = step(cs, *state, q)
        state[:] = out[:3]
        return out

    info = {"oc": oc, "hr": hr, "needed": int(np.max(plan.n_owned + plan.n_ghost)),
            "program": step, "args": lambda: (cs, *state, q),
            "op_args": lambda: (cs.owned_to_halo(state[0], positions=True),
                                *(() if q is None else (cs.owned_to_halo(q),)), cs.halo_owned_mask())}
    return one, cs.to_global(np.asarray(f0, dtype=np.float64)), float(e0), info


def run_bridge(case: Case, n_dev: int, dtype: str, iters: int, warmup: int, skin: float):
    """(median step s, first-step forces (N, 3), energy, info) through compile() on an n_dev mesh."""
    import jax

    one, f0g, e0, info = bridge_stepper(case, n_dev, dtype, skin)
    iters = _iters_for(lambda: jax.block_until_ready(one()), iters)
    times = cm.time_jax(one, warmup=warmup, iters=iters)
    args = info.pop("args")()
    info["rows_held"] = sorted({s.data.shape[0] for a in args[1:4] for s in a.addressable_shards})
    info["memory"] = _program_memory(info.pop("program"), *args)
    del args
    return cm.med(times), f0g, e0, info


def _iters_for(call, iters: int, seconds: float = 3.0) -> int:
    """Run one step (compiles, warms up) and choose how many to time: about `seconds` of steps, at least 3."""
    import time as _t

    t0 = _t.perf_counter()
    call()
    return max(min(3, iters), min(iters, int(seconds / max(_t.perf_counter() - t0, 1e-9))))


def _owned_inverse_mass(cs, plan, masses, dtype):
    """1 / (MVV2E m) per owned row, 0 on padding rows (they never move)."""
    m = np.asarray(plan.to_owned(np.asarray(masses, np.float64)[:, None]))
    inv = np.where(m > 0, 1.0 / (_mvv2e() * np.where(m > 0, m, 1.0)), 0.0).astype(dtype)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nvalchemi_jaxbridge.lower.tables import place

    return place(inv.reshape(-1, 1), NamedSharding(cs.mesh, P(cs.axis)))


def _program_memory(fn, *args) -> str:
    """XLA's per-device memory of a jitted program (arguments + outputs + temporaries)."""
    try:
        ma = fn.lower(*args).compile().memory_analysis()
        total = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
        return cm.human_bytes(total)
    except Exception as e:  # noqa: BLE001 - informational
        return f"n/a ({type(e).__name__})"


# ------------------------------------------------------------------ memory


def reset_peaks(platform: str) -> None:
    """Reset torch's peak counters (JAX's peak cannot be reset: it is the process peak)."""
    if platform == "gpu":
        import torch

        torch.cuda.empty_cache()
        for i in range(torch.cuda.device_count()):
            # The caching allocator of a device torch has not touched yet refuses a reset
            # ("Invalid device argument"): initialise it with a tiny allocation first.
            torch.empty(1, device=f"cuda:{i}")
            torch.cuda.reset_peak_memory_stats(i)


def peaks(platform: str, n_dev: int) -> str:
    """Per device: torch peak since the reset; JAX process peak so far."""
    if platform != "gpu":
        return "n/a (CPU)"
    import jax
    import torch

    out = []
    for i in range(n_dev):
        tp = torch.cuda.max_memory_allocated(i)
        st = jax.local_devices()[i].memory_stats() or {}
        jp = st.get("peak_bytes_in_use", float("nan"))
        out.append(f"gpu{i}: torch {cm.human_bytes(tp)}, jax {cm.human_bytes(jp) if jp == jp else 'n/a'}")
    return "; ".join(out)


def _is_oom(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return "out of memory" in text or "resource_exhausted" in text or "outofmemory" in text


def main(argv: list[str] | None = None) -> int:
    p = cm.base_parser(__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop starting new sizes after this many seconds")
    p.add_argument("--limit-s", type=float, default=1.0, help="largest step time worth growing past")
    p.add_argument("--iters", type=int, default=None, help="timed steps (default 8, smoke 1)")
    p.add_argument("--systems", default="lj,dsf", help="comma list of lj, dsf")
    # torch-cells is opt-in: run_all.sh's time budget and its smoke test count the default combinations
    p.add_argument("--kernels", default="torch,triton",
                   help="comma list of torch, triton, torch-cells (the cell-list op; LJ only, 10^4 .. 2x10^6 atoms)")
    p.add_argument("--skin", type=float, default=1.0)
    p.add_argument("--min-atoms", type=int, default=0, help="skip the ladder's sizes below this many atoms")
    a = p.parse_args(argv)
    platform = cm.setup(a.platform)
    import jax
    import torch

    iters = a.iters or (1 if a.smoke else 8)
    warmup = 0 if a.smoke else 1  # plus the one step that chooses the repetitions
    dev = torch.device("cuda", 0) if platform == "gpu" else torch.device("cpu")
    settings = {"dtype": a.dtype, "cutoff": f"{SMOKE_CUTOFF} A (smoke)" if a.smoke else "LJ 8.5 A, DSF 9.0 A", "timing": f"median of up to {iters} steps (at most ~3 s of steps, >= {min(3, iters)}) after {warmup + 1} warm-up; wall clock of each step and a synchronisation, every run",
                "plan": f"HaloPlan headroom 1.0, skin {a.skin} A, built once (no rebuild during the timed steps)",
                "limits": f"step > {a.limit_s} s or out of memory stops a run; budget {a.budget_s:.0f} s",
                "memory": "torch: max_memory_allocated since the run began; jax: peak_bytes_in_use of the process so far"}
    rep = cm.Report("md_step", "End-to-end MD step (velocity Verlet)", a.out, cm.context(platform), settings)
    if len(jax.devices()) < 2:
        rep.note(f"Only {len(jax.devices())} device(s): the 2-device runs are skipped.")
    rows = rep.table("Steps", ["system", "kernel", "atoms", "run", "rows/device (held / needed)", "step (ms)",
                               "steps/s", "atom-steps/s", "vs torch 1 dev", "2-dev speedup (eff.)",
                               "force parity", "XLA program/device", "peak memory"])
    t_start = time.perf_counter()
    summary: dict[tuple[str, str], dict[str, float]] = {}
    failed_parity = []
    kernels = [kn for kn in a.kernels.split(",") if kn]
    if bad := sorted(set(kernels) - set(KERNELS)):
        raise SystemExit(f"md_step: unknown --kernels {bad}; choose from {', '.join(KERNELS)}.")
    combos = [(k, kn) for k in a.systems.split(",") if k for kn in kernels if (k, kn) in OP_NAMES]
    for k, kn in [(k, kn) for k in a.systems.split(",") if k for kn in kernels if (k, kn) not in OP_NAMES]:
        rep.note(f"{k}/{kn}: not run, there is no {kn} op for {k} (only LJ has a cell-list op).")
    if a.smoke and ("dsf", "triton") in combos and ("lj", "triton") in combos:
        # the Triton interpreter takes seconds per step on the CPU; one Triton system checks the Triton rows
        combos.remove(("dsf", "triton"))
        rep.note("dsf/triton: not run in the smoke run (lj/triton covers the Triton path).")
    for i_combo, (kind, kernel) in enumerate(combos):
        # each system/kernel pair gets an equal share of what is left of the budget
        left = a.budget_s - (time.perf_counter() - t_start)
        deadline = time.perf_counter() + left / (len(combos) - i_combo)
        alive = {m: True for m in MODES}
        if len(jax.devices()) < 2:
            alive["bridge, 2 dev"] = False
        for cells in ladder_for(kind, kernel, a.smoke):
            if not any(alive.values()):
                break
            if time.perf_counter() > deadline:
                rep.note(f"{kind}/{kernel}: stopped before {cells}^3 cells: its share of the "
                         f"{a.budget_s:.0f} s time budget is spent.")
                break
            case = make_case(kind, kernel, cells, SMOKE_CUTOFF if a.smoke else None)
            if case.n < a.min_atoms:
                continue
            ref_f = None
            res: dict[str, float] = {}
            for mode in MODES:
                if not alive[mode]:
                    continue
                with rep.section(f"{kind}/{kernel}/{case.n} atoms/{mode}"):
                    n_dev = 2 if mode.endswith("2 dev") else 1
                    reset_peaks(platform)
                    try:
                        if mode.startswith("torch"):
                            t, f0, e0, info = run_torch(case, a.dtype, dev, iters, warmup, a.skin)
                            ref_f = f0
                            held = f"{info['rows']} / {info['rows']}"
                            mem_prog = "-"
                        else:
                            t, f0, e0, info = run_bridge(case, n_dev, a.dtype, iters, warmup, a.skin)
                            held = (f"owned {info['oc']} (state shards: {info['rows_held']}), "
                                    f"halo {info['hr']} / {info['needed']}")
                            mem_prog = info["memory"]
                    except Exception as e:
                        if _is_oom(e):
                            alive[mode] = False
                            rep.row(rows, [kind, kernel, case.n, mode, "-", "OOM", "-", "-", "-", "-", "-", "-",
                                           peaks(platform, n_dev)])
                            reset_peaks(platform)
                            continue
                        raise
                    res[mode] = t
                    parity = "-"
                    if ref_f is not None and not mode.startswith("torch"):
                        err = float(np.abs(f0 - ref_f).max() / max(np.abs(ref_f).max(), 1e-30))
                        tol = 1e-3 if a.dtype == "float32" else 1e-8
                        parity = f"{err:.1e} {'ok' if err <= tol else 'FAIL'}"
                        if err > tol:
                            failed_parity.append(f"{kind}/{kernel}/{case.n}/{mode}: {err:.1e}")
                    base = res.get("torch, 1 dev")
                    one = res.get("bridge, 1 dev")
                    vs = f"{base / t:.2f}x" if base and not mode.startswith("torch") else "-"
                    sp = f"{one / t:.2f}x ({one / t / 2:.0%})" if one and n_dev == 2 else "-"
                    rep.row(rows, [kind, kernel, case.n, mode, held, cm.ms(t), f"{1 / t:.3g}",
                                   f"{case.n / t:.3g}", vs, sp, parity, mem_prog, peaks(platform, n_dev)])
                    if t > a.limit_s:
                        alive[mode] = False
                if platform == "gpu":
                    torch.cuda.empty_cache()
            if res:
                summary[kind, kernel] = {"n": case.n, **res}
    with rep.section("targets"):
        if failed_parity:
            raise AssertionError("first-step force parity failed: " + "; ".join(failed_parity))
        for (kind, kernel), r in summary.items():
            one, two, base = r.get("bridge, 1 dev"), r.get("bridge, 2 dev"), r.get("torch, 1 dev")
            parts = [f"largest size with results: {int(r['n'])} atoms"]
            if one and two:
                parts.append(f"2 dev / 1 dev atom-steps/s {one / two:.2f}x (target >= 1.8x: "
                             f"{'MET' if one / two >= 1.8 else 'NOT MET'})")
            if one and base:
                parts.append(f"bridge 1 dev / torch 1 dev {base / one:.2f}x (target >= 0.95x: "
                             f"{'MET' if base / one >= 0.95 else 'NOT MET'})")
            rep.note(f"{kind}/{kernel}: " + "; ".join(parts) + ".")
        rep.note("Rows per device: every per-atom array of the bridge runs is held as owned storage "
                 "(owned_capacity rows) or halo storage (halo_rows = owned + ghost capacity); 'needed' is the "
                 "largest n_owned + n_ghost. Every kernel sees the whole halo block; the dense ones (torch, "
                 "triton) evaluate all of its R^2 row pairs, torch-cells only the pairs of neighbouring cells.")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
