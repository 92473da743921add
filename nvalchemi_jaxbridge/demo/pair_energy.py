"""A torch custom-op pair model run through the PyTorch front door, one process per device.

    python -m nvalchemi_jaxbridge.torch.launch -n 2 -m nvalchemi_jaxbridge.demo.pair_energy --out result.json

Every rank builds the same periodic system and plan, wraps its block of the
positions in a `ShardTensor`, installs two `OpAdapter`s and runs the model
(per-atom energies -> total energy -> backward). Rank 0 writes the total
energy and the forces (global atom order) to `--out` as JSON. Run with `-n 1`
(or plain `python`) for the single-process answer; the notebook
`notebooks/02_pytorch_front_door.ipynb` compares the two.

Importing this file only registers the ops (`jbexample::pair_energy`,
`jbexample::total`) and defines `system()`; nothing runs.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
import torch

# ---- the kernels: ordinary torch custom ops, written for one device ----------------

_lib = torch.library.Library("jbexample", "DEF")
_lib.define("pair_energy(Tensor pos, int n_owned, float cutoff) -> Tensor")
_lib.define("total(Tensor e) -> Tensor")

EPSILON, CUTOFF, BOX, N_ATOMS = 0.5, 2.5, 8.0, 48


def _pair_energy(pos: torch.Tensor, n_owned: int, cutoff: float) -> torch.Tensor:
    """Per-row energy: half the pair energy eps (1 - r^2/rc^2)^3 of each owned row; 0 on ghost rows.

    A pair of two owned rows is counted 1/2 + 1/2 here; a pair of an owned row
    and a ghost row 1/2 here and 1/2 on the ghost's owner. Non-periodic: the
    halo rows already carry the periodic images.
    """
    d = pos[:, None, :] - pos[None, :, :]
    r2 = (d * d).sum(-1)
    u = (1.0 - r2 / (cutoff * cutoff)).clamp(min=0.0)
    not_self = 1.0 - torch.eye(pos.shape[0], dtype=pos.dtype, device=pos.device)
    rows = 0.5 * EPSILON * (u**3 * not_self).sum(1)
    owned = (torch.arange(pos.shape[0], device=pos.device) < n_owned).to(pos.dtype)
    return rows * owned


_lib.impl("pair_energy", _pair_energy, "CompositeImplicitAutograd")
_lib.impl("total", lambda e: e.sum(0, keepdim=True), "CompositeImplicitAutograd")


def system(n: int = N_ATOMS, box: float = BOX, seed: int = 0) -> np.ndarray:
    """`n` random positions in a cubic periodic box, at least 1.0 apart (minimum image)."""
    rng = np.random.default_rng(seed)
    pts: list[np.ndarray] = []
    while len(pts) < n:
        p = rng.uniform(0.0, box, 3)
        if all(np.linalg.norm((p - q) - box * np.round((p - q) / box)) >= 1.0 for q in pts):
            pts.append(p)
    return np.array(pts)


def adapters() -> tuple:
    """The two declarations: gather halo rows into the pair kernel; sum the total over ranks."""
    from nvalchemi_jaxbridge import AllReduceSum, OpAdapter

    pair = OpAdapter(torch.ops.jbexample.pair_energy, gather_inputs=[0])
    # every rank calls backward() on the same total: the adjoint must not sum again
    total = OpAdapter(torch.ops.jbexample.total, owned_slice_inputs=[0],
                      output_transforms={0: AllReduceSum(replicated_consumer=True)})
    return pair, total


def run(pos: np.ndarray, plan: object) -> tuple[float, np.ndarray]:
    """Total energy and forces `(N, 3)` (global order) of this process's share of the job."""
    from nvalchemi_jaxbridge.torch import ShardTensor, installed

    x = ShardTensor.from_global(torch.tensor(pos), plan, positions=True, requires_grad=True)
    with installed(*adapters()):
        e_rows = torch.ops.jbexample.pair_energy(x, x.n_owned, CUTOFF)   # halo rows in, halo rows out
        energy = torch.ops.jbexample.total(e_rows)                       # owned rows in, replicated out
        energy.backward()
    forces = -ShardTensor.from_local(x.grad, plan).full_tensor()         # a collective: every rank calls it
    return float(energy.item()), forces.detach().numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True, help="JSON file rank 0 writes")
    args = parser.parse_args()

    from nvalchemi_jaxbridge.torch import distributed

    info = distributed.initialize(platform="cpu")        # reads RANK / WORLD_SIZE / MASTER_* from the launcher
    import jax

    jax.config.update("jax_enable_x64", True)
    from nvalchemi_jaxbridge.layout import HaloPlan

    pos = system()
    plan = HaloPlan.build(pos, np.eye(3) * BOX, cutoff=CUTOFF, n_devices=info.world_size)
    energy, forces = run(pos, plan)
    if info.rank == 0:
        args.out.write_text(json.dumps({"world_size": info.world_size, "energy": energy,
                                        "forces": forces.tolist(), "n_owned": plan.n_owned.tolist()}))
    print(f"rank {info.rank}/{info.world_size}: energy {energy:.12f}", flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main()
