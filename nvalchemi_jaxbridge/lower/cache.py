"""JAX's persistent compilation cache for this package's programs: a second process start skips XLA compilation.

`enable_compilation_cache()` points JAX's own cache (`jax_compilation_cache_dir`) at
`~/.cache/nvalchemi_jaxbridge/xla` unless the user has chosen a cache directory
already (their choice wins, never overwritten). The CLI, `DistributedMLIP`,
`KernelPotential` and the ASE calculator call it when they are made, so the first
call of a second process loads its executables from disk instead of compiling
them; tracing still runs. `JAXBRIDGE_COMPILATION_CACHE` decides: unset (the
default location), a directory (that one), or `0` / `off` (leave JAX's
configuration alone). JAX caches only programs that took longer than
`jax_persistent_cache_min_compile_time_secs` (1 s by default) to compile, and it
is JAX's setting for the whole process: the user's own programs of at least that
compile time are cached there too.
"""

from __future__ import annotations

import logging
import os
import pathlib

_log = logging.getLogger(__name__)

ENV = "JAXBRIDGE_COMPILATION_CACHE"
DEFAULT = pathlib.Path("~/.cache/nvalchemi_jaxbridge/xla")
_OFF = ("0", "off", "false", "no", "none")


def enable_compilation_cache(path: str | os.PathLike[str] | None = None) -> pathlib.Path | None:
    """Turn on JAX's persistent compilation cache for this process, unless the user opted out or chose one.

    Args:
        path: the directory (optional; default `$JAXBRIDGE_COMPILATION_CACHE`, else
            `~/.cache/nvalchemi_jaxbridge/xla`). An explicit `path` overrides the environment's opt-out.

    Returns:
        The cache directory in use (the user's own `jax_compilation_cache_dir` if one was set), or
        None where `JAXBRIDGE_COMPILATION_CACHE=0` (or `off`) turned it off.
    """
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return pathlib.Path(current)  # set by the user (or by an earlier call): leave it
    if path is None:
        env = os.environ.get(ENV, "").strip()
        if env.lower() in _OFF:
            return None
        path = env or DEFAULT
    where = pathlib.Path(path).expanduser()
    jax.config.update("jax_compilation_cache_dir", str(where))
    _log.info("JAX's persistent compilation cache is at %s (set %s=0 to leave it off)", where, ENV)
    return where
