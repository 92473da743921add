"""PyTorch front door overhead: GatherInputs + ScatterOutputs on ShardTensors vs NCCL all_to_all_single.

    PYTHONPATH=. python3 benchmarks/front_door.py --out OUTDIR [--smoke]

Starts itself on 2 processes through `python -m nvalchemi_jaxbridge.torch.launch -n 2`
(one device each; a process already started by a launcher runs as a rank). Each
rank holds its owned rows of a per-atom feature block (fcc argon, LJ cutoff, a
2-device `HaloPlan`) and calls an identity op under an installed
`OpAdapter(op, gather_inputs=[0], scatter_outputs=[0])`: forward halo exchange,
op, reverse + forward exchange (three exchanges). The reference does the same
three exchanges in torch with `torch.distributed.all_to_all_single` (NCCL on GPU,
gloo on the CPU) from the same plan's tables, and its result is checked against
the front door's. Per-call wall time (synchronize after each call), median per
rank; the table shows the slower rank.

The front door runs its one path: the stream-ordered release with cached steps,
sharding and zero blocks. The before/after figures of the paths it replaced (a
host sync after every program, the first DLPack-race fix; every piece rebuilt
per call, before issue 7) are in benchmarks/RESULTS.md, and the code in git
history; they are no longer switches in the library.

The breakdown table (issue 7) splits one GatherInputs transform of the same plan
into its parts, each timed alone in interleaved rounds: a trivial jitted program
over the 2-process array (the dispatch floor), the bare `ppermute` of the same
rows, the torch -> JAX import, the JAX -> torch export, the padding, the whole
transform, and one `all_to_all_single` of the same bytes.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import _common as cm
import numpy as np

CELLS = [8, 16, 24]
SMOKE_CELLS = [2]
FEATURES = 3
CHAIN = 10
FRONT_DOOR = "front door (stream-ordered, cached steps)"
# Breakdown steps: key -> label.
STEPS = {
    "i": "(i) trivial program x + 1, no collective (pre-built global array)",
    "ii": "(ii) bare ppermute of the same rows (pre-built global array)",
    "ii+": "(ii+) the transform's jitted program alone (pre-built global array, device tables)",
    "iii": "(iii) import: torch_to_jax + make_array_from_single_device_arrays",
    "iii+": "(iii+) import + the transform's program (a fresh global array each call)",
    "iv": "(iv) export: local shard + jax_to_torch",
    "v": "(v) _pad to the owned capacity",
    "vi": "(vi) whole GatherInputs transform (halo_from_owned)",
    "vii": "(vii) all_to_all_single of the same bytes",
}


def _launch(argv: list[str], timeout_s: float) -> int:
    """Re-run this script on 2 ranks with the package's launcher."""
    from nvalchemi_jaxbridge.torch.launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(cm.ROOT), os.environ.get("PYTHONPATH", "")]),
                   XLA_PYTHON_CLIENT_PREALLOCATE="false", JAXBRIDGE_BENCH_STORE=os.path.join(tmp, "store"))
        code = launch([os.path.abspath(__file__), *argv], 2, timeout_s=timeout_s, env=env)
    if code:
        print(f"front_door: the 2-process run exited with {code}", flush=True)
    return code


def _identity_op():
    """`jaxbridge_bench::rows(x) -> x.clone()`: the kernel does nothing, so only the transforms cost."""
    import torch

    lib = torch.library.Library("jaxbridge_bench", "FRAGMENT")
    lib.define("rows(Tensor x) -> Tensor")
    lib.impl("rows", lambda x: x.clone(), "CompositeExplicitAutograd")
    torch.library.register_fake("jaxbridge_bench::rows", lambda x: torch.empty_like(x), lib=lib)
    return lib, torch.ops.jaxbridge_bench.rows.default


