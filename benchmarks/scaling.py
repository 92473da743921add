"""Scaling: the MD step over 1, 2, 4, 8 devices (strong and weak), and halo exchanges on device grids.

One velocity Verlet step is one `jax.jit` program over the `CompiledSpec` (GatherInputs -> the force kernel
on every device's halo block -> ScatterOutputs + AllReduceSum -> update), on the automatic device grid
(slabs, 2-D or 3-D). Strong: one cubic system on every device count. Weak: one cubic block per device,
replicated along the axes the grid splits (2x1x1 on 2 devices, 2x2x1 on 4, 2x2x2 on 8), so every device's
domain is the same cube. Per device count: the median step, atom-steps/s, parallel efficiency (strong:
t1 / (n tn); weak: t1 / tn), the halo rows and bytes a step moves (from the plan's tables), and the split
into kernel and the rest: the same step with the kernel replaced by a trivial JAX function of the same
shapes, timed in turns with it. Correctness (a failure otherwise): each device count's first-step forces,
computed in float64 with the same kernel, equal the smallest count's within 1e-9 of max |F| (weak: each
replica's forces its block original's). Halo part: GatherInputs / ScatterOutputs of a real argon plan on
the slab grid and the automatic grid of each count >= 2, checked against a numpy reference.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from benchmarks import common as cm

KERNELS = ("lj-triton", "lj-torch", "lj-cells", "lj-jax", "dsf-triton", "dsf-torch", "dsf-jax")
SYSTEM = {"lj": "argon", "dsf": "rocksalt"}
ATOMS_PER_CELL = {"argon": 4, "rocksalt": 8}
SIZES = {"gpu": [2_048_000, 1_000_000, 1_000_000], "cpu": [2048, 256, 6912], "smoke": [108, 108, 256]}
PARITY_RTOL = 1e-9  # float64 first-step forces between device counts, relative to max |F|
SMOKE_CUTOFF = 4.0
LOOP = 20  # exchanges per program in the looped halo measurement


def parse_devices(counts: tuple[int, ...] | None, available: int) -> list[int]:
    """Device counts asked for (default: powers of two up to `available`), ascending; bad ones raise."""
    if counts is None:
        return [2**k for k in range(available.bit_length()) if 2**k <= available]
    out = sorted(set(counts))
    if not out or out[0] < 1:
        raise ValueError(f"--devices needs positive device counts, got {counts}.")
    if out[-1] > available:
        raise ValueError(f"--devices asks for {out[-1]} devices but JAX sees {available}; drop the larger counts, or on "
                         "the CPU raise the virtual device count (the suite starts 8).")
    return out


def cubic_cells(atoms: int, system: str) -> int:
    """Cubic cells per axis whose system is closest to `atoms` atoms (at least 1)."""
    return max(1, round((atoms / ATOMS_PER_CELL[system]) ** (1 / 3)))


def block_grid(n_devices: int) -> tuple[int, int, int]:
    """How a cube is split over `n_devices` (the automatic grid of a cubic cell): the weak-scaling replicas."""
    from nvalchemi_jaxbridge.layout.grid import choose_grid

    return choose_grid(n_devices, np.eye(3), (True, True, True))


def grid_name(grid: tuple[int, int, int]) -> str:
    """'1 (no split)', '1-D slab 2x1x1', '2-D 2x2x1' or '3-D 2x2x2'."""
    split = sum(g > 1 for g in grid)
    return "1 (no split)" if split == 0 else f"{'1-D slab' if split == 1 else f'{split}-D'} {'x'.join(map(str, grid))}"


@dataclasses.dataclass(frozen=True)
class Case:
    """`reps` copies of one periodic block of `block_atoms` atoms; atom r * block_atoms + i is atom i of replica r."""

    system: str
    cells: int
    reps: tuple[int, int, int]
    positions: np.ndarray
    velocities: np.ndarray
    masses: np.ndarray
    charges: np.ndarray | None
    cell: np.ndarray
    block_atoms: int

    @property
    def n(self) -> int:
        return len(self.positions)


def make_case(system: str, cells: int, reps: tuple[int, int, int] = (1, 1, 1)) -> Case:
    """A cubic block of `cells`^3 unit cells (thermal velocities, rattled, wrapped) tiled `reps` times."""
    from nvalchemi_jaxbridge.app.run_config import wrap
    from nvalchemi_jaxbridge.demo import argon_fcc, rock_salt

    s = argon_fcc(cells, temperature=60.0) if system == "argon" else rock_salt(cells, temperature=300.0)
    pos = wrap(s.positions + np.random.default_rng(cells).normal(scale=0.05, size=s.positions.shape), s.cell, s.periodic)
    edge = np.diag(s.cell)
    shifts = np.array(list(itertools.product(*(range(r) for r in reps))), dtype=np.float64) * edge
    tile = lambda a: np.concatenate([a] * len(shifts)) if a is not None else None  # noqa: E731
    return Case(system, cells, tuple(reps), (pos[None] + shifts[:, None]).reshape(-1, 3), tile(s.velocities),
                tile(s.masses), tile(s.charges), np.diag(edge * np.array(reps)), len(pos))


def params_for(system: str, cutoff: float | None):
    from nvalchemi_jaxbridge.demo import DSFParams, LJParams

    p = LJParams() if system == "argon" else DSFParams()
    return p if cutoff is None else dataclasses.replace(p, cutoff=cutoff)


def _adapter(kernel: str, null: bool = False):
    """The force op's OpAdapter (positions and charges gathered, forces scattered, energy summed), or a trivial twin."""
    import jax.numpy as jnp

    from benchmarks.md_step import op_for
    from nvalchemi_jaxbridge.app.run_config import potential_for
    from nvalchemi_jaxbridge.spec import OpAdapter

    charged = kernel.startswith("dsf")
    if null:  # the same signature and output shapes, every input used, no work
        def op(x, *rest):
            q = rest[0] if charged else 1.0
            w = rest[1 if charged else 0].astype(x.dtype)
            return 1e-12 * jnp.sum(w * q * x[:, 0]), 1e-12 * (q[:, None] if charged else 1.0) * x
    elif kernel.endswith("-jax"):
        op = potential_for(SYSTEM[kernel.split("-")[0]]).jax_block()
    else:
        op = op_for(kernel)
    return OpAdapter(op, gather_inputs=[0, 1] if charged else [0], scatter_outputs=[1], all_reduce_outputs=[0])


