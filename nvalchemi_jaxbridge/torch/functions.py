"""Transforms as `torch.autograd.Function`s that run the lowered JAX programs on local blocks.

Each process owns one JAX device; the mesh spans one device per process. A
transform turns this rank's torch block into its shard of a global `jax.Array`
(DLPack, no copy, `jax.make_array_from_single_device_arrays`), runs a jitted
`shard_map` program built from `nvalchemi_jaxbridge.lower.collectives`, and
hands the local shard back (`torch.from_dlpack`). Backward runs `jax.vjp` of the
same program (jitted, cached); backward's backward runs the forward again, so
force training (double backward) works too.

Programs use static capacities: a block of `n` rows is padded with zero rows to
the plan's capacity on the device (no host round trip) when `n` is smaller.

Per-rank adjoint of `AllReduceSum`: in torch each rank consumes its own copy
of the sum, so the cotangent a rank receives is its partial. The program is
therefore `psum` followed by a cast to per-device (varying) values, whose VJP
sums the partial cotangents over ranks (`replicated_consumer=False`), or the
lowered identity-adjoint sum (`replicated_consumer=True`), where every rank
already holds the global cotangent.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..kernels.dlpack import jax_to_torch, torch_to_jax
from ..lower import collectives as col
from .plan_context import PlanContext as PlanContext  # re-exported: callers of the transforms take
from .plan_context import context_for as context_for  # their context from this module too
from .plan_context import front_door_mesh as front_door_mesh

# ---- programs ---------------------------------------------------------------------


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


def _cached_step(ctx: PlanContext, key: tuple, build: Callable[[], Step]) -> Step:
    """`build()`, kept in `ctx.memo` under `key` (built once per context, transform, shape and dtype)."""
    memo = ctx.memo
    step = memo.get(key)
    if step is None:
        step = memo[key] = build()
    return step


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """One linear (or affine) map of local blocks: its forward and its adjoint, as torch -> torch."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[[torch.Tensor], torch.Tensor] | None = None  # forward without its constant term

    def adjoint(self) -> Step:
        """The step whose forward is this step's backward."""
        return Step(self.backward, self.linear or self.forward)


class _Transform(torch.autograd.Function):
    """Base: forward runs `step.forward`, backward runs `step.backward` (itself differentiable)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, step: Step) -> torch.Tensor:
        ctx.step = step
        return step.forward(x.detach())

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return AdjointFn.apply(g.contiguous(), ctx.step.adjoint()), None


class GatherInputsFn(_Transform):
    """GatherInputs: owned rows -> owned + ghost rows (forward halo exchange)."""


class ScatterOutputsFn(_Transform):
    """ScatterOutputs: reverse then forward halo exchange of a kernel output."""


class AllReduceSumFn(_Transform):
    """AllReduceSum: the sum over ranks, held by every rank."""


class GatherInputsFullFn(_Transform):
    """GatherInputsFull: owned rows -> all rows in global-id order."""


class SliceOutputsOwnedFn(_Transform):
    """SliceOutputsOwned: all rows -> this rank's owned rows."""


class GatherOwnedFn(_Transform):
    """`ShardTensor.full_tensor()`: owned rows of every rank in global-id order."""


class AdjointFn(_Transform):
    """The adjoint of a transform (what backward runs); differentiable again."""


def gather_inputs_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any, *, positions: bool) -> Step:
    """Owned block `(n_owned, *F)` -> halo block `(n_owned + n_ghost, *F)`."""
    key = ("gather_inputs", tuple(shape), np.dtype(dtype), positions)
    return _cached_step(ctx, key, lambda: _gather_inputs_step(ctx, tuple(shape), dtype, positions))


