"""Stress checks of the front door's memory ordering (the GPU DLPack race), in-process or on N ranks.

    python -m nvalchemi_jaxbridge.torch.launch -n 2 tests/torch/stress.py OUT_DIR [cpu|gpu] [--iters N] [--cells C]

Every iteration builds fresh input tensors, runs transforms forward and
backward, and right after each call fills same-size junk tensors with NaN:
torch memory handed back while a JAX program still reads it would then be
overwritten and show up as NaN or wrong values. Each result is compared with a
closed form built from the plan's `halo_global` ids only (no exchange tables),
or with the pair model's numpy reference. The front door has one path, the
stream-ordered release (the host-synchronised one it replaced is gone from the
library; its results are in benchmarks/RESULTS.md), reported as the mode
"stream-ordered".

On GPU a negative control runs the same pattern directly with JAX and torch,
dropping the input without ordering: it shows whether this machine exposes the
race at all (informational; it does not fail the run). The launched form writes
OUT_DIR/rank<k>_stress.json; scripts/gpu_torch_front_door.py judges it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

MODE = "stream-ordered"  # the front door's only path (the key of res["modes"])


def _junk(dev: Any, dtype: Any, shapes: list[tuple[int, ...]]) -> list[Any]:
    """NaN-filled tensors of the given shapes (they take over blocks torch just freed)."""
    import torch

    return [torch.full(s, float("nan"), dtype=dtype, device=dev) for s in shapes]


def exchange_reference(plan: Any, rank: int, x_global: np.ndarray, w_halo: list[np.ndarray]
                       ) -> tuple[np.ndarray, np.ndarray]:
    """ScatterOutputs(GatherInputs(x)) on `rank`, and the gradient of sum_d <w_d, out_d> on its owned rows.

    From ids only: every halo row of atom g holds `count[g] * x[g]` (all copies of
    g summed), and by self-adjointness the owned gradient is `count[g] * S_w[g]`,
    where `S_w[g]` sums `w` over all copies of g on all ranks.
    """
    hg = np.asarray(plan.halo_global)
    n_pad = np.asarray(plan.n_owned) + np.asarray(plan.n_ghost)
    ids = [hg[d, : n_pad[d]] for d in range(len(n_pad))]
    count = np.bincount(np.concatenate(ids), minlength=len(x_global)).astype(x_global.dtype)
    s_w = np.zeros_like(x_global)
    for d, w in enumerate(w_halo):
        np.add.at(s_w, ids[d], w)
    owned = np.asarray(plan.owned_global)[rank, : int(plan.n_owned[rank])]
    return count[ids[rank], None] * x_global[ids[rank]], count[owned, None] * s_w[owned]


def exchange_stress(plan: Any, rank: int, dev: Any, *, iters: int, features: int, seed: int = 0
                    ) -> dict[str, list[float]]:
    """GatherInputs + ScatterOutputs forward and backward on fresh blocks; max |error| per iteration."""
    import torch

    from nvalchemi_jaxbridge.spec import OpAdapter
    from nvalchemi_jaxbridge.torch import ShardTensor, installed
    from tests.torch import model  # noqa: F401  (registers jbtest ops)

    n_pad = np.asarray(plan.n_owned) + np.asarray(plan.n_ghost)
    oc, hr, n_own = int(plan.owned_capacity), int(plan.halo_rows), int(plan.n_owned[rank])
    shapes = [(oc, features), (hr, features), (n_own, features), (int(n_pad[rank]), features)]
    adapter = OpAdapter(torch.ops.jbtest.twice, gather_inputs=[0], scatter_outputs=[0])
    res: dict[str, list[float]] = {"forward": [], "backward": []}
    junk: list[Any] = []
    for it in range(iters):
        rng = np.random.default_rng(seed + it)
        x_global = rng.normal(size=(plan.n_atoms, features))
        w_halo = [rng.normal(size=(int(n), features)) for n in n_pad]
        want_out, want_grad = exchange_reference(plan, rank, x_global, w_halo)
        x = ShardTensor.from_global(torch.tensor(x_global, device=dev), plan, requires_grad=True)
        with installed(adapter):
            out = torch.ops.jbtest.twice(x, x, scale=1.0)
        junk = _junk(dev, torch.float64, shapes)  # fills the blocks of the temporaries just dropped
        (out.to_local() * torch.tensor(w_halo[rank], device=dev)).sum().backward()
        junk = _junk(dev, torch.float64, shapes)
        got_out, got_grad = out.to_local().detach().cpu().numpy(), _local(x.grad).detach().cpu().numpy()
        res["forward"].append(_max_err(got_out, want_out))
        res["backward"].append(_max_err(got_grad[:n_own], want_grad))
    del junk
    return res


def model_stress(pos: np.ndarray, box: float, world: int, dev: Any, *, iters: int) -> dict[str, list[float]]:
    """Energy and forces of the pair model (tests/torch/model.py), a fresh plan and tensors every iteration."""
    import torch

    from nvalchemi_jaxbridge.layout import HaloPlan
    from nvalchemi_jaxbridge.spec import OpAdapter
    from nvalchemi_jaxbridge.torch import ShardTensor, installed
    from tests.torch import model

    e_ref, f_ref = model.reference(pos, box)
    pair = OpAdapter(torch.ops.jbtest.pair_energy, gather_inputs=[0], scatter_outputs=[0])
    total = OpAdapter(torch.ops.jbtest.system_sum, owned_slice_inputs=[0], all_reduce_outputs=[0])
    res: dict[str, list[float]] = {"energy": [], "forces": []}
    for _ in range(iters):
        plan = HaloPlan.build(pos, np.eye(3) * box, cutoff=model.CUTOFF, n_devices=world)  # new tables upload
        x = ShardTensor.from_global(torch.tensor(pos, device=dev), plan, positions=True, requires_grad=True)
        with installed(pair, total):
            energy = torch.ops.jbtest.system_sum(torch.ops.jbtest.pair_energy(x, x.n_owned, model.CUTOFF))
            energy.backward()
        junk = _junk(dev, torch.float64, [tuple(x.grad.shape), (int(plan.halo_rows), 3)])
        forces = -ShardTensor.from_local(x.grad, plan).full_tensor()
        del junk
        # all_reduce_outputs: each rank seeds its own partial, so the gradient is world * the true one
        res["energy"].append(abs(float(_local(energy).item()) - e_ref) / max(abs(e_ref), 1e-300))
        res["forces"].append(_max_err(forces.detach().cpu().numpy() / world, f_ref))
    return res


def negative_control(dev: Any, *, iters: int, rows: int = 1 << 20, work: int = 4096) -> dict[str, Any]:
    """Import a fresh torch block into a slow JAX program, drop it unordered, refill its memory: corrupted runs.

    The program reads its input only at the end (after a `work` x `work` matmul
    chain), so a block torch reuses at once is overwritten before it is read.
    """
    import jax
    import jax.numpy as jnp
    import torch

    m = jnp.ones((work, work), jnp.float32) / work
    prog = jax.jit(lambda a, m: a + jnp.sum((m @ m @ m)[:1, :1]))  # = a + 1 (up to rounding)
    bad = 0
    for it in range(iters):
        t = torch.full((rows,), float(it), dtype=torch.float32, device=dev)
        with torch.cuda.device(dev):
            a = jax.dlpack.from_dlpack(t)
        out = prog(a, m)
        del t, a  # the unsafe order: nothing keeps torch's memory until the program is done
        junk = torch.full((rows,), float("nan"), dtype=torch.float32, device=dev)
        y = torch.from_dlpack(out)
        bad += int(not torch.allclose(y, torch.full_like(y, it + 1.0), rtol=1e-4, atol=1e-4))
        del junk, y
    return {"iterations": iters, "corrupted": bad}


def _local(t: Any) -> Any:
    """This rank's block of a ShardTensor (host reads of a ShardTensor itself are refused), else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


