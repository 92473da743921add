"""Host memory that torch ops free on XLA's threads, given back to the operating system.

On the CPU, XLA runs each device's part of a program on its own worker thread, so a torch
op called from a program with several devices allocates its temporaries on several
threads at once; glibc's malloc serves each thread from its own arena and keeps what they
free there for later reuse instead of returning it. Over a long loop the freed-but-kept
memory grows (the main job with the demo Lennard-Jones op on 8 CPU devices: live heap
flat at ~185 MB while the arenas' free memory grew by ~1 MB per step, so RSS grew with
it), although nothing leaks. `release_freed_host_memory()` gives those free pages back
(`malloc_trim`); a loop calls it now and then (the main job: at each host check).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.cache
def _trim() -> Any:
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_freed_host_memory() -> bool:
    """Return the free pages of every malloc arena to the operating system (glibc `malloc_trim(0)`).

    Live memory is untouched; only memory already freed (and kept by malloc for reuse) is
    released, so the resident set follows what is in use. Costs a walk over the arenas'
    free lists (about a millisecond for a few hundred MB free).

    Returns:
        True where glibc released some memory, False where it released none or has no `malloc_trim`.
    """
    trim = _trim()
    return bool(trim(0)) if trim is not None else False
