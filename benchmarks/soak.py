"""Memory soak of the main job: `nvalchemi-jaxbridge run` launched as a child, its RSS sampled.

    python -m benchmarks soak [--kernels torch jax] [--steps 2500] [--every 10] [--warmup 0.1] [--window 0]
                              [--log FILE] [-- RUN OPTIONS]
    python benchmarks/run_soak.py ...            # the same command line

Each kernel's run is one child process: the CLI's `run --kernel K --steps N --quiet` (plus `--thermo` into a
temporary file so the sampler knows the step: the job writes a row every 10 steps), started through
`python -m benchmarks.soak CHECKS run ...`, which runs the CLI's `main` unchanged and records the job's own
VmRSS at each host check (after the check's rows are written and malloc's free pages given back, when no
device call is in flight) into the CSV file CHECKS. The sampler also reads the child's VmRSS from
/proc/PID/status every `--every` seconds, whatever the job is doing. Warm-up: the
samples before `--warmup` of the steps (default 10 %, at least step 100 when the run is long enough) are left
out; the rest fall in windows of `--window` steps (default a tenth of the run). The RSS moves within a step:
a torch op's temporaries are mapped and unmapped at each call on every device's thread, and the job gives
malloc's free pages back at each host check, so a window's lowest sample is between calls and its highest the
working set with the calls in flight (the median: the RSS most of the time): the table
gives, for the windows' highest, median and lowest RSS, the first and last window's, their spread and their
least-squares slope in MB per 1000 steps, and the same for the RSS at the host checks (the job's resting
size, the figure that says whether it grows); then every window. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import numpy as np

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the child imports benchmarks from it

SMOKE_COMMAND = "python -m benchmarks soak --kernels jax --steps 20 --every 0.5 -- --cells 2"
COLUMNS = ["kernel", "exit", "wall s", "windows", "highest: first / last window (MB)", "spread (MB)",
           "slope (MB/1000 steps)", "median: first / last window (MB)", "spread (MB)", "slope (MB/1000 steps)",
           "lowest: first / last window (MB)", "spread (MB)", "slope (MB/1000 steps)",
           "at the host checks (median): first / last window (MB)", "spread (MB)", "slope (MB/1000 steps)"]


def rss_mb(pid: int) -> float | None:
    """VmRSS of process `pid` in MB, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def last_step(thermo: str) -> int:
    """The last step the job wrote to its thermo file (0 before the first row)."""
    try:
        with open(thermo) as f:
            rows = f.read().strip().splitlines()
    except OSError:
        return 0
    last = rows[-1].split(",")[0] if len(rows) > 1 else "0"
    return int(last) if last.isdigit() else 0


def soak(kernel: str, steps: int, every: float, extra: Sequence[str], log: str | None = None
         ) -> tuple[list[tuple[float, int, float]], list[tuple[float, int, float]], int, str]:
    """Run the job for `kernel`; its samples and its RSS at the host checks (seconds, step, RSS MB), exit
    code and output tail.

    `log`: a CSV file the samples are appended to as they are taken (kernel, seconds, step, RSS MB), so a
    run stopped early still leaves them."""
    with tempfile.TemporaryDirectory() as tmp:
        thermo, checks = os.path.join(tmp, "thermo.csv"), os.path.join(tmp, "checks.csv")
        cmd = [sys.executable, "-m", "benchmarks.soak", checks, "run", "--kernel", kernel, "--steps", str(steps),
               "--quiet", "--thermo", thermo, "--thermo-every", "10", *extra]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [CHECKOUT, os.environ.get("PYTHONPATH")])))
        with open(os.path.join(tmp, "log"), "w+") as out, open(log or os.devnull, "a") as rows:
            t0 = time.perf_counter()
            child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
            samples = []
            while child.poll() is None:
                rss = rss_mb(child.pid)
                if rss is not None:
                    samples.append((time.perf_counter() - t0, last_step(thermo), rss))
                    rows.write(f"{kernel},{samples[-1][0]:.1f},{samples[-1][1]},{rss:.1f}\n")
                    rows.flush()
                time.sleep(every)
            out.seek(0)
            tail = "\n".join(out.read().strip().splitlines()[-25:])
            at_checks = read_checks(checks)
    return samples, at_checks, child.returncode, tail


