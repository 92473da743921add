"""The suite's command line: `python -m benchmarks run [QUESTION ...]`, `list` and `soak`.

    python -m benchmarks run                         # every question, each in its own process
    python -m benchmarks run md mlip --sizes mlip=108,1372 --dtype float32
    python -m benchmarks run --smoke --device cpu    # tiny sizes: checks the code paths, times nothing
    python -m benchmarks run tiles --memory-budget 60G --kernels tiles=cueq   # tiles with a budget, cuequivariance
    python -m benchmarks run tile-ways --kernels tile-ways=1,2,4,8   # per-layer tiles beside the deep halo's
    python -m benchmarks run host --device cpu --devices 1,2,4,8   # the CPU-device proxy of host time per device
    python -m benchmarks list                        # the questions and what their options mean
    python -m benchmarks soak --kernels torch jax --steps 2500 --every 10   # the main job's memory soak

Every question writes OUT/<question>.md (device, versions and UTC date in its header, then its tables)
and OUT/<question>.targets.json; `run` also writes OUT/ALL.md: every target of the run in one table,
then every question's report. The options mean the same in every question; `--sizes` and `--kernels`
take `QUESTION=LIST` to set one question's values.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Question:
    """One question of the suite: the modules that answer it (each has `run(rep, opt)`) and its defaults."""

    title: str
    parts: tuple[str, ...]
    sizes: str  # what --sizes means for it
    kernels: str  # what --kernels means for it ("" if nothing)
    budget_s: float  # time budget on a GPU (the smoke run has none)


QUESTIONS: dict[str, Question] = {
    "kernel": Question("Kernel call: a torch op called from JAX, against the same call in torch",
                       ("kernel_call", "kernel_grad", "front_door"),
                       "atoms of the autograd-force LJ op (default 1000,10000,100000)", "", 75.0),
    "exchange": Question("Exchange: halo exchanges against the interconnect, and per layer against the deep halo",
                         ("exchange", "exchange_settings", "exchange_models"),
                         "bytes per message, K/M suffixes (default 64K..256M)", "", 45.0),
    "md": Question("MD step: velocity Verlet through the bridge against the same step in torch; the MD driver",
                   ("md_step", "md_driver"),
                   "atoms of the LJ/DSF system (default 10976,42592,171500)",
                   "force ops: lj-cells, lj-triton, lj-torch, dsf-torch, dsf-triton (default lj-cells,lj-triton)", 90.0),
    "mlip": Question("MLIP energy + forces: MACE through the bridge against its own forward",
                     ("mlip", "mlip_md"), "atoms of fcc Cu/Au, 4 n^3 (default 108,1372,10976)",
                     "MACE kernels: e3nn, cueq (default e3nn, and cueq where cuequivariance_torch imports)", 150.0),
    "memory": Question("Memory: host RSS over long runs, one op's call loop and the main job",
                       ("memory", "soak"), "(not used)", "main job's force kernels: torch, jax, ... (default torch)",
                       100.0),
    "scaling": Question("Scaling: the MD step over 1, 2, 4, 8 devices; halo exchanges on device grids",
                        ("scaling",), "atoms: strong-scaling system, weak-scaling atoms per device, halo system "
                        "(default 2048000,1000000,1000000 on GPUs)",
                        "force kernel: lj-cells, lj-triton, lj-torch, lj-jax, dsf-... (default lj-cells on GPU, lj-jax "
                        "on CPU)", 90.0),
    "host": Question("Host time per device per MD step of the JAX front door; the CPU-device proxy (issue 31)",
                     ("host",), "atoms per device, then the strong-scaling system's atoms (default 1000 and "
                     "1000 x the largest device count on GPUs; 1000,4000 for the MPNN, 1000,864 for MACE on the CPU)",
                     "model: mace or mpnn (default mace on GPUs, mpnn on the CPU)", 240.0),
    "first-call": Question("First call: where a cold single point spends its time", ("first_call",),
                           "(not used)", "", 60.0),
    "tiles": Question("Tiles: MACE through the bridge past one GPU's memory, tiles chosen by the memory model",
                      ("tiles",), "atoms of fcc Cu/Au, 4 n^3 (default 1372,10976,55296,256000,1000188)",
                      "MACE kernels: e3nn, cueq (default e3nn)", 900.0),
    "tile-ways": Question("Tile ways: per-layer tiles (a prototype) beside the deep-halo tiles and native MACE",
                          ("tile_ways",), "atoms of fcc Cu/Au, 4 n^3 (default 55296)",
                          "tile counts (default 1,2,4,8)", 150.0),
}


def parse_size(text: str) -> int:
    """'1372' -> 1372, '64K' -> 65536, '16M' -> 16 MiB (K, M, G: powers of 1024)."""
    t = text.strip()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        return int(t[:-1]) * units[t[-1].upper()] if t and t[-1].upper() in units else int(t)
    except ValueError:
        raise ValueError(f"not a size: {text!r}; write an integer, optionally with K, M or G (x1024).") from None


def _scoped(values: Sequence[str], what: str) -> tuple[tuple[str, str], ...]:
    """['md=1,2', '3'] -> (('md', '1,2'), ('', '3')): a value for one question, or for all ('')."""
    out = []
    for v in values:
        q, sep, rest = v.partition("=")
        if not sep:
            q, rest = "", v
        elif q not in QUESTIONS:
            raise ValueError(f"{what} {v!r}: no question {q!r}; questions: {', '.join(QUESTIONS)}.")
        out.append((q, rest))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Options:
    """What a run was asked for; `None` / empty means each question's own default."""

    smoke: bool = False
    device: str = "auto"
    out: pathlib.Path = ROOT / "out" / "bench"
    sizes: tuple[tuple[str, str], ...] = ()
    kernels: tuple[tuple[str, str], ...] = ()
    repeats: int | None = None
    dtypes: tuple[str, ...] | None = None
    steps: int | None = None
    devices: tuple[int, ...] | None = None
    budget_s: float | None = None
    memory_budget: int | None = None  # bytes per device, where a question takes a memory budget
    label: str = ""
    platform: str = ""  # "cpu" or "gpu" once the question's process has set JAX up

    def _scope(self, entries: tuple[tuple[str, str], ...], question: str) -> str | None:
        own = [v for q, v in entries if q == question]
        every = [v for q, v in entries if q == ""]
        return (own or every or [None])[-1]

    def sizes_for(self, question: str, default: Sequence[int]) -> list[int]:
        """This question's sizes: --sizes QUESTION=..., else --sizes ..., else `default`."""
        text = self._scope(self.sizes, question)
        return list(default) if text is None else [parse_size(s) for s in text.split(",") if s.strip()]

    def kernels_for(self, question: str, default: Sequence[str], allowed: Sequence[str]) -> list[str]:
        """This question's kernels (as `sizes_for`); an unknown name is an error that lists the known ones."""
        text = self._scope(self.kernels, question)
        names = list(default) if text is None else [k.strip() for k in text.split(",") if k.strip()]
        if bad := [k for k in names if k not in allowed]:
            raise ValueError(f"--kernels {question}: unknown {bad}; choose from {', '.join(allowed)}.")
        return names

    def dtypes_or(self, default: Sequence[str]) -> list[str]:
        return list(self.dtypes or default)

    def repeats_or(self, gpu: int, smoke: int = 2) -> int:
        """--repeats, else `smoke` in a smoke run, else `gpu`."""
        return self.repeats or (smoke if self.smoke else gpu)

    def argv(self) -> list[str]:
        """Command-line arguments that parse back to these options (the question's own process gets them)."""
        a = ["--device", self.device, "--out", str(self.out)] + (["--smoke"] if self.smoke else [])
        a += [x for q, v in self.sizes for x in ("--sizes", f"{q}={v}" if q else v)]
        a += [x for q, v in self.kernels for x in ("--kernels", f"{q}={v}" if q else v)]
        for flag, value in (("--repeats", self.repeats), ("--steps", self.steps), ("--budget-s", self.budget_s),
                            ("--memory-budget", self.memory_budget)):
            if value is not None:
                a += [flag, str(value)]
        if self.dtypes:
            a += ["--dtype", ",".join(self.dtypes)]
        if self.devices:
            a += ["--devices", ",".join(map(str, self.devices))]
        return a + (["--label", self.label] if self.label else [])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run questions (all by default) and write their reports")
    run.add_argument("questions", nargs="*", metavar="QUESTION", help=f"any of {', '.join(QUESTIONS)} (default all)")
    run.add_argument("--smoke", action="store_true", help="tiny sizes and few repeats: the CPU dry run of the tests")
    run.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto", help="default auto: the GPU if any")
    run.add_argument("--out", type=pathlib.Path, default=ROOT / "out" / "bench", help="folder for the reports")
    run.add_argument("--sizes", action="append", default=[], metavar="[QUESTION=]LIST",
                     help="comma list of sizes (`list` says what each question takes); repeat for several questions")
    run.add_argument("--kernels", action="append", default=[], metavar="[QUESTION=]LIST",
                     help="comma list of kernels (`list` says which each question knows)")
    run.add_argument("--repeats", type=int, default=None, help="timed rounds per measurement (default: each question's)")
    run.add_argument("--dtype", default=None, help="float32, float64 or both as float32,float64 (default: each question's)")
    run.add_argument("--steps", type=int, default=None, help="MD steps per run where a question runs MD (default: its own)")
    run.add_argument("--devices", default=None, help="device counts for the multi-device parts, e.g. 1,2,4,8")
    run.add_argument("--budget-s", type=float, default=None, help="time budget of each question (default: its own)")
    run.add_argument("--memory-budget", default=None, metavar="BYTES",
                     help="memory budget per device where a question takes one (tiles), K/M/G suffixes (x1024), "
                          "e.g. 60G (default: the library's, 80 % of each device's memory with tiles='auto')")
    run.add_argument("--label", default="", help="a tag for the rows (e.g. the version measured)")
    run.add_argument("--in-process", action="store_true",
                     help="run the questions in this process (default: each in its own, under a timeout)")
    sub.add_parser("list", help="the questions, their parts and what --sizes / --kernels mean for each")
    soak = sub.add_parser("soak", help="the main job's memory soak (same options as benchmarks/run_soak.py)",
                          add_help=False)
    soak.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def options(args: argparse.Namespace) -> Options:
    """The `Options` of a parsed `run` command line; bad values raise ValueError naming the option."""
    dtypes = tuple(d for d in (args.dtype or "").split(",") if d) or None
    if dtypes and (bad := [d for d in dtypes if d not in ("float32", "float64")]):
        raise ValueError(f"--dtype: unknown {bad}; write float32, float64 or float32,float64.")
    try:
        devices = tuple(int(d) for d in args.devices.split(",")) if args.devices else None
    except ValueError:
        raise ValueError(f"--devices {args.devices!r}: write device counts as a comma list, e.g. 1,2,4,8.") from None
    if bad := [q for q in args.questions if q not in QUESTIONS]:
        raise ValueError(f"unknown question(s) {bad}; questions: {', '.join(QUESTIONS)} (python -m benchmarks list).")
    try:
        memory = parse_size(args.memory_budget) if args.memory_budget is not None else None
    except ValueError as e:
        raise ValueError(f"--memory-budget: {e}") from None
    if memory is not None and memory <= 0:
        raise ValueError(f"--memory-budget {args.memory_budget!r}: give bytes per device > 0, e.g. 60G.")
    opt = Options(smoke=args.smoke, device=args.device, out=args.out, sizes=_scoped(args.sizes, "--sizes"),
                  kernels=_scoped(args.kernels, "--kernels"), repeats=args.repeats, dtypes=dtypes, steps=args.steps,
                  devices=devices, budget_s=args.budget_s, memory_budget=memory, label=args.label)
    for q, v in opt.sizes:  # sizes are checked now, not minutes later in a question's process
        for s in v.split(","):
            parse_size(s)
    return opt