def _max_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| (inf on a shape mismatch or NaN)."""
    if got.shape != want.shape:
        return float("inf")
    err = np.abs(got - want)
    return float("inf") if np.isnan(err).any() else float(err.max(initial=0.0))


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=pathlib.Path)
    p.add_argument("platform", nargs="?", default="cpu", choices=("cpu", "gpu"))
    p.add_argument("--iters", type=int, default=200, help="iterations per check")
    p.add_argument("--cells", type=int, default=16, help="fcc cells per axis of the exchange system")
    p.add_argument("--features", type=int, default=16)
    a = p.parse_args(argv)

    from nvalchemi_jaxbridge.torch import distributed

    info = distributed.initialize(platform=a.platform, timeout_s=120)
    import jax

    jax.config.update("jax_enable_x64", True)
    import torch

    from nvalchemi_jaxbridge.demo import LJParams, argon_fcc
    from nvalchemi_jaxbridge.layout import HaloPlan
    from tests.torch import model

    dev = torch.device("cuda", info.local_rank) if a.platform == "gpu" else torch.device("cpu")
    rank, world = info.rank, info.world_size
    s = argon_fcc(a.cells)
    plan = HaloPlan.build(s.positions, s.cell, cutoff=LJParams().cutoff, n_devices=world, headroom=1.0)
    res: dict[str, Any] = {"rank": rank, "world": world, "atoms": int(s.n_atoms), "features": a.features,
                           "halo_rows": int(plan.halo_rows), "iters": a.iters, "modes": {}}
    t0 = time.perf_counter()
    t = time.perf_counter()
    ex = exchange_stress(plan, rank, dev, iters=a.iters, features=a.features)
    md = model_stress(model.system(40, 7.0, 3), 7.0, world, dev, iters=max(a.iters // 4, 1))
    res["modes"][MODE] = {"exchange": ex, "model": md, "seconds": time.perf_counter() - t}
    if a.platform == "gpu":
        res["negative_control"] = negative_control(dev, iters=min(a.iters, 50))
    res["seconds"] = time.perf_counter() - t0
    (a.out_dir / f"rank{rank}_stress.json").write_text(json.dumps(res))
    print(f"rank {rank}/{world}: stress done in {res['seconds']:.1f} s", flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
