"""Command line: check, convert and show spec files, validate an op, run MD of a demo potential, your op or an MLIP.

`nvalchemi-jaxbridge <group> [<command>] ...`. Quiet by default (known third-party warnings filtered,
`app/quiet.py`); `--verbose` shows them and the package's INFO log.

To add a command: add its parser in `_build_parser()` and its handler to `_HANDLERS`
under the same (group, command) key.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any


def _spec_check(args: argparse.Namespace) -> int:
    from ..spec import check_spec_file

    problems = check_spec_file(args.file)
    if args.json:
        import json

        print(json.dumps({"file": args.file, "ok": not problems,
                          "problems": [{"path": p.path, "message": p.message} for p in problems]}, indent=1))
        return 1 if problems else 0
    for p in problems:
        print(f"{args.file}: {p}")
    if problems:
        print(f"{args.file}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"{args.file}: ok")
    return 0


def _spec_convert(args: argparse.Namespace) -> int:
    from ..spec import SpecError, load_spec, save_spec

    try:
        spec = load_spec(args.input)
        out = spec.to_v2() if args.to == "v2" else spec.to_bare(drop_envelope=args.drop_envelope)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    save_spec(out, args.output)
    print(f"wrote {args.output} ({args.to})")
    return 0


def _spec_show(args: argparse.Namespace) -> int:
    from .show import show_spec

    text, unresolved = show_spec(args.file, devices=args.devices, system=args.system, cells=args.cells,
                                 structure=args.structure, op=args.op)
    print(text)
    for line in unresolved:
        print(f"error: {line}", file=sys.stderr)
    return 1 if unresolved else 0


def _run(args: argparse.Namespace) -> int:
    from . import model_run, outputs, report, run_config, simulate, user_op

    is_model = args.model is not None or args.checkpoint is not None
    model_run.check_options(model_run=is_model, given=vars(args))
    outputs.check_paths({"--json-report": args.json_report, "--plot": args.plot, "--trajectory": args.trajectory,
                         "--thermo": args.thermo})
    from ..kernels.host_memory import map_large_blocks

    map_large_blocks()  # this process's malloc: a torch op's large temporaries, freed on XLA's threads, go back at once
    if is_model:
        return _run_model(args)
    every = {k: getattr(args, k) for k in ("trajectory_every", "thermo_every", *_LIMITS)
             if getattr(args, k) is not None}
    config = run_config.RunConfig(
        system=args.system, spec=args.spec, kernel=args.kernel, devices=args.devices, steps=args.steps,
        dt=args.dt, temperature=args.temperature, langevin=args.langevin, cells=args.cells, seed=args.seed,
        structure=args.structure, skin=1.0 if args.skin is None else args.skin, check_every=args.check_every,
        dtype=args.dtype, op=args.op, params=user_op.parse_params(args.param), rtol=args.rtol,
        trajectory=args.trajectory, thermo=args.thermo, **every,
    )
    result = _with_progress(args, config.steps, "compiling", lambda progress: simulate.run(config, progress=progress))
    print(report.format_run(result))
    _write_json(args, result)
    _plot(args, result)
    _say_stop(result)
    return 0 if result.ok else 1


def _run_model(args: argparse.Namespace) -> int:
    from . import model_run, report

    given = {k: getattr(args, k) for k in ("dt", "temperature", "cells", "skin", "trajectory_every", "thermo_every",
                                           *_LIMITS) if getattr(args, k) is not None}
    config = model_run.ModelRunConfig(
        model=args.model, checkpoint=args.checkpoint, seed=args.seed, devices=args.devices,
        exchange=args.exchange or ("per_layer" if args.tiles in (None, "1") else "deep_halo"),  # tiles: deep halo
        steps=args.steps, structure=args.structure,
        check_every=args.check_every, dtype=args.dtype, rtol=args.rtol, langevin=args.langevin,
        trajectory=args.trajectory, thermo=args.thermo, tiles=model_run.parse_tiles(args.tiles),
        memory_budget=model_run.parse_bytes(args.memory_budget), **given,
    )
    result = _with_progress(args, config.steps, "layout",
                            lambda progress: model_run.run_model(config, progress=progress))
    print(report.format_model_run(result))
    _write_json(args, result)
    _plot(args, result)
    _say_stop(result)
    return 0 if result.ok else 1


def _plot(args: argparse.Namespace, result: Any) -> None:
    """The run's picture (`plots.figure`), if --plot asked for one."""
    if args.plot:
        from . import plots

        plots.save(result.series(), args.plot)
        print(f"wrote {args.plot}")


