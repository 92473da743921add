"""One rank of the multi-process front-door checks; run via the launcher.

    python -m nvalchemi_jaxbridge.torch.launch -n 2 tests/torch/worker.py OUT_DIR [cpu|gpu]

Writes OUT_DIR/rank<k>.json with what this rank computed; the pytest side
(tests/torch/test_multiprocess.py) or scripts/gpu_torch_front_door.py compares
it against independent references. Nothing here asserts results.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
import types

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from nvalchemi_jaxbridge.torch import distributed  # noqa: E402

platform = sys.argv[2] if len(sys.argv) > 2 else "cpu"
info = distributed.initialize(platform=platform, timeout_s=60)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import torch  # noqa: E402

from nvalchemi_jaxbridge.layout import HaloPlan, ShardPlan  # noqa: E402
from nvalchemi_jaxbridge.spec import AllReduceSum, OpAdapter  # noqa: E402
from nvalchemi_jaxbridge.torch import ShardTensor, installed  # noqa: E402
from tests.torch import model  # noqa: E402

DEV = torch.device("cuda", info.local_rank) if platform == "gpu" else torch.device("cpu")
BOX, N, SEED = 7.0, 40, 3


def lst(t: torch.Tensor) -> list:
    """A tensor (a ShardTensor: this rank's block) as nested lists (for JSON)."""
    t = t.to_local() if isinstance(t, ShardTensor) else t
    return t.detach().cpu().tolist()


def model_run(plan: HaloPlan, pos: np.ndarray, replicated: bool) -> dict:
    """Energy and forces of the pair model through the front door."""
    x = ShardTensor.from_global(torch.tensor(pos, device=DEV), plan, positions=True, requires_grad=True)
    out_t = AllReduceSum(replicated_consumer=True) if replicated else None
    pair = OpAdapter(torch.ops.jbtest.pair_energy, gather_inputs=[0], scatter_outputs=[0])
    if replicated:
        total = OpAdapter(torch.ops.jbtest.system_sum, owned_slice_inputs=[0], output_transforms={0: out_t})
    else:
        total = OpAdapter(torch.ops.jbtest.system_sum, owned_slice_inputs=[0], all_reduce_outputs=[0])
    with installed(pair, total):
        e_atoms = torch.ops.jbtest.pair_energy(x, x.n_owned, model.CUTOFF)
        energy = torch.ops.jbtest.system_sum(e_atoms)
        energy.backward()
    forces = -ShardTensor.from_local(x.grad, plan).full_tensor()
    return {"energy": float(lst(energy)[0]), "forces": lst(forces), "layout_e_atoms": e_atoms.layout,
            "layout_energy": energy.layout}


def golden_plan() -> types.SimpleNamespace:
    """The semantics reference's 2-rank setup: r0 owns g0..g2 + ghost g3; r1 owns g3..g5 + ghosts g1, g2."""
    oc, gc = 3, 3
    hr = oc + gc
    return types.SimpleNamespace(
        n_devices=2, n_atoms=6, owned_capacity=oc, ghost_capacity=gc, halo_rows=hr,
        offsets=(1,), pair_capacities=(2,),
        send_idx=(np.array([[1, 2], [0, oc]]),), recv_slot=(np.array([[3, hr], [3, 4]]),),
        halo_offset=np.zeros((2, hr, 3)), owned_offset=np.zeros((2, oc, 3)),
        owned_mask=np.ones((2, oc), bool), halo_owned_mask=np.arange(hr)[None, :] < np.array([[3], [3]]),
        n_owned=np.array([3, 3]), n_ghost=np.array([1, 2]),
        owned_global=np.array([[0, 1, 2], [3, 4, 5]]),
    )


def golden(rank: int) -> dict:
    """The golden 2-rank vectors through the front door."""
    plan = golden_plan()
    g = np.arange(6, dtype=np.float64)
    res: dict = {}
    echo = OpAdapter(torch.ops.jbtest.twice, gather_inputs=[0])
    x = ShardTensor.from_global(torch.tensor(10 * g + 1, device=DEV), plan, requires_grad=True)
    with installed(echo):
        seen = torch.ops.jbtest.twice(x, x, scale=1.0)
        res["forward"] = lst(seen)
        seen.to_local().sum().backward()  # every halo row, ghosts included: probes the adjoint
    res["reverse_ones"] = lst(x.grad)
    x.grad = None
    with installed(echo):
        (2 * torch.ops.jbtest.twice(x, x, scale=1.0)).to_local().sum().backward()
    res["grad_sum_2out"] = lst(x.grad)

    n_pad = 3 + [1, 2][rank]
    scat = OpAdapter(torch.ops.jbtest.twice, scatter_outputs=[0])
    ones = ShardTensor.from_local(torch.ones(n_pad, dtype=torch.float64, device=DEV), plan, layout="halo",
                                  requires_grad=True)
    with installed(scat):
        out = torch.ops.jbtest.twice(ones, ones)
        res["scatter"] = lst(out)
        w = torch.arange(1, n_pad + 1, dtype=torch.float64, device=DEV)
        (w * out.to_local()).sum().backward()
        res["scatter_adjoint"] = lst(ones.grad)
        plus1 = ShardTensor.from_local(torch.ones(n_pad + 1, dtype=torch.float64, device=DEV), plan,
                                       layout="halo")
        res["scatter_plus1"] = lst(torch.ops.jbtest.twice(plus1, plus1))

    start = [1.0, 11.0][rank]
    leaf_vals = torch.arange(start, start + n_pad, dtype=torch.float64, device=DEV)[:, None]
    for flag in (False, True):
        leaf = ShardTensor.from_local(leaf_vals.clone(), plan, layout="halo", requires_grad=True)
        ad = OpAdapter(torch.ops.jbtest.split_sum, owned_slice_inputs=[0],
                       output_transforms={1: AllReduceSum(replicated_consumer=flag)})
        with installed(ad):
            o0, o1 = torch.ops.jbtest.split_sum(leaf)
            o1.sum().backward()
        key = "replicated" if flag else "symmetric"
        res[f"allreduce_{key}_out1"] = lst(o1)
        res[f"allreduce_{key}_out0_shape"] = list(o0.shape)
        res[f"allreduce_{key}_out1_layout"] = o1.layout
        res[f"allreduce_{key}_grad"] = lst(leaf.grad[:, 0])

    splan = ShardPlan.from_assignment(np.array([0, 0, 0, 1, 1, 1]), n_devices=2)
    local = torch.tensor([10 * (3 * rank + i) + 1.0 for i in range(3)] + [-1.0], dtype=torch.float64, device=DEV)
    xs = ShardTensor.from_local(local, splan, requires_grad=True)
    full = OpAdapter(torch.ops.jbtest.twice, gather_inputs_full=[0], slice_outputs_owned=[0])
    with installed(full):
        y = torch.ops.jbtest.twice(xs, xs)
        y.to_local().sum().backward()  # the pad row too
    res["shard_out"] = lst(y)
    res["shard_grad"] = lst(xs.grad)
    return res


def main() -> None:
    out_dir = pathlib.Path(sys.argv[1])
    rank, world = info.rank, info.world_size
    t0 = time.perf_counter()
    pos = model.system(N, BOX, SEED)
    plan = HaloPlan.build(pos, np.eye(3) * BOX, cutoff=model.CUTOFF, n_devices=world)
    res: dict = {"rank": rank, "world": world, "n_owned": int(plan.n_owned[rank]),
                 "n_ghost": int(plan.n_ghost[rank])}
    res["replicated"] = model_run(plan, pos, replicated=True)
    res["symmetric"] = model_run(plan, pos, replicated=False)
    if world == 2:
        res["golden"] = golden(rank)
    res["seconds"] = time.perf_counter() - t0
    (out_dir / f"rank{rank}.json").write_text(json.dumps(res))
    print(f"rank {rank}/{world}: done in {res['seconds']:.1f} s", flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main()