class A2AExchange:
    """The plan's halo exchanges for one rank in plain torch.distributed (one all_to_all_single each)."""

    def __init__(self, plan, rank: int, dev, dtype):
        import torch

        self.d, self.rank = int(plan.n_devices), rank
        self.oc, self.hr = int(plan.owned_capacity), int(plan.halo_rows)
        t = lambda a: torch.as_tensor(np.asarray(a, np.int64), device=dev)  # noqa: E731
        self.local = [(t(s[rank]), t(r[rank])) for k, s, r in zip(plan.offsets, plan.send_idx, plan.recv_slot) if k == 0]
        by_dest = [[] for _ in range(self.d)]
        by_src = [[] for _ in range(self.d)]
        for k, s, r in zip(plan.offsets, plan.send_idx, plan.recv_slot):
            if k % self.d:
                by_dest[(rank + k) % self.d].append(t(s[rank]))
                by_src[(rank - k) % self.d].append(t(r[rank]))
        self.send = torch.cat([i for g in by_dest for i in g]) if any(by_dest) else t([])
        self.recv = torch.cat([i for g in by_src for i in g]) if any(by_src) else t([])
        self.send_split = [int(sum(len(i) for i in g)) for g in by_dest]
        self.recv_split = [int(sum(len(i) for i in g)) for g in by_src]
        self.mask = torch.arange(self.oc, device=dev) < int(plan.n_owned[rank])
        self.dtype = dtype

    def _a2a(self, x, out_rows: int, send_split, recv_split):
        import torch
        import torch.distributed as dist

        out = x.new_empty((out_rows,) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_split, send_split)
        return out

    def forward(self, owned):
        """Owned storage (oc, F) -> halo storage (hr, F)."""
        import torch

        own = torch.cat([owned * self.mask[:, None], owned.new_zeros((1, owned.shape[1]))])  # row oc: padding
        halo = owned.new_zeros((self.hr + 1, owned.shape[1]))  # row hr: dropped padding
        halo[: self.oc] = own[: self.oc]
        for s, r in self.local:
            halo[r] = own[s]
        if len(self.send):
            halo[self.recv] = self._a2a(own[self.send], len(self.recv), self.send_split, self.recv_split)
        return halo[: self.hr]

    def reverse(self, halo):
        """Halo storage (hr, F) -> owned storage (oc, F), ghost rows added into their owners."""
        import torch

        ext = torch.cat([halo, halo.new_zeros((1, halo.shape[1]))])
        own = torch.cat([halo[: self.oc] * self.mask[:, None], halo.new_zeros((1, halo.shape[1]))])
        for s, r in self.local:
            own.index_add_(0, s, ext[r])
        if len(self.send):
            back = self._a2a(ext[self.recv], len(self.send), self.recv_split, self.send_split)
            own.index_add_(0, self.send, back)
        return own[: self.oc]