#: The blow-up thresholds (`app/guards.py`), options of both kinds of run.
_LIMITS = ("max_energy", "max_temperature", "max_energy_jump")


def _say_stop(result: Any) -> None:
    """A run that a guard stopped says why on stderr too (the report and JSON carry it as `stop`)."""
    if result.stop is not None:
        print(f"error: {result.stop['message']}", file=sys.stderr)


def _with_progress(args: argparse.Namespace, total: int, desc: str, run: Any) -> Any:
    """`run(progress)` with a tqdm bar on an interactive stderr (none with --quiet).

    `progress(done, phase=None, temperature=None, energy=None)`: `phase` becomes the bar's description
    (e.g. "compiling" until step 1 is done), temperature (K) and energy (eV/atom) its postfix.
    """
    bar = None
    if not args.quiet and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr)

    def update(done: int, phase: str | None = None, temperature: float | None = None,
               energy: float | None = None) -> None:
        if phase is not None:
            bar.set_description(phase, refresh=False)
        if temperature is not None:
            bar.set_postfix({"T": f"{temperature:.1f} K", "E": f"{energy:.6f} eV/atom"}, refresh=False)
        if done != bar.n:
            bar.update(done - bar.n)
        else:
            bar.refresh()

    try:
        return run(None if bar is None else update)
    finally:
        if bar is not None:
            bar.close()


def _write_json(args: argparse.Namespace, result: Any) -> None:
    """The run's JSON report, if --json-report asked for one."""
    if args.json_report:
        import json

        with open(args.json_report, "w") as f:
            json.dump(result.to_dict(), f, indent=1)


def _validate(args: argparse.Namespace) -> int:
    from .validate import validate

    result = validate(args.spec, args.op, devices=args.devices, structure=args.structure, cells=args.cells,
                      cutoff=args.cutoff, skin=args.skin, rtol=args.rtol)
    if args.json:
        import json

        print(json.dumps(result.to_dict(), indent=1))
    else:
        print(result.format())
    return 0 if result.ok else 1


_HANDLERS: dict[tuple[str, str | None], Callable[[argparse.Namespace], int]] = {
    ("spec", "check"): _spec_check,
    ("spec", "convert"): _spec_convert,
    ("spec", "show"): _spec_show,
    ("run", None): _run,
    ("validate", None): _validate,
}


def _version() -> str:
    from .. import __version__

    return __version__


def _build_parser() -> argparse.ArgumentParser:
    """Every option's help ends with its default ("(default ...)"); `run --help` lists them all."""
    parser = argparse.ArgumentParser(prog="nvalchemi-jaxbridge", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    groups = parser.add_subparsers(dest="group", required=True, metavar="GROUP")

    spec = groups.add_parser("spec", help="inspect and convert spec files")
    spec_cmds = spec.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check = spec_cmds.add_parser("check", help="report every problem of a spec file (exit 1 if any)")
    check.add_argument("file", help="spec file (JSON)")
    check.add_argument("--json", action="store_true",
                       help="print {file, ok, problems: [{path, message}]} as JSON instead of lines (default: lines)")
    convert = spec_cmds.add_parser("convert", help="rewrite a spec file as bare or v2")
    convert.add_argument("input", help="spec file to read")
    convert.add_argument("output", help="spec file to write")
    convert.add_argument("--to", choices=("bare", "v2"), required=True, help="target form (required)")
    convert.add_argument(
        "--drop-envelope", action="store_true",
        help="with --to bare: discard non-default v2 envelope keys instead of refusing (default off)",
    )
    show = spec_cmds.add_parser("show", help="the compiled plan: mesh, partition specs, collectives and bytes")
    show.add_argument("file", help="spec file (JSON)")
    show.add_argument("--devices", type=int, default=None, help="devices (default 8 CPU devices, or all GPUs)")
    show.add_argument("--system", choices=("argon", "rocksalt"), default=None,
                      help="sample system (default rocksalt if an op takes charges, else argon)")
    show.add_argument("--cells", type=int, default=None,
                      help="cubic cells per axis of the sample system (default 3 argon, 2 rock salt)")
    show.add_argument("--structure", default=None, help="read the sample system from this file, ASE (default: generated)")
    show.add_argument("--op", default=None,
                      help="module:attr or file.py:attr implementing (or registering) the spec's op (default: the spec's op name)")
    _add_verbose(show)

    _add_run_parser(groups)

    val = groups.add_parser("validate", help="single-device vs distributed parity of an op under a spec")
    val.add_argument("spec", help="spec file (JSON)")
    val.add_argument("--op", required=True,
                     help="module:attr or file.py:attr: a torch op, a JAX callable, or an attribute of a module that registers the op "
                          "(required)")
    val.add_argument("--devices", type=int, default=None, help="devices (default 8 CPU devices, or all GPUs)")
    val.add_argument("--structure", default=None, help="sample system from this file (default: generated)")
    val.add_argument("--cells", type=int, default=None,
                     help="cubic cells per axis of the generated sample (default 3 argon, 2 rock salt)")
    val.add_argument("--cutoff", type=float, default=None, help="interaction cutoff, Å (default: the op's 'cutoff')")
    val.add_argument("--skin", type=float, default=0.0, help="extra ghost width beyond the cutoff, Å (default 0)")
    val.add_argument("--json", action="store_true", help="print the report as JSON (default: text)")
    val.add_argument("--rtol", type=float, default=1e-8,
                     help="tolerance on max|diff| / max|single-device| (default 1e-8)")
    _add_verbose(val)
    return parser


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true",
                        help="show the package's INFO log (FFI build, plan capacity growth) and the third-party "
                             "warnings filtered by default (default off)")


