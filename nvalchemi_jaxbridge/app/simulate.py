"""The MD job behind `nvalchemi-jaxbridge run`: system -> HaloPlan -> compiled step -> loop -> report.

The force op is a demo potential or the user's own (`--op`, `app/user_op.py`: scalars bound
by name); the trajectory and thermo files are written by `app/outputs.py`.

One MD step is one compiled program: `jax.jit` over the `CompiledSpec` (a
pytree, so a rebuilt plan with equal capacities reuses the program) and the
state in owned storage. Inside: the force call through `CompiledSpec.call`
(GatherInputs on positions, the kernel on every device's halo block,
ScatterOutputs on forces, AllReduceSum on the energy), then the velocity Verlet
(or BAOAB) update on owned rows, and the largest displacement of an owned atom
from the positions the plan was built from (where the forces were computed).

Every `check_every` steps (after a stale plan, as often as that plan held, then
doubling back) and at the last step, the host reads the steps' values
(`app/guards.py`) and gives the heap's freed pages back to the system
(`kernels/host_memory.py`: a torch op's temporaries, freed on XLA's threads, would
otherwise stay with malloc and grow the RSS step by step; the CLI's process also has
malloc map large blocks, `map_large_blocks`): a runaway energy or
temperature stops the run (`RunReport.stop`); a step whose displacement passed
skin/2 had forces from a stale plan, so the steps since the last check are run
again with the plan rebuilt at the step before (or, if one step from a fresh plan
moved that far, the run stops). Then the host re-plans if an atom could pass skin/2
before the next check. A rebuild wraps positions into the cell, builds the new plan,
carries velocities and forces across through global-ID order and asserts that every
atom is still owned exactly once. Step 1 is checked against a reference (the demo's
numpy one, or the user's op on one device):
`RunReport.ok` is False past the tolerance.

Call `configure_jax` before anything else touches JAX (the CLI does).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .run_report import RunReport, energy_drift  # noqa: F401  (energy_drift: part of this module's API)
from . import guards
from .run_config import SYSTEM_DEFAULTS, Potential, RunConfig, configure_jax, make_system, wrap


class AtomLossError(RuntimeError):
    """A plan rebuild lost, duplicated or moved an atom (a bug: never expected)."""


# ------------------------------------------------------------------ the job


@dataclasses.dataclass
class _Loop:
    """Host-side state of the loop (the compiled spec and per-atom constants change at rebuilds)."""

    cs: Any
    layout: Any
    state: Any


def run(config: RunConfig, *, progress: Callable[..., Any] | None = None) -> RunReport:
    """Run the MD job and measure it (call `configure_jax` first).

    Args:
        config: what to simulate.
        progress: called as `progress(done, **status)` after each step, `done` the steps done; `status`
            may hold `phase` ("compiling" before step 1, then "MD") and, at the host checks,
            `temperature` (K) and `energy` (total, eV/atom).

    Returns:
        The `RunReport` (`report.ok` is False when step 1 is outside the tolerance).

    Raises:
        AtomLossError: a rebuild lost an atom (never expected).
        ValueError: bad configuration or output path (the message names the option).
    """
    from . import outputs, user_op

    outputs.check_paths({"--trajectory": config.trajectory, "--thermo": config.thermo})
    if config.trajectory is not None:
        outputs.require_ase("--trajectory")

    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from ..demo import md
    from ..demo.units import KB_EV, MVV2E
    from ..kernels import compile as kcompile
    from ..kernels.host_memory import release_freed_host_memory
    from ..layout import HaloPlan
    from ..lower import make_mesh
    from ..lower.finite import all_finite, check_results, max_or_inf
    from .report import collectives
    from .run_config import check_species, species_counts

    t_start = time.perf_counter()
    devices, dtype_name = configure_jax(config.devices, dtype=config.dtype)
    dtype = np.dtype(dtype_name)
    n_dev = len(devices)
    fop = user_op.resolve(config)
    config = dataclasses.replace(config, system=config.system or ("rocksalt" if fop.charged else "argon"))
    pot, adapter, roles, scalars = fop.potential, fop.adapter, fop.roles, fop.scalars
    _, dt_default, _ = SYSTEM_DEFAULTS[config.system]
    dt = float(config.dt if config.dt is not None else dt_default)
    sys_ = make_system(config, charged=fop.charged)
    check_species(sys_, pot, config.structure or f"the generated {config.system} system")
    n = sys_.n_atoms

    plan = HaloPlan.build(sys_.positions, sys_.cell, periodic=sys_.periodic, cutoff=fop.cutoff,
                          skin=config.skin, n_devices=n_dev, headroom=1.5)
    cs = kcompile(fop.spec, make_mesh(n_dev, devices=devices), plan, positions={adapter: [0]})
    charged = fop.charged
    friction = config.langevin
    bath_t = float(config.temperature if config.temperature is not None else SYSTEM_DEFAULTS[config.system][2])

    def layout(cs: Any) -> dict[str, Any]:
        lay = {
            "masses": cs.owned(sys_.masses.astype(dtype)),
            "inv_mass": cs.owned((1.0 / (MVV2E * sys_.masses)).astype(dtype)),
            "ids": cs.owned(np.arange(n, dtype=np.int32)),
            "mask": cs.owned(np.ones(n, dtype=bool)),
            "reference": cs.owned(cs.plan.reference_positions.astype(dtype), positions=True),  # padding parked
        }
        if charged:
            lay["charges"] = cs.owned(sys_.charges.astype(dtype))
        return lay

    def owned_rows(cs: Any, halo: Any) -> Any:
        oc = cs.tables.owned_capacity
        spec = P(cs.axis)
        return jax.shard_map(lambda b: b[:oc], mesh=cs.mesh, in_specs=spec, out_specs=spec)(halo)

    def call_args(cs: Any, x: Any, lay: dict[str, Any]) -> list[Any]:
        """The block arrays in the op's order (roles by parameter name); scalars go by keyword."""
        return [x if r == "positions" else lay["charges"] if r == "charges" else cs.halo_owned_mask() for r in roles]

    def forces(cs: Any, x: Any, lay: dict[str, Any]) -> tuple[Any, Any]:
        outs = cs.call(adapter, *call_args(cs, x, lay), **scalars)
        if not (isinstance(outs, (tuple, list)) and len(outs) == 2 and outs[0].ndim == 0 and outs[1].ndim == 2
                and outs[1].shape[1] == 3):
            raise ValueError(f"run: {fop.name} returned {_shapes(outs)}; the MD job needs (energy (), forces (R, 3)) "
                             "(block convention).")
        energy, f_halo = outs
        return energy, owned_rows(cs, f_halo)

    def step(cs: Any, state: md.MDState, lay: dict[str, Any], key: Any, dt: Any) -> tuple[md.MDState, Any]:
        inv_m = lay["inv_mass"][:, None]
        v = state.velocities + 0.5 * dt * state.forces * inv_m
        if friction is None:
            x = state.positions + dt * v
        else:  # BAOAB; noise drawn in global-ID order, so it does not depend on the layout
            x = state.positions + 0.5 * dt * v
            c1 = jnp.exp(-friction * dt)
            sigma = jnp.sqrt(KB_EV * bath_t * inv_m)
            noise = jax.random.normal(key, (n, 3), dtype=v.dtype)[lay["ids"]]
            noise = jnp.where(lay["mask"][:, None], noise, jnp.zeros((), v.dtype))
            v = c1 * v + jnp.sqrt(1.0 - c1 * c1) * sigma * noise
            x = x + 0.5 * dt * v
        energy, f = forces(cs, x, lay)
        v = v + 0.5 * dt * f * inv_m
        kinetic = 0.5 * MVV2E * jnp.sum(lay["masses"][:, None] * v * v)
        d = x - lay["reference"]  # where this step's forces were computed, against the plan's positions
        # NaN-safe: a maximum over the mesh can drop a NaN, so non-finite values are found by an explicit
        # isfinite reduction and reported as a NaN displacement (the host stops there, naming the step)
        moved = jnp.sqrt(max_or_inf(jnp.sum(d * d, axis=1)))
        moved = jnp.where(all_finite(x, v, f, energy), moved, jnp.nan)
        return md.MDState(x, v, f, energy), jnp.stack([energy, kinetic, moved.astype(energy.dtype)])

    jitted_step = jax.jit(step)

    def step_fn(cs: Any, state: md.MDState, lay: dict[str, Any], key: Any, dt: float = dt) -> tuple[md.MDState, Any]:
        # the step never reads the energy it is given: leaving it out keeps one compiled program for every call
        return jitted_step(cs, dataclasses.replace(state, energy=None), lay, key, dt)

    def place(cs: Any, pos: np.ndarray, vel: np.ndarray, frc: np.ndarray | None, lay: dict[str, Any]) -> md.MDState:
        x = cs.owned(pos.astype(dtype), positions=True)
        v = cs.owned(vel.astype(dtype))
        if frc is None:  # a step of 0 fs (x and v stay as they are): the forces at x, from the step's own program
            state, _ = step_fn(cs, md.MDState(x, v, jnp.zeros_like(x), None), lay, jax.random.key(0), 0.0)
            return state
        return md.MDState(x, v, cs.owned(frc.astype(dtype)), jnp.zeros((), dtype))

    if progress is not None:
        progress(0, phase="compiling")
    rec = outputs.Recorder(config, sys_, dt, progress)
    lay = layout(cs)
    t0 = time.perf_counter()
    state = place(cs, sys_.positions, sys_.velocities, None, lay)
    e_kin0 = float(0.5 * MVV2E * np.sum(sys_.masses[:, None] * sys_.velocities**2))
    e0 = float(state.energy) + e_kin0
    check_results(f"run: the op {fop.name} at step 0", {"energy": state.energy, "forces": cs.to_global(state.forces)},
                  explain=lambda: f"It came from the op {fop.name} (its energy and forces outputs).")
    guards.check_first_step(guards.first_step_displacement(sys_.velocities, cs.to_global(state.forces), sys_.masses,
                                                           dt), config.skin, dt)
    rec.start(cs, state, float(state.energy), e_kin0)
    loop = _Loop(cs, lay, state)
    key = jax.random.key(config.seed)
    rebuilds: list[int] = []
    late: list[int] = []
    grown: list[str] = []
    parity = (float("nan"),) * 3
    t_first = None
    limits, half = config.limits(), config.skin / 2
    row0 = (float(state.energy), e_kin0)
    stop = guards.check_rows([row0], 0, n, limits)
    ckpt, fresh, checks = (loop, 0), True, 0  # the last host check: its loop, step, and whether its plan was new
    i, rebuild_at, stale1, every = 0, None, False, config.check_every  # `every`: the current check interval
    while stop is None and i < config.steps:
        new, en = step_fn(loop.cs, loop.state, loop.layout, jax.random.fold_in(key, i))
        loop, i = dataclasses.replace(loop, state=new), i + 1
        rec.step(i, loop.cs, loop.state, en)
        if i == 1 and t_first is None:
            jax.block_until_ready(loop.state)
            t_first = time.perf_counter()
            stale1 = not float(en[2]) <= half  # a stale step 1 is checked (and stops the run) at once
            if not stale1:
                parity = _parity(loop.cs, loop.state, pot, sys_, float(en[0]))
            if progress is not None:
                progress(1, phase="MD")
        if i == rebuild_at:  # replayed up to the last step the plan held for: re-plan there
            rebuild_at = None
            loop = _rebuild(loop, i, sys_, layout, place, rebuilds, grown)
            ckpt, fresh = (loop, i), True
        elif i >= ckpt[1] + every or i == config.steps or (i == 1 and stale1):
            checks += 1
            c, rows = ckpt[1], rec.pull()
            bad = np.flatnonzero(~(rows[c:i, 2] <= half))  # NaN counts as moved too far
            upto = i if bad.size == 0 else c + int(bad[0])
            stop = guards.check_rows(rows[c:upto], c + 1, n, limits, previous=rows[c - 1] if c else row0)
            if stop is None and bad.size and np.isnan(rows[upto, 2]):  # non-finite state: stop, name the step
                stop = guards.nonfinite_step(upto + 1, i, _nonfinite_atoms(loop.cs, loop.state))
            if stop is None and bad.size:
                s = upto + 1  # the first step whose forces came from a plan it had moved too far from
                if s == c + 1 and fresh:
                    stop = guards.stale_step(s, float(rows[upto, 2]), config.skin)
                else:
                    print(f"note: step {s}: an atom moved {rows[upto, 2]:.3f} Å > skin/2 = {half:.3f} Å since its "
                          f"plan; steps {c + 1}-{i} are run again with the plan rebuilt at step {s - 1} (raise "
                          "--skin or lower --check-every to avoid it).", file=sys.stderr)
                    late.append(s - 1)
                    loop, i, every = ckpt[0], c, max(1, s - 1 - c)  # check as often as that plan held
                    rec.truncate(c)
                    if s - 1 > c:
                        rebuild_at = s - 1
                    else:
                        loop = _rebuild(loop, c, sys_, layout, place, rebuilds, grown)
                        ckpt, fresh = (loop, c), True
                    continue
            if stop is not None:  # keep the runaway step, not a step computed on a stale plan
                i, loop = min(stop.step, upto), ckpt[0]  # the final state reported: the last check's
                rec.truncate(i)
                break
            rec.flush()
            release_freed_host_memory()  # what torch ops freed on XLA's threads (kernels/host_memory.py)
            if i < config.steps:
                loop, fresh = _check_and_rebuild(loop, i, dt, sys_, layout, place, rebuilds, grown, every)
                ckpt, every = (loop, i), min(config.check_every, 2 * every)
        if progress is not None:
            progress(i)
    jax.block_until_ready(loop.state)
    t_end = time.perf_counter()

    e = rec.finish()
    total = np.concatenate([[e0], e[:, 0] + e[:, 1]])
    drift, slope = energy_drift(total, n, dt)
    t_first = t_end if t_first is None else t_first
    per_step = (t_end - t_first) / (i - 1) if i > 1 else t_end - t0
    vel = loop.cs.to_global(loop.state.velocities)
    final_t = float(md.temperature(jnp.asarray(vel), jnp.asarray(sys_.masses)))
    plan = loop.cs.plan
    coll = collectives(loop.cs, adapter, *call_args(loop.cs, loop.state.positions, loop.layout), **scalars)
    return RunReport(
        system=config.system if config.structure is None else "".join(
            f"{k}{v}" for k, v in species_counts(sys_.atomic_numbers).items()),  # a file's own formula, e.g. Cu108
        potential=pot.name, spec=fop.spec_path, op=fop.name, kernel=fop.kernel,
        n_atoms=n, n_devices=n_dev, platform=devices[0].platform, dtype=dtype_name, grid=tuple(plan.grid),
        steps=config.steps, dt_fs=dt,
        thermostat="NVE (velocity Verlet)" if friction is None else f"Langevin BAOAB, friction {friction:g}/fs, {bath_t:g} K",
        compile_s=float(t_first - t0), time_per_step_s=float(per_step), wall_s=float(time.perf_counter() - t_start),
        energy_per_atom_eV=tuple(float(v) for v in total / n),
        energy_change_max_eV_per_atom=drift, energy_slope_eV_per_atom_ps=slope,
        parity_energy_rel=parity[0], parity_force_max_abs_eV_per_A=parity[1], parity_force_max_rel=parity[2],
        parity_reference=fop.reference,
        halo_ghost_rows=int(plan.n_ghost.sum()),
        halo_rows_per_step=int(sum(c.rows for c in coll if c.op == "ppermute")),
        halo_bytes_per_step=int(sum(c.bytes for c in coll)),
        halo_padded_bytes_per_step=int(sum(c.padded_bytes for c in coll)),
        collectives=tuple(c.to_dict() for c in coll),
        owned_per_device=tuple(int(v) for v in plan.n_owned), ghosts_per_device=tuple(int(v) for v in plan.n_ghost),
        rebuilds=tuple(rebuilds), late_rebuilds=tuple(late), grown=tuple(dict.fromkeys(grown)),
        final_temperature_K=final_t,
        initial_temperature_K=float(md.temperature(jnp.asarray(sys_.velocities), jnp.asarray(sys_.masses))),
        call_path=_call_path(adapter.op),
        structure=config.structure, species=species_counts(sys_.atomic_numbers),
        params=dict(scalars),
        rtol=config.tolerance(dtype_name), outputs=rec.summary(),
        final_positions=loop.cs.to_global(loop.state.positions).astype(np.float64),
        final_velocities=np.asarray(vel, dtype=np.float64),
        steps_done=i, stop=None if stop is None else stop.to_dict(), skin_A=float(config.skin),
        max_displacement_A=float(np.max(e[:, 2], initial=0.0)), host_checks=checks,
        potential_per_atom_eV=tuple(float(v) for v in np.concatenate([[e0 - e_kin0], e[:, 0]]) / n),
        bath_temperature_K=None if friction is None else bath_t,
        temperature_K=tuple(float(v) for v in 2.0 * np.concatenate([[e_kin0], e[:, 1]]) / (max(3 * n - 3, 1) * KB_EV)),
    )


