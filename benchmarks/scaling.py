"""Strong and weak scaling of the MD step over 1, 2, 4, 8 devices, and halo exchanges on 3-D device grids.

    PYTHONPATH=. python3 benchmarks/scaling.py --out OUTDIR [--devices 1,2,4,8] [--mode both] [--halo] [--smoke]
        [--dtype float32] [--parity-cells K] [--kernel triton|torch|torch-cells|jax]

MD part (`--mode strong|weak|both`): for each device count one velocity Verlet
step is one `jax.jit` program over the `CompiledSpec` (GatherInputs -> the force
kernel on every device's halo block -> ScatterOutputs + AllReduceSum -> update),
as in `md_step.py`. The plan uses the automatic device grid (`choose_grid`:
slabs, 2-D or 3-D). Per device count the table gives the median step time after
warm-up, steps/s, atom-steps/s, parallel efficiency (strong: t1 / (n tn); weak:
t1 / tn), the halo rows and bytes each step moves (from the plan's tables: rows
x bytes per row, for every exchange of the step) and the split of the step into
kernel and non-kernel time. The non-kernel time is measured by running the same
step program with the force kernel replaced by a trivial JAX function of the
same shapes (exchanges, reductions and update kept); kernel time = step - that.

Kernels (`--kernel`): `triton`, `torch` (the dense demo ops, work ~ rows^2 per
device), `torch-cells` (the cell-list LJ op `jaxbridge_demo::lj_energy_forces_cells`,
argon only, work ~ rows per device) and `jax` (the dense JAX block function).

- strong: one cubic system of `--atoms` atoms on every device count.
- weak: `--atoms-per-device` atoms per device; the system is a cubic block
  replicated along the axes the grid splits (2x1x1 blocks on 2 devices, 2x2x1
  on 4, 2x2x2 on 8), so every device's domain is the same cube.

Correctness (asserted; the run exits 1 if it fails): the first-step forces on
every device count, computed in float64 with the same kernel (one force call, no
timing), equal those of the smallest count (normally 1 device) to max|dF| <=
1e-9 max|F|. In weak scaling the larger systems are periodic replicas of the
1-device block, so each atom's force must equal its original's. The float64
check runs on the timed system, or with `--parity-cells K` on a smaller one of
the same grid and replication (K^3 cells: the strong system, or the weak block
per device); the table says which. The timed run's own first-step forces (in
`--dtype`) are compared too, as information: in float32 a long system's
coordinates are rounded more coarsely (a replica at x + L is not rounded like
the original at x), so the table gives the largest coordinate the kernel sees
and the float32 spacing there.

Halo part (`--halo`): one argon box, for each device count >= 2 a real
`HaloPlan` on the slab grid (n, 1, 1) and on the automatic grid (2x2x1 on 4,
2x2x2 on 8); GatherInputs of positions and ScatterOutputs of forces timed alone
(one dispatch per exchange, and inside a `fori_loop`), bytes from the tables,
results checked against the plan's numpy reference exchange.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from typing import Any

import _common as cm
import numpy as np

SYSTEM_KIND = {"argon": "lj", "rocksalt": "dsf"}  # md_step's names for the op and time step
ATOMS_PER_CELL = {"argon": 4, "rocksalt": 8}
RTOL = {"float32": 1e-5, "float64": 1e-9}  # halo-exchange checks, in the timed dtype
PARITY_DTYPE = "float64"  # the asserted force parity is computed in this dtype, whatever --dtype is
PARITY_RTOL = RTOL[PARITY_DTYPE]
DEFAULTS = {  # (strong atoms, weak atoms per device, halo atoms)
    "gpu": (1_000_000, 1_000_000, 1_000_000),
    "cpu": (2048, 256, 6912),
    "smoke": (108, 108, 256),  # strong and weak share the 1-device run
}
SMOKE_CUTOFF = 4.0  # A: as in md_step's smoke run
LOOP = 20  # exchanges per program in the looped halo measurement


# ------------------------------------------------------------------ arguments


def parse_devices(text: str | None, available: int) -> list[int]:
    """Device counts from '--devices 1,2,4,8' (default: powers of two up to `available`), ascending."""
    if text is None:
        return [2**k for k in range(available.bit_length()) if 2**k <= available]
    try:
        counts = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise SystemExit(f"scaling: --devices must be a comma list of ints such as 1,2,4,8, got {text!r}.") from None
    if not counts or counts[0] < 1:
        raise SystemExit(f"scaling: --devices needs positive device counts, got {text!r}.")
    if counts[-1] > available:
        raise SystemExit(
            f"scaling: --devices {text} asks for {counts[-1]} devices but JAX sees {available}; drop the larger "
            "counts, or on the CPU raise the virtual device count (this script starts 8)."
        )
    return counts


def cubic_cells(atoms: int, system: str, where: str) -> int:
    """Cubic cells per axis whose system is closest to `atoms` atoms (at least 1)."""
    if atoms < 1:
        raise SystemExit(f"scaling: {where} must be >= 1 atom, got {atoms}.")
    return max(1, round((atoms / ATOMS_PER_CELL[system]) ** (1 / 3)))


def block_grid(n_devices: int) -> tuple[int, int, int]:
    """How a cube is split over `n_devices` (the automatic grid of a cubic cell): the weak-scaling replicas."""
    from nvalchemi_jaxbridge.layout.grid import choose_grid

    return choose_grid(n_devices, np.eye(3), (True, True, True))


def grid_name(grid: tuple[int, int, int]) -> str:
    """'1 (no split)', '1-D slab 2x1x1', '2-D 2x2x1' or '3-D 2x2x2'."""
    split = sum(g > 1 for g in grid)
    return "1 (no split)" if split == 0 else f"{'1-D slab' if split == 1 else f'{split}-D'} {'x'.join(map(str, grid))}"


# ------------------------------------------------------------------ systems


@dataclasses.dataclass(frozen=True)
class Case:
    """A system (numpy, global order) made of `reps` copies of one periodic block of `block_atoms` atoms.

    Atom `r * block_atoms + i` is atom `i` of the block shifted into replica `r`
    (replicas in C order over `reps`), so its forces equal atom `i`'s.
    """

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
    """A cubic block of `cells`^3 unit cells (thermal velocities, random displacements, wrapped) tiled `reps` times."""
    from nvalchemi_jaxbridge.demo import argon_fcc, rock_salt

    s = argon_fcc(cells, temperature=60.0) if system == "argon" else rock_salt(cells, temperature=300.0)
    from nvalchemi_jaxbridge.app.run_config import wrap

    rng = np.random.default_rng(cells)
    # wrapped into the block before tiling (HaloPlan itself no longer needs wrapped positions: it plans
    # in the wrapped frame whatever image an atom is given at)
    pos = wrap(s.positions + rng.normal(scale=0.05, size=s.positions.shape), s.cell, s.periodic)
    edge = np.diag(s.cell)
    shifts = np.array(list(itertools.product(*(range(r) for r in reps))), dtype=np.float64) * edge
    tile = lambda a: np.concatenate([a] * len(shifts)) if a is not None else None  # noqa: E731
    return Case(system, cells, tuple(reps), (pos[None] + shifts[:, None]).reshape(-1, 3), tile(s.velocities),
                tile(s.masses), tile(s.charges), np.diag(edge * np.array(reps)), len(pos))


# ------------------------------------------------------------------ kernels


def null_kernel(charged: bool):
    """A trivial JAX function of the force kernel's signature and output shapes (uses every input)."""
    import jax.numpy as jnp

    def lj_null(positions, owned_mask, epsilon, sigma, cutoff):
        w = owned_mask.astype(positions.dtype)
        return 1e-12 * jnp.sum(w * positions[:, 0]), 1e-12 * positions

    def dsf_null(positions, charges, owned_mask, alpha, cutoff, born_a, born_rho, coulomb_constant):
        w = owned_mask.astype(positions.dtype)
        return 1e-12 * jnp.sum(w * charges * positions[:, 0]), 1e-12 * charges[:, None] * positions

    return dsf_null if charged else lj_null