def _add_run_parser(groups: Any) -> None:
    """The `run` command: the demo potentials, the user's own op (--op), or an MLIP (--model)."""
    run = groups.add_parser(
        "run", help="domain-decomposed MD of a demo potential, your own op (--op) or an MLIP (--model), "
                    "with a parity check")
    run.add_argument("--system", choices=("argon", "rocksalt"), default=None,
                     help="argon FCC (Lennard-Jones) or NaCl rock salt (DSF Coulomb, charged) "
                          "(default argon; rocksalt for an --op that takes charges)")
    run.add_argument("--spec", default=None,
                     help="spec file (default: the packaged spec file for --system and --kernel; with --op, "
                          "GatherInputs / AllReduceSum / ScatterOutputs on the op)")
    run.add_argument("--kernel", choices=("torch", "torch-cells", "triton", "jax"), default=None,
                     help="torch custom op, torch-cells (the same LJ op with an O(N) cell list, argon only), "
                          "Triton op, or the JAX potential; picks the default spec (default torch)")
    run.add_argument("--op", default=None, metavar="MODULE:ATTR",
                     help="your own force op: (positions[, charges], owned_mask, scalars...) -> (energy, forces), "
                          "a torch op or a JAX callable; checked against itself on one device "
                          "(default: the demo potential)")
    run.add_argument("--param", action="append", default=None, metavar="NAME=VALUE",
                     help="a scalar parameter of the op, by name; repeat for each (default: the op's own defaults); "
                          "its 'cutoff' sets the halo cutoff")
    run.add_argument("--devices", type=int, default=None, help="devices (default 8 virtual CPU devices, or all GPUs)")
    run.add_argument("--steps", type=int, default=100, help="MD steps (default 100)")
    run.add_argument("--dt", type=float, default=None, help="time step in fs (default 5 argon, 2 rock salt, 1 --model)")
    run.add_argument("--temperature", type=float, default=None,
                     help="initial (and bath) temperature, K (default 40 argon, 300 rock salt and --model)")
    run.add_argument("--langevin", type=float, default=None, metavar="FRICTION",
                     help="Langevin (BAOAB) thermostat with this friction in 1/fs (default off: NVE)")
    run.add_argument("--cells", type=int, default=None,
                     help="cubic cells per axis (default 4 argon, 2 rock salt, 3 --model)")
    run.add_argument("--seed", type=int, default=0, help="velocity and noise seed (default 0)")
    run.add_argument("--structure", default=None,
                     help="read the system from a file in any format ase.io reads (default: generated)")
    run.add_argument("--skin", type=float, default=None,
                     help="Verlet skin of the halo plan, Å (default 1.0; 0.5 with --model)")
    run.add_argument("--check-every", type=int, default=10,
                     help="steps between host checks (each step's displacement flag and energies are read, the plan "
                          "rebuilt if needed); also checked at the last step (default 10)")
    run.add_argument("--max-energy", type=float, default=None, metavar="EV",
                     help="stop the run once |potential energy| per atom passes this, eV (default 1000)")
    run.add_argument("--max-temperature", type=float, default=None, metavar="K",
                     help="stop the run once the temperature passes this, K (default 1e6)")
    run.add_argument("--max-energy-jump", type=float, default=None, metavar="REL",
                     help="stop the run once the total energy changes in one step by more than this fraction of "
                          "|E_pot| + E_kin (default 1)")
    run.add_argument("--dtype", choices=("float32", "float64"), default=None,
                     help="floating point type (default float64 on the CPU, float32 on GPUs)")
    run.add_argument("--rtol", type=float, default=None,
                     help="parity tolerance, relative to the reference's largest value; exit 1 past it "
                          "(default 1e-8 in float64, 1e-4 in float32)")
    run.add_argument("--trajectory", default=None, metavar="PATH",
                     help="write frames (positions, velocities, energy, forces) as extended XYZ (default none)")
    run.add_argument("--trajectory-every", type=int, default=None, metavar="K",
                     help="steps between trajectory frames (default 10)")
    run.add_argument("--thermo", default=None, metavar="PATH",
                     help="write step, time (fs), temperature (K), E_pot, E_kin, E_tot (eV) as CSV (default none)")
    run.add_argument("--thermo-every", type=int, default=None, metavar="K", help="steps between thermo rows (default 10)")
    run.add_argument("--json-report", default=None, metavar="PATH", help="write the report as JSON (default none)")
    run.add_argument("--plot", default=None, metavar="PNG",
                     help="energy change, energy per atom and temperature against time (ps) with the plan "
                          "rebuilds marked, and atoms per device; matplotlib (default none)")
    run.add_argument("--quiet", action="store_true", help="no progress bar (default off)")
    _add_verbose(run)
    mlip = run.add_argument_group(
        "message-passing model (--model)",
        "distribute an MLIP on the JAX front door, compare energy, forces and stress with the same model on one "
        "device (exit 1 past --rtol), then run MD (NVE, or --langevin); --trajectory, --thermo and --plot as for the "
        "demo, sampled at the MD's checks (a check falls on every output step); default structure: rattled fcc "
        "Cu/Au, --cells 3 (108 atoms); --dt defaults to 1 fs, --temperature to 300 K")
    mlip.add_argument("--model", default=None, metavar="mpnn|mace|FILE",
                      help="mpnn or mace: the project's MPNN or a MACE (mace-torch) with seeded random weights "
                           "(--seed); any other value: a model file saved with torch.save(model, path) (MACE's "
                           "*.model, an MPNN, a MessagePassingWrapper), read by mlip.load_model; it is a pickle, "
                           "and loading it runs code from it: name only files you trust; write ./mpnn for a file "
                           "named mpnn (default none: a potential run)")
    mlip.add_argument("--checkpoint", default=None, metavar="FILE",
                      help="a model file, as --model FILE; with --model mpnn|mace, the file must hold that kind "
                           "(default none)")
    mlip.add_argument("--exchange", choices=("per_layer", "deep_halo"), default=None,
                      help="per_layer (halo of one cutoff, refresh between layers) or deep_halo "
                           "(n_layers x cutoff, no exchange) (default per_layer; deep_halo with --tiles)")
    mlip.add_argument("--tiles", default=None, metavar="N|auto",
                      help="evaluate each device's block in N tiles one after another (memory per device: one "
                           "tile's), each with its own deep halo, same numbers; auto: the fewest that fit "
                           "--memory-budget, from the model's measured memory (default 1)")
    mlip.add_argument("--memory-budget", default=None, metavar="BYTES",
                      help="bytes per device a layout may take, e.g. 8e9 or 8GiB (default half of each device's "
                           "memory, 80 %% with --tiles auto); a layout or tile that does not fit is refused "
                           "before the run")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 problems found, 2 usage errors)."""
    from .quiet import cli_output

    args = _build_parser().parse_args(argv)
    if args.group in ("run", "validate"):  # programs to compile: a second start reads them from disk
        from ..lower.cache import enable_compilation_cache

        enable_compilation_cache()
    try:
        with cli_output(verbose=getattr(args, "verbose", False)):
            return _HANDLERS[(args.group, getattr(args, "command", None))](args)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except _user_errors() as e:
        print(f"error: {e}{_in_cli_words(e)}", file=sys.stderr)
        return 2


def _in_cli_words(e: BaseException) -> str:
    """For a layout refused by its memory budget, the options that its fix names, as this command spells them."""
    from ..layout.budget import LayoutBudgetError

    if not isinstance(e, LayoutBudgetError):
        return ""
    return ("\n  (on the command line: tiles= is --tiles N|auto, memory_budget= is --memory-budget BYTES, "
            "exchange= is --exchange, and more devices is --devices N)")


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that a user's input causes (or a feature not there yet): reported in one line, no traceback."""
    from ..spec import SpecError

    return (ValueError, KeyError, ImportError, SpecError, NotImplementedError)


if __name__ == "__main__":
    sys.exit(main())