@dataclasses.dataclass(frozen=True)
class Result:
    step_s: float
    null_s: float
    forces: np.ndarray  # first-step forces in the timed dtype, (N, 3) float64, global order
    grid: tuple[int, int, int]
    owned_max: int
    rows_max: int
    halo_rows: int
    halo_bytes: str
    program: str


def _setup(case: Case, n_dev: int, kernel: str, dtype: str, cutoff, null: bool):
    """(plan, CompiledSpec, adapters, force(cs, x, q), x, q) of `case` on `n_dev` devices."""
    from nvalchemi_jaxbridge.kernels import compile as kcompile
    from nvalchemi_jaxbridge.layout import HaloPlan
    from nvalchemi_jaxbridge.lower import make_mesh
    from nvalchemi_jaxbridge.spec import DistributionSpec
    from nvalchemi_jaxbridge.spec.policies import HaloStoragePolicy

    p = params_for(case.system, cutoff)
    plan = HaloPlan.build(case.positions, case.cell, cutoff=p.cutoff, skin=1.0, n_devices=n_dev, headroom=1.0)
    adapters = (_adapter(kernel),) + ((_adapter(kernel, null=True),) if null else ())
    cs = kcompile(DistributionSpec(policy=HaloStoragePolicy(), custom_ops=adapters), make_mesh(n_dev), plan,
                  positions={ad: [0] for ad in adapters})
    oc, hr, charged = cs.tables.owned_capacity, cs.tables.halo_rows, case.charges is not None

    def force(adapter):
        def f(cs, x, q):
            args = (x, q, cs.halo_owned_mask()) if charged else (x, cs.halo_owned_mask())
            e, fh = cs.call(adapter, *args, *p.args())
            return e, fh.reshape(n_dev, hr, 3)[:, :oc].reshape(n_dev * oc, 3)

        return f

    x = cs.owned(case.positions.astype(dtype), positions=True)
    q = cs.owned(case.charges.astype(dtype)) if charged else None
    return plan, cs, adapters, force, x, q


def first_forces(case: Case, n_dev: int, kernel: str, dtype: str, cutoff) -> np.ndarray:
    """First-step forces (N, 3), global order, of `case` on `n_dev` devices in `dtype`: one call."""
    import jax

    _, cs, (adapter,), force, x, q = _setup(case, n_dev, kernel, dtype, cutoff, null=False)
    return cs.to_global(np.asarray(jax.jit(force(adapter))(cs, x, q)[1], dtype=np.float64))


