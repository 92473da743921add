"""The lowered JAX programs on this rank's torch blocks: build, cache, pad, run.

Each process owns one JAX device; the mesh spans one device per process. A
program turns this rank's torch block into its shard of a global `jax.Array`
(DLPack, no copy, `jax.make_array_from_single_device_arrays`), runs a jitted
`shard_map` program of local blocks, and hands the local shard back
(`torch.from_dlpack`). Each program comes with its jitted VJP (`jax.vjp` of the
same program, cached).

Programs use static capacities: a block of `n` rows is padded with zero rows to
the plan's capacity on the device (no host round trip) when `n` is smaller.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..kernels.dlpack import jax_to_torch, torch_to_jax
from .plan_context import PlanContext


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A jitted shard_map program on local blocks and its jitted VJP."""

    fwd: Callable[..., jax.Array]
    bwd: Callable[..., jax.Array]
    in_local: tuple[int, ...]
    uses_tables: bool


_PROGRAMS: dict[tuple, Program] = {}


def _program(ctx: PlanContext, name: str, local_fn: Callable, in_local: tuple[int, ...], dtype: Any,
             *, tables: Any = None) -> Program:
    """Build (or fetch) the program `local_fn` over `ctx.mesh` for local input shape `in_local`."""
    key = (name, id(ctx.mesh), in_local, str(dtype), None if tables is None else tables.static_key)
    if key in _PROGRAMS:
        return _PROGRAMS[key]
    mesh, axis = ctx.mesh, ctx.axis
    gshape = (ctx.n_devices * in_local[0],) + tuple(in_local[1:])
    x_sharding = NamedSharding(mesh, P(axis))
    if tables is None:
        smap = jax.shard_map(lambda x, t: local_fn(x), mesh=mesh, in_specs=(P(axis), None), out_specs=P(axis))
    else:
        smap = jax.shard_map(local_fn, mesh=mesh, in_specs=(P(axis), tables.specs(axis)), out_specs=P(axis))

    def vjp(t: Any, ct: jax.Array) -> jax.Array:
        x0 = jax.lax.with_sharding_constraint(jnp.zeros(gshape, dtype), x_sharding)
        return jax.vjp(lambda x: smap(x, t), x0)[1](ct)[0]

    prog = Program(jax.jit(smap), jax.jit(vjp), in_local, tables is not None)
    _PROGRAMS[key] = prog
    return prog


def _to_global(ctx: PlanContext, t: torch.Tensor, name: str) -> tuple[jax.Array, jax.Array]:
    """This rank's torch block as its shard of a global `P(axis)` array (no copy), and the imported array.

    The imported single-device array is returned too: when it has to be moved to
    `ctx.device` (a CPU block landing on another virtual device), the global
    array does not hold it, and the caller must keep it alive (see `_call`).
    """
    a = torch_to_jax(t.detach().contiguous(), name=name, copy=True)
    placed = a if a.sharding.device_set == {ctx.device} else jax.device_put(a, ctx.device)
    gshape = (ctx.n_devices * t.shape[0],) + tuple(t.shape[1:])
    return jax.make_array_from_single_device_arrays(gshape, ctx.row_sharding, [placed]), a


