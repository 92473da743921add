"""Quiet by default, in the command line only: known third-party noise filtered, our INFO lines on `--verbose`.

`KNOWN_WARNINGS` are warnings that mace-torch, e3nn and torch emit while a MACE model is imported or
loaded (about 30 on one `run --model mace`); none asks the user to do anything. `KNOWN_PRINTS` are
lines third-party packages print to stdout at import. The CLI filters exactly these (by category and
message), never a whole category or module; the library itself filters nothing. With `--verbose`
nothing is filtered and our own loggers (`nvalchemi_jaxbridge.*`, e.g. the FFI build and the halo
plan's capacity growth) print their INFO lines to stderr. docs/guide.md lists the same items.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import warnings
from collections.abc import Iterator

#: (category, message regex, who emits it and why it says nothing to a CLI user).
KNOWN_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (FutureWarning, r"`torch\.jit\.script` is deprecated",
     "torch, for each TorchScript function that e3nn and mace-torch define at import"),
    (UserWarning, r"The TorchScript type system doesn't support instance-level annotations",
     "torch, while scripting e3nn / mace-torch modules at import"),
    (UserWarning, r"Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD detected",
     "torch.load in e3nn, because mace-torch sets that variable at import"),
    (FutureWarning, r"You are using `torch\.load` with `weights_only=False`",
     "torch.load of a model file named on the command line (the user trusts it by naming it)"),
)
#: (stdout line regex, who prints it); such a line goes to the INFO log instead.
KNOWN_PRINTS: tuple[tuple[str, str], ...] = (
    (r"cuequivariance or cuequivariance_torch is not available\. Cuequivariance acceleration will be disabled\.",
     "mace-torch at import: cuEquivariance is an optional GPU acceleration, not used by this package"),
)

_log = logging.getLogger("nvalchemi_jaxbridge.app.quiet")


class _StdoutFilter(io.TextIOBase):
    """A stdout that sends the `KNOWN_PRINTS` lines to the INFO log and passes every other line on."""

    def __init__(self, out: io.TextIOBase):
        self.out, self._partial = out, ""
        self._known = [re.compile(p) for p, _ in KNOWN_PRINTS]

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if any(k.fullmatch(line.strip()) for k in self._known):
                _log.info("third-party message: %s", line.strip())
            else:
                self.out.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        if self._partial:
            self.out.write(self._partial)
            self._partial = ""
        self.out.flush()

    def isatty(self) -> bool:
        return self.out.isatty()

    def fileno(self) -> int:  # what writes to the descriptor itself bypasses the filter, as it bypasses print
        return self.out.fileno()

    @property
    def encoding(self) -> str | None:  # type: ignore[override]
        return getattr(self.out, "encoding", None)


@contextlib.contextmanager
def cli_output(verbose: bool) -> Iterator[None]:
    """Inside: the known third-party noise filtered (unless `verbose`), our INFO log on stderr (if `verbose`)."""
    if verbose:
        handler = _TqdmHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        ours = logging.getLogger("nvalchemi_jaxbridge")
        level = ours.level
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        try:
            yield
        finally:
            ours.removeHandler(handler)
            ours.setLevel(level)
        return
    with warnings.catch_warnings():
        for category, message, _ in KNOWN_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        out = _StdoutFilter(sys.stdout)
        with contextlib.redirect_stdout(out):
            try:
                yield
            finally:
                out.flush()


class _TqdmHandler(logging.Handler):
    """Log lines on stderr above a progress bar, when there is one (tqdm.write), else plainly."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)