def _gather_inputs_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any, positions: bool) -> Step:
    """Build `gather_inputs_step`'s step."""
    tail = tuple(shape[1:])
    n_pad, oc, hr, n_owned = ctx.n_owned + ctx.n_ghost, ctx.owned_capacity, ctx.halo_rows, ctx.n_owned
    progs = {
        p: _program(ctx, f"gather_inputs(positions={p})",
                    functools.partial(_halo_forward, axis=ctx.axis, positions=p),
                    (oc,) + tail, dtype, tables=ctx.tables)
        for p in {positions, False}
    }
    fwd_p, lin_p, adj_p = _bind(ctx, progs[positions]), _bind(ctx, progs[False]), _bind(ctx, progs[False], adjoint=True)
    pad, name = _padder(ctx), "GatherInputs argument"
    fwd = lambda x: run(ctx, fwd_p, pad(x, oc), n_pad, name)  # noqa: E731
    bwd = lambda g: run(ctx, adj_p, pad(g, hr), n_owned, name)  # noqa: E731
    lin = lambda x: run(ctx, lin_p, pad(x, oc), n_pad, name)  # noqa: E731
    return Step(fwd, bwd, lin)


def _halo_forward(x: jax.Array, t: Any, *, axis: str, positions: bool) -> jax.Array:
    """`collectives.halo_forward` with keyword arguments bound (for partial)."""
    return col.halo_forward(x, t, axis, positions=positions)


def scatter_outputs_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any) -> Step:
    """Halo block `(n_owned + n_ghost, *F)` -> the same rows, ghost partials folded into owners."""
    key = ("scatter_outputs", tuple(shape), np.dtype(dtype))
    return _cached_step(ctx, key, lambda: _scatter_outputs_step(ctx, tuple(shape), dtype))


def _scatter_outputs_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any) -> Step:
    """Build `scatter_outputs_step`'s step."""
    n_pad, hr = ctx.n_owned + ctx.n_ghost, ctx.halo_rows
    prog = _program(ctx, "scatter_outputs", functools.partial(_halo_scatter, axis=ctx.axis),
                    (hr,) + tuple(shape[1:]), dtype, tables=ctx.tables)
    fwd_p, adj_p = _bind(ctx, prog), _bind(ctx, prog, adjoint=True)
    pad, name = _padder(ctx), "ScatterOutputs output"
    fwd = lambda x: run(ctx, fwd_p, pad(x, hr), n_pad, name)  # noqa: E731
    bwd = lambda g: run(ctx, adj_p, pad(g, hr), n_pad, name)  # noqa: E731
    return Step(fwd, bwd)


def _halo_scatter(x: jax.Array, t: Any, *, axis: str) -> jax.Array:
    """`collectives.halo_scatter` with the axis bound."""
    return col.halo_scatter(x, t, axis)


def _sum_per_rank(x: jax.Array, *, axis: str, replicated_consumer: bool) -> jax.Array:
    """All-reduce whose result each device holds and consumes as its own (varying) value."""
    if replicated_consumer:
        return col.all_reduce_sum(x, axis, replicated_consumer=True)
    return jax.lax.pcast(col.all_reduce_sum(x, axis), axis, to="varying")


def all_reduce_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any, *, replicated_consumer: bool) -> Step:
    """Any-shape partial -> the sum over ranks (same shape)."""
    key = ("all_reduce_sum", tuple(shape), np.dtype(dtype), replicated_consumer)
    return _cached_step(ctx, key, lambda: _all_reduce_step(ctx, tuple(shape), dtype, replicated_consumer))


def _all_reduce_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any, replicated_consumer: bool) -> Step:
    """Build `all_reduce_step`'s step."""
    local = (1,) + tuple(shape)
    fn = functools.partial(_sum_per_rank, axis=ctx.axis, replicated_consumer=replicated_consumer)
    prog = _program(ctx, f"all_reduce_sum(replicated_consumer={replicated_consumer})", fn, local, dtype)
    fwd_p, adj_p = _bind(ctx, prog), _bind(ctx, prog, adjoint=True)
    name = "AllReduceSum output"

    def go(x: torch.Tensor, program: Callable[[jax.Array], jax.Array]) -> torch.Tensor:
        return run(ctx, program, x.reshape(local), 1, name).reshape(shape)

    return Step(lambda x: go(x, fwd_p), lambda g: go(g, adj_p))