def run_case(case: Case, n_dev: int, kernel: str, dtype: str, cutoff, iters: int, twin: bool = True) -> Result:
    """Time the MD step and (`twin`) its trivial-kernel twin in turns on `n_dev` devices; keep the first forces."""
    import jax

    from benchmarks.md_step import DT, _mvv2e
    from nvalchemi_jaxbridge.app.report import collectives
    from nvalchemi_jaxbridge.lower.tables import place

    plan, cs, adapters, force, x, q = _setup(case, n_dev, kernel, dtype, cutoff, null=twin)
    real = adapters[0]
    v = cs.owned(case.velocities.astype(dtype))
    m = np.asarray(plan.to_owned(np.asarray(case.masses, np.float64)[:, None]))
    inv_m = place(np.where(m > 0, 1.0 / (_mvv2e() * np.where(m > 0, m, 1.0)), 0.0).astype(dtype).reshape(-1, 1),
                  x.sharding)
    dt = np.asarray(DT["lj" if case.system == "argon" else "dsf"], dtype)
    runs, programs = {}, {}
    for name, adapter in zip(("real", "null"), adapters):
        f = force(adapter)

        @jax.jit
        def step(cs, x, v, f0, q, dt, f=f):
            v = v + 0.5 * dt * f0 * inv_m
            x = x + dt * v
            e, f1 = f(cs, x, q)
            return x, v + 0.5 * dt * f1 * inv_m, f1, e

        f0 = step(cs, x, v, v, q, np.zeros_like(dt))[2]  # a step of 0 fs: the first forces, the same program
        state = [x, v, f0]

        def one(step=step, state=state):
            out = step(cs, *state, q, dt)
            state[:] = out[:3]
            return out

        runs[name], programs[name] = (one, cm.jax_sync), (step, state, f0)
    t = cm.medians(runs, warmup=1, iters=iters)
    step, state, f0 = programs["real"]
    try:
        program = cm.human_bytes(cm.program_bytes(step, cs, *state, q, dt))
    except Exception as e:  # noqa: BLE001 - informational
        program = f"n/a ({type(e).__name__})"
    p = params_for(case.system, cutoff)
    call_args = (x, q, cs.halo_owned_mask()) if q is not None else (x, cs.halo_owned_mask())
    coll = [c for c in collectives(cs, real, *call_args, *p.args()) if c.op == "ppermute"]
    return Result(t["real"], t.get("null", float("nan")), cs.to_global(np.asarray(f0, dtype=np.float64)), tuple(int(g) for g in plan.grid),
                  int(plan.n_owned.max()), int((plan.n_owned + plan.n_ghost).max()), sum(c.rows for c in coll),
                  f"{cm.human_bytes(sum(c.bytes for c in coll))} / {cm.human_bytes(sum(c.padded_bytes for c in coll))}",
                  program)


