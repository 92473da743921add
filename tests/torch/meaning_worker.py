"""One rank of the 2-process ShardTensor-meaning checks; run via the launcher.

    python -m nvalchemi_jaxbridge.torch.launch -n 2 tests/torch/meaning_worker.py OUT_DIR

Writes OUT_DIR/rank<k>.json: the routed sums over atoms (values and gradients
on this rank's rows), the message of the refused naive model, and what each dense
pair model of tests/torch/pair_models.py does with the positions' ShardTensor
(owned and halo layouts: raised, with the message, or an energy), plus the
energy of the held-out model on `x.full_tensor()`.
tests/torch/test_meaning_multiprocess.py judges them; nothing here asserts.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from nvalchemi_jaxbridge.torch import distributed  # noqa: E402

info = distributed.initialize(platform="cpu", timeout_s=60)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import torch  # noqa: E402

from nvalchemi_jaxbridge.layout import HaloPlan  # noqa: E402
from nvalchemi_jaxbridge.torch import ShardTensor  # noqa: E402
from nvalchemi_jaxbridge.torch.meaning import ShardTensorMeaningError  # noqa: E402
from tests.torch import model, pair_models  # noqa: E402
from tests.torch.test_meaning import toy_mpnn  # noqa: E402

BOX, N, SEED, N_SYSTEMS = 7.0, 40, 3, 3


def values() -> np.ndarray:
    """The global per-atom values (the test rebuilds them)."""
    return np.random.default_rng(SEED).normal(size=(N, 2))


def local(t: torch.Tensor) -> list:
    """This rank's block (or a replicated value) as nested lists."""
    return t.to_local().detach().tolist()


def main() -> None:
    out_dir, rank = pathlib.Path(sys.argv[1]), info.rank
    pos = model.system(N, BOX, SEED)
    plan = HaloPlan.build(pos, np.eye(3) * BOX, cutoff=model.CUTOFF, n_devices=info.world_size)
    n_pad = int(plan.n_owned[rank] + plan.n_ghost[rank])
    ids = np.asarray(plan.halo_global)[rank, :n_pad]
    res: dict = {"rank": rank, "n_owned": int(plan.n_owned[rank]), "n_ghost": int(plan.n_ghost[rank]),
                 "ids": ids.tolist()}
    batch = torch.tensor(ids % N_SYSTEMS)
    for name, f in {
        "sum": lambda h: h.sum(),
        "sum0": lambda h: h.sum(0),
        "index_add_": lambda h: torch.zeros(N_SYSTEMS, 2, dtype=h.dtype).index_add_(0, batch, h),
        "scatter_add": lambda h: torch.zeros(N_SYSTEMS, 2, dtype=h.dtype).scatter_add(
            0, batch[:, None].expand(-1, 2), h),
        "system_sum": lambda h: h.system_sum(batch, n_systems=N_SYSTEMS),
        "mean0": lambda h: h.mean(0),
    }.items():
        h = ShardTensor.from_global(torch.tensor(values()), plan, layout="halo", requires_grad=True)
        total = f(h)
        total.sum().backward()  # every rank, on the same replicated value
        res[name] = {"value": local(total), "layout": total.layout, "grad": local(h.grad)}
    g = ShardTensor.from_global(torch.tensor(values()), plan, layout="halo").detach().to_local().clone()
    g[int(plan.n_owned[rank]):] = 0.0  # ghost rows that disagree with their owners must not decide
    g = ShardTensor.from_local(g, plan, layout="halo")
    res["all_any"] = {"all": local(g.all()), "any0": local((g == 0).any()), "any_gt1_0": local((g > 1).any(0)),
                      "all_gt_m1_0": local((g > -1).all(0))}
    xp = ShardTensor.from_global(torch.tensor(pos), plan, layout="halo", positions=True)
    xh = ShardTensor.from_global(torch.tensor(values()), plan, layout="halo")
    edges = torch.tensor(np.array([[i, (i + 1) % n_pad] for i in range(n_pad)]).T)
    try:
        toy_mpnn(xp, xh, edges)
        res["naive"] = "no error"
    except ShardTensorMeaningError as e:
        res["naive"] = str(e)
    res["pairs"] = {}
    for layout in ("owned", "halo"):  # the held-out family: every pair of the tensor it is given
        x = ShardTensor.from_global(torch.tensor(pos), plan, layout=layout, positions=True, requires_grad=True)
        for name in pair_models.MODELS:
            res["pairs"][f"{name}:{layout}"] = pair_models.outcome(name, x)
        res["pairs"][f"full_tensor:{layout}"] = {"energy": float(pair_models.DensePairModel()(x.full_tensor()))}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(res))
    distributed.shutdown()


if __name__ == "__main__":
    main()
