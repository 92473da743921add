"""Host time per device per MD step on the JAX front door (issue 31, item 2), and the CPU-device proxy.

One process drives D devices; the stage ops' Python bodies hold the GIL, so D devices queue on them. Per
device count D, `mlip.dynamics.nve` (velocity Verlet, 1 fs, 300 K; `check_every` steps per program, as the
`mlip` question's MD step) of MACE (`benchmarks.mlip`'s model; a GPU's default) or the project's MPNN (the
CPU's) on rattled fcc Cu/Au, at fixed atoms per device (weak) and at fixed total atoms (strong). Measured
in this process, with no timer in the library: each stage op's Python body (the function `mlip.stages`
hands to `torch_function`, and the backward of a CUDA-graph replay) is wrapped with `time.perf_counter`
and `time.thread_time` accumulators, and the chunk program `nve` calls with a clock around the call
(returns at dispatch) and its results (ready). The C++ FFI handler around a body and the autograd engine's
backward outside a replay are not counted. Per chunk that compiled nothing (the first, the start's
forces, is left out), per step:

- step: wall time from one chunk's call to the next's (nve's host checks included); the median;
- program: the chunk's call until its results are ready;
- dispatch: until the call returns (JAX dispatches asynchronously), as wall time (which includes waiting for
  the GIL while the program's first stage ops hold it) and as the calling thread's CPU time (which does not);
- stage-op host time: the bodies' thread CPU time (and wall time) summed over the D devices' calls;
- host per device = (stage-op CPU time + dispatch CPU time) / D, and its share of the step; a body that ran
  on the dispatching thread (where XLA runs the program's host side there) is inside the dispatch's CPU time,
  so it is counted once (the table gives that part of the stage-op CPU time in parentheses).

On the CPU the bodies *are* the model's compute (torch on the calling thread, one torch thread, so D
devices use D cores), so there the share is not host overhead; the CPU proxy's figure is the strong-scaling
speed-up. Each strong-scaling run's final positions are checked against the one-device run's.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from benchmarks import common as cm

MODELS = ("mace", "mpnn")
NEAR = (500, 2000)  # atoms per device counted as "10^3 atoms per device" by the target
TARGET = 0.10
BACKWARD = "backward (graph replay)"  # the label of a CUDA-graph replay's backward (Python, on a GPU)
DX_TOL = {"float32": 1e-3, "float64": 1e-8}  # final positions on D devices against 1 (A)


class OpClock:
    """Calls, wall seconds and thread CPU seconds of wrapped functions, by label (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: collections.Counter[str] = collections.Counter()
        self.wall: collections.Counter[str] = collections.Counter()
        self.cpu: collections.Counter[str] = collections.Counter()
        self.inline: collections.Counter[str] = collections.Counter()  # CPU of bodies run on the dispatcher
        self.dispatcher: int | None = None  # the thread that calls the chunk program

    def timed(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args)
            finally:
                c = time.thread_time() - c0  # the CPU window inside the wall window
                w = time.perf_counter() - w0
                with self.lock:
                    self.calls[label] += 1
                    self.wall[label] += w
                    self.cpu[label] += c
                    if threading.get_ident() == self.dispatcher:
                        self.inline[label] += c

        return run

    def snapshot(self) -> tuple[collections.Counter, ...]:
        with self.lock:
            return tuple(collections.Counter(c) for c in (self.calls, self.wall, self.cpu, self.inline))


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One call of nve's chunk program: its steps, clocks, compilations and the stage ops inside it."""

    n: int
    start: float
    returned: float
    ready: float
    dispatch_cpu: float  # the calling thread's CPU seconds until the call returned
    compiles: int
    calls: collections.Counter
    wall: collections.Counter
    cpu: collections.Counter
    inline: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # in dispatch_cpu too


class Probe:
    """The question's clocks: one `OpClock` for every stage op, and the chunk calls of the current run."""

    def __init__(self) -> None:
        self.clock, self.chunks = OpClock(), []


@contextlib.contextmanager
def clocked(probe: Probe) -> Iterator[None]:
    """Inside: stage ops defined here time their bodies, graph backwards and nve's chunk calls are timed.

    Monkeypatched in this process (`mlip.stages.torch_function`, `mlip.dynamics._chunk_fn`, the CUDA-graph
    replay's backward) and restored on the way out.
    """
    import jax

    from nvalchemi_jaxbridge.kernels import cuda_graphs
    from nvalchemi_jaxbridge.mlip import dynamics, stages
    from tests.compile_events import backend_compiles

    real_fn, real_chunk, real_back = stages.torch_function, dynamics._chunk_fn, cuda_graphs._Replay.backward
    clock = probe.clock

    def torch_function(fn, n_in, n_out, *, label="fn", call_path="auto"):
        return real_fn(clock.timed(fn, label), n_in, n_out, label=label, call_path=call_path)

    def chunk_fn(model, thermostat):
        call = real_chunk(model, thermostat)

        def timed(*args):
            before = clock.snapshot()
            clock.dispatcher = threading.get_ident()
            with backend_compiles() as seen:
                t0, c0 = time.perf_counter(), time.thread_time()
                out = call(*args)
                c1 = time.thread_time()
                t1 = time.perf_counter()
                jax.block_until_ready(out)
                t2 = time.perf_counter()
            after = clock.snapshot()
            probe.chunks.append(Chunk(int(args[7]), t0, t1, t2, c1 - c0, len(seen),
                                      *(a - b for a, b in zip(after, before))))
            return out

        return timed

    stages.torch_function, dynamics._chunk_fn = torch_function, chunk_fn
    cuda_graphs._Replay.backward = staticmethod(clock.timed(real_back, BACKWARD))
    try:
        yield
    finally:
        stages.torch_function, dynamics._chunk_fn = real_fn, real_chunk
        cuda_graphs._Replay.backward = staticmethod(real_back)


@dataclasses.dataclass(frozen=True)
class Result:
    """Per-step medians of one nve run on `devices` devices (seconds), the stage ops' counts and final positions."""

    devices: int
    atoms: int
    steps: int  # steps in the chunks timed
    step: float
    program: float
    dispatch: float  # wall
    dispatch_cpu: float
    op_cpu: float  # all devices
    op_wall: float
    op_inline: float  # the part of op_cpu run on the dispatching thread (so inside dispatch_cpu as well)
    calls: float  # stage-op bodies run per step (forwards)
    backwards: float  # graph-replay backwards per step
    ops: int  # stage ops per evaluation
    per_op: dict[str, float]  # CPU seconds per call, by op
    final: np.ndarray

    @property
    def host(self) -> float:
        """Host seconds per device per step: (stage-op CPU time + dispatch CPU time) / D, the bodies run on
        the dispatching thread counted once (they are inside its CPU time)."""
        return (self.op_cpu - self.op_inline + self.dispatch_cpu) / self.devices


def summarise(chunks: list[Chunk], end: float, devices: int, atoms: int, ops: int, final: np.ndarray) -> Result:
    """The per-step medians over the chunks that compiled nothing (the start's forces left out)."""
    spans = [(c, nxt - c.start) for c, nxt in zip(chunks, [c.start for c in chunks[1:]] + [end])]
    timed = [(c, s) for c, s in spans[1:] if c.compiles == 0]
    if not timed:
        raise RuntimeError(f"host: every chunk of the run on {devices} devices compiled; give more --steps.")
    per = lambda f: cm.med([f(c, s) / c.n for c, s in timed])  # noqa: E731
    calls = collections.Counter()
    cpu = collections.Counter()
    for c, _ in timed:
        calls.update(c.calls)
        cpu.update(c.cpu)
    steps = sum(c.n for c, _ in timed)
    return Result(devices, atoms, steps, per(lambda c, s: s), per(lambda c, s: c.ready - c.start),
                  per(lambda c, s: c.returned - c.start), per(lambda c, s: c.dispatch_cpu),
                  per(lambda c, s: sum(c.cpu.values())),
                  per(lambda c, s: sum(c.wall.values())), per(lambda c, s: sum(c.inline.values())),
                  (sum(calls.values()) - calls[BACKWARD]) / steps,
                  calls[BACKWARD] / steps, ops,
                  {k: cpu[k] / calls[k] for k in sorted(calls)}, final)


def build(kind: str, dtype: str, dev: Any, smoke: bool):
    """The model's wrapper: MACE as the `mlip` question builds it, or the MPNN (2 layers in a smoke run)."""
    import torch

    from benchmarks.mlip import SPECIES, build_model

    if kind == "mace":
        from nvalchemi_jaxbridge.mlip.mace import MACEWrapper

        return MACEWrapper(build_model(dtype, "e3nn", dev, smoke))
    from nvalchemi_jaxbridge.mlip import MPNN, MPNNWrapper

    return MPNNWrapper(MPNN(SPECIES, cutoff=4.0, n_layers=2 if smoke else 3, dtype=getattr(torch, dtype)).to(dev))


def weak_system(per_device: int, devices: int, a: float = 3.75):
    """Rattled fcc Cu/Au of 4 b^3 atoms (b: closest to `per_device`) per device: the cube repeated along the
    axes the device grid splits (2x1x1 on 2 devices, 2x2x1 on 4, 2x2x2 on 8), shifted by a/4 so that no
    lattice plane lies on a domain boundary: every device owns one cube's atoms."""
    from benchmarks.mlip import SPECIES
    from benchmarks.scaling import block_grid
    from tests.mlip._reference import alloy

    b = max(1, round((per_device / 4) ** (1 / 3)))
    atoms = alloy(reps=tuple(b * g for g in block_grid(devices)), a=a, species=SPECIES)
    atoms.positions += a / 4
    atoms.wrap()
    return atoms


def run_md(probe: Probe, model: Any, atoms: Any, steps: int, check: int) -> Result:
    """nve of `atoms` on `model`'s devices, timed as the module docstring says (inside `clocked`)."""
    from nvalchemi_jaxbridge.demo.systems import maxwell_boltzmann
    from nvalchemi_jaxbridge.mlip.dynamics import nve

    masses = atoms.get_masses()
    probe.chunks = []
    out = nve(model, atoms.positions, maxwell_boltzmann(masses, 300.0, seed=1), masses, atoms.numbers,
              atoms.cell.array, atoms.pbc, steps=steps, dt=1.0, check_every=check)
    end = time.perf_counter()
    ops = len(model.stages.defined()[0].named())
    return summarise(probe.chunks, end, model.mesh.size, len(atoms), ops, out["positions"][out["steps"]])


def run(rep: cm.Report, opt) -> None:
    import jax
    import torch

    from benchmarks.mlip import atoms_of
    from benchmarks.scaling import parse_devices
    from nvalchemi_jaxbridge.mlip import DistributedMLIP

    gpu = opt.platform == "gpu"
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    kinds = opt.kernels_for("host", ["mace" if gpu and not opt.smoke else "mpnn"], MODELS)
    if len(kinds) != 1:
        raise ValueError(f"--kernels host={','.join(kinds)}: give one model, mace or mpnn.")
    kind = kinds[0]
    counts = parse_devices(opt.devices or ((1, 2) if opt.smoke else None), len(jax.devices()))
    default_total = 1000 * counts[-1] if gpu else {"mpnn": 4000, "mace": 864}[kind]
    sizes = opt.sizes_for("host", [32, 32] if opt.smoke else [1000, default_total])
    per_device, total = sizes[0], (sizes[1] if len(sizes) > 1 else sizes[0] * counts[-1])
    dtype = opt.dtypes_or(["float32"])[0]
    check = 1 if opt.smoke else 10
    steps = opt.steps or (3 if opt.smoke else 100 if gpu else 30)
    rep.setting("host", f"{kind} ({dtype}), nve {steps} steps of 1 fs at 300 K, check_every={check}, skin 0.5 A; "
                f"devices {counts}; weak: about {per_device} atoms per device; strong: about {total} atoms; "
                + ("" if gpu else "torch threads 1 (one per device: XLA's device threads call torch); ")
                + "per-step medians over the chunks that compiled nothing")
    weak = rep.table("Host time per device per MD step, fixed atoms per device", [
        "devices", "atoms (per device)", "steps timed", "step ms", "program ms/step",
        "dispatch us/step (wall / CPU)", "stage-op calls/step (ops x devices)",
        "stage-op host CPU us/step (all devices; on the dispatching thread)", "stage-op wall us/step (all devices)",
        "host per device us/step",
        "host per device / step", "weak efficiency t1 / tD", "CPU us per call, by op"])
    strong = rep.table("Strong scaling: the MD step at fixed total atoms", [
        "devices", "atoms (per device)", "step ms", "speed-up vs the first", "efficiency",
        "host per device us/step", "host per device / step", "final max |dx| vs the first (A)"])
    wrapper, probe, threads = build(kind, dtype, dev, opt.smoke), Probe(), torch.get_num_threads()
    done: dict[tuple[int, str], Result] = {}  # (devices, "weak" or "strong")
    runs: dict[tuple, Result] = {}
    if not gpu:
        torch.set_num_threads(1)
    try:
        with clocked(probe):
            for d in counts:
                if rep.time_left() < 0:
                    rep.note(f"host: {d} devices and more not run (budget spent).")
                    break
                with rep.section(f"{kind} on {d} devices"):
                    model = DistributedMLIP(wrapper, n_devices=d)  # one per count: weak and strong share programs
                    for key, atoms in (("weak", weak_system(per_device, d)), ("strong", atoms_of(total))):
                        same = (d, atoms.positions.tobytes(), atoms.numbers.tobytes())  # a system run already
                        if same not in runs:
                            runs[same] = run_md(probe, model, atoms, steps, check)
                        done[d, key] = runs[same]
                    weak_row(weak, done[d, "weak"], done.get((counts[0], "weak")))
                    strong_row(rep, strong, done[d, "strong"], done[counts[0], "strong"], dtype)
    finally:
        torch.set_num_threads(threads)
    target(rep, [done[d, "weak"] for d in counts if (d, "weak") in done])


def _op(label: str) -> str:
    """'mpnn_layer_1' -> 'layer_1' (the model's name off)."""
    return label.split("_", 1)[1] if "_layer_" in label or label.endswith("_whole") else label


def weak_row(table: cm.Table, r: Result, base: Result | None) -> None:
    calls = f"{r.calls:g} ({r.ops} x {r.devices})" + (f" + {r.backwards:g} backwards" if r.backwards else "")
    table.add(r.devices, f"{r.atoms} ({r.atoms / r.devices:.0f})", r.steps, cm.ms(r.step), cm.ms(r.program),
              f"{cm.us(r.dispatch)} / {cm.us(r.dispatch_cpu)}", calls, f"{cm.us(r.op_cpu)} ({cm.us(r.op_inline)})",
              cm.us(r.op_wall),
              cm.us(r.host), f"{r.host / r.step:.1%}", cm.ratio(base.step, r.step) if base else "-",
              ", ".join(f"{_op(k)} {v * 1e6:.1f}" for k, v in r.per_op.items()))


def strong_row(rep: cm.Report, table: cm.Table, r: Result, base: Result, dtype: str) -> None:
    dx = float(np.abs(r.final - base.final).max())
    speed = base.step / r.step
    table.add(r.devices, f"{r.atoms} ({r.atoms / r.devices:.0f})", cm.ms(r.step), f"{speed:.2f}x",
              f"{speed * base.devices / r.devices:.2f}", cm.us(r.host), f"{r.host / r.step:.1%}", f"{dx:.1e}")
    if not dx <= DX_TOL[dtype]:
        rep.fail(f"host: nve on {r.devices} devices ends {dx:.1e} A from the run on {base.devices} "
                 f"(tolerance {DX_TOL[dtype]} A)")


def target(rep: cm.Report, results: list[Result]) -> None:
    """The issue's target, from the fixed-atoms-per-device runs near 10^3 atoms per device."""
    what = (f"host time per device per MD step of the JAX front door <= {TARGET:.0%} of the step at 10^3 atoms per "
            "device (issue 31)")
    near = [r for r in results if NEAR[0] <= r.atoms / r.devices <= NEAR[1]]
    if not near:
        ran = sorted({round(r.atoms / r.devices) for r in results})
        rep.target(what, f"not run at 10^3 atoms per device (ran {ran} per device)", None)
        return
    rep.target(what, ", ".join(f"{r.host / r.step:.1%} on {r.devices} ({r.atoms // r.devices} atoms each)"
                               for r in near), max(r.host / r.step for r in near) <= TARGET)
