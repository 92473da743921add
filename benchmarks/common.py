"""What every question of the suite shares: platform setup, the run's context, timing, and the markdown report.

A question's `run(rep, opt)` measures inside `rep.section(...)` blocks (one that fails is recorded and the
others still run), adds rows to `rep.table(...)`, states its targets with `rep.target(...)`, and the runner
ends with `rep.finish()`, whose value is the exit status.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import platform as _platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def setup(device: str, *, cpu_devices: int = 8) -> str:
    """Configure JAX before its backend starts (float64 on); returns the platform, "cpu" or "gpu".

    `device` is "auto" (the GPU if torch sees one), "cpu" or "gpu". Sets XLA_PYTHON_CLIENT_PREALLOCATE=false
    (torch and JAX share the GPU) and, on the CPU, `cpu_devices` virtual devices and TRITON_INTERPRET=1.
    A backend that already started (the tests' 8 CPU devices) is left as it is.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if device == "auto":
        import torch

        device = "gpu" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import jax
    from jax._src import xla_bridge

    if device == "cpu" and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    jax.config.update("jax_enable_x64", True)
    if device == "gpu" and jax.default_backend() != "gpu":
        raise RuntimeError(
            f"--device gpu: JAX started on {jax.default_backend()!r}, not a GPU; check the jax CUDA plugin "
            "(pip show jax-cuda13-plugin) and that JAX_PLATFORMS is not set to cpu.")
    return device


def version(module: str) -> str:
    """`module.__version__`, or why it is not there."""
    try:
        return str(getattr(__import__(module), "__version__", "?"))
    except Exception as e:  # noqa: BLE001 - context only
        return f"not importable ({type(e).__name__})"


def context(platform: str) -> dict[str, str]:
    """Date (UTC), device, versions and host of this run: the header of every question's report."""
    import jax
    import jaxlib

    devs = jax.devices()
    ctx = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "device": f"{len(devs)} x {devs[0].device_kind}"}
    if platform == "gpu":
        import torch

        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            smi = ""
        ctx["GPU"] = (smi.strip().splitlines() or [torch.cuda.get_device_name(0)])[0] + f", CUDA {torch.version.cuda}"
    else:
        ctx["note"] = "CPU run on virtual devices: checks the code paths, not a performance claim"
    ctx["versions"] = (f"python {_platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
                       f"torch {version('torch')}, triton {version('triton')}")
    ctx["host"] = f"{os.cpu_count()} CPUs, load {' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1/5/15 min)"
    return ctx


# ------------------------------------------------------------------ timing


Run = tuple[Callable[[], Any], Callable[[Any], Any]]  # (call, sync(result))


def time_interleaved(runs: dict[str, Run], *, warmup: int, iters: int) -> dict[str, list[float]]:
    """Wall seconds per call of each `(fn, sync)` in `runs`, the runs taking turns call by call.

    One call of each run per round, so a slow stretch of a noisy machine falls on every run alike and the
    ratios of the medians are comparable (separate blocks of calls drift apart by more than the differences
    looked for).
    """
    for _ in range(warmup):
        for fn, sync in runs.values():
            sync(fn())
    out: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(iters):
        for name, (fn, sync) in runs.items():
            t0 = time.perf_counter()
            sync(fn())
            out[name].append(time.perf_counter() - t0)
    return out


def medians(runs: dict[str, Run], *, warmup: int, iters: int) -> dict[str, float]:
    """Median seconds per call of each run, timed in turns (`time_interleaved`)."""
    return {k: med(v) for k, v in time_interleaved(runs, warmup=warmup, iters=iters).items()}


def pipelined(fn: Callable[[], Any], sync: Callable[[Any], Any], calls: int) -> Run:
    """`calls` calls of `fn` issued back to back, then one `sync` of the last: what an MD loop does.

    Divide a block's time by `calls` for a per-call time.
    """

    def run() -> Any:
        out = None
        for _ in range(calls):
            out = fn()
        return out

    return run, sync


def time_events(fn: Callable[[], Any], *, warmup: int, iters: int, device: Any) -> list[float]:
    """GPU seconds between CUDA events recorded around each call of a torch function ([] off CUDA)."""
    import torch

    if device is None or torch.device(device).type != "cuda":
        return []
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize(device)
        out.append(a.elapsed_time(b) * 1e-3)
    return out


def torch_sync(dev: Any) -> Callable[[Any], None]:
    """A sync for `Run`s of torch calls on `dev`: `torch.cuda.synchronize` on a GPU, nothing on the CPU."""
    import torch

    return (lambda _: torch.cuda.synchronize(dev)) if torch.device(dev).type == "cuda" else (lambda _: None)


def jax_sync(x: Any) -> Any:
    """`jax.block_until_ready` (imported on first use)."""
    import jax

    return jax.block_until_ready(x)


def med(xs: Sequence[float]) -> float:
    """Median (NaN for an empty list)."""
    return statistics.median(xs) if xs else float("nan")


