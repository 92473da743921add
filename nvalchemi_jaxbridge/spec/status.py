"""AdapterStatus and the install-site capture shared by every adapter kind."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Literal

from .errors import SpecError

AdapterState = Literal["pending", "installed", "restored", "failed"]
STATES = ("pending", "installed", "restored", "failed")

_SPEC_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_DATACLASSES = os.path.abspath(dataclasses.__file__)


@dataclasses.dataclass(frozen=True)
class AdapterStatus:
    """One adapter's lifecycle state, as listed by `AdapterRegistry.list_active()`.

    Args:
        kind: "op", "python", "jit" or "method" (also for module-forward adapters).
        target: what is adapted, e.g. "demo::spread" or "aimnet.nbops.mol_sum".
        state: "pending", "installed", "restored" or "failed".
        install_site: where the adapter was declared ("file:line", or a spec file path).
        error: repr of the exception for a failed install or restore, else None.
    """

    kind: str
    target: str
    state: AdapterState
    install_site: str = ""
    error: str | None = None

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise SpecError(
                f"AdapterStatus(target={self.target!r}): unknown state {self.state!r}; "
                f"expected one of {list(STATES)}."
            )


def capture_install_site() -> str:
    """`file:line` of the nearest caller outside the spec layer and generated code."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        path = os.path.abspath(filename)
        if not (filename.startswith("<") or path.startswith(_SPEC_DIR) or path == _DATACLASSES):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return ""