def force_op(system: str, kernel: str):
    """The demo force op: a torch/Triton custom op, or the JAX block function."""
    import md_step

    if kernel == "jax":
        from nvalchemi_jaxbridge.app.run_config import potential_for

        return potential_for(system).jax_block()
    return md_step.op_for(SYSTEM_KIND[system], kernel)


def params_for(system: str, cutoff: float | None):
    """The potential's parameters, with the cutoff replaced if given."""
    from nvalchemi_jaxbridge.demo import DSFParams, LJParams

    p = LJParams() if system == "argon" else DSFParams()
    return p if cutoff is None else dataclasses.replace(p, cutoff=cutoff)


# ------------------------------------------------------------------ one device count


@dataclasses.dataclass(frozen=True)
class Result:
    """What one (case, device count) run measured."""

    n_dev: int
    grid: tuple[int, int, int]
    step_s: float
    null_s: float
    forces: np.ndarray  # first-step forces computed in --dtype, (N, 3) float64, global order
    owned_max: int
    rows_max: int  # largest n_owned + n_ghost
    ghost_rows: int  # all devices
    halo_rows_step: int
    halo_bytes_step: int
    halo_sent_bytes_step: int
    plan_s: float
    program: str
    memory: str
    coord_max: float  # largest |coordinate| of a real row in any halo block (what the kernel sees), A