def _nonfinite_atoms(cs: Any, state: Any) -> str:
    """Which atoms hold NaN or inf positions, velocities or forces in `state` (for the stop message)."""
    from ..layout.finite import bad_rows, rows_text

    parts = []
    for name in ("positions", "velocities", "forces"):
        rows = bad_rows(cs.to_global(getattr(state, name)))
        if rows.size:
            parts.append(f"the {name} of atoms {rows_text(rows)}")
    return ", ".join(parts) + " are not finite" if parts else ""


def _shapes(outs: Any) -> str:
    """The shapes of an op's outputs, for a message."""
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return f"{len(outs)} output(s) of shapes {[tuple(getattr(o, 'shape', ())) for o in outs]}"


def _call_path(op: Any) -> str:
    """How the run's calls reached a torch kernel ("ffi" / "callback (<why>)"), or "-" for a JAX kernel."""
    from ..kernels import TorchOpKernel, resolve_kernel

    kernel = resolve_kernel(op)
    if not isinstance(kernel, TorchOpKernel):
        return "-"
    return "; ".join(kernel.paths_taken()) or "-"


def _parity(cs: Any, state: Any, pot: Potential, sys_: Any, energy: float) -> tuple[float, float, float]:
    """(energy rel error, max |dF|, max |dF| / max |F_ref|) of the distributed step against numpy."""
    pos = cs.to_global(state.positions).astype(np.float64)
    f = cs.to_global(state.forces).astype(np.float64)
    e_ref, f_ref = pot.reference(pos, sys_.charges, sys_)
    err = float(np.max(np.abs(f - f_ref)))
    scale = max(float(np.max(np.abs(f_ref))), np.finfo(np.float64).tiny)
    return abs(energy - e_ref) / max(abs(e_ref), np.finfo(np.float64).tiny), err, err / scale