# ------------------------------------------------------------------ the GPU profiler

XLA_PREFIXES = ("loop_", "input_", "wrapped_", "copy", "concatenate", "dynamic_", "scatter", "gather", "slice",
                "select", "transpose", "xla")


def is_xla_kernel(name: str) -> bool:
    """A kernel XLA emitted (its fusions and copies); the rest are torch's or Triton's."""
    return "fusion" in name or name.startswith(XLA_PREFIXES)


def is_sync_call(name: str) -> bool:
    """A CUDA runtime/driver call that makes the host wait for the device."""
    return "Synchronize" in name or "DtoH" in name or name in ("cudaMemcpy", "cuMemcpy")


def profile(fn: Callable[[], Any], sync: Callable[[Any], Any], calls: int) -> dict[str, Any]:
    """Per call, under `torch.profiler` (CUPTI sees XLA's kernels too): wall s, device busy s by source
    ("op": torch/Triton kernels, "xla", "copy"), kernels, host synchronisations and the time waiting in them."""
    import collections
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity

    sync(fn())
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn()
        sync(out)
        wall = time.perf_counter() - t0
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    busy: collections.Counter[str] = collections.Counter()
    kernels: collections.Counter[str] = collections.Counter()
    n_sync, wait = 0, 0.0
    for e in events:
        cat, name, dur = e.get("cat", ""), e.get("name", ""), float(e.get("dur", 0)) * 1e-6
        if cat == "kernel":
            kind = "xla" if is_xla_kernel(name) else "op"
            busy[kind] += dur
            kernels[kind] += 1
        elif cat in ("gpu_memcpy", "gpu_memset"):
            busy["copy"] += dur
        elif cat in ("cuda_runtime", "cuda_driver") and is_sync_call(name):
            n_sync += 1
            wait += dur
    return {"wall": wall / calls, "busy": {k: v / calls for k, v in busy.items()},
            "busy_total": sum(busy.values()) / calls, "kernels": {k: v / calls for k, v in kernels.items()},
            "syncs": n_sync / calls, "wait": wait / calls}


# ------------------------------------------------------------------ memory


def is_oom(e: BaseException) -> bool:
    """Whether an exception is an out-of-memory error (torch's, XLA's or one raised through the bridge)."""
    text = f"{type(e).__name__} {e}".lower()
    return "out of memory" in text or "resource_exhausted" in text or "outofmemory" in text


def free_memory(gpu: bool) -> None:
    """Collect garbage and, on a GPU, give torch's cached blocks back (between sizes and ways)."""
    import gc

    gc.collect()
    if gpu:
        import torch

        torch.cuda.empty_cache()


def reset_peaks(platform: str) -> None:
    """Reset torch's peak-memory counters on every GPU (JAX's peak cannot be reset: it is the process's)."""
    if platform == "gpu":
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
        for i in range(torch.cuda.device_count()):
            torch.empty(1, device=f"cuda:{i}")  # an untouched device's allocator refuses a reset
            torch.cuda.reset_peak_memory_stats(i)


def torch_peak(platform: str, index: int = 0) -> float:
    """torch's peak bytes on GPU `index` since the last reset (NaN on the CPU)."""
    if platform != "gpu":
        return float("nan")
    import torch

    return float(torch.cuda.max_memory_allocated(index))


def program_bytes(fn: Callable[..., Any], *args: Any) -> float:
    """Device bytes one call of `jax.jit(fn)` holds: arguments + results + XLA temporaries - aliased.

    A function jitted already is lowered as it is, so its compiled program comes from JAX's cache.
    """
    import jax

    m = (fn if hasattr(fn, "lower") else jax.jit(fn)).lower(*args).compile().memory_analysis()
    return float(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


# ------------------------------------------------------------------ formatting


def us(s: float) -> str:
    """Seconds as microseconds, 1 decimal ('n/a' for NaN)."""
    return "n/a" if s != s else f"{s * 1e6:.1f}"


def ms(s: float) -> str:
    """Seconds as milliseconds, 3 significant digits ('n/a' for NaN)."""
    return "n/a" if s != s else f"{s * 1e3:.3g}"


def ratio(num: float, den: float) -> str:
    """`num / den` as '1.02x' ('-' if either is missing)."""
    return "-" if not (num == num and den == den and den) else f"{num / den:.3g}x"


def human_bytes(n: float) -> str:
    """Bytes as KiB / MiB / GiB ('n/a' for NaN)."""
    if n != n:
        return "n/a"
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{int(n)} B"


def markdown_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A titled markdown table, one line per row; `|` inside a cell is escaped."""
    cell = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    return ([f"**{title}**", "", "| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(map(cell, r)) + " |" for r in rows])


def parse_table(text: str, title: str) -> list[dict[str, str]]:
    """The rows of the table titled `title` in a report's markdown, as {column: cell} (the tests read them)."""
    lines = text.splitlines()
    start = lines.index(f"**{title}**")
    split = lambda line: [c.strip().replace("\\|", "|") for c in line.strip()[1:-1].split(" | ")]  # noqa: E731
    cols = split(lines[start + 2])
    rows = []
    for line in lines[start + 4:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(cols, split(line))))
    return rows


