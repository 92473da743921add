"""Non-finite values inside programs and in concrete device arrays, found by explicit `isfinite` reductions.

A maximum does not find a NaN on a mesh: `jnp.max` over an array sharded on 8 CPU
devices, holding a NaN on one of them, was seen to return 0.0. So a program that must
notice a NaN (a stale-layout check, an MD step) reduces `isfinite` with a logical and,
which every device's partial result carries, or takes `max_or_inf` (NaN counted as
+inf) where it wants a largest displacement.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..layout.finite import NonFiniteError, rows_text


def all_finite(*arrays: Any) -> jax.Array:
    """True (a bool scalar) when no entry of any of `arrays` is NaN or infinite (jit-able, mesh-safe)."""
    ok = jnp.asarray(True)
    for x in arrays:
        if x is not None:
            ok = ok & jnp.all(jnp.isfinite(x))
    return ok


def max_or_inf(x: jax.Array) -> jax.Array:
    """`max(x)` (0 for an empty `x`) with every NaN counted as +inf, so a NaN is never lost across devices."""
    return jnp.max(jnp.where(jnp.isnan(x), jnp.inf, x), initial=0.0)


def nonfinite_rows(x: Any) -> np.ndarray:
    """Rows of a concrete array (numpy or `jax.Array`) holding NaN or inf; one device reduction when all is well."""
    if isinstance(x, jax.Array):
        if not jnp.issubdtype(x.dtype, jnp.inexact) or bool(jnp.all(jnp.isfinite(x))):
            return np.zeros(0, dtype=np.int64)
        if not x.is_fully_addressable:  # the error path only: find the rows on the host (every process's)
            from jax.experimental import multihost_utils

            x = multihost_utils.process_allgather(x, tiled=True)
        x = np.asarray(x)
    a = np.asarray(x)
    if a.dtype.kind not in "fc":
        return np.zeros(0, dtype=np.int64)
    ok = np.isfinite(a).reshape(len(a), -1).all(axis=1) if a.ndim else np.isfinite(a).reshape(1)
    return np.flatnonzero(~ok)


def check_array(where: str, name: str, x: Any, *, fix: str, ids: Any = None) -> None:
    """Raise `NonFiniteError` naming the atoms if a concrete `x` holds NaN or inf (tracers pass unchecked).

    `ids`: per row of `x`, the atom id to report (e.g. a storage's global ids); rows with id < 0 (padding) are
    left out of the message.
    """
    if isinstance(x, jax.core.Tracer):
        return
    rows = nonfinite_rows(x)
    if rows.size == 0:
        return
    atoms = rows if ids is None else np.asarray(ids).reshape(-1)[rows]
    atoms = np.sort(atoms[atoms >= 0])
    raise NonFiniteError(
        f"{where}: {name} of atoms {rows_text(atoms)} are not finite (NaN or inf); {fix}.", name=name,
        rows=tuple(atoms[:5]),
    )


def _host(value: Any) -> Any:
    """A torch tensor as numpy (on the host), anything else as it is."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        return value.detach().cpu().numpy()
    return value


def check_results(where: str, results: Any, *, explain: Any = None, skip: tuple[str, ...] = ("owned_ids",)) -> None:
    """Raise `NonFiniteError` if a result (energy, forces, stress, per-atom energies, ...) holds NaN or inf.

    Each result is reduced once with `isfinite`. On failure the message names the result, its rows (atom ids
    for per-atom results) and, from `explain()` (called on the error path only), the stage that made it.

    Args:
        where: the call, as the user made it (e.g. "DistributedMLIP.evaluate").
        results: `{name: value}` (floats, numpy, `jax.Array`s or torch tensors; None skipped).
        explain: `() -> str`: which stage of the model first gave a non-finite value, and on which atoms.
    """
    for name, value in results.items():
        if value is None or name in skip:
            continue
        rows = nonfinite_rows(_host(value) if hasattr(value, "detach") else value)
        if rows.size == 0:
            continue
        per_atom = np.ndim(value) >= 1 and name not in ("stress", "virial")
        at = f" on atoms {rows_text(rows)}" if per_atom else ""
        origin = explain() if explain is not None else ""
        raise NonFiniteError(
            f"{where}: the model returned a non-finite {name!r} (NaN or inf){at}, though its inputs are finite and "
            f"no two atoms coincide. {origin} Fix the model: weights that are NaN or inf (e.g. after a diverged "
            "training), a dtype too narrow for its values (float16 overflows past 65504), or atom types it was not "
            "built for; check it on one device with its own forward on the same structure.",
            name=name, rows=tuple(rows[:5]) if per_atom else (),
        )