def parity(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want|."""
    return float(np.abs(got - want).max() / max(float(np.abs(want).max()), np.finfo(np.float64).tiny))


def spacing(value: float, dtype: str) -> float:
    """The gap between `value` and the next number of `dtype` (its coordinate resolution there)."""
    return float(np.spacing(np.dtype(dtype).type(value)))


COLUMNS = ["devices", "grid", "atoms", "owned / rows per device (max)", "step (ms)", "atom-steps/s", "speedup",
           "parallel eff.", "halo rows/step", "halo bytes/step (true / sent)", "non-kernel (ms)", "kernel share",
           "float64 force parity (asserted)", "timed-dtype forces vs reference (info)", "XLA program/device"]


def scaling(rep: cm.Report, mode: str, counts: list[int], atoms: int, kernel: str, dtype: str, cutoff, iters: int,
            cache: dict, twin: bool = True) -> dict[int, float]:
    """One scaling table (strong or weak); returns each device count's efficiency."""
    system = SYSTEM[kernel.split("-")[0]]
    cells = cubic_cells(atoms, system)
    cases = {n: make_case(system, cells, (1, 1, 1) if mode == "strong" else block_grid(n)) for n in counts}
    table = rep.table(f"{mode.capitalize()} scaling: {cases[counts[0]].n} atoms on {counts[0]} device(s) ({cells}^3 "
                      f"cells{' per device' if mode == 'weak' else ''}), {kernel}, timed in {dtype}", COLUMNS)
    base: Result | None = None
    base_p: np.ndarray | None = None
    eff: dict[int, float] = {}
    for n in counts:
        case = cases[n]
        if rep.time_left() < 0:
            rep.note(f"{mode} scaling: {n} devices and more not run (budget spent).")
            break
        with rep.section(f"{mode} scaling, {n} device(s), {case.n} atoms"):
            key = (case.cells, case.reps, n)  # strong and weak share the smallest count's run
            try:
                r = cache[key] if key in cache else run_case(case, n, kernel, dtype, cutoff, iters, twin)
            except Exception as e:
                if not cm.is_oom(e):
                    raise
                table.add(n, "-", case.n, "-", "OOM", *["-"] * (len(COLUMNS) - 5))
                continue
            cache[key] = r
            fp = r.forces if dtype == "float64" else first_forces(case, n, kernel, "float64", cutoff)
            tile = lambda f, case=case: np.tile(f[: case.block_atoms], (case.n // case.block_atoms, 1))  # noqa: E731
            if base is None:
                base, base_p, p_text, t_text = r, fp, f"reference ({n} dev)", "reference"
            else:
                p_err = parity(fp, tile(base_p))
                p_text = f"{p_err:.1e} {'ok' if p_err <= PARITY_RTOL else 'FAIL'}"
                t_text = f"{parity(r.forces, tile(base.forces)):.1e}"
                if p_err > PARITY_RTOL:
                    rep.fail(f"{mode} {n} dev: float64 max|dF|/max|F| = {p_err:.1e} > {PARITY_RTOL:g} (vs {counts[0]} dev)")
            speed = base.step_s / r.step_s
            eff[n] = speed * counts[0] / n if mode == "strong" else speed
            table.add(n, grid_name(r.grid), case.n, f"{r.owned_max} / {r.rows_max}", cm.ms(r.step_s),
                      f"{case.n / r.step_s:.3g}", f"{speed:.2f}x" if mode == "strong" else "-", f"{eff[n]:.0%}",
                      r.halo_rows, r.halo_bytes, cm.ms(r.null_s),
                      f"{max(r.step_s - r.null_s, 0.0) / r.step_s:.0%}" if r.null_s == r.null_s else "-",
                      p_text, t_text, r.program)
    return eff


def halo_grids(rep: cm.Report, counts: list[int], atoms: int, dtype: str, cutoff, iters: int, smoke: bool) -> None:
    """GatherInputs / ScatterOutputs of a real argon plan on slab and automatic grids, checked against numpy."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nvalchemi_jaxbridge.layout import HaloPlan
    from nvalchemi_jaxbridge.layout.grid import choose_grid
    from nvalchemi_jaxbridge.lower import collectives as C
    from nvalchemi_jaxbridge.lower import device_tables, make_mesh
    from nvalchemi_jaxbridge.lower.mesh import mesh_axis
    from nvalchemi_jaxbridge.lower.tables import place

    case = make_case("argon", cubic_cells(atoms, "argon"))
    p, item = params_for("argon", cutoff), np.dtype(dtype).itemsize
    table = rep.table(f"Halo exchanges on device grids: argon, {case.n} atoms, ghosts within cutoff + skin = "
                      f"{p.cutoff + 1:g} A, one row = 3 x {dtype}", [
                          "devices", "grid", "messages (ppermutes)", "ghost rows", "bytes (true / sent)",
                          "GatherInputs (us)", f"GatherInputs in a loop of {LOOP} (us)", "ScatterOutputs (us, 2x bytes)",
                          f"ScatterOutputs in a loop of {LOOP} (us)", "matches numpy"])
    rng = np.random.default_rng(0)
    for n in [c for c in counts if c >= 2]:
        for grid in dict.fromkeys([(n, 1, 1), choose_grid(n, case.cell, (True, True, True))]):
            with rep.section(f"halo exchange, {n} devices, grid {grid}"):
                plan = HaloPlan.build(case.positions, case.cell, cutoff=p.cutoff, skin=1.0, n_devices=n, grid=grid,
                                      headroom=1.0)
                mesh = make_mesh(n)
                axis, t = mesh_axis(mesh), device_tables(plan, mesh)
                oc = t.owned_capacity
                sm = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(t.specs(axis), P(axis)),  # noqa: E731
                                                     out_specs=P(axis)))
                fwd = sm(lambda t, x: C.halo_forward(x, t, axis, positions=True))
                sct = sm(lambda t, x: C.halo_scatter(x, t, axis))
                loop = 1 if smoke else LOOP  # a smoke run checks the exchanges, not the loops' device time
                fwd_loop = sm(lambda t, h: jax.lax.fori_loop(0, loop, lambda i, c: C.halo_forward(c[:oc], t, axis), h))
                sct_loop = sm(lambda t, h: jax.lax.fori_loop(0, loop, lambda i, c: C.halo_scatter(c, t, axis) * 0.5, h))
                sharding = NamedSharding(mesh, P(axis))
                pos = case.positions.astype(dtype)
                x = place(plan.to_owned(pos, positions=True), sharding)
                y_np = rng.normal(size=(n * t.halo_rows, 3)).astype(dtype)
                y = place(y_np, sharding)
                ids = plan.halo_global.reshape(-1)  # the reference: rows straight from each halo row's global id
                summed = np.zeros((case.n, 3))
                np.add.at(summed, ids[ids >= 0], y_np[ids >= 0].astype(np.float64))
                tol = 1e-4 if dtype == "float32" else 1e-8
                ok = (np.allclose(np.asarray(fwd(t, x)), plan.to_halo(pos, positions=True), rtol=tol,
                                  atol=tol * np.abs(pos).max())
                      and np.allclose(np.asarray(sct(t, y)), plan.to_halo(summed), rtol=tol, atol=tol * 10))
                h0 = fwd(t, x)
                times = cm.medians({"fwd": (lambda: fwd(t, x), cm.jax_sync), "fwd_loop": (lambda: fwd_loop(t, h0), cm.jax_sync),
                                    "sct": (lambda: sct(t, y), cm.jax_sync), "sct_loop": (lambda: sct_loop(t, y), cm.jax_sync)},
                                   warmup=1, iters=max(3, iters))
                count = true_rows = sent_rows = 0
                for k, send, cap in zip(plan.offsets, plan.send_idx, plan.pair_capacities):
                    if k % n:
                        count, true_rows, sent_rows = count + 1, true_rows + int((np.asarray(send) < oc).sum()), sent_rows + n * int(cap)
                table.add(n, grid_name(tuple(plan.grid)), count, int(plan.n_ghost.sum()),
                          f"{cm.human_bytes(true_rows * 3 * item)} / {cm.human_bytes(sent_rows * 3 * item)}",
                          cm.us(times["fwd"]), cm.us(times["fwd_loop"] / loop), cm.us(times["sct"]),
                          cm.us(times["sct_loop"] / loop), "yes" if ok else "MISMATCH")
                if not ok:
                    rep.fail(f"halo exchange on {n} devices, grid {grid}: differs from the numpy reference")


def run(rep: cm.Report, opt) -> None:
    import jax

    counts = parse_devices(opt.devices or ((1, 2) if opt.smoke else None), len(jax.devices()))
    if len(counts) < 2:
        rep.note(f"Scaling: not run, it needs 2 or more devices (JAX sees {len(jax.devices())}).")
        return
    kernel = opt.kernels_for("scaling", ["lj-cells" if opt.platform == "gpu" else "lj-jax"], KERNELS)[0]
    strong, weak, halo = (opt.sizes_for("scaling", SIZES["smoke" if opt.smoke else opt.platform]) + [None] * 3)[:3]
    dtype = opt.dtypes_or(["float32" if opt.platform == "gpu" else "float64"])[0]
    cutoff, iters = SMOKE_CUTOFF if opt.smoke else None, opt.repeats_or(8, 2)
    rep.setting("scaling", f"devices {counts}, {kernel}, {dtype}, skin 1 A, headroom 1.0, automatic grid; median of "
                f"{iters} steps of the step and its trivial-kernel twin in turns; parity in float64, asserted")
    effs, cache = {}, {}
    for mode, atoms in (("strong", strong), ("weak", weak)):
        if atoms:
            # a smoke run leaves out the trivial-kernel twin (the kernel's share of the step)
            effs[mode] = scaling(rep, mode, counts, atoms, kernel, dtype, cutoff, iters, cache, twin=not opt.smoke)
    if halo:
        halo_grids(rep, counts, halo, dtype, cutoff, iters, opt.smoke)
    if opt.platform == "cpu":
        rep.note(f"CPU: the virtual devices share the host's cores, so these efficiencies measure overheads, not "
                 "hardware scaling.")
    if 2 in effs.get("strong", {}) and counts[0] == 1:
        rep.target(f"2 devices >= 1.8x one device, strong scaling, {strong} atoms ({kernel}; issue 7)",
                   f"{2 * effs['strong'][2]:.2f}x", 2 * effs["strong"][2] >= 1.8)
    if len(effs.get("weak", {})) > 1:
        n = max(effs["weak"])
        rep.target(f"weak-scaling efficiency at {n} devices >= 85 % ({kernel}; issue 8)",
                   f"{effs['weak'][n]:.0%}", effs["weak"][n] >= 0.85)