def _compiled(case: Case, n_dev: int, a: Any, adapters: tuple):
    """(plan, CompiledSpec, plan build seconds) of `case` on `n_dev` devices."""
    from nvalchemi_jaxbridge.kernels import compile as kcompile
    from nvalchemi_jaxbridge.layout import HaloPlan
    from nvalchemi_jaxbridge.lower import make_mesh
    from nvalchemi_jaxbridge.spec import DistributionSpec
    from nvalchemi_jaxbridge.spec.policies import HaloStoragePolicy

    t0 = time.perf_counter()
    plan = HaloPlan.build(case.positions, case.cell, cutoff=params_for(case.system, a.cutoff).cutoff, skin=a.skin,
                          n_devices=n_dev, headroom=1.0)
    plan_s = time.perf_counter() - t0
    spec = DistributionSpec(policy=HaloStoragePolicy(), custom_ops=adapters)
    cs = kcompile(spec, make_mesh(n_dev), plan, positions={ad: [0] for ad in adapters})
    return plan, cs, plan_s


def _roles(charged: bool) -> dict:
    """The force op's cross-rank roles: positions (and charges) gathered, forces scattered, energy summed."""
    return dict(gather_inputs=[0, 1] if charged else [0], scatter_outputs=[1], all_reduce_outputs=[0])


def _force_fn(cs, adapter, n_dev: int, charged: bool, scalars: tuple):
    """force(cs, x, q) -> (energy, forces in owned storage) through `adapter` (traceable)."""
    oc, hr = cs.tables.owned_capacity, cs.tables.halo_rows

    def force(cs, x, q):
        args = (x, q, cs.halo_owned_mask()) if charged else (x, cs.halo_owned_mask())
        e, fh = cs.call(adapter, *args, *scalars)
        return e, fh.reshape(n_dev, hr, 3)[:, :oc].reshape(n_dev * oc, 3)

    return force


def kernel_coord_max(plan, positions: np.ndarray) -> float:
    """Largest |coordinate| over the real (non-padding) rows of every halo block, in the plan's wrapped frame."""
    rows = plan.to_halo(np.asarray(positions, np.float64), positions=True)
    return float(np.abs(rows[np.asarray(plan.halo_global).reshape(-1) >= 0]).max())


def force_adapter(system: str, kernel: str, charged: bool):
    """An OpAdapter of the force op with its halo roles."""
    from nvalchemi_jaxbridge.spec import OpAdapter

    return OpAdapter(force_op(system, kernel), **_roles(charged))


def first_forces(case: Case, n_dev: int, a: Any, dtype: str) -> np.ndarray:
    """First-step forces (N, 3), global order, of `case` on `n_dev` devices computed in `dtype`: one call, no timing."""
    import jax

    charged = case.charges is not None
    adapter = force_adapter(case.system, a.kernel, charged)
    _, cs, _ = _compiled(case, n_dev, a, (adapter,))
    force = _force_fn(cs, adapter, n_dev, charged, params_for(case.system, a.cutoff).args())
    x = cs.owned(case.positions.astype(dtype), positions=True)
    q = cs.owned(case.charges.astype(dtype)) if charged else None
    _, f = jax.jit(force)(cs, x, q)
    out = cs.to_global(np.asarray(f, dtype=np.float64))
    del cs, x, q, f
    return out