def read_checks(path: str) -> list[tuple[float, int, float]]:
    """The (seconds, step, RSS MB) rows the child wrote at its host checks (none if it wrote none)."""
    try:
        with open(path) as f:
            return [(float(t), int(st), float(mb)) for t, st, mb in (ln.split(",") for ln in f if ln.strip())]
    except OSError:
        return []


def child(argv: Sequence[str]) -> int:
    """`python -m benchmarks.soak CHECKS run ...`: the CLI's `main(run ...)`, recording the job's VmRSS at
    each host check into CHECKS (seconds, step, MB), right after the check gives malloc's free pages back."""
    from nvalchemi_jaxbridge.app import cli
    from nvalchemi_jaxbridge.kernels import host_memory

    checks, run_args = argv[0], list(argv[1:])
    thermo = run_args[run_args.index("--thermo") + 1]
    release, t0 = host_memory.release_freed_host_memory, time.perf_counter()

    def release_and_record() -> bool:
        released = release()
        with open(checks, "a") as f:
            f.write(f"{time.perf_counter() - t0:.2f},{last_step(thermo)},{rss_mb(os.getpid()):.1f}\n")
        return released

    host_memory.release_freed_host_memory = release_and_record  # simulate.run imports it at each run
    return cli.main(run_args)


def windows(samples: Sequence[tuple[float, int, float]], steps: int, warmup: float, width: int
            ) -> list[tuple[int, int, float, float, float]]:
    """(first step, last step, min, max, median RSS) of the samples in each `width`-step window past warm-up."""
    start = max(min(100, steps // 2), int(warmup * steps))
    out = []
    for lo in range(start, steps, width):
        last = lo + width >= steps  # the last window holds the samples at the last step too
        rss = [r for _, s, r in samples if lo <= s < lo + width or (last and s == steps)]
        if rss:
            out.append((lo, min(lo + width, steps), min(rss), max(rss), float(np.median(rss))))
    return out


def summary(win: Sequence[tuple[int, int, float, float, float]]) -> dict[str, float]:
    """First, last, spread and slope (MB per 1000 steps) of the windows' highest, median and lowest RSS."""
    if len(win) < 2:
        return {"n": len(win)}
    mid = np.array([(w[0] + w[1]) / 2 for w in win])
    out: dict[str, float] = {"n": len(win)}
    for name, col in (("min", 2), ("max", 3), ("med", 4)):
        v = np.array([w[col] for w in win])
        out.update({f"{name}_first": v[0], f"{name}_last": v[-1], f"{name}_spread": np.ptp(v),
                    f"{name}_slope": 1000.0 * float(np.polyfit(mid, v, 1)[0])})
    return out


def summarise(kernel: str, samples, code: int, steps: int, warmup: float, window: int, checks=()
              ) -> tuple[list[str], list[tuple[int, int, float, float, float]]]:
    """The table row (`COLUMNS`) of one kernel's run, and its windows (of the samples; `checks`, the RSS at
    the host checks, gives the last three columns)."""
    width = max(10, window or steps // 10)
    win = windows(samples, steps, warmup, width)
    s, wall = summary(win), (f"{samples[-1][0]:.0f}" if samples else "-")
    c = summary(windows(checks, steps, warmup, width))
    at_checks = ["-"] * 3 if c["n"] < 2 else [
        f"{c['med_first']:.0f} / {c['med_last']:.0f}", f"{c['med_spread']:.0f}", f"{c['med_slope']:+.1f}"]
    if s["n"] < 2:
        return [kernel, str(code), wall, str(s["n"])] + ["-"] * 9 + at_checks, win
    return [kernel, str(code), wall, str(s["n"])] + [
        x for name in ("max", "med", "min") for x in (
            f"{s[name + '_first']:.0f} / {s[name + '_last']:.0f}", f"{s[name + '_spread']:.0f}",
            f"{s[name + '_slope']:+.1f}")] + at_checks, win


def run(rep, opt) -> None:
    """The memory question's part: a short soak of each kernel's main job (the long one: `main`).

    A smoke run leaves it out (its process costs more than the rest of the memory question)."""
    if opt.smoke:
        rep.note(f"Main job: not run in a smoke run (a process of its own); its quickest run is `{SMOKE_COMMAND}`.")
        return
    kernels = opt.kernels_for("memory", ["torch"], ["torch", "torch-cells", "triton", "jax"])
    steps, every = opt.steps or 300, 2.0
    rep.setting("main job", f"`run --kernel K --steps {steps} --quiet` as a child, RSS every {every:g} s; the long "
                "soak: `python -m benchmarks soak --kernels torch jax --steps 2500 --every 10`")
    table = rep.table("Host RSS of the main job (`run`), windows after warm-up: the highest and lowest sample of each",
                      COLUMNS)
    for kernel in kernels:
        if rep.time_left() < 0:
            rep.note(f"Main job: --kernel {kernel} not run (budget spent).")
            continue
        samples, checks, code, tail = soak(kernel, steps, every, [])
        table.add(*summarise(kernel, samples, code, steps, 0.1, 0, checks)[0])
        if code:
            rep.fail(f"main job --kernel {kernel} exited {code}: {tail.splitlines()[-1] if tail else ''}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks soak", description=__doc__.splitlines()[0])
    p.add_argument("--kernels", nargs="+", default=["torch", "jax"])
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--every", type=float, default=10.0, help="seconds between RSS samples (default 10)")
    p.add_argument("--warmup", type=float, default=0.1, help="fraction of the steps left out (default 0.1)")
    p.add_argument("--window", type=int, default=0, help="steps per window (default a tenth of the steps)")
    p.add_argument("--log", help="CSV file the samples are appended to as they are taken (kernel, s, step, MB)")
    p.add_argument("extra", nargs="*", help="more `run` options, after --")
    args = p.parse_args(argv)
    import jax
    import torch

    print(f"python {sys.version.split()[0]}, jax {jax.__version__}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    rows, traces, at_checks = [], {}, {}
    width = max(10, args.window or args.steps // 10)
    for kernel in args.kernels:
        samples, checks, code, tail = soak(kernel, args.steps, args.every, args.extra, args.log)
        if code != 0:
            print(f"run --kernel {kernel} exited {code}:\n{tail}")
        row, traces[kernel] = summarise(kernel, samples, code, args.steps, args.warmup, args.window, checks)
        at_checks[kernel] = windows(checks, args.steps, args.warmup, width)
        rows.append(row)
    print(f"\nRSS (MB) after warm-up, in windows of {width} steps: the highest, median and lowest sample of each "
          "window\n")
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for kernel, win in traces.items():
        print(f"\nrun --kernel {kernel}: steps, lowest - highest (median) RSS MB")
        print("  " + "; ".join(f"{a}-{b}: {lo:.0f}-{hi:.0f} ({med:.0f})" for a, b, lo, hi, med in win))
        print(f"run --kernel {kernel} at its host checks: steps, lowest - highest (median) RSS MB")
        print("  " + "; ".join(f"{a}-{b}: {lo:.0f}-{hi:.0f} ({med:.0f})" for a, b, lo, hi, med in at_checks[kernel]))
    return 0 if all(row[1] == "0" for row in rows) else 1


if __name__ == "__main__":  # the soak's child: python -m benchmarks.soak CHECKS run ...
    sys.exit(child(sys.argv[1:]))
