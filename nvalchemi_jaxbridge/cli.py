"""Command line: `nvalchemi-jaxbridge <group> <command> ...`; thin calls into the layers.

To add a command: add its parser in `_build_parser()` and its handler to `_HANDLERS`
under the same (group, command) key.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _spec_check(args: argparse.Namespace) -> int:
    from .spec import check_spec_file

    problems = check_spec_file(args.file)
    for p in problems:
        print(f"{args.file}: {p}")
    if problems:
        print(f"{args.file}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"{args.file}: ok")
    return 0


def _spec_convert(args: argparse.Namespace) -> int:
    from .spec import SpecError, load_spec, save_spec

    try:
        spec = load_spec(args.input)
        out = spec.to_v2() if args.to == "v2" else spec.to_bare(drop_envelope=args.drop_envelope)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    save_spec(out, args.output)
    print(f"wrote {args.output} ({args.to})")
    return 0


_HANDLERS: dict[tuple[str, str], Callable[[argparse.Namespace], int]] = {
    ("spec", "check"): _spec_check,
    ("spec", "convert"): _spec_convert,
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nvalchemi-jaxbridge", description=__doc__.splitlines()[0])
    groups = parser.add_subparsers(dest="group", required=True, metavar="GROUP")

    spec = groups.add_parser("spec", help="inspect and convert spec files")
    spec_cmds = spec.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check = spec_cmds.add_parser("check", help="report every problem of a spec file (exit 1 if any)")
    check.add_argument("file", help="spec file (JSON)")
    convert = spec_cmds.add_parser("convert", help="rewrite a spec file as bare or v2")
    convert.add_argument("input", help="spec file to read")
    convert.add_argument("output", help="spec file to write")
    convert.add_argument("--to", choices=("bare", "v2"), required=True, help="target form")
    convert.add_argument(
        "--drop-envelope", action="store_true",
        help="with --to bare: discard non-default v2 envelope keys instead of refusing",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 problems found, 2 usage errors)."""
    args = _build_parser().parse_args(argv)
    try:
        return _HANDLERS[(args.group, args.command)](args)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
