"""Shared pieces of the benchmark scripts: platform setup, run context, timing, markdown reports.

Every script calls `setup()` before touching JAX (so `XLA_PYTHON_CLIENT_PREALLOCATE`
and the CPU device count take effect), runs its sections inside `Report.section`
(one failing section is recorded and the others still run), and ends with
`Report.finish()`, whose value is the exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
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

MIB = 1 << 20
KIB = 1 << 10


def base_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every benchmark takes: --out, --smoke, --platform."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "out",
                   help="directory for the markdown table (created if missing)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and few repetitions (CPU dry run)")
    p.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto: GPU if torch sees one, else CPU")
    return p


def setup(platform: str, *, cpu_devices: int = 8, x64: bool = True) -> str:
    """Configure JAX before its backend starts; returns "cpu" or "gpu".

    Sets XLA_PYTHON_CLIENT_PREALLOCATE=false (torch and JAX share the GPU), on
    the CPU `cpu_devices` virtual devices and TRITON_INTERPRET=1.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if platform == "auto":
        import torch

        platform = "gpu" if torch.cuda.is_available() else "cpu"
    if platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        if platform == "cpu":
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", cpu_devices)
    jax.config.update("jax_enable_x64", x64)
    if platform == "gpu" and jax.default_backend() != "gpu":
        raise RuntimeError(
            f"--platform gpu: JAX started on {jax.default_backend()!r}, not a GPU; check the jax CUDA "
            "plugin (pip show jax-cuda13-plugin) and that JAX_PLATFORMS is not set to cpu."
        )
    return platform


def _run(cmd: Sequence[str]) -> str:
    """Output of a command, or '' if it fails (never raises)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001 - context only
        return ""


def _version(module: str) -> str:
    """`module.__version__`, or why it is not there."""
    try:
        mod = __import__(module)
        return str(getattr(mod, "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        return f"not importable ({type(e).__name__})"


def context(platform: str) -> dict[str, str]:
    """Device, driver, versions and date of this run."""
    import jax
    import jaxlib

    devs = jax.devices()
    ctx = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform,
        "devices": f"{len(devs)} x {devs[0].device_kind}",
        "python": _platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "torch": _version("torch"),
        "triton": _version("triton"),
        "host CPUs": str(os.cpu_count()),
    }
    if platform == "gpu":
        smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
        import torch

        ctx["driver"] = smi.splitlines()[0] if smi else "nvidia-smi unavailable"
        ctx["CUDA (torch)"] = str(torch.version.cuda)
    else:
        ctx["driver"] = "n/a (CPU)"
        ctx["note"] = "CPU smoke run on virtual devices: not a performance claim"
    return ctx


# ------------------------------------------------------------------ timing


def time_interleaved(runs: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]], *, warmup: int,
                     iters: int) -> dict[str, list[float]]:
    """Wall seconds per call of each `(fn, sync)` in `runs`, the runs taking turns call by call.

    One call of each run per round, so a slow stretch of a noisy machine falls on every run
    alike and the ratios of the medians are comparable (separate blocks of calls are not).
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


def pipelined(fn: Callable[[], Any], sync: Callable[[Any], Any], calls: int
              ) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """A `(fn, sync)` run of `calls` calls of `fn` issued back to back, then one `sync` of the last result.

    What a loop of steps or evaluations does: the host issues the next call while the device works, so
    a call's synchronisation is paid once per block. Divide the block's time by `calls` for a per-call time.
    """

    def run() -> Any:
        out = None
        for _ in range(calls):
            out = fn()
        return out

    return run, sync


def time_calls(fn: Callable[[], Any], *, warmup: int, iters: int, sync: Callable[[Any], Any]) -> list[float]:
    """Wall seconds of `iters` calls of `fn` (each followed by `sync(result)`), after `warmup` calls."""
    return time_interleaved({"": (fn, sync)}, warmup=warmup, iters=iters)[""]


def time_jax(fn: Callable[[], Any], *, warmup: int, iters: int) -> list[float]:
    """Wall seconds per call of a JAX function, `block_until_ready` after each call."""
    import jax

    return time_calls(fn, warmup=warmup, iters=iters, sync=jax.block_until_ready)


