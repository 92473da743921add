"""One rank of the multi-process `refresh_halo` / `fold_halo` checks; run via the launcher.

    python -m nvalchemi_jaxbridge.torch.launch -n 2 tests/torch/exchange_worker.py OUT_DIR [cpu|gpu]

Writes OUT_DIR/rank<k>_exchange.json with this rank's inputs and what it
computed (outputs, gradients, local inner products); the pytest side
(tests/torch/test_exchange_multiprocess.py) compares them with references built
from the plan's ids. Nothing here asserts results.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from nvalchemi_jaxbridge.torch import distributed  # noqa: E402

platform = sys.argv[2] if len(sys.argv) > 2 else "cpu"
info = distributed.initialize(platform=platform, timeout_s=60)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import torch  # noqa: E402

from nvalchemi_jaxbridge.layout import HaloPlan, ShardPlan  # noqa: E402
from nvalchemi_jaxbridge.spec.policies import (  # noqa: E402
    GraphParallelPolicy,
    HaloStoragePolicy,
    RefreshOnlyHaloPolicy,
)
from nvalchemi_jaxbridge.torch import fold_halo, refresh_halo  # noqa: E402
from tests.torch import model  # noqa: E402

DEV = torch.device("cuda", info.local_rank) if platform == "gpu" else torch.device("cpu")
BOX, N, SEED, FEAT = 7.0, 40, 3, 2


def lst(t: torch.Tensor) -> list:
    """A tensor as nested lists (for JSON)."""
    return t.detach().cpu().tolist()


def tensor(a: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float64, device=DEV, requires_grad=grad)


def main() -> None:
    out_dir = pathlib.Path(sys.argv[1])
    rank, world = info.rank, info.world_size
    plan = HaloPlan.build(model.system(N, BOX, SEED), np.eye(3) * BOX, cutoff=model.CUTOFF, n_devices=world)
    n_own, n_gh = int(plan.n_owned[rank]), int(plan.n_ghost[rank])
    x_global = np.random.default_rng(SEED).normal(size=(N, FEAT))         # the same on every rank
    rng = np.random.default_rng(100 + rank)
    owned = np.asarray(plan.owned_global)[rank, :n_own]
    block = np.concatenate([x_global[owned], rng.normal(size=(n_gh, FEAT))])  # stale junk on ghost rows
    w, y = rng.normal(size=(n_own + n_gh, FEAT)), rng.normal(size=(n_own + n_gh, FEAT))
    res: dict = {"rank": rank, "world": world, "block": block.tolist(), "w": w.tolist(), "y": y.tolist()}

    b = tensor(block, grad=True)
    out = refresh_halo(plan, b)
    dot = (out * tensor(w)).sum()
    dot.backward()
    res["refresh"] = {"out": lst(out), "grad": lst(b.grad), "dot_w_Rx": float(dot), "dot_RTw_x": float((b.grad * b).sum())}

    yt = tensor(y, grad=True)
    out = fold_halo(plan, yt)
    dot = (out * tensor(w)).sum()
    dot.backward()
    res["fold"] = {"out": lst(out), "grad": lst(yt.grad), "dot_w_Fy": float(dot),
                   "dot_FTw_y": float((yt.grad * yt).sum())}

    bt = tensor(block)
    res["identity"] = {
        "refresh_only_fold": bool(fold_halo(plan, bt, RefreshOnlyHaloPolicy()) is bt),
        "local_gather_refresh": bool(refresh_halo(plan, bt, HaloStoragePolicy(gather_mode="local")) is bt),
        "local_scatter_fold": bool(fold_halo(plan, bt, HaloStoragePolicy(scatter_mode="local")) is bt),
        "refresh_only_refresh_equal": bool(torch.equal(refresh_halo(plan, bt, RefreshOnlyHaloPolicy()),
                                                       refresh_halo(plan, bt))),
    }

    splan = ShardPlan.contiguous(N, world)
    mine = np.asarray(splan.owned_global)[rank, : int(splan.n_owned[rank])]
    local = tensor(np.concatenate([x_global[mine], [[-1.0 - rank] * FEAT]]), grad=True)   # owned rows, pad row
    w2 = rng.normal(size=(N + 1, FEAT))
    full = refresh_halo(splan, local, GraphParallelPolicy())
    (full * tensor(w2)).sum().backward()
    res["graph_parallel"] = {"owned_ids": mine.tolist(), "w": w2.tolist(), "out": lst(full), "grad": lst(local.grad)}

    (out_dir / f"rank{rank}_exchange.json").write_text(json.dumps(res))
    print(f"rank {rank}/{world}: exchange checks done", flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main()
