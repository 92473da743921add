"""Counting XLA compilations: for tests that a second call reuses the first's programs (and benchmarks that say so)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

# jax/_src/dispatch.py's event name. It spans a read from the persistent compilation cache too (measured with
# jax 0.12, tests/lower/test_cache.py), so a program taken from the disk counts as a compilation: a test that
# asserts "no new program" holds with a warm cache as without one.
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def backend_compiles() -> Iterator[list[float]]:
    """The seconds of each XLA compilation that happens inside the block (JAX's compile events), as a list."""
    seen: list[float] = []

    def listener(event: str, duration: float, **_: object) -> None:
        if event == BACKEND_COMPILE:
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