def _call(ctx: PlanContext, program: Callable[[jax.Array], jax.Array], x: torch.Tensor, name: str
          ) -> torch.Tensor:
    """Run `program` (a jitted program of the global array) on this rank's block `x`; this rank's output block.

    Stream-ordered on GPU, with no host sync (see the comment in the body).
    """
    g, imported = _to_global(ctx, x, name)
    out = program(g)
    # Why no host sync is needed, and why the order of the next lines matters.
    #
    # JAX reads `x` in place: `imported` views torch's memory (DLPack, no copy)
    # and its capsule holds a torch reference to the tensor, so torch cannot take
    # the memory back while that JAX array lives (tests/torch/test_stream_order.py
    # checks this). On CPU, PjRt also defers the release until the programs that
    # read the buffer are done (checked by hand). On GPU we cannot rely on that:
    # PjRt's GPU client (compute-synchronized allocation) may release a buffer
    # as soon as its last array dies on the host, safe for XLA's own memory (its
    # next user runs later on the same stream) but not for torch's, whose caching
    # allocator hands a freed block to the next allocation on its stream at once.
    #
    # So torch's memory may go back to torch only once torch's stream is ordered
    # behind the program. `jax_to_torch` (torch.from_dlpack) enqueues that order:
    # torch's current stream waits (an event, no host sync) until `out` is ready,
    # and `out` is ready only when the whole program, every read of its input
    # included, has finished. Hence: convert first, and keep `x`, `g` and
    # `imported` referenced until after it. Temporaries made on the way (`_pad`,
    # `.contiguous()`, an aligning clone) were allocated on the current stream,
    # so their reuse comes after that wait. The caller's `x` may have been
    # allocated on another stream: `record_stream` makes the allocator wait for
    # the current stream (now behind the program) before reusing it, whichever
    # stream allocated it (a no-op on its own stream and for memory torch did not
    # allocate, such as earlier JAX outputs). Backward (the VJP programs) runs
    # through here too, under autograd's current stream (the forward's stream).
    #
    # The other direction: a JAX output viewed by torch is freed to XLA when the
    # torch view dies, possibly before torch's queued reads of it ran. The next
    # front-door program cannot overwrite it early, since its import makes XLA
    # wait for torch's current stream; table uploads are guarded in
    # `_device_tables`. JAX work of the user's own, not ordered behind torch's
    # stream, is not covered (nor was it with the host sync).
    #
    # On CPU torch.from_dlpack blocks until `out` is ready (no streams), as before.
    y = _local_out(out, name)
    if x.is_cuda:
        x.record_stream(torch.cuda.current_stream(x.device))
    del g, imported, out  # only now may the input memory go back to torch
    return y


def _local_out(out: jax.Array, name: str) -> torch.Tensor:
    """This rank's shard of a program's output as a torch tensor (DLPack, no copy)."""
    return jax_to_torch(out.addressable_data(0), name=name)


def _pad(t: torch.Tensor, rows: int, memo: dict[tuple, Any]) -> torch.Tensor:
    """`t` with zero rows appended up to `rows` (no copy when it already has them).

    The zero rows come from a block cached in `memo` (a context's cache) and one
    `torch.cat` makes the result (one kernel instead of fill + copy). The block
    is marked as used on the current CUDA stream, so that freeing it with its
    context waits for every stream that read it.
    """
    n = t.shape[0]
    if n == rows:
        return t
    if n > rows:
        raise ValueError(f"internal: block of {n} rows exceeds the capacity {rows}")
    key = ("zeros", rows - n, tuple(t.shape[1:]), t.dtype, t.device)
    zeros = memo.get(key)
    if zeros is None:
        zeros = memo[key] = t.new_zeros((rows - n,) + tuple(t.shape[1:]))
    if t.is_cuda:
        zeros.record_stream(torch.cuda.current_stream(t.device))
    return torch.cat([t, zeros])


def _padder(ctx: PlanContext) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """`_pad` with the context's cached zero blocks."""
    return functools.partial(_pad, memo=ctx.memo)


def _bind(ctx: PlanContext, prog: Program, *, adjoint: bool = False, tables: Any = None
          ) -> Callable[[jax.Array], jax.Array]:
    """`prog`'s forward (or VJP) as a function of the global array alone (`tables` or the context's bound)."""
    if tables is None and prog.uses_tables:
        tables = ctx.tables
    return functools.partial(prog.bwd, tables) if adjoint else functools.partial(_fwd_call, prog.fwd, tables)


def _fwd_call(fwd: Callable[..., jax.Array], tables: Any, g: jax.Array) -> jax.Array:
    """`fwd(g, tables)` (the argument order of the jitted forward)."""
    return fwd(g, tables)


def run(ctx: PlanContext, program: Callable[[jax.Array], jax.Array], x: torch.Tensor, rows_out: int, name: str
        ) -> torch.Tensor:
    """Run a bound program (see `_bind`) on this rank's block `x`; keep the first `rows_out` rows of the result."""
    y = _call(ctx, program, x, name)
    return y if y.ndim == 0 else y[:rows_out]


_JAX_DTYPES: dict[torch.dtype, Any] = {}


def _jax_dtype(t: torch.Tensor) -> Any:
    """The numpy dtype matching a torch tensor's dtype (looked up once per dtype)."""
    hit = _JAX_DTYPES.get(t.dtype)
    if hit is None:
        hit = _JAX_DTYPES[t.dtype] = _numpy_dtype(t.dtype)
    return hit


def _numpy_dtype(dtype: torch.dtype) -> Any:
    """The numpy dtype of a torch dtype (bfloat16: JAX's)."""
    return torch.empty((), dtype=dtype).numpy().dtype if dtype != torch.bfloat16 else jnp.bfloat16
