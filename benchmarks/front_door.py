"""Kernel call through the PyTorch front door: GatherInputs + ScatterOutputs on ShardTensors vs NCCL all_to_all.

Two processes (one device each, started by `nvalchemi_jaxbridge.torch.launch -n 2`), each holding its owned
rows of a per-atom feature block (fcc argon, LJ cutoff, a 2-device `HaloPlan`), call an identity op under
`OpAdapter(op, gather_inputs=[0], scatter_outputs=[0])`: forward halo exchange, op, reverse + forward
exchange (three exchanges). The reference does the same three exchanges in torch with
`torch.distributed.all_to_all_single` (NCCL on GPUs, gloo on the CPU) from the same plan's tables, and the
front door's result is checked against it. Per-call wall time (synchronised after each call, and chains of
calls with one synchronisation), median per rank; the table shows the slower rank. Needs 2 GPUs on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np

if __package__ in (None, ""):  # run as a script by the launcher: the checkout, not benchmarks/, goes first
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from benchmarks import common as cm  # noqa: E402

FEATURES = 3
CHAIN = 10
FRONT_DOOR = "front door (stream-ordered, cached steps)"


def run(rep: cm.Report, opt) -> None:
    """Launch the two ranks, read rank 0's measurements, add the table."""
    from nvalchemi_jaxbridge.torch.launch import launch

    if opt.platform == "gpu":
        import torch

        if (n := torch.cuda.device_count()) < 2:
            rep.note(f"PyTorch front door: not run, it needs 2 GPUs (this machine has {n}).")
            return
    iters = opt.repeats_or(100, 2)
    cells = [2] if opt.smoke else [8, 16, 24]
    tmp = tempfile.mkdtemp(prefix="jaxbridge-front-door-")
    out = os.path.join(tmp, "rows.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(cm.ROOT), os.environ.get("PYTHONPATH")])),
               XLA_PYTHON_CLIENT_PREALLOCATE="false", JAXBRIDGE_BENCH_STORE=os.path.join(tmp, "store"))
    argv = [os.path.abspath(__file__), "--platform", opt.platform, "--iters", str(iters), "--json", out,
            "--cells", ",".join(map(str, cells))]
    rep.setting("front door", f"2 processes, {FEATURES} x float32 per atom, argon fcc {cells} cells; median of "
                f"{iters} calls after warm-up, synchronised after each, and chains of {CHAIN} calls with one "
                "synchronisation; front door and all_to_all_single in turns; the slower rank")
    try:
        code = launch(argv, 2, timeout_s=180 if opt.smoke else 300, env=env)
        rows = json.load(open(out)) if os.path.exists(out) else []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table = rep.table("PyTorch front door: GatherInputs + ScatterOutputs round trip (3 exchanges, 2 processes)",
                      ["atoms", "rows/rank (owned / halo)", "ghost rows sent", "bytes/exchange/dir", "path",
                       "per call, sync each (us)", f"per call, chain of {CHAIN} (us)", "/ all_to_all_single",
                       "same result"])
    for r in rows:
        table.add(*r)
        if r[-1] != "yes":
            rep.fail(f"front door, {r[0]} atoms: {r[4]} disagrees with the all_to_all_single reference")
    if code or not rows:
        rep.fail(f"front door: the 2-process run exited with {code} (its output is above)")


def _identity_op():
    """`jaxbridge_bench::rows(x) -> x.clone()`: the kernel does nothing, so only the exchanges cost."""
    import torch

    lib = torch.library.Library("jaxbridge_bench", "FRAGMENT")
    lib.define("rows(Tensor x) -> Tensor")
    lib.impl("rows", lambda x: x.clone(), "CompositeExplicitAutograd")
    torch.library.register_fake("jaxbridge_bench::rows", lambda x: torch.empty_like(x), lib=lib)
    return lib, torch.ops.jaxbridge_bench.rows.default


class A2AExchange:
    """The plan's halo exchanges for one rank in plain torch.distributed (one all_to_all_single each)."""

    def __init__(self, plan, rank: int, dev):
        import torch

        self.d, self.oc, self.hr = int(plan.n_devices), int(plan.owned_capacity), int(plan.halo_rows)
        t = lambda a: torch.as_tensor(np.asarray(a, np.int64), device=dev)  # noqa: E731
        self.local = [(t(s[rank]), t(r[rank])) for k, s, r in zip(plan.offsets, plan.send_idx, plan.recv_slot) if k == 0]
        by_dest, by_src = [[] for _ in range(self.d)], [[] for _ in range(self.d)]
        for k, s, r in zip(plan.offsets, plan.send_idx, plan.recv_slot):
            if k % self.d:
                by_dest[(rank + k) % self.d].append(t(s[rank]))
                by_src[(rank - k) % self.d].append(t(r[rank]))
        self.send = torch.cat([i for g in by_dest for i in g]) if any(by_dest) else t([])
        self.recv = torch.cat([i for g in by_src for i in g]) if any(by_src) else t([])
        self.send_split = [int(sum(len(i) for i in g)) for g in by_dest]
        self.recv_split = [int(sum(len(i) for i in g)) for g in by_src]
        self.mask = torch.arange(self.oc, device=dev) < int(plan.n_owned[rank])

    def _a2a(self, x, out_rows: int, send_split, recv_split):
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
            own.index_add_(0, self.send, self._a2a(ext[self.recv], len(self.send), self.recv_split, self.send_split))
        return own[: self.oc]