def run_case(case: Case, n_dev: int, a: Any, platform: str) -> Result:
    """Build the plan for `n_dev` devices, time the MD step and its null-kernel twin, keep the first forces."""
    import jax
    import md_step

    from nvalchemi_jaxbridge.app.report import collectives
    from nvalchemi_jaxbridge.spec import OpAdapter

    scalars = params_for(case.system, a.cutoff).args()
    charged = case.charges is not None
    real = force_adapter(case.system, a.kernel, charged)
    null = OpAdapter(null_kernel(charged), **_roles(charged))
    plan, cs, plan_s = _compiled(case, n_dev, a, (real, null))
    x = cs.owned(case.positions.astype(a.dtype), positions=True)
    v = cs.owned(case.velocities.astype(a.dtype))
    q = cs.owned(case.charges.astype(a.dtype)) if charged else None
    inv_m = md_step._owned_inverse_mass(cs, plan, case.masses, a.dtype)
    dt = md_step.DT[SYSTEM_KIND[case.system]]

    def make_step(adapter):
        force = _force_fn(cs, adapter, n_dev, charged, scalars)

        @jax.jit
        def step(cs, x, v, f, q):
            v = v + 0.5 * dt * f * inv_m
            x = x + dt * v
            e, f = force(cs, x, q)
            return x, v + 0.5 * dt * f * inv_m, f, e

        return step

    _, f0 = jax.jit(_force_fn(cs, real, n_dev, charged, scalars))(cs, x, q)
    forces = cs.to_global(np.asarray(f0, dtype=np.float64))
    timed = {}
    for name, adapter in (("real", real), ("null", null)):
        step = make_step(adapter)
        state = [x, v, f0]

        def one(step=step, state=state):
            out = step(cs, *state, q)
            state[:] = out[:3]
            return out

        iters = md_step._iters_for(lambda: jax.block_until_ready(one()), a.iters)
        timed[name] = cm.med(cm.time_jax(one, warmup=a.warmup, iters=iters))
        if name == "real":
            program = md_step._program_memory(step, cs, *state, q)
        del state
    call_args = (x, q, cs.halo_owned_mask(), *scalars) if charged else (x, cs.halo_owned_mask(), *scalars)
    coll = [c for c in collectives(cs, real, *call_args) if c.op == "ppermute"]
    res = Result(
        n_dev=n_dev, grid=tuple(int(g) for g in plan.grid), step_s=timed["real"], null_s=timed["null"],
        forces=forces, owned_max=int(plan.n_owned.max()), rows_max=int((plan.n_owned + plan.n_ghost).max()),
        ghost_rows=int(plan.n_ghost.sum()), halo_rows_step=sum(c.rows for c in coll),
        halo_bytes_step=sum(c.bytes for c in coll), halo_sent_bytes_step=sum(c.padded_bytes for c in coll),
        plan_s=plan_s, program=program, memory=md_step.peaks(platform, n_dev),
        coord_max=kernel_coord_max(plan, case.positions),
    )
    del cs, x, v, q, f0
    return res