def run_question(name: str, opt: Options) -> int:
    """Run one question in this process: set JAX up, run its parts, write its report; the exit status."""
    import importlib

    from benchmarks import common as cm

    platform = cm.setup(opt.device)
    opt = dataclasses.replace(opt, platform=platform)
    q = QUESTIONS[name]
    rep = cm.Report(name, q.title, opt.out, cm.context(platform))
    budget = opt.budget_s if opt.budget_s is not None else (float("inf") if opt.smoke else q.budget_s)
    rep.deadline = time.perf_counter() + budget
    rep.setting("budget", "none (smoke run)" if budget == float("inf") else f"{budget:.0f} s")
    if opt.label:
        rep.setting("label", opt.label)
    t0, c0 = time.perf_counter(), _cpu_s()
    with _quick_compiles(opt.smoke):
        for part in q.parts:
            with rep.section(part):
                importlib.import_module(f"benchmarks.{part}").run(rep, opt)
    code = rep.finish()
    print(f"{name}: {time.perf_counter() - t0:.1f} s, {_cpu_s() - c0:.1f} CPU-s (this process and its children)",
          flush=True)
    return code


@contextlib.contextmanager
def _quick_compiles(on: bool):
    """A smoke run times nothing: XLA skips most optimisation (in this process and its children), then restores."""
    if not on:
        yield
        return
    import jax

    from jax._src import compiler

    old_flag, old_env = compiler._DISABLE_MOST_OPTIMIZATIONS.value, os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS")
    jax.config.update("jax_disable_most_optimizations", True)
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", old_flag)
        if old_env is None:
            os.environ.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
        else:
            os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = old_env