def _chain(fn, n: int):
    def run():
        for _ in range(n - 1):
            fn()
        return fn()

    return run


def rank_main(a: argparse.Namespace) -> int:
    """One rank: time the front door and the all_to_all reference; rank 0 writes the rows as JSON."""
    if a.platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    from nvalchemi_jaxbridge.torch import distributed

    info = distributed.initialize(platform=a.platform, timeout_s=120)
    import jax

    jax.config.update("jax_enable_x64", True)
    import torch
    import torch.distributed as dist

    from nvalchemi_jaxbridge.demo import LJParams, argon_fcc
    from nvalchemi_jaxbridge.layout import HaloPlan
    from nvalchemi_jaxbridge.spec import OpAdapter
    from nvalchemi_jaxbridge.torch import ShardTensor, installed

    rank, world = info.rank, info.world_size
    dev = torch.device("cuda", info.local_rank) if a.platform == "gpu" else torch.device("cpu")
    store = dist.FileStore(os.environ["JAXBRIDGE_BENCH_STORE"], world)
    dist.init_process_group("nccl" if a.platform == "gpu" else "gloo", store=store, rank=rank, world_size=world)
    warmup = 2 if a.iters < 10 else 10
    _lib, op = _identity_op()
    adapter = OpAdapter(op, gather_inputs=[0], scatter_outputs=[0])
    sync = cm.torch_sync(dev)
    rows = []
    for cells in (int(c) for c in a.cells.split(",")):
        s = argon_fcc(cells)
        plan = HaloPlan.build(s.positions, s.cell, cutoff=LJParams().cutoff, n_devices=world, headroom=1.0)
        feats = np.random.default_rng(0).normal(size=(s.n_atoms, FEATURES)).astype(np.float32)
        x = ShardTensor.from_global(torch.tensor(feats, device=dev), plan)
        ex = A2AExchange(plan, rank, dev)
        owned = torch.as_tensor(np.asarray(plan.to_owned(feats)).reshape(world, -1, FEATURES)[rank], device=dev)
        ref = lambda: ex.forward(ex.reverse(ex.forward(owned).clone()))  # noqa: E731
        n_pad = int(plan.n_owned[rank] + plan.n_ghost[rank])
        want = ref()[:n_pad]
        with installed(adapter):
            calls = {FRONT_DOOR: lambda: op(x), "all_to_all_single": ref}
            each = cm.time_interleaved({k: (f, sync) for k, f in calls.items()}, warmup=warmup, iters=a.iters)
            chained = cm.time_interleaved({k: (_chain(f, CHAIN), sync) for k, f in calls.items()}, warmup=1,
                                          iters=max(2, a.iters // CHAIN))
            got = op(x).to_local()
        same = bool(torch.allclose(got[:n_pad].float(), want, rtol=1e-5, atol=1e-5))
        mine = {k: (cm.med(each[k]), cm.med(chained[k]) / CHAIN) for k in calls}
        stats = [None] * world
        dist.all_gather_object(stats, (mine, len(ex.send), same))
        sent = max(r[1] for r in stats)
        base = max(r[0]["all_to_all_single"][0] for r in stats)
        for name in calls:
            t_each, t_chain = (max(r[0][name][i] for r in stats) for i in (0, 1))
            ok = name != FRONT_DOOR or all(r[2] for r in stats)
            rows.append([s.n_atoms, f"{plan.owned_capacity} / {plan.halo_rows}", sent,
                         cm.human_bytes(sent * FEATURES * 4), name, cm.us(t_each), cm.us(t_chain),
                         f"{t_each / base:.2f}", "yes" if ok else "NO"])
    if rank == 0:
        with open(a.json, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="one rank of the front-door benchmark (started by run())")
    p.add_argument("--platform", choices=("cpu", "gpu"), required=True)
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--cells", required=True)
    p.add_argument("--json", required=True)
    sys.exit(rank_main(p.parse_args()))
