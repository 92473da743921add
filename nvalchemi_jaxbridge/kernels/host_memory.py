"""Host memory that torch ops free on XLA's threads, given back to the operating system.

On the CPU, XLA runs each device's part of a program on its own worker thread, so a torch
op called from a program with several devices allocates its temporaries on several
threads at once; glibc's malloc serves each thread from its own arena and keeps what they
free there for later reuse instead of returning it. glibc also raises its mmap threshold
(up to 32 MiB) each time a large mmapped block is freed, so after the first calls an op's
multi-MB temporaries come from the arenas too. Over a long loop the freed-but-kept memory
grows (the main job with the demo Lennard-Jones op on 8 CPU devices: live heap flat at
~185 MB while the arenas grew to ~2.7 GB, ~2.5 GB of it free, and kept creeping up), although
nothing leaks.

- `map_large_blocks()` fixes the mmap threshold (glibc `mallopt(M_MMAP_THRESHOLD)`), so a block
  of at least `LARGE_BLOCK` bytes that an arena has no free room for gets its own mapping,
  returned to the system by `free`, instead of growing the arena; the arenas then stay small
  (the same job: arenas ~0.2 GB; RSS flat, ~1.4 GB most of the time and 1.6-1.8 GB with every
  device's call in flight, where it was 2.8-3.0 GB and creeping). A fresh mapping
  is faulted in page by page at each call, so it also has torch's CPU allocator ask for huge
  pages for blocks of 2 MB and more (`THP_MEM_ALLOC_ENABLE`): ~8x fewer page faults, and the
  job's CPU time per step as before (without huge pages it was 1.6-1.9x).
  A process that runs torch ops on XLA's CPU threads calls it once (the CLI's `run` does).
- `release_freed_host_memory()` gives the arenas' free pages back (`malloc_trim`); a loop
  calls it now and then (the main job: at each host check).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any

# bytes: an op's temporaries on an atom block (MBs) are larger; a mapping's syscalls are small beside filling it
LARGE_BLOCK = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


@functools.cache
def _libc_function(name: str) -> Any:
    """A glibc malloc function by name, or None where the C library has none (musl, macOS)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None


def _trim() -> Any:
    """glibc's `malloc_trim`, or None where the C library has none."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
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


@functools.cache
def map_large_blocks() -> bool:
    """Have malloc map blocks of at least `LARGE_BLOCK` bytes instead of growing its arenas, for this process.

    Sets glibc's mmap threshold (`mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK)`), which also stops
    glibc from raising it by itself: a large block an arena has no free room for (a torch
    temporary, on any thread) is mapped, and unmapped when freed, instead of growing the arena.
    Sets `THP_MEM_ALLOC_ENABLE=1` unless it is set already (torch reads it at its first CPU
    allocation: blocks of 2 MB and more are then advised to use transparent huge pages, where the
    system allows them). Call once, before the loop and before torch's first CPU tensor (arenas
    grown earlier keep their free room); later calls do nothing.

    Returns:
        True where glibc took the setting, False where the C library has no `mallopt` or refused it.
    """
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, LARGE_BLOCK))