def _cpu_s() -> float:
    """User + system seconds of this process and of its children that ended."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _run_child(name: str, opt: Options) -> int:
    """Run one question in its own process under a timeout; its output goes to OUT/<name>.log."""
    q = QUESTIONS[name]
    budget = opt.budget_s if opt.budget_s is not None else q.budget_s
    limit = 3 * budget + 300 if opt.smoke else 1.5 * budget + 120  # compiles and imports are outside the budget
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    opt.out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "benchmarks", "run", name, "--in-process", *opt.argv()]
    print(f"[{time.strftime('%H:%M:%S')}] {name}: start (timeout {limit:.0f} s)", flush=True)
    t0 = time.perf_counter()
    with open(opt.out / f"{name}.log", "w") as log:
        try:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            code = 124
    tail = (opt.out / f"{name}.log").read_text().splitlines()[-40:]
    print("\n".join(tail), flush=True)
    why = " (TIMED OUT: partial report kept)" if code == 124 else ""
    print(f"[{time.strftime('%H:%M:%S')}] {name}: exit {code} after {time.perf_counter() - t0:.0f} s{why}", flush=True)
    return code


def summary(out: pathlib.Path, names: Sequence[str], codes: dict[str, int], command: str) -> str:
    """ALL.md: the run's command and exit statuses, every target in one table, then every question's report."""
    from benchmarks.common import markdown_table

    rows = []
    for n in names:
        f = out / f"{n}.targets.json"
        data = json.loads(f.read_text()) if f.is_file() else {"targets": [], "date": "", "device": ""}
        rows += [[t["target"], t["verdict"], t["figure"], f"{data['date']}, {data['device']}", n]
                 for t in data["targets"]]
    lines = [f"# Benchmark run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             f"`{command}`", "", "Exit status: " + ", ".join(f"{n} {codes[n]}" for n in names), ""]
    lines += markdown_table("Targets in this run", ["target", "status", "figure (same run)", "when, device",
                                                     "question"], rows)
    for n in names:
        f = out / f"{n}.md"
        lines += ["", f.read_text() if f.is_file() else f"## {n}\n\n(no report: see {n}.log)"]
    return "\n".join(lines) + "\n"


def _list() -> int:
    for name, q in QUESTIONS.items():
        print(f"{name}: {q.title}\n  parts: {', '.join(q.parts)} (benchmarks/<part>.py)\n  --sizes: {q.sizes}")
        if q.kernels:
            print(f"  --kernels: {q.kernels}")
        print(f"  budget on a GPU: {q.budget_s:.0f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["soak"]:  # its own options (argparse's REMAINDER does not take ones that start with --)
        from benchmarks.soak import main as soak_main

        return soak_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.cmd == "list":
        return _list()
    try:
        opt = options(args)
    except ValueError as e:
        _parser().error(str(e))
    names = args.questions or list(QUESTIONS)
    codes: dict[str, Any] = {}
    for n in names:
        codes[n] = run_question(n, opt) if args.in_process else _run_child(n, opt)
    if len(names) > 1 or not args.in_process:
        text = summary(opt.out, names, codes, "python -m benchmarks " + " ".join(argv))
        (opt.out / "ALL.md").write_text(text)
        print(f"wrote {opt.out / 'ALL.md'}; exit status: {codes}", flush=True)
    return 0 if all(c == 0 for c in codes.values()) else 1