def parity(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want|."""
    return float(np.abs(got - want).max() / max(float(np.abs(want).max()), np.finfo(np.float64).tiny))


def spacing(value: float, dtype: str) -> float:
    """The gap between `value` and the next representable number of `dtype` (its coordinate resolution there)."""
    return float(np.spacing(np.dtype(dtype).type(value)))


# ------------------------------------------------------------------ scaling tables

COLUMNS = ["devices", "grid", "atoms", "owned / rows per device (max)", "step (ms)", "steps/s", "atom-steps/s",
           "speedup", "parallel eff.", "halo rows/step", "halo bytes/step (true / sent)", "non-kernel (ms)",
           "kernel + call (ms)", "kernel share", "force parity, float64 (asserted)",
           "forces in timed dtype vs reference (info)", "max kernel coordinate (timed-dtype spacing there)",
           "plan build (s)", "XLA program/device", "peak memory"]


def _parity_forces(case: Case, n: int, r: Result, a: Any, same_system: bool, cache: dict) -> np.ndarray:
    """Float64 first-step forces of `case` on `n` devices: the timed run's own if it ran in float64 on this system."""
    if same_system and a.dtype == PARITY_DTYPE:
        return r.forces
    key = ("parity", case.cells, case.reps, n)
    if key not in cache:
        cache[key] = first_forces(case, n, a, PARITY_DTYPE)
    return cache[key]


def _tiled(base: np.ndarray, case: Case) -> np.ndarray:
    """What `case`'s forces must be: the reference block's forces, once per replica (strong: the same forces)."""
    return np.tile(base[: case.block_atoms], (case.n // case.block_atoms, 1))


def scaling(rep: cm.Report, mode: str, counts: list[int], a: Any, platform: str, cache: dict,
            failures: list[str], summary: dict) -> None:
    """One scaling table (strong or weak) over the device counts."""
    import md_step

    if mode == "strong":
        cells = cubic_cells(a.atoms, a.system, "--atoms")
        cases = {n: make_case(a.system, cells) for n in counts}
    else:
        cells = cubic_cells(a.atoms_per_device, a.system, "--atoms-per-device")
        cases = {n: make_case(a.system, cells, block_grid(n)) for n in counts}
    p_cells = a.parity_cells or cells
    same = p_cells == cells
    p_cases = cases if same else {n: make_case(a.system, p_cells, c.reps) for n, c in cases.items()}
    base_n = counts[0]
    title = (f"Strong scaling: {cases[base_n].n} atoms ({cells}^3 cells)" if mode == "strong" else
             f"Weak scaling: {cases[base_n].block_atoms} atoms per device ({cells}^3 cells per device)")
    p_where = ("the timed systems" if same else
               f"REDUCED systems of the same grid and replication, {p_cells}^3 cells "
               f"{'in all' if mode == 'strong' else 'per device'} ({p_cases[base_n].n} atoms on {base_n} device(s))")
    rows = rep.table(f"{title}, {a.system}, {a.kernel} kernel, timed in {a.dtype}; force parity in "
                     f"{PARITY_DTYPE} on {p_where}", COLUMNS)
    base: Result | None = None
    base_p: np.ndarray | None = None
    info: dict[int, tuple[float, float, bool]] = {}  # n -> (timed-dtype difference, float64 parity, parity ok)
    for n in counts:
        case, p_case = cases[n], p_cases[n]
        with rep.section(f"{mode} {n} device(s), {case.n} atoms"):
            key = (case.cells, case.reps, n)
            md_step.reset_peaks(platform)
            try:
                r = cache[key] if key in cache else run_case(case, n, a, platform)
            except Exception as e:
                if md_step._is_oom(e):
                    rep.row(rows, [n, "-", case.n, "-", "OOM"] + ["-"] * (len(COLUMNS) - 6)
                            + [md_step.peaks(platform, n)])
                    continue
                raise
            cache[key] = r
            try:
                fp = _parity_forces(p_case, n, r, a, same, cache)
            except Exception as e:
                if not md_step._is_oom(e):
                    raise
                fp = None
                failures.append(f"{mode} {n} dev: the {PARITY_DTYPE} parity forces ran out of memory ({p_case.n} "
                                "atoms); rerun with --parity-cells K for a smaller system of the same grid")
            coord = f"{r.coord_max:.4g} A ({spacing(r.coord_max, a.dtype):.1e} A)"
            if base is None:
                base, base_p = r, fp
                p_text = t_text = "reference" if n == 1 else f"reference ({n} dev)"
                if fp is None:
                    p_text = "OOM: not checked"
            else:
                # weak: every system is a set of periodic replicas of one block, so an atom's force is
                # its block original's; strong: the same system, the same forces
                t_err = parity(r.forces, _tiled(base.forces, case))
                t_text = f"{t_err:.1e}"
                if fp is None or base_p is None:
                    p_text, p_err, ok = "OOM: not checked", float("nan"), False
                else:
                    p_err = parity(fp, _tiled(base_p, p_case))
                    ok = p_err <= PARITY_RTOL
                    p_text = f"{p_err:.1e} {'ok' if ok else 'FAIL'}" + ("" if same else f" ({p_case.n} atoms)")
                    if not ok:
                        failures.append(f"{mode} {n} dev: {PARITY_DTYPE} max|dF|/max|F| = {p_err:.1e} > "
                                        f"{PARITY_RTOL:g} (vs {base.n_dev} dev)")
                info[n] = (t_err, p_err, ok)
            t1, tn = base.step_s, r.step_s
            speed = t1 / tn
            eff = speed * base.n_dev / n if mode == "strong" else speed
            kern = max(tn - r.null_s, 0.0)
            rep.row(rows, [
                n, grid_name(r.grid), case.n, f"{r.owned_max} / {r.rows_max}", cm.ms(tn), f"{1 / tn:.3g}",
                f"{case.n / tn:.3g}", f"{speed:.2f}x" if mode == "strong" else "-", f"{eff:.0%}",
                r.halo_rows_step, f"{cm.human_bytes(r.halo_bytes_step)} / {cm.human_bytes(r.halo_sent_bytes_step)}",
                cm.ms(r.null_s), cm.ms(kern), f"{kern / tn:.0%}", p_text, t_text, coord, f"{r.plan_s:.2f}",
                r.program, r.memory,
            ])
            summary[mode, n] = {"eff": eff, "t": tn, "null": r.null_s, "rows": r.rows_max, "owned": r.owned_max,
                                "base": base.n_dev, "base_rows": base.rows_max, "base_null": base.null_s}
    if base is not None and info:
        precision_note(rep, mode, a, base, {n: cache[cases[n].cells, cases[n].reps, n] for n in info}, info, same)


def precision_note(rep: cm.Report, mode: str, a: Any, base: Result, results: dict[int, Result],
                   info: dict[int, tuple[float, float, bool]], same: bool) -> None:
    """The timed dtype's force differences (not asserted) next to the coordinate resolution the kernel has."""
    s0 = spacing(base.coord_max, a.dtype)
    parts = []
    for n, (t_err, p_err, ok) in info.items():
        c = results[n].coord_max
        s = spacing(c, a.dtype)
        parts.append(f"{n} dev: max|dF|/max|F| = {t_err:.1e} in {a.dtype} vs {p_err:.1e} in {PARITY_DTYPE}"
                     f"{'' if same else ' (reduced system)'}; the kernel sees coordinates up to {c:.4g} A, where "
                     f"{a.dtype} spacing is {s:.1e} A ({s / s0:.3g}x the {s0:.1e} A at {base.coord_max:.4g} A "
                     f"on {base.n_dev} dev)")
    text = f"{mode.capitalize()} scaling, forces in the timed dtype (information, not asserted): " + "; ".join(parts)
    if a.dtype != PARITY_DTYPE and all(ok for _, _, ok in info.values()):
        where = "" if same else " of the reduced systems"
        text += (f". The {PARITY_DTYPE} forces{where} agree within {PARITY_RTOL:g}, so the {a.dtype} differences are "
                 f"{a.dtype} rounding (of coordinates, image shifts and force sums, whose order differs between device "
                 "counts), not the bridge" + ("; in weak scaling a replica at x + L is rounded more coarsely than its "
                                              "original at x, and a stiff pair force amplifies a separation error of "
                                              "about one spacing" if mode == "weak" else ""))
    rep.note(text + ".")


def reading(rep: cm.Report, mode: str, counts: list[int], summary: dict, platform: str, kernel: str) -> None:
    """Where the time goes at each device count, from the measured rows and non-kernel times."""
    import os

    done = [n for n in counts if (mode, n) in summary]
    if len(done) < 2:
        return
    s0 = summary[mode, done[0]]
    b, r0 = s0["base"], s0["base_rows"]
    parts = []
    for n in done[1:]:
        s = summary[mode, n]
        # a dense kernel's work per device grows as rows^2, the cell-list kernel's as rows: the
        # efficiency the rows alone predict
        power = 1 if kernel == "torch-cells" else 2
        model = r0**power * b / (n * s["rows"] ** power) if mode == "strong" else r0**power / s["rows"] ** power
        work = "a cell-list kernel (work ~ rows)" if power == 1 else "a dense kernel (work ~ rows^2)"
        parts.append(f"{n} dev: efficiency {s['eff']:.0%}; rows/device {s['rows']} (owned {s['owned']} + ghosts) "
                     f"vs {r0} on {b} dev, so {work} predicts {model:.0%}; non-kernel time "
                     f"{cm.ms(s['null'])} ms ({s['null'] / s['t']:.0%} of the step) vs {cm.ms(s0['base_null'])} ms")
    rep.note(f"{mode.capitalize()} scaling, measured: " + "; ".join(parts) + ".")
    if platform == "cpu":
        rep.note(f"CPU caveat: the {max(done)} virtual devices share {os.cpu_count()} cores, so n devices run "
                 "their kernels on the same cores; weak-scaling efficiency there is bounded by roughly "
                 f"min(1, cores / n), and the numbers measure overheads, not hardware scaling.")
    if mode == "weak":
        n = done[-1]
        eff = summary[mode, n]["eff"]
        rep.note(f"Target: weak-scaling efficiency at {n} devices >= 85% of {b} device(s): "
                 f"{eff:.0%} -> {'MET' if eff >= 0.85 else 'NOT MET'}.")


# ------------------------------------------------------------------ halo exchange on device grids


def halo_grids(rep: cm.Report, counts: list[int], a: Any) -> None:
    """GatherInputs / ScatterOutputs of a real argon plan on slab and automatic (2-D, 3-D) grids."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nvalchemi_jaxbridge.layout import HaloPlan
    from nvalchemi_jaxbridge.layout.grid import choose_grid
    from nvalchemi_jaxbridge.lower import collectives as C
    from nvalchemi_jaxbridge.lower import device_tables, make_mesh
    from nvalchemi_jaxbridge.lower.mesh import mesh_axis
    from nvalchemi_jaxbridge.lower.tables import place

    cells = cubic_cells(a.halo_atoms, "argon", "--halo-atoms")
    case = make_case("argon", cells)
    params = params_for("argon", a.cutoff)
    item = np.dtype(a.dtype).itemsize
    rows = rep.table(
        f"Halo exchanges on device grids: argon, {case.n} atoms ({cells}^3 cells), ghosts within cutoff + skin = "
        f"{params.cutoff + a.skin:g} A, one row = 3 x {a.dtype} ({3 * item} B)",
        ["devices", "grid", "messages (ppermutes)", "ghost rows", "bytes (true / sent)", "GatherInputs (us)",
         f"GatherInputs in loop of {LOOP} (us)", "ScatterOutputs (us, 2x bytes)",
         f"ScatterOutputs in loop of {LOOP} (us)", "GatherInputs GB/s (all devices)", "matches numpy"])
    rng = np.random.default_rng(0)
    iters = max(3, a.iters)
    for n in [c for c in counts if c >= 2]:
        for grid in dict.fromkeys([(n, 1, 1), choose_grid(n, case.cell, (True, True, True))]):
            with rep.section(f"halo {n} devices, grid {grid}"):
                plan = HaloPlan.build(case.positions, case.cell, cutoff=params.cutoff, skin=a.skin, n_devices=n,
                                      grid=grid, headroom=1.0)
                mesh = make_mesh(n)
                axis = mesh_axis(mesh)
                t = device_tables(plan, mesh)
                oc = t.owned_capacity

                def sm(f, t=t, mesh=mesh, axis=axis):
                    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(t.specs(axis), P(axis)), out_specs=P(axis)))

                fwd = sm(lambda t, x, axis=axis: C.halo_forward(x, t, axis, positions=True))
                sct = sm(lambda t, x, axis=axis: C.halo_scatter(x, t, axis))
                # each iteration sends the rows the previous one produced, so no exchange can be dropped
                fwd_loop = sm(lambda t, h, axis=axis, oc=oc: jax.lax.fori_loop(
                    0, LOOP, lambda i, c: C.halo_forward(c[:oc], t, axis), h))
                sct_loop = sm(lambda t, h, axis=axis: jax.lax.fori_loop(
                    0, LOOP, lambda i, c: C.halo_scatter(c, t, axis) * 0.5, h))
                sharding = NamedSharding(mesh, P(axis))
                pos = case.positions.astype(a.dtype)
                x = place(plan.to_owned(pos, positions=True), sharding)
                y_np = rng.normal(size=(n * t.halo_rows, 3)).astype(a.dtype)
                y = place(y_np, sharding)
                # independent of the exchange tables: rows straight from each halo row's global id
                want_fwd = plan.to_halo(pos, positions=True)
                ids = plan.halo_global.reshape(-1)
                summed = np.zeros((case.n, 3))
                np.add.at(summed, ids[ids >= 0], y_np[ids >= 0].astype(np.float64))
                want_sct = plan.to_halo(summed)
                tol = RTOL[a.dtype] * 10
                ok = (np.allclose(np.asarray(fwd(t, x)), want_fwd, rtol=tol, atol=tol * np.abs(pos).max())
                      and np.allclose(np.asarray(sct(t, y)), want_sct, rtol=tol, atol=tol * 10))
                h0 = fwd(t, x)
                times = {}
                for name, fn, arg, div in (("fwd", fwd, x, 1), ("fwd_loop", fwd_loop, h0, LOOP),
                                           ("sct", sct, y, 1), ("sct_loop", sct_loop, y, LOOP)):
                    times[name] = cm.med(cm.time_jax(lambda fn=fn, arg=arg: fn(t, arg), warmup=max(1, a.warmup),
                                                     iters=iters)) / div
                count = true_rows = sent_rows = 0
                for k, send, cap in zip(plan.offsets, plan.send_idx, plan.pair_capacities):
                    if k % n:
                        count += 1
                        true_rows += int((np.asarray(send) < oc).sum())
                        sent_rows += n * int(cap)
                nbytes = true_rows * 3 * item
                rep.row(rows, [n, grid_name(tuple(plan.grid)), count, int(plan.n_ghost.sum()),
                               f"{cm.human_bytes(nbytes)} / {cm.human_bytes(sent_rows * 3 * item)}",
                               cm.us(times["fwd"]), cm.us(times["fwd_loop"]), cm.us(times["sct"]),
                               cm.us(times["sct_loop"]), f"{nbytes / times['fwd'] / 1e9:.3g}",
                               "yes" if ok else "MISMATCH"])
                if not ok:
                    raise AssertionError(f"halo exchange on {n} devices, grid {grid}: differs from the numpy "
                                         "reference built from halo_global")
                del t, x, y, h0


# ------------------------------------------------------------------ main


def _load() -> str:
    """1/5/15-minute load averages and the CPU count (other jobs on the host skew CPU timings)."""
    import os

    return f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1/5/15 min) on {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    p = cm.base_parser(__doc__.splitlines()[0])
    p.add_argument("--devices", default=None, help="comma list of device counts (default: 1, 2, 4, ... available)")
    p.add_argument("--mode", choices=("strong", "weak", "both", "none"), default="both",
                   help="which scaling tables (none: only --halo)")
    p.add_argument("--atoms", type=int, default=None, help="strong scaling: atoms of the system (GPU 1e6, CPU 2048)")
    p.add_argument("--atoms-per-device", type=int, default=None,
                   help="weak scaling: atoms per device (GPU 1e6, CPU 256)")
    p.add_argument("--kernel", choices=("torch", "triton", "torch-cells", "jax"), default=None,
                   help="force kernel (default triton on GPU, jax on CPU); torch-cells: the cell-list LJ op "
                        "(argon only)")
    p.add_argument("--system", choices=("argon", "rocksalt"), default="argon")
    p.add_argument("--dtype", choices=("float32", "float64"), default=None,
                   help="default float32 on GPU, float64 on CPU")
    p.add_argument("--halo", action="store_true", help="also run the halo exchanges on slab and 2-D/3-D grids")
    p.add_argument("--halo-atoms", type=int, default=None, help="atoms of the halo benchmark's argon box")
    p.add_argument("--iters", type=int, default=None, help="most timed steps per run (default 8, smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps after the first (default 1, smoke 0)")
    p.add_argument("--skin", type=float, default=1.0)
    p.add_argument("--cutoff", type=float, default=None, help="override the potential's cutoff (A)")
    p.add_argument("--parity-cells", type=int, default=None,
                   help="cubic cells per axis of the float64 parity system (strong: the system, weak: the block per "
                        "device); default: the timed system's")
    a = p.parse_args(argv)
    platform = cm.setup(a.platform)
    import jax

    counts = parse_devices(a.devices, len(jax.devices()))
    strong_n, weak_n, halo_n = DEFAULTS["smoke" if a.smoke else platform]
    a.atoms = a.atoms or strong_n
    a.atoms_per_device = a.atoms_per_device or weak_n
    a.halo_atoms = a.halo_atoms or halo_n
    a.kernel = a.kernel or ("triton" if platform == "gpu" else "jax")
    if a.kernel == "torch-cells" and a.system != "argon":
        raise SystemExit(f"scaling: --kernel torch-cells is the cell-list Lennard-Jones op, for --system argon only, "
                         f"got --system {a.system}; use --kernel torch or triton for {a.system}.")
    a.dtype = a.dtype or ("float32" if platform == "gpu" else "float64")
    a.iters = a.iters or (2 if a.smoke else 8)
    a.warmup = a.warmup if a.warmup is not None else (0 if a.smoke else 1)
    a.cutoff = a.cutoff if a.cutoff is not None else (SMOKE_CUTOFF if a.smoke else None)
    if a.parity_cells is not None and a.parity_cells < 1:
        raise SystemExit(f"scaling: --parity-cells must be >= 1 cubic cell per axis, got {a.parity_cells}; leave it "
                         "out to check parity on the timed systems.")
    params = params_for(a.system, a.cutoff)
    settings = {
        "devices": ", ".join(map(str, counts)), "system": a.system, "kernel": a.kernel, "dtype": a.dtype,
        "cutoff": f"{params.cutoff:g} A, skin {a.skin:g} A", "plan": "HaloPlan headroom 1.0, automatic grid",
        "timing": f"median of up to {a.iters} steps (~3 s of steps, >= 3) after {a.warmup + 1} warm-up; wall clock "
                  "+ block_until_ready",
        "non-kernel time": "the same step program with the kernel replaced by a trivial JAX function of the "
                           "same shapes (exchanges, psum, update kept); kernel + call = step - non-kernel",
        "halo bytes/step": "from the plan's tables: GatherInputs (positions" + (", charges" if a.system ==
                           "rocksalt" else "") + ") + ScatterOutputs (forces, reverse + forward); true rows / "
                           "sent with static message capacities",
        "parity": f"first-step forces computed in {PARITY_DTYPE} (one force call, same kernel, "
                  + ("the timed systems" if a.parity_cells is None else f"--parity-cells {a.parity_cells}")
                  + f") vs the smallest device count, max|dF|/max|F| <= {PARITY_RTOL:g}, asserted; the timed "
                  f"{a.dtype} run's first-step forces compared the same way, as information",
        "host load at start": _load(),
    }
    rep = cm.Report("scaling", "Strong and weak scaling of the MD step, halo exchanges on device grids", a.out,
                    cm.context(platform), settings)
    cache: dict = {}
    failures: list[str] = []
    summary: dict = {}
    for mode in {"both": ("strong", "weak"), "none": ()}.get(a.mode, (a.mode,)):
        scaling(rep, mode, counts, a, platform, cache, failures, summary)
        with rep.section(f"{mode} reading"):
            reading(rep, mode, counts, summary, platform, a.kernel)
    if a.halo:
        halo_grids(rep, counts, a)
    with rep.section("force parity"):
        if failures:
            raise AssertionError(f"{PARITY_DTYPE} first-step force parity between device counts failed: "
                                 + "; ".join(failures))
        if summary:
            rep.note(f"Force parity: every device count's {PARITY_DTYPE} first-step forces equal the "
                     f"{counts[0]}-device forces within {PARITY_RTOL:g} (max|dF|/max|F|)"
                     + ("" if a.parity_cells is None else f", on the reduced --parity-cells {a.parity_cells} systems")
                     + ".")
    rep.note(f"Host load at the end: {_load()}.")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
