"""MD step: a velocity Verlet step of LJ argon or charged NaCl (DSF) through the bridge, against the same in torch.

Native: the torch (or Triton) op on the one-device halo rows (owned atoms and their periodic images, from a
one-device `HaloPlan`), forces folded back with `index_add_`, Verlet in torch. Bridge: one jitted program
per step over the `CompiledSpec` (GatherInputs -> the op -> ScatterOutputs + AllReduceSum -> Verlet), one
process driving the mesh. The sides take turns, each round one synchronised step of each, then a block of
steps of each issued back to back with one synchronisation (pipelined: what an MD loop does), then the
bridge's block as one program (`lax.fori_loop` over the step: one dispatch per block, as JAX MD codes run).
First-step forces of the bridge are checked against native's, and the loop's positions against as many
steps of the step program. On a GPU the profiler splits each step's device time by source (`md_profile`);
with 2 or more devices the bridge's step on 2 is timed against 1, its forces checked again.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from benchmarks import common as cm

# kernel name -> (system, op of jaxbridge_demo::)
KERNELS = {"lj-cells": ("lj", "lj_energy_forces_cells"), "lj-triton": ("lj", "lj_energy_forces_triton"),
           "lj-torch": ("lj", "lj_energy_forces"), "dsf-torch": ("dsf", "dsf_energy_forces"),
           "dsf-triton": ("dsf", "dsf_energy_forces_triton")}
ATOMS_PER_CELL = {"lj": 4, "dsf": 8}
DT = {"lj": 2.0, "dsf": 1.0}  # fs
SMOKE_CUTOFF = 4.0  # A: past argon's nearest neighbours; small blocks for the Triton interpreter
SMOKE_ATOMS = {"lj-cells": 32, "lj-torch": 32, "lj-triton": 4, "dsf-torch": 64, "dsf-triton": 64}


@dataclasses.dataclass(frozen=True)
class Case:
    """One system at one size: its op and initial state (numpy, global order)."""

    kernel: str
    positions: np.ndarray
    velocities: np.ndarray
    masses: np.ndarray
    charges: np.ndarray | None
    cell: np.ndarray
    cutoff: float

    @property
    def system(self) -> str:
        return KERNELS[self.kernel][0]

    @property
    def n(self) -> int:
        return len(self.positions)


def cells_for(atoms: int, system: str) -> int:
    """Cubic cells per axis whose system is closest to `atoms` atoms (at least 1)."""
    return max(1, round((atoms / ATOMS_PER_CELL[system]) ** (1 / 3)))


def make_case(kernel: str, atoms: int, cutoff: float | None = None) -> Case:
    """Argon (LJ) or rock salt (DSF) of about `atoms` atoms, rattled, with thermal velocities."""
    from nvalchemi_jaxbridge.demo import DSFParams, LJParams, argon_fcc, rock_salt

    system = KERNELS[kernel][0]
    cells = cells_for(atoms, system)
    s = argon_fcc(cells, temperature=60.0) if system == "lj" else rock_salt(cells, temperature=300.0)
    pos = s.positions + np.random.default_rng(cells).normal(scale=0.05, size=s.positions.shape)
    if cutoff is None:
        cutoff = LJParams().cutoff if system == "lj" else DSFParams().cutoff
    return Case(kernel, pos, np.asarray(s.velocities), np.asarray(s.masses),
                None if s.charges is None else np.asarray(s.charges), np.asarray(s.cell), cutoff)


def op_for(kernel: str):
    import torch

    import nvalchemi_jaxbridge.demo.torch_ops  # noqa: F401 - registers the jaxbridge_demo:: ops

    return getattr(torch.ops.jaxbridge_demo, KERNELS[kernel][1]).default


def plan_for(case: Case, n_devices: int, skin: float):
    """A HaloPlan with no spare capacity (headroom 1.0): kernels see almost no padding rows."""
    from nvalchemi_jaxbridge.layout import HaloPlan

    return HaloPlan.build(case.positions, case.cell, cutoff=case.cutoff, skin=skin, n_devices=n_devices, headroom=1.0)


def _mvv2e() -> float:
    from nvalchemi_jaxbridge.demo.units import MVV2E

    return MVV2E


def torch_stepper(case: Case, dtype: str, dev, skin: float = 1.0):
    """(step, first-step forces (N, 3) numpy, op_args): the native run; `step()` advances one Verlet step."""
    import torch

    plan = plan_for(case, 1, skin)
    n_pad = int(plan.n_owned[0] + plan.n_ghost[0])
    tdt = getattr(torch, dtype)
    ids = torch.as_tensor(np.array(plan.halo_global)[0, :n_pad], device=dev)
    shift = torch.as_tensor(np.asarray(plan.halo_offset)[0, :n_pad], dtype=tdt, device=dev)
    mask = torch.arange(n_pad, device=dev) < int(plan.n_owned[0])
    op = op_for(case.kernel)
    q_rows = None if case.charges is None else torch.as_tensor(case.charges, dtype=tdt, device=dev)[ids]
    inv_m = (1.0 / (_mvv2e() * torch.as_tensor(case.masses, dtype=tdt, device=dev)))[:, None]
    dt = DT[case.system]

    def rows_of(x):
        rows = x.index_select(0, ids) + shift
        return (rows, mask) if q_rows is None else (rows, q_rows, mask)

    def forces(x):
        _, f_rows = op(*rows_of(x), cutoff=case.cutoff)
        return torch.zeros_like(x).index_add_(0, ids, f_rows)

    x = torch.as_tensor(case.positions, dtype=tdt, device=dev)
    state = {"x": x, "v": torch.as_tensor(case.velocities, dtype=tdt, device=dev), "f": forces(x)}
    f0 = state["f"].double().cpu().numpy()

    def step():
        v = state["v"] + 0.5 * dt * state["f"] * inv_m
        x = state["x"] + dt * v
        f = forces(x)
        state.update(x=x, v=v + 0.5 * dt * f * inv_m, f=f)
        return f

    return step, f0, lambda: rows_of(state["x"])


def bridge_stepper(case: Case, n_dev: int, dtype: str, skin: float = 1.0):
    """(one, first-step forces (N, 3) numpy, info) through compile() on an n_dev mesh; `one()` is one step.

    info: "program" (the jitted step), "args" (its current arguments), "op_args" (the op's halo rows now),
    "rows" (owned capacity / halo rows / largest owned + ghost).
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nvalchemi_jaxbridge.kernels import compile as kcompile
    from nvalchemi_jaxbridge.lower import make_mesh
    from nvalchemi_jaxbridge.lower.tables import place
    from nvalchemi_jaxbridge.spec import DistributionSpec, OpAdapter
    from nvalchemi_jaxbridge.spec.policies import HaloStoragePolicy

    plan = plan_for(case, n_dev, skin)
    charged = case.charges is not None
    adapter = OpAdapter(op_for(case.kernel), gather_inputs=[0, 1] if charged else [0], scatter_outputs=[1],
                        all_reduce_outputs=[0])
    cs = kcompile(DistributionSpec(policy=HaloStoragePolicy(), custom_ops=(adapter,)), make_mesh(n_dev), plan,
                  positions={adapter: [0]})
    oc, hr = cs.tables.owned_capacity, cs.tables.halo_rows
    x = cs.owned(case.positions.astype(dtype), positions=True)
    v = cs.owned(np.asarray(case.velocities, dtype=dtype))
    q = cs.owned(np.asarray(case.charges, dtype=dtype)) if charged else None
    m = np.asarray(plan.to_owned(np.asarray(case.masses, np.float64)[:, None]))
    inv = np.where(m > 0, 1.0 / (_mvv2e() * np.where(m > 0, m, 1.0)), 0.0).astype(dtype)  # padding rows stay put
    inv_m = place(inv.reshape(-1, 1), NamedSharding(cs.mesh, P(cs.axis)))
    dt = np.asarray(DT[case.system], dtype)

    def force(cs, x, q):
        args = (x, q, cs.halo_owned_mask()) if charged else (x, cs.halo_owned_mask())
        e, fh = cs.call(adapter, *args, cutoff=case.cutoff)
        return e, fh.reshape(n_dev, hr, 3)[:, :oc].reshape(n_dev * oc, 3)

    @jax.jit
    def step(cs, x, v, f, q, dt):
        v = v + 0.5 * dt * f * inv_m
        x = x + dt * v
        e, f = force(cs, x, q)
        return x, v + 0.5 * dt * f * inv_m, f, e

    f0 = step(cs, x, v, v, q, np.zeros_like(dt))[2]  # a step of 0 fs: the forces at the start, the same program
    state = [x, v, f0]

    def one():
        out = step(cs, *state, q, dt)
        state[:] = out[:3]
        return out

    info = {"program": step, "args": lambda: (cs, *state, q, dt),
            "op_args": lambda: (cs.owned_to_halo(state[0], positions=True),
                                *(() if q is None else (cs.owned_to_halo(q),)), cs.halo_owned_mask()),
            "rows": f"{oc} / {hr} / {int(np.max(plan.n_owned + plan.n_ghost))}"}
    return one, cs.to_global(np.asarray(f0, dtype=np.float64)), info


def looped(info: dict, steps: int) -> cm.Run:
    """`steps` of the bridge's step program as one jitted `lax.fori_loop` (its own state, from the same start)."""
    import jax

    prog = info["program"]
    cs, x, v, f, q, dt = info["args"]()

    @jax.jit
    def loop(cs, x, v, f, q):
        return jax.lax.fori_loop(0, steps, lambda _, c: prog(cs, *c, q, dt)[:3], (x, v, f))

    state = [x, v, f]

    def run():
        state[:] = loop(cs, *state, q)
        return state[0]

    return run, cm.jax_sync


def host_until_return(step, sync, steps: int) -> float:
    """Median host seconds until a step call returns, in a block of back-to-back steps (work enqueued, not done)."""
    import time

    sync(step())
    host = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = step()
        host.append(time.perf_counter() - t0)
    sync(out)
    return cm.med(host)


def parity(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want|."""
    return float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-30))


def run(rep: cm.Report, opt) -> None:
    import jax
    import torch

    from benchmarks import md_profile

    gpu = opt.platform == "gpu"
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    kernels = opt.kernels_for("md", ["lj-cells", "lj-triton", "dsf-torch"] if opt.smoke else ["lj-cells", "lj-triton"],
                              list(KERNELS))
    dtype = opt.dtypes_or(["float32"])[0]
    rounds, steps = opt.repeats_or(15, 1), opt.steps or (2 if opt.smoke else 10)
    warmup = 0 if opt.smoke else 2
    tol = {"float32": (1e-4, 1e-3), "float64": (1e-10, 1e-9)}[dtype]  # first-step forces, loop positions (A)
    rep.setting("MD step", f"{dtype}, skin 1 A, HaloPlan headroom 1.0 built once, cutoff "
                f"{f'{SMOKE_CUTOFF} A (smoke)' if opt.smoke else 'LJ 8.5 A, DSF 9 A'}; median of {rounds} rounds "
                f"after {warmup} warm-up rounds, each round in turns: one synchronised step of each side, then {steps} steps "
                "of each back to back with one synchronisation, then the bridge's loop program of as many steps")
    table = rep.table("MD step on one device, native and the bridge in turns", [
        "kernel", "atoms", "rows (owned cap. / halo rows / needed)", "native synced ms", "bridge synced ms",
        "bridge/native (synced)", "native pipelined ms", "bridge pipelined ms", "bridge/native (pipelined)",
        f"bridge loop ms ({steps} steps per program)", "bridge loop/native", "host ms until return: native / bridge",
        "first-step max |dF| / max |F|; loop max |dx| (A)"])
    two = len(jax.devices()) >= 2
    table2 = rep.table("MD step on 2 devices against 1 (bridge, synchronised, in turns)", [
        "kernel", "atoms", "rows/device (owned cap. / halo rows / needed)", "1 device ms", "2 devices ms", "speedup",
        "2-device first-step max |dF| / max |F|", "XLA program per device"]) if two else None
    prof = md_profile.table(rep, steps) if gpu else None
    summary: dict[str, list] = {}
    speedups: dict[tuple[str, int], float] = {}
    for kernel in kernels:
        last = None  # (atoms, native step s) of the size before
        for atoms in opt.sizes_for("md", [SMOKE_ATOMS[kernel]] if opt.smoke else [10976, 42592, 171500]):
            if rep.time_left() < 0:
                rep.note(f"MD step: {kernel} at {atoms} atoms and later not run (budget spent).")
                break
            # the dense ops' work grows as the square of the rows, the cell-list op's linearly
            guess = last and last[1] * (atoms / last[0]) ** (1 if kernel == "lj-cells" else 2)
            if guess and guess > 1.0:
                rep.note(f"MD step: {kernel} at {atoms} atoms and later not run (a step would take ~{guess:.0f} s).")
                break
            case = make_case(kernel, atoms, SMOKE_CUTOFF if opt.smoke else None)
            with rep.section(f"MD step {kernel}, {case.n} atoms"):
                t_step, f_nat, t_args = torch_stepper(case, dtype, dev)
                b_step, f_br, info = bridge_stepper(case, 1, dtype)
                tsync = cm.torch_sync(dev)
                runs = {"native": (t_step, tsync), "bridge": (b_step, cm.jax_sync),
                        "native block": cm.pipelined(t_step, tsync, steps),
                        "bridge block": cm.pipelined(b_step, cm.jax_sync, steps)}
                dx = float("nan")
                if not opt.smoke or kernel == kernels[0]:  # a smoke run checks the loop program once
                    runs["bridge loop"] = loop = looped(info, steps)
                    for _ in range(steps):  # the loop's first block against as many step calls, same start
                        b_step()
                    dx = float(np.abs(np.asarray(loop[0]()) - np.asarray(info["args"]()[1])).max())
                err = parity(f_br, f_nat)
                n_rounds = rounds if opt.smoke else _rounds_for(t_step, tsync, rounds, steps)
                t = cm.medians(runs, warmup=warmup, iters=n_rounds)
                pn, pb = t["native block"] / steps, t["bridge block"] / steps
                pl = t["bridge loop"] / steps if "bridge loop" in t else float("nan")
                hn, hb = (host_until_return(step, sync, 1 if opt.smoke else steps)
                          for step, sync in ((t_step, tsync), (b_step, cm.jax_sync)))
                table.add(kernel, case.n, info["rows"], cm.ms(t["native"]), cm.ms(t["bridge"]),
                          cm.ratio(t["native"], t["bridge"]), cm.ms(pn), cm.ms(pb), cm.ratio(pn, pb), cm.ms(pl),
                          cm.ratio(pn, pl), f"{cm.ms(hn)} / {cm.ms(hb)}", f"{err:.1e}; {dx:.1e}")
                if not (err <= tol[0] and (dx <= tol[1] or dx != dx)):
                    rep.fail(f"MD step {kernel}, {case.n} atoms: first-step forces off by {err:.1e} of max |F| "
                             f"(tolerance {tol[0]:g}) or the loop's positions by {dx:.1e} A (tolerance {tol[1]:g})")
                summary.setdefault(kernel, []).append((case.n, t["native"] / t["bridge"], pn / pb, pn / pl))
                if prof is not None:
                    md_profile.add_rows(prof, kernel, case, (t_step, tsync), (b_step, cm.jax_sync), t_args, info, dev, steps)
                if table2 is not None:
                    speedups[kernel, case.n] = _two_devices(table2, rep, case, dtype, f_nat, b_step, n_rounds, warmup,
                                                            tol[0])
                last = (case.n, t["native"])
    for kernel, rows in summary.items():
        big = [r for r in rows if r[0] >= 10_000]
        if big:
            rep.target(f"MD step >= 1.0x native from 10^4 atoms, {kernel} (pipelined; loop program; issue 15)",
                       ", ".join(f"{n} atoms {p:.2f}x; loop {lp:.2f}x" for n, _, p, lp in big),
                       min(max(p, lp) for _, _, p, lp in big) >= 1.0)
            n, s, _, _ = big[-1]
            rep.target(f"one device through the bridge >= 0.95x without it, largest size, {kernel} (synced; issue 7)",
                       f"{s:.2f}x at {n} atoms", s >= 0.95)
        if two := sorted((n, s) for (k, n), s in speedups.items() if k == kernel and n >= 10_000):
            n, s = two[-1]
            rep.target(f"2 devices >= 1.8x one device through the bridge, largest size, {kernel} (issue 7)",
                       f"{s:.2f}x at {n} atoms", s >= 1.8)


def _rounds_for(step, sync, rounds: int, steps: int, seconds: float = 20.0) -> int:
    """Rounds that take about `seconds` (at least 3, at most `rounds`), from the time of one step."""
    import time

    sync(step())
    t0 = time.perf_counter()
    sync(step())
    per_round = (time.perf_counter() - t0) * (2 + 3 * steps)  # a synced step and three blocks, each side alike
    return max(3, min(rounds, int(seconds / max(per_round, 1e-9))))


def _two_devices(table2, rep: cm.Report, case: Case, dtype: str, f_nat, b_step1, rounds: int, warmup: int,
                 tol: float) -> float:
    """The bridge's step on 2 devices against 1, in turns; its first-step forces against native's."""
    b_step2, f2, info2 = bridge_stepper(case, 2, dtype)
    t = cm.medians({"1": (b_step1, cm.jax_sync), "2": (b_step2, cm.jax_sync)}, warmup=warmup, iters=rounds)
    err = parity(f2, f_nat)
    try:
        mem = cm.human_bytes(cm.program_bytes(info2["program"], *info2["args"]()))
    except Exception as e:  # noqa: BLE001 - informational
        mem = f"n/a ({type(e).__name__})"
    table2.add(case.kernel, case.n, info2["rows"], cm.ms(t["1"]), cm.ms(t["2"]), cm.ratio(t["1"], t["2"]),
               f"{err:.1e}", mem)
    if err > tol:
        rep.fail(f"MD step {case.kernel}, {case.n} atoms, 2 devices: first-step forces off by {err:.1e} of max |F|")
    return t["1"] / t["2"]