def rank_main(a) -> int:
    """One rank: time the front door and the all_to_all reference, gather the medians on rank 0."""
    platform = a.platform
    if platform == "auto":
        import torch

        platform = "gpu" if torch.cuda.is_available() else "cpu"
    if platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    from nvalchemi_jaxbridge.torch import distributed

    info = distributed.initialize(platform=platform, timeout_s=120)
    import jax

    jax.config.update("jax_enable_x64", True)
    import torch
    import torch.distributed as dist

    from nvalchemi_jaxbridge.demo import LJParams, argon_fcc
    from nvalchemi_jaxbridge.layout import HaloPlan
    from nvalchemi_jaxbridge.spec import OpAdapter
    from nvalchemi_jaxbridge.torch import ShardTensor, installed
    from nvalchemi_jaxbridge.torch import functions as F

    rank, world = info.rank, info.world_size
    dev = torch.device("cuda", info.local_rank) if platform == "gpu" else torch.device("cpu")
    store = dist.FileStore(os.environ["JAXBRIDGE_BENCH_STORE"], world)
    dist.init_process_group("nccl" if platform == "gpu" else "gloo", store=store, rank=rank, world_size=world)
    iters = a.iters or (5 if a.smoke else 100)
    warmup = 2 if a.smoke else 10
    rep = None
    if rank == 0:
        settings = {"processes": f"{world} (one device each), launched by nvalchemi_jaxbridge.torch.launch",
                    "features": f"{FEATURES} x float32 per atom", "plan": f"argon fcc, cutoff {LJParams().cutoff} A",
                    "timing": (f"median of {iters} calls after {warmup} warm-up, wall + synchronize after each; "
                               f"chain: {CHAIN} calls, one synchronize, time / {CHAIN}; front door and reference "
                               "alternate in two rounds; slower rank shown"),
                    "paths": "the front door's one path (stream-ordered, cached steps); the earlier paths' figures "
                             "are in benchmarks/RESULTS.md",
                    "breakdown": (f"GatherInputs of the same plan, {iters} calls per step after {warmup} warm-up, "
                                  f"in {_rounds(a.smoke)} interleaved rounds; sync each: every call followed by "
                                  "block_until_ready / torch.cuda.synchronize; chain: {CHAIN} calls, one sync, "
                                  f"time / {CHAIN}; median per rank, slower rank shown; derived rows: differences of one rank's "
                                  "medians, the largest over ranks (a negative value is below the noise)"
                                  ).replace("{CHAIN}", str(CHAIN)),
                    "reference": f"torch.distributed all_to_all_single ({'nccl' if platform == 'gpu' else 'gloo'})"}
        rep = cm.Report("front_door", "PyTorch front door vs torch.distributed (2 processes)", a.out,
                        cm.context(platform), settings)
        rows = rep.table("GatherInputs + ScatterOutputs round trip (3 exchanges)",
                         ["atoms", "rows/rank (owned / halo)", "ghost rows sent", "bytes/exchange/dir", "path",
                          "per call, sync each (us)", f"per call, chain of {CHAIN} (us)", "/ all_to_all_single",
                          "same result"])
        bd_rows = rep.table("Breakdown of one GatherInputs transform (issue 7)",
                            ["atoms", "owned rows per rank of capacity / halo rows", "step",
                             "sync each (us), slower rank", "sync each, per rank (us)",
                             f"chain of {CHAIN}, per call (us)", "/ (vii) all_to_all_single"])
    _lib, op = _identity_op()
    adapter = OpAdapter(op, gather_inputs=[0], scatter_outputs=[0])
    sync = (lambda _: torch.cuda.synchronize(dev)) if platform == "gpu" else (lambda _: None)
    failures = 0
    for cells in SMOKE_CELLS if a.smoke else CELLS:
        try:
            s = argon_fcc(cells)
            plan = HaloPlan.build(s.positions, s.cell, cutoff=LJParams().cutoff, n_devices=world, headroom=1.0)
            feats = np.random.default_rng(0).normal(size=(s.n_atoms, FEATURES)).astype(np.float32)
            x = ShardTensor.from_global(torch.tensor(feats, device=dev), plan)
            ex = A2AExchange(plan, rank, dev, torch.float32)
            owned = torch.as_tensor(np.asarray(plan.to_owned(feats)).reshape(world, -1, FEATURES)[rank], device=dev)
            ref = lambda: ex.forward(ex.reverse(ex.forward(owned).clone()))  # noqa: E731
            n_pad = int(plan.n_owned[rank] + plan.n_ghost[rank])
            want = ref()[:n_pad]
            times: dict[str, list[float]] = {name: [] for name in [FRONT_DOOR, "all_to_all_single"]}
            chained: dict[str, list[float]] = {name: [] for name in times}
            same: dict[str, bool] = {}
            with installed(adapter):
                fd = lambda: op(x)  # noqa: E731
                for rnd in range(2):  # alternate front door and reference so that drift hits both alike
                    for name, call in ((FRONT_DOOR, fd), ("all_to_all_single", ref)):
                        n = iters // 2 if rnd == 0 else iters - iters // 2
                        times[name] += cm.time_calls(call, warmup=warmup, iters=n, sync=sync)
                        chained[name] += [t / CHAIN for t in cm.time_calls(
                            _chain(call, CHAIN), warmup=1, iters=max(n // CHAIN, 2), sync=sync)]
                        if rnd == 0:
                            got = call()
                            got = got.to_local() if name == FRONT_DOOR else got
                            same[name] = bool(torch.allclose(got[:n_pad].float(), want, rtol=1e-5, atol=1e-5))
            stats = [None] * world
            mine = {k: (cm.med(times[k]), cm.med(chained[k]), same[k]) for k in times}
            dist.all_gather_object(stats, (mine, len(ex.send)))
            if rep is not None:
                sent = max(r[1] for r in stats)
                base = max(r[0]["all_to_all_single"][0] for r in stats)
                for name in times:
                    t_each = max(r[0][name][0] for r in stats)
                    t_chain = max(r[0][name][1] for r in stats)
                    ok = all(r[0][name][2] for r in stats)
                    rep.row(rows, [s.n_atoms, f"{plan.owned_capacity} / {plan.halo_rows}", sent,
                                   cm.human_bytes(sent * FEATURES * 4), name, cm.us(t_each), cm.us(t_chain),
                                   f"{t_each / base:.2f}", "yes" if ok else "NO"])
                    if not ok:
                        rep.note(f"{s.n_atoms} atoms: {name} and the all_to_all reference disagree.")
                        failures += 1
            bd, frames = _breakdown(F.context_for(plan), owned, ex, dev, iters=iters, warmup=warmup,
                                    rounds=_rounds(a.smoke))
            bd_stats = [None] * world
            dist.all_gather_object(bd_stats, ({k: cm.med(v) for k, v in bd.items()}, frames))  # per rank
            if rep is not None:
                owned_rows = "+".join(str(int(n)) for n in np.asarray(plan.n_owned))
                _breakdown_rows(rep, bd_rows, s.n_atoms, f"{owned_rows} of {plan.owned_capacity} / {plan.halo_rows}",
                                bd_stats)
        except Exception as e:  # noqa: BLE001 - record and go on (a one-rank failure ends in the launcher timeout)
            failures += 1
            msg = f"{s.n_atoms if 's' in locals() else '?'} atoms on rank {rank} FAILED - {type(e).__name__}: {e}"
            print(msg, flush=True)
            if rep is not None:
                rep.note(msg.splitlines()[0])
    code = 0
    if rep is not None:
        code = rep.finish() or (1 if failures else 0)
    dist.barrier()
    dist.destroy_process_group()
    distributed.shutdown()
    return code if rank == 0 else (1 if failures else 0)


def _rounds(smoke: bool) -> int:
    """Interleaved rounds of the breakdown."""
    return 2 if smoke else 10


def _breakdown(ctx, owned, ex, dev, *, iters: int, warmup: int, rounds: int
               ) -> tuple[dict[tuple[str, str], list[float]], dict[str, int]]:
    """Per-call seconds of each breakdown step on this rank, and jit's Python frames per program call.

    `owned` is this rank's owned storage (owned-capacity rows); the transform reads
    its first `n_owned` rows, as the installed op path does. Keys: (step, mode),
    mode "each" (synchronize after every call) or "chain".
    """
    import jax
    import torch
    from jax.sharding import PartitionSpec as P

    from nvalchemi_jaxbridge.torch import block_programs as BP
    from nvalchemi_jaxbridge.torch import functions as F

    oc, axis, n_dev = ctx.owned_capacity, ctx.axis, ctx.n_devices
    own_n = owned[: ctx.n_owned].contiguous()
    block = BP._pad(own_n, oc, ctx.memo)
    g, _imported = BP._to_global(ctx, block, "breakdown block")  # kept alive with `block`
    smap = lambda f: jax.jit(jax.shard_map(f, mesh=ctx.mesh, in_specs=P(axis), out_specs=P(axis)))  # noqa: E731
    trivial = smap(lambda x: x + 1)
    perm = [(i, (i + 1) % n_dev) for i in range(n_dev)]
    ppermute = smap(lambda x: jax.lax.ppermute(x, axis, perm))
    out = jax.block_until_ready(trivial(g))  # a program output of the block's shape, to export
    prog = BP._program(ctx, "gather_inputs(positions=False)",  # the transform's program (cached: same key)
                       functools.partial(F._halo_forward, axis=axis, positions=False), tuple(block.shape),
                       BP._jax_dtype(block), tables=ctx.tables)
    send = owned[ex.send].contiguous()
    torch_sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def jax_sync(r: Any) -> None:
        jax.block_until_ready(r)
        torch_sync()

    calls = {
        "i": (lambda: trivial(g), jax_sync),
        "ii": (lambda: ppermute(g), jax_sync),
        "ii+": (lambda: prog.fwd(g, ctx.tables), jax_sync),
        "iii": (lambda: BP._to_global(ctx, block, "breakdown block")[0], jax_sync),
        "iii+": (lambda: prog.fwd(BP._to_global(ctx, block, "breakdown block")[0], ctx.tables), jax_sync),
        "iv": (lambda: BP._local_out(out, "breakdown output"), lambda _: torch_sync()),
        "v": (lambda: BP._pad(own_n, oc, ctx.memo), lambda _: torch_sync()),
        "vi": (lambda: F.halo_from_owned(ctx, own_n, positions=False), lambda _: torch_sync()),
        "vii": (lambda: ex._a2a(send, len(ex.recv), ex.send_split, ex.recv_split), lambda _: torch_sync()),
    }
    times: dict[tuple[str, str], list[float]] = {(k, m): [] for k in STEPS for m in ("each", "chain")}
    per_round = max(iters // rounds, 1)
    for rnd in range(rounds):
        for key in STEPS:
            fn, sync = calls[key]
            times[(key, "each")] += cm.time_calls(fn, warmup=warmup if rnd == 0 else 1, iters=per_round, sync=sync)
            times[(key, "chain")] += [t / CHAIN for t in cm.time_calls(
                _chain(fn, CHAIN), warmup=0, iters=max(per_round // CHAIN, 1), sync=sync)]
    frames = {k: _jit_python_frames(calls[k][0]) for k in ("i", "ii", "ii+", "vi")}
    torch_sync()
    return times, frames


def _jit_python_frames(fn: Callable[[], Any]) -> int:
    """Python calls into `jax/_src/pjit.py` while `fn()` runs: 0 when jit's C++ fast path dispatched it."""
    hits = 0
    tail = os.path.join("jax", "_src", "pjit.py")

    def prof(frame: Any, event: str, _arg: Any) -> None:
        nonlocal hits
        if event == "call" and frame.f_code.co_filename.endswith(tail):
            hits += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return hits


def _breakdown_rows(rep, rows, atoms: int, layout: str, stats: list) -> None:
    """Rows of the breakdown table (slower rank per step) and its notes."""
    world = len(stats)
    slow = {k: max(r[0][k] for r in stats) for k in stats[0][0]}
    base = slow[("vii", "each")]
    for key in STEPS:
        per_rank = " / ".join(cm.us(r[0][(key, "each")]) for r in stats)
        t = slow[(key, "each")]
        rep.row(rows, [atoms, layout, STEPS[key], cm.us(t), per_rank, cm.us(slow[(key, "chain")]), f"{t / base:.2f}"])
    derived = [("(vi) - (ii+): the front door around its program", ("vi",), ("ii+",)),
               ("(vi) - (ii): the transform above a bare exchange", ("vi",), ("ii",)),
               ("(iii) + (iv) + (v): import, export, pad", ("iii", "iv", "v"), ()),
               ("(iii+) - (iii) - (ii+): a fresh input's extra program cost", ("iii+",), ("iii", "ii+")),
               ("(vi) - (iii+) - (iv) - (v): autograd, step lookup, slicing", ("vi",), ("iii+", "iv", "v"))]
    for name, plus, minus in derived:
        def val(r: Any, mode: str, plus=plus, minus=minus) -> float:
            return sum(r[0][(k, mode)] for k in plus) - sum(r[0][(k, mode)] for k in minus)

        each, chain = (max(val(r, m) for r in stats) for m in ("each", "chain"))
        rep.row(rows, [atoms, layout, name, cm.us(each), "-", cm.us(chain), f"{each / base:.2f}"])
    frames = " / ".join(", ".join(f"({k}) {n}" for k, n in r[1].items()) for r in stats)
    rep.note(f"{atoms} atoms: Python calls into jax/_src/pjit.py per call, rank 0..{world - 1} (0 = jit's C++ "
             f"fast path): {frames}.")


def _chain(fn: Callable[[], Any], n: int) -> Callable[[], Any]:
    """`fn` called `n` times back to back; returns the last result (for the final synchronize)."""

    def run() -> Any:
        for _ in range(n - 1):
            fn()
        return fn()

    return run


def main(argv: list[str] | None = None) -> int:
    p = cm.base_parser(__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=None, help="timed calls (default 100, smoke 5)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="limit for the 2-process run")
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    if "RANK" not in os.environ:
        return _launch(argv, a.timeout_s)
    return rank_main(a)


if __name__ == "__main__":
    sys.exit(main())