def _check_and_rebuild(loop: _Loop, step: int, dt: float, sys_: Any, layout: Callable, place: Callable,
                       rebuilds: list[int], grown: list[str], check_every: int) -> tuple[_Loop, bool]:
    """The host rebuild check: re-plan when an atom could pass skin/2 before the next check; (loop, re-planned)."""
    pos = loop.cs.to_global(loop.state.positions).astype(np.float64)
    vel = loop.cs.to_global(loop.state.velocities).astype(np.float64)
    plan = loop.cs.plan
    ahead = plan.max_displacement(pos) + check_every * dt * float(np.max(np.linalg.norm(vel, axis=1), initial=0.0))
    if ahead <= plan.skin / 2 and not plan.needs_rebuild(pos):
        return loop, False
    return _rebuild(loop, step, sys_, layout, place, rebuilds, grown), True


def _rebuild(loop: _Loop, step: int, sys_: Any, layout: Callable, place: Callable, rebuilds: list[int],
             grown: list[str]) -> _Loop:
    """A new plan at the loop's positions (wrapped into the cell), the state carried over and every atom checked."""
    cs = loop.cs
    pos = cs.to_global(loop.state.positions).astype(np.float64)
    vel = cs.to_global(loop.state.velocities).astype(np.float64)
    frc = cs.to_global(loop.state.forces).astype(np.float64)
    wrapped = wrap(pos, sys_.cell, sys_.periodic)
    new_cs = cs.rebuild(wrapped)
    grown.extend(new_cs.plan.grown)
    lay = layout(new_cs)
    state = place(new_cs, wrapped, vel, frc, lay)
    state = dataclasses.replace(state, energy=loop.state.energy)
    _assert_all_atoms(new_cs, state, wrapped, vel, step)
    rebuilds.append(step)
    return _Loop(new_cs, lay, state)


def _assert_all_atoms(cs: Any, state: Any, positions: np.ndarray, velocities: np.ndarray, step: int) -> None:
    """Every global ID owned exactly once, and positions and velocities come back unchanged."""
    plan = cs.plan
    ids = np.sort(plan.owned_global[plan.owned_mask])
    n = positions.shape[0]
    if ids.shape != (n,) or not np.array_equal(ids, np.arange(n)):
        missing = np.setdiff1d(np.arange(n), ids)[:5].tolist()
        raise AtomLossError(
            f"rebuild at step {step}: the new plan owns {ids.size} rows for {n} atoms (missing ids {missing}); "
            "this is a bug in the layout layer, please report it with the structure and the step."
        )
    back_x = cs.to_global(state.positions)
    back_v = cs.to_global(state.velocities)
    if not (np.allclose(back_x, positions.astype(back_x.dtype), rtol=0, atol=0)
            and np.allclose(back_v, velocities.astype(back_v.dtype), rtol=0, atol=0)):
        raise AtomLossError(
            f"rebuild at step {step}: positions or velocities changed while moving to the new plan; "
            "this is a bug in the layout or lowering layer, please report it."
        )