# ------------------------------------------------------------------ reports


class Table:
    """Rows of one markdown table of a report; `add` prints the row and rewrites the report's file."""

    def __init__(self, report: Report, title: str, columns: Sequence[str]) -> None:
        self.report, self.title, self.columns, self.rows = report, title, list(columns), []

    def add(self, *values: Any) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"table {self.title!r}: a row of {len(values)} cells for {len(self.columns)} columns "
                             f"({self.columns})")
        self.rows.append([str(v) for v in values])
        print(" | ".join(self.rows[-1]), flush=True)
        self.report.flush()


class Report:
    """One question's markdown report: header (context, settings), tables, notes, failures and targets.

    Written to `out / f"{name}.md"` at every change, so a run stopped by its timeout keeps what it had;
    `finish()` also writes the targets as `out / f"{name}.targets.json"` for the runner's summary.
    """

    def __init__(self, name: str, title: str, out: pathlib.Path, ctx: dict[str, str]) -> None:
        self.name, self.title, self.ctx, self.settings = name, title, ctx, {}
        out.mkdir(parents=True, exist_ok=True)
        self.path, self.targets_path = out / f"{name}.md", out / f"{name}.targets.json"
        self.blocks: list[Table | str] = []
        self.failures: list[str] = []
        self.targets: list[dict[str, Any]] = []
        self.deadline = float("inf")  # perf_counter() time after which a question starts nothing new
        print(f"# {title}\n" + "\n".join(f"- {k}: {v}" for k, v in ctx.items()), flush=True)
        self.flush()

    def setting(self, key: str, value: Any) -> None:
        """A line of the header: how this question ran (sizes, timing, model)."""
        self.settings[key] = str(value)
        print(f"- {key}: {value}", flush=True)
        self.flush()

    def table(self, title: str, columns: Sequence[str]) -> Table:
        t = Table(self, title, columns)
        self.blocks.append(t)
        self.flush()
        return t

    def time_left(self) -> float:
        """Seconds left of the question's budget (inf in a smoke run)."""
        return self.deadline - time.perf_counter()

    def note(self, text: str) -> None:
        """A paragraph: a finding, a limit, a part left out and why."""
        self.blocks.append(text)
        print(text, flush=True)
        self.flush()

    def target(self, target: str, figure: str, met: bool | None) -> None:
        """A performance target, this run's same-run figure and whether it is met (None: not measured).

        The targets are GPU figures: on the CPU the verdict says so instead.
        """
        verdict = "not measured" if met is None else ("met" if met else "NOT met")
        if "GPU" not in self.ctx:
            verdict = f"no verdict (CPU run; {verdict} here)"
        self.targets.append({"question": self.name, "target": target, "figure": figure, "verdict": verdict})
        self.note(f"Target: {target} -> {figure}: {verdict}.")

    def fail(self, what: str) -> None:
        """A failed check: recorded in the report, and the exit status becomes 1."""
        self.failures.append(what)
        self.note(f"**FAILED** - {what}")

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """A part of the question; an exception is recorded as a failure and does not stop the other parts."""
        t0, c0 = time.perf_counter(), time.process_time()
        print(f"[{time.strftime('%H:%M:%S')}] {self.name}: {name} ...", flush=True)
        try:
            yield
        except Exception as e:  # noqa: BLE001 - one part must not lose the others
            first = str(e).splitlines()[0][:300] if str(e) else ""
            traceback.print_exc()
            self.fail(f"{name}: {type(e).__name__}: {first}")
        print(f"[{time.strftime('%H:%M:%S')}] {self.name}: {name} done in {time.perf_counter() - t0:.1f} s "
              f"({time.process_time() - c0:.1f} CPU-s)", flush=True)

    def markdown(self) -> str:
        lines = [f"## {self.title}", ""] + [f"- {k}: {v}" for k, v in {**self.ctx, **self.settings}.items()]
        for b in self.blocks:
            lines.append("")
            lines += markdown_table(b.title, b.columns, b.rows) if isinstance(b, Table) else [b]
        return "\n".join(lines) + "\n"

    def flush(self) -> None:
        self.path.write_text(self.markdown())

    def finish(self) -> int:
        """Write the report and its targets; 0 if every part ran and every check passed, else 1."""
        self.flush()
        self.targets_path.write_text(json.dumps(
            {"date": self.ctx.get("date", ""), "device": self.ctx.get("GPU", self.ctx.get("device", "")),
             "targets": self.targets, "failures": self.failures}, indent=1))
        print(f"wrote {self.path}", flush=True)
        if self.failures:
            print(f"{self.name}: {len(self.failures)} failure(s): " + "; ".join(self.failures), flush=True)
        return 1 if self.failures else 0
