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
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import _common as cm
import numpy as np

CELLS = [8, 16, 24]
SMOKE_CELLS = [2]
FEATURES = 3
CHAIN = 10
PATHS = {"front door (host sync, before)": True, "front door (stream-ordered, after)": False}


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
                               f"chain: {CHAIN} calls, one synchronize, time / {CHAIN}; the paths alternate in two "
                               "rounds; slower rank shown"),
                    "paths": "host sync = functions._HOST_SYNC on (a host wait per JAX program, before); "
                             "stream-ordered = off (event waits only, after)",
                    "reference": f"torch.distributed all_to_all_single ({'nccl' if platform == 'gpu' else 'gloo'})"}
        rep = cm.Report("front_door", "PyTorch front door vs torch.distributed (2 processes)", a.out,
                        cm.context(platform), settings)
        rows = rep.table("GatherInputs + ScatterOutputs round trip (3 exchanges)",
                         ["atoms", "rows/rank (owned / halo)", "ghost rows sent", "bytes/exchange/dir", "path",
                          "per call, sync each (us)", f"per call, chain of {CHAIN} (us)", "/ all_to_all_single",
                          "same result"])
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
            times: dict[str, list[float]] = {name: [] for name in [*PATHS, "all_to_all_single"]}
            chained: dict[str, list[float]] = {name: [] for name in times}
            same: dict[str, bool] = {}
            with installed(adapter):
                fd = lambda: op(x)  # noqa: E731
                for rnd in range(2):  # alternate the paths so that drift hits both alike
                    for name, sync_on in [*PATHS.items(), ("all_to_all_single", None)]:
                        call = ref if sync_on is None else fd
                        with _host_sync(sync_on):
                            n = iters // 2 if rnd == 0 else iters - iters // 2
                            times[name] += cm.time_calls(call, warmup=warmup, iters=n, sync=sync)
                            chained[name] += [t / CHAIN for t in cm.time_calls(
                                _chain(call, CHAIN), warmup=1, iters=max(n // CHAIN, 2), sync=sync)]
                            if rnd == 0:
                                got = call()
                                got = got.to_local() if sync_on is not None else got
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
                med = {k: (max(r[0][k][0] for r in stats), max(r[0][k][1] for r in stats)) for k in PATHS}
                (before, after) = (med[k] for k in PATHS)
                rep.note(f"{s.n_atoms} atoms: stream-ordered / host sync = {after[0] / before[0]:.2f} (sync each), "
                         f"{after[1] / before[1]:.2f} (chain of {CHAIN}).")
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


@contextlib.contextmanager
def _host_sync(on: bool | None) -> Iterator[None]:
    """Set the front door's private host-sync switch inside the block (None: leave it as it is)."""
    from nvalchemi_jaxbridge.torch import functions as F

    old = F._HOST_SYNC
    if on is not None:
        F._HOST_SYNC = on
    try:
        yield
    finally:
        F._HOST_SYNC = old


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