def gather_full_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any) -> Step:
    """Owned block `(n_owned, *F)` -> `(n_global, *F)` in global-id order (sharded storage)."""
    key = ("gather_full", tuple(shape), np.dtype(dtype))
    return _cached_step(ctx, key, lambda: _gather_full_step(ctx, tuple(shape), dtype))


def _gather_full_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any) -> Step:
    """Build `gather_full_step`'s step."""
    t = ctx.tables if ctx.kind == "shard" else ctx.shard_tables
    prog = _program(ctx, "gather_full", functools.partial(_gather_full, axis=ctx.axis),
                    (ctx.owned_capacity,) + tuple(shape[1:]), dtype, tables=t)
    return _shard_step(ctx, prog, t, ctx.owned_capacity, ctx.n_global, ctx.n_owned, "GatherInputsFull argument")


def _gather_full(x: jax.Array, t: Any, *, axis: str) -> jax.Array:
    """`collectives.gather_full` with the axis bound."""
    return col.gather_full(x, t, axis)


def slice_outputs_owned_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any) -> Step:
    """Kernel output `(n_global, *F)` -> this rank's owned rows `(n_owned, *F)`."""
    key = ("slice_outputs_owned", tuple(shape), np.dtype(dtype))
    return _cached_step(ctx, key, lambda: _slice_outputs_owned_step(ctx, tuple(shape), dtype))


def _slice_outputs_owned_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any) -> Step:
    """Build `slice_outputs_owned_step`'s step."""
    t = ctx.tables
    prog = _program(ctx, "slice_outputs_owned", functools.partial(_slice_owned_out, axis=ctx.axis),
                    (ctx.n_global,) + tuple(shape[1:]), dtype, tables=t)
    return _shard_step(ctx, prog, t, ctx.n_global, ctx.n_owned, ctx.n_global, "SliceOutputsOwned output")


def _slice_owned_out(x: jax.Array, t: Any, *, axis: str) -> jax.Array:
    """`collectives.slice_outputs_owned` with the axis bound."""
    return col.slice_outputs_owned(x, t, axis)


def _shard_step(ctx: PlanContext, prog: Program, tables: Any, in_rows: int, out_rows: int, back_rows: int,
                name: str) -> Step:
    """A step over shard tables (which may differ from `ctx.tables` for a halo plan)."""
    fwd_p, adj_p = _bind(ctx, prog, tables=tables), _bind(ctx, prog, adjoint=True, tables=tables)
    pad = _padder(ctx)
    out_cap = ctx.n_global if in_rows == ctx.owned_capacity else ctx.owned_capacity
    fwd = lambda x: _call(ctx, fwd_p, pad(x, in_rows), name)[:out_rows]  # noqa: E731
    bwd = lambda g: _call(ctx, adj_p, pad(g, out_cap), name)[:back_rows]  # noqa: E731
    return Step(fwd, bwd)


def apply(fn: type[_Transform], x: torch.Tensor, step: Step) -> torch.Tensor:
    """Run a transform Function on a plain (or ShardTensor) block, autograd included."""
    with torch._C.DisableTorchFunctionSubclass():
        return fn.apply(x, step)


def halo_from_owned(ctx: PlanContext, owned: torch.Tensor, *, positions: bool) -> torch.Tensor:
    """Forward halo exchange of an owned block (differentiable)."""
    step = gather_inputs_step(ctx, tuple(owned.shape), _jax_dtype(owned), positions=positions)
    return apply(GatherInputsFn, owned, step)


def gather_owned(ctx: PlanContext, owned: torch.Tensor) -> torch.Tensor:
    """All ranks' owned rows in global-id order, on every rank (differentiable)."""
    return apply(GatherOwnedFn, owned, gather_full_step(ctx, tuple(owned.shape), _jax_dtype(owned)))


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
