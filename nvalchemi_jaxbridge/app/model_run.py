"""The model-level job behind `nvalchemi-jaxbridge run --model`: a message-passing MLIP distributed, checked, run.

    model (seeded MPNN / MACE, or a model file: `mlip.load_model`) -> DistributedMLIP (JAX front door)
      -> energy, forces, stress against the same model on one device -> MD (NVE or Langevin, `mlip.dynamics.md`)

The single-device reference and the parity are in `model_reference`; the report is `run_report.ModelRunReport`;
the trajectory and thermo files are written by `outputs` (the demo path's writers), at the MD's checks.

Call `run_config.configure_jax` before anything else touches JAX (`run_model` does).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .model_reference import parity, single_device_reference
from .run_report import ModelRunReport
from .model_reference import periodic_graph as periodic_graph  # re-exported: a public name here too

MODELS = ("mpnn", "mace")
#: Species of the seeded models and the default structure (Cu, Au), and their masses (amu).
SPECIES = (29, 79)
MASSES = {29: 63.546, 79: 196.966570}
EXCHANGES = ("per_layer", "deep_halo")
#: Options of the demo potentials (LJ / DSF) and of --op that a model run has no use for.
DEMO_ONLY = ("system", "spec", "kernel", "op", "param")
#: Options of a model run that the demo potentials have no use for.
MODEL_ONLY = ("exchange", "checkpoint", "tiles", "memory_budget")
#: Unit suffixes `--memory-budget` takes (bytes per unit; case-insensitive).
BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_tiles(text: str | None) -> int | str:
    """`--tiles`: an int >= 1 or "auto" (None: 1).

    Raises:
        ValueError: anything else, naming the option and what it takes.
    """
    if text is None:
        return 1
    value = text.strip().lower()
    if value == "auto":
        return "auto"
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise ValueError(
        f"run: --tiles must be an int >= 1 (tiles per device, evaluated one after another) or 'auto' (as many as "
        f"--memory-budget needs), got {text!r}; e.g. --tiles 4 or --tiles auto."
    )


def parse_bytes(text: str | None) -> float | None:
    """`--memory-budget`: bytes per device, as a number (`8e9`) or with a unit (`8GiB`, `500MB`); None: None.

    Raises:
        ValueError: not a number > 0 with one of `BYTE_UNITS`, naming the option.
    """
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    try:
        value = float(m.group(1)) * BYTE_UNITS[m.group(2) or "b"] if m else float("nan")
    except (KeyError, ValueError):
        value = float("nan")
    if not (np.isfinite(value) and value > 0):
        raise ValueError(
            f"run: --memory-budget must be bytes per device > 0, as a number (8e9) or with a unit (B, kB, MB, GB, "
            f"TB, KiB, MiB, GiB, TiB; e.g. 8GiB), got {text!r}."
        )
    return value


def check_options(*, model_run: bool, given: dict[str, Any]) -> None:
    """Refuse options of the other kind of run (`given`: option name -> value, None when not given).

    Raises:
        ValueError: a demo-only option with `--model` / `--checkpoint`, or a model-only one without.
    """
    names = DEMO_ONLY if model_run else MODEL_ONLY
    if bad := [f"--{n.replace('_', '-')}" for n in names if given.get(n) is not None]:
        if model_run:
            raise ValueError(
                f"run: {', '.join(bad)} apply to the demo potentials (Lennard-Jones, DSF), not to a model run; "
                "drop them, or drop --model / --checkpoint to run the demo."
            )
        raise ValueError(f"run: {', '.join(bad)} apply to a model run; add --model mpnn|mace|FILE.")


# ------------------------------------------------------------------ config


@dataclasses.dataclass(frozen=True)
class ModelRunConfig:
    """What `run_model` runs.

    Attributes:
        model: "mpnn" or "mace" (seeded random weights), or the path of a model file (any other value;
            `mlip.load_model` reads it, trusting it: a whole-model pickle runs code from the file);
            with `checkpoint`, None or the checkpoint's kind.
        checkpoint: a model file, as `model` takes it (the older spelling).
        seed: weights of a seeded model, the rattle of the default structure, the velocities.
        devices: devices of the mesh (default 8 on the CPU, all GPUs otherwise).
        exchange: "per_layer" (halo of one cutoff + skin) or "deep_halo" (n_layers x cutoff + skin).
        steps, dt, temperature: MD steps, time step (fs), initial (and Langevin bath) temperature (K).
        langevin: the Langevin (BAOAB) friction (1/fs), or None for NVE.
        cells: fcc cells per axis of the default rattled Cu/Au structure (4 atoms each).
        structure: read this file (ASE) instead.
        skin: Verlet skin of the layout (Å).
        check_every: steps between host rebuild checks.
        dtype: "float64" or "float32" (default float64 on the CPU, float32 on GPUs); the model is cast to it.
        rtol: parity tolerance on each relative difference (default 1e-8 in float64, 1e-4 in float32).
        max_energy, max_temperature, max_energy_jump: the run stops past `abs(E_pot)` per atom (eV), the
            temperature (K) or the relative total-energy jump between checks (`guards.Limits`).
        trajectory, trajectory_every: extended XYZ file with a frame every `trajectory_every` steps (and the
            last step); a check of the MD falls on each frame's step.
        thermo, thermo_every: CSV of step, time, temperature and energies every `thermo_every` steps (and the
            last step), likewise.
        tiles: each device's block in this many tiles (`DistributedMLIP(tiles=)`, needs the deep halo), or
            "auto" (the fewest that fit `memory_budget`, from the model's measured memory).
        memory_budget: bytes per device (None: half of each device's memory).
    """

    model: str | None = "mpnn"
    checkpoint: str | None = None
    seed: int = 0
    devices: int | None = None
    exchange: str = "per_layer"
    steps: int = 100
    dt: float = 1.0
    temperature: float = 300.0
    cells: int = 3
    structure: str | None = None
    skin: float = 0.5
    check_every: int = 10
    dtype: str | None = None
    rtol: float | None = None
    max_energy: float = 1e3
    max_temperature: float = 1e6
    max_energy_jump: float = 1.0
    langevin: float | None = None
    trajectory: str | None = None
    trajectory_every: int = 10
    thermo: str | None = None
    thermo_every: int = 10
    tiles: int | str = 1
    memory_budget: float | None = None

    def __post_init__(self):
        if self.model is None and self.checkpoint is None:
            raise ValueError("run: name a model: --model mpnn|mace (seeded random weights) or --model FILE.")
        if self.model is not None and self.model not in MODELS and self.checkpoint is not None:
            raise ValueError(
                f"run: --model {self.model} and --checkpoint {self.checkpoint} both name a model file; give it once "
                "(--model FILE)."
            )
        if self.file is not None and not os.path.isfile(self.file):
            option = "--checkpoint" if self.checkpoint is not None else "--model"
            raise ValueError(
                f"run: {option} {self.file}: no such file; --model takes mpnn or mace (seeded random weights) or "
                "the path of a model file saved with torch.save(model, path) (e.g. MACE's *.model)."
            )
        if self.exchange not in EXCHANGES:
            raise ValueError(f"run: exchange must be one of {EXCHANGES}, got {self.exchange!r}.")
        for name in ("steps", "check_every", "cells", "trajectory_every", "thermo_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "steps" else 1):
                raise ValueError(f"run: --{name.replace('_', '-')} must be an int >= {0 if name == 'steps' else 1}, "
                                 f"got {v!r}.")
        for name in ("dt", "temperature", "skin", "rtol", "langevin"):
            v = getattr(self, name)
            positive = name in ("dt", "langevin")
            if v is not None and not (np.isfinite(v) and (v > 0 if positive else v >= 0)):
                raise ValueError(f"run: --{name} must be a finite number {'> 0' if positive else '>= 0'}, got {v!r}.")
        if self.tiles != 1 and self.exchange != "deep_halo":
            raise ValueError(
                f"run: --tiles {self.tiles} evaluates each tile with its own deep halo, but --exchange is "
                f"{self.exchange}; pass --exchange deep_halo with it (same numbers), or leave --tiles out."
            )
        if self.memory_budget is not None and not (np.isfinite(self.memory_budget) and self.memory_budget > 0):
            raise ValueError(f"run: --memory-budget must be bytes per device > 0, got {self.memory_budget!r}.")
        if self.dtype not in (None, "float32", "float64"):
            raise ValueError(f"run: dtype must be 'float32' or 'float64', got {self.dtype!r}.")
        self.limits()

    @property
    def file(self) -> str | None:
        """The model file of the run (`model` when it is not a model name, else `checkpoint`), or None."""
        return self.model if self.model is not None and self.model not in MODELS else self.checkpoint

    def limits(self) -> Any:
        """The run's blow-up thresholds (`guards.Limits`; raises ValueError on a bad one)."""
        from .guards import Limits

        return Limits(self.max_energy, self.max_temperature, self.max_energy_jump)

    def tolerance(self, dtype: str) -> float:
        """The parity tolerance for a run in `dtype`."""
        return self.rtol if self.rtol is not None else (1e-8 if dtype == "float64" else 1e-4)


# ------------------------------------------------------------------ model and structure


def load_wrapper(config: ModelRunConfig, dtype: str = "float64") -> Any:
    """The run's model in `dtype`: a `MessagePassingWrapper`, or the ML-IAP model object a model file holds.

    A model file is read by `mlip.load_model(..., trust=True)`: naming it on the command line trusts it.
    """
    import torch

    from ..mlip import MPNN, MPNNWrapper, load_model
    from ..mlip.mace import MACEWrapper

    tdtype = getattr(torch, dtype)
    if config.file is None:
        if config.model == "mpnn":
            return MPNNWrapper(MPNN(SPECIES, seed=config.seed).to(tdtype))  # the same weights in either dtype
        from ..mlip.mace import random_mace

        # edge harmonics to l = 2: MACE's code paths at a fraction of l = 3's build and run time
        return MACEWrapper(random_mace(SPECIES, seed=config.seed, dtype=tdtype, max_ell=2))
    loaded = load_model(config.file, trust=True)
    kind = {MPNNWrapper: "mpnn", MACEWrapper: "mace"}.get(type(loaded))
    if config.model in MODELS and config.model != kind:
        what = f"a {kind} model" if kind else f"a {type(loaded).__name__}"
        raise ValueError(
            f"run: --checkpoint {config.file} holds {what} but --model {config.model} was given; "
            f"{f'use --model {kind} or drop --model' if kind else 'drop --model'}."
        )
    if kind is not None:
        return type(loaded)(loaded.model.to(tdtype))
    if getattr(loaded, "dtype", tdtype) != tdtype:
        raise ValueError(
            f"run: {config.file} holds a {type(loaded).__name__} that computes in {loaded.dtype} but the run is "
            f"{dtype}; pass --dtype {str(loaded.dtype).removeprefix('torch.')}."
        )
    return loaded


def alloy(cells: int = 3, *, a: float = 3.75, rattle: float = 0.1, seed: int = 0) -> Any:
    """Rattled fcc Cu/Au (species drawn at random): `cells` cubic cells of 4 atoms along each axis, periodic."""
    from ..demo.systems import System

    base = np.array([[0.0, 0.0, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5], [0.5, 0.5, 0.0]])
    grid = np.stack(np.meshgrid(*(np.arange(cells),) * 3, indexing="ij"), -1).reshape(-1, 1, 3)
    rng = np.random.default_rng(seed)
    pos = ((grid + base).reshape(-1, 3) * a) + rng.normal(scale=rattle, size=(4 * cells**3, 3))
    numbers = rng.choice(np.asarray(SPECIES), len(pos))
    return System(positions=pos, cell=np.eye(3) * a * cells, periodic=(True, True, True),
                  masses=np.array([MASSES[int(z)] for z in numbers]), atomic_numbers=numbers)


def make_structure(config: ModelRunConfig) -> Any:
    """The run's structure (the default alloy or the file), with Maxwell-Boltzmann velocities."""
    from ..demo import systems

    s = systems.read_structure(config.structure) if config.structure else alloy(config.cells, seed=config.seed)
    return s.with_temperature(config.temperature, seed=config.seed) if s.velocities is None else s


# ------------------------------------------------------------------ the job


def run_model(config: ModelRunConfig, *, progress: Callable[..., Any] | None = None) -> ModelRunReport:
    """Distribute the model, compare it with one device, then run `config.steps` MD steps.

    Args:
        config: what to run.
        progress: called as `progress(done, phase=..., temperature=K, energy=eV/atom)`: `phase` names
            what runs ("layout", "compiling", "reference", "compiling MD", "MD"); at each MD check the
            steps done, the temperature and the total energy per atom.

    Returns:
        The `ModelRunReport` (`report.ok` is False when a parity difference exceeds the tolerance).
    """
    from ..mlip import DistributedMLIP
    from ..mlip.dynamics import Langevin, md
    from ..mlip.model_files import is_mliap_model
    from ..mlip.model_layout import build_layout
    from . import guards, outputs
    from .run_config import configure_jax

    outputs.check_paths({"--trajectory": config.trajectory, "--thermo": config.thermo})
    if config.trajectory is not None:
        outputs.require_ase("--trajectory")
    say = progress or (lambda *a, **k: None)
    t_start = time.perf_counter()
    devices, dtype = configure_jax(config.devices, dtype=config.dtype)
    say(0, phase="layout")
    wrapper = load_wrapper(config, dtype)
    s = make_structure(config)
    pos, z, cell, pbc = s.positions, s.atomic_numbers, s.cell, s.periodic
    n_dev = len(devices)
    mliap = is_mliap_model(wrapper)
    memory = {k: v for k, v in (("tiles", config.tiles), ("memory_budget", config.memory_budget))
              if v not in (1, None)}
    if mliap and memory:
        raise ValueError(
            f"run: {', '.join('--' + k.replace('_', '-') for k in memory)} apply to a message-passing model "
            f"(mpnn, mace, a MessagePassingWrapper), but {config.file} holds an ML-IAP model, which runs its own "
            "forward layer by layer; drop them."
        )
    model = DistributedMLIP(wrapper, n_devices=n_dev, exchange=config.exchange, skin=config.skin, **memory)
    state = model.prepare(pos, z, cell, pbc)
    say(0, phase="compiling")
    t0 = time.perf_counter()
    got = model.evaluate(pos, z, cell, pbc, state=state, stress=True)
    compile_s = time.perf_counter() - t0
    say(0, phase="reference")
    if mliap:  # the model's own compute_forces on one device: LAMMPS' one-process view (images as ghost rows)
        import copy

        want = DistributedMLIP(copy.deepcopy(wrapper), n_devices=1, skin=config.skin).evaluate(
            pos, z, cell, pbc, stress=True)
        want["how"] = "the ML-IAP model's own compute_forces on one device"
        other, other_rows = config.exchange, tuple(state.rows_per_device())  # it asks for its own exchanges
        name, n_layers = model.name, len([s for s in model.model.schedule if s.kind == "forward"]) + 1
    else:
        want = single_device_reference(wrapper, pos, z, cell, pbc)
        other = EXCHANGES[1 - EXCHANGES.index(config.exchange)]
        o_plan, o_edges, *_ = build_layout(wrapper, other, pos, z, cell, pbc, n_devices=n_dev, skin=config.skin,
                                           headroom=model.headroom)
        other_rows = tuple({"owned": int(o_plan.n_owned[d]), "ghost": int(o_plan.n_ghost[d]),
                            "edges": int(o_edges.n_edges[d])} for d in range(n_dev))
        name, n_layers = wrapper.name, int(wrapper.n_layers)

    out = outputs.CheckOutputs(config, s, say)
    watch = guards.Watch(config.limits(), len(pos))
    e_kin0 = guards.kinetic(s.velocities, s.masses)
    traj = {"energy": {0: float(got["energy"])}, "kinetic": {0: e_kin0}, "rebuilds": 1, "rebuild_steps": [],
            "steps": 0, "timing": (0, 0.0, 0.0)}
    if config.steps:
        guards.check_first_step(guards.first_step_displacement(s.velocities, got["forces"], s.masses, config.dt),
                                config.skin, config.dt)
        if not watch(0, float(got["energy"]), e_kin0):
            say(0, phase="compiling MD")
            thermostat = None if config.langevin is None else Langevin(config.temperature, config.langevin,
                                                                         config.seed)
            traj = md(model, pos, s.velocities, s.masses, z, cell, pbc, steps=config.steps, dt=config.dt,
                      check_every=config.check_every, thermostat=thermostat,
                      stop_when=out.watch(watch), frames_every=out.every,
                      on_frame=out.on_frame if out.every else None)
    elif out.every:  # --steps 0: the outputs hold the start
        out.on_frame(0, {"positions": np.asarray(pos, dtype=np.float64), "velocities": s.velocities,
                         "forces": got["forces"], "energy": float(got["energy"]), "kinetic": e_kin0})
    return ModelRunReport(
        model=name, source=config.file or f"seeded random weights (seed {config.seed})",
        cutoff=float(wrapper.cutoff if not mliap else model.cutoff), n_layers=n_layers,
        n_params=_n_params(wrapper),
        n_atoms=len(pos), n_devices=n_dev, platform=devices[0].platform, dtype=dtype, exchange=config.exchange,
        halo_depth=float(model.halo_depth), skin=float(config.skin),
        energy=float(got["energy"]), energy_reference=float(want["energy"]), parity=parity(got, want),
        rtol=config.tolerance(dtype), reference=want["how"],
        rows_per_device=memory_rows(model, state), other_exchange=other, other_rows_per_device=other_rows,
        compile_s=float(compile_s), steps=config.steps, dt=float(config.dt),
        thermostat="NVE (velocity Verlet)" if config.langevin is None else
        f"Langevin BAOAB, friction {config.langevin:g}/fs, {config.temperature:g} K",
        bath_temperature_K=None if config.langevin is None else float(config.temperature),
        md_steps=tuple(sorted(traj["energy"])),
        potential_energy_eV=tuple(float(traj["energy"][k]) for k in sorted(traj["energy"])),
        kinetic_energy_eV=tuple(float(traj["kinetic"][k]) for k in sorted(traj["energy"])),
        rebuilds=int(traj["rebuilds"]), rebuild_steps=tuple(int(k) for k in traj["rebuild_steps"]),
        timing=tuple(traj["timing"]), wall_s=float(time.perf_counter() - t_start),
        steps_done=int(traj["steps"]), stop=None if watch.stop is None else watch.stop.to_dict(),
        outputs=out.summary(), tiles=config.tiles,
        memory_budget_bytes=None if mliap else float(model.budget.bytes),
        memory_model=None if mliap else "measured" if model.model_cost is not None else "budget",
    )


def memory_rows(model: Any, state: Any) -> tuple[dict[str, Any], ...]:
    """`state.rows_per_device()`, with each device's tiles, its largest tile (the one of the largest predicted
    peak: its rows, edges and peak bytes) when the model runs in tiles or chose their count ("auto"); the peak
    from the model's measured cost where it has one, else from the budget's cost per row and edge (what explicit
    tiles were checked against)."""
    rows = [dict(r) for r in state.rows_per_device()]
    tiles, cost = getattr(state, "tiles", None), getattr(model, "model_cost", None)
    if tiles is None and getattr(model, "tile_choice", None) is None:
        return tuple(rows)
    predict = cost.predict if cost is not None else model.budget.cost
    for d, r in enumerate(rows):
        if tiles is None:  # "auto" chose the block in one go
            r.update(tiles=1, tile_rows=r["owned"] + r["ghost"], tile_edges=r["edges"])
            r["predicted_bytes"] = float(predict(r["tile_rows"], r["tile_edges"]))
        else:
            peaks = predict(tiles.n_rows[d], tiles.n_edges[d])
            t = int(np.argmax(peaks))
            r.update(tile_rows=int(tiles.n_rows[d, t]), tile_edges=int(tiles.n_edges[d, t]),
                     predicted_bytes=float(peaks[t]))
    return tuple(rows)


def _n_params(wrapper: Any) -> int:
    """Parameters of the wrapper's torch model (`wrapper.model`; 0 when it has none)."""
    import torch

    model = getattr(wrapper, "model", None)
    return int(sum(p.numel() for p in model.parameters())) if isinstance(model, torch.nn.Module) else 0
