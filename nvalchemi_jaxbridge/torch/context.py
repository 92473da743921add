"""`installed(*adapters)`: install for the duration of a `with` block, restore even on error."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def installed(*adapters: Any) -> Iterator[list[Any]]:
    """Install `adapters` in order; restore them in reverse when the block exits.

    If an install fails, the adapters installed before it are restored and the
    error propagates. The body's exceptions propagate after the restore.

    Example:
        >>> with installed(OpAdapter(torch.ops.demo.pair_energy, gather_inputs=[0])):
        ...     e = model(pos)
    """
    done: list[tuple[Any, Any]] = []
    try:
        for a in adapters:
            done.append((a, a.install()))
        yield [m for _, m in done]
    finally:
        for a, m in reversed(done):
            a.restore(m)