def time_torch(fn: Callable[[], Any], *, warmup: int, iters: int, device: Any) -> tuple[list[float], list[float]]:
    """(wall seconds, CUDA-event seconds) per call of a torch function; events only on CUDA.

    Wall time is `perf_counter` around the call and `torch.cuda.synchronize`;
    event time is the GPU time between events recorded before and after the call.
    """
    import torch

    if device is None or torch.device(device).type != "cuda":
        return time_calls(fn, warmup=warmup, iters=iters, sync=lambda _: None), []
    sync = lambda _: torch.cuda.synchronize(device)  # noqa: E731
    for _ in range(warmup):
        sync(fn())
    wall, ev = [], []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync(None)
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        sync(None)
        wall.append(time.perf_counter() - t0)
        ev.append(a.elapsed_time(b) * 1e-3)
    return wall, ev


def med(xs: Sequence[float]) -> float:
    """Median (NaN for an empty list)."""
    return statistics.median(xs) if xs else float("nan")


def us(s: float) -> str:
    """Seconds as microseconds, 1 decimal."""
    return "n/a" if s != s else f"{s * 1e6:.1f}"


def ms(s: float) -> str:
    """Seconds as milliseconds, 3 significant digits."""
    return "n/a" if s != s else f"{s * 1e3:.3g}"


def human_bytes(n: float) -> str:
    """Bytes as KiB / MiB / GiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------ reports


class Report:
    """A markdown report: context, settings, tables and failures; rewritten on every change.

    The file is `out_dir / f"{name}.md"`; rows are written as they are measured,
    so a run killed by a timeout still leaves what it had.
    """

    def __init__(self, name: str, title: str, out_dir: pathlib.Path, ctx: dict[str, str],
                 settings: dict[str, Any]) -> None:
        self.name, self.title, self.ctx, self.settings = name, title, ctx, settings
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / f"{name}.md"
        self.blocks: list[Any] = []
        self.failures: list[str] = []
        self._flush()
        print(f"# {title}\n" + "\n".join(f"- {k}: {v}" for k, v in {**ctx, **settings}.items()), flush=True)

    def table(self, title: str, columns: Sequence[str]) -> list[list[str]]:
        """Start a table; returns its row list (append with `row`)."""
        rows: list[list[str]] = []
        self.blocks.append(("table", title, list(columns), rows))
        self._flush()
        return rows

    def row(self, rows: list[list[str]], values: Sequence[Any]) -> None:
        """Add a row to a table, print it and rewrite the file."""
        rows.append([str(v) for v in values])
        print(" | ".join(str(v) for v in values), flush=True)
        self._flush()

    def note(self, text: str) -> None:
        """A paragraph of text (a finding, a limit, a skipped part)."""
        self.blocks.append(("note", text))
        print(text, flush=True)
        self._flush()

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Run a part of the benchmark; an exception is recorded and does not stop the others."""
        t0 = time.perf_counter()
        print(f"[{time.strftime('%H:%M:%S')}] {self.name}: {name} ...", flush=True)
        try:
            yield
        except Exception as e:  # noqa: BLE001 - a benchmark section must not lose the others
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            self.failures.append(f"{name}: {msg}")
            self.blocks.append(("note", f"**{name} FAILED** - {msg}"))
            traceback.print_exc()
            self._flush()
        print(f"[{time.strftime('%H:%M:%S')}] {self.name}: {name} done in {time.perf_counter() - t0:.1f} s",
              flush=True)

    def markdown(self) -> str:
        """The whole report as markdown."""
        lines = [f"## {self.title}", ""]
        lines += [f"- {k}: {v}" for k, v in self.ctx.items()]
        lines += [f"- {k}: {v}" for k, v in self.settings.items()]
        for b in self.blocks:
            lines.append("")
            if b[0] == "note":
                lines.append(b[1])
                continue
            _, title, cols, rows = b
            lines += [f"**{title}**", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines) + "\n"

    def _flush(self) -> None:
        self.path.write_text(self.markdown())

    def finish(self) -> int:
        """Print the report; 0 if every section ran, 1 otherwise."""
        text = self.markdown()
        self.path.write_text(text)
        print("\n" + text, flush=True)
        print(f"wrote {self.path}", flush=True)
        if self.failures:
            print(f"{len(self.failures)} section(s) failed: " + "; ".join(self.failures), flush=True)
            return 1
        return 0
