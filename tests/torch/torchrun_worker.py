"""One rank of tests/torch/test_torchrun.py: started by the project's launcher, or by real torchrun (in the
suite, inside the front door's shared 2-process job: tests/torch/all_workers.py).

    python -m nvalchemi_jaxbridge.torch.launch -n 2 tests/torch/torchrun_worker.py OUT_DIR [lj]
    torchrun --standalone --nproc-per-node 2 tests/torch/torchrun_worker.py OUT_DIR [lj]

`initialize()` reads the launcher's variables; the rank all-gathers per-rank data
and, with `lj`, runs Lennard-Jones on a small argon box through the JAX front
door (one CPU device per process). Writes OUT_DIR/rank<k>.json; asserts nothing.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: the user's import
    from nvalchemi_jaxbridge.torch import distributed
else:  # the launcher's start needs no torch: load the module alone (the package imports torch, ~4 s CPU)
    import importlib.util

    _spec = importlib.util.spec_from_file_location("jb_distributed", ROOT / "nvalchemi_jaxbridge/torch/distributed.py")
    distributed = sys.modules["jb_distributed"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(distributed)

CELLS, CUTOFF = 2, 5.0  # 32 atoms, box 10.52 Å > 2 * cutoff


def lj_front_door() -> dict:
    """Energy and forces of argon through compile(...).call on a mesh of both processes' devices."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from nvalchemi_jaxbridge import DistributionSpec, HaloPlan, HaloStoragePolicy, OpAdapter
    from nvalchemi_jaxbridge.demo import argon_fcc, jax_potentials
    from nvalchemi_jaxbridge.demo.params import LJParams
    from nvalchemi_jaxbridge.lower import compile, make_mesh

    atoms = argon_fcc(CELLS)
    rng = np.random.default_rng(7)  # off the lattice, where forces are not zero by symmetry
    pos = atoms.positions + 0.1 * rng.standard_normal(atoms.positions.shape)
    eps, sigma = LJParams().epsilon, LJParams().sigma
    lj = OpAdapter(jax_potentials.lj_energy_forces, gather_inputs=[0], all_reduce_outputs=[0],
                   scatter_outputs=[1])
    mesh = make_mesh(jax.device_count())
    plan = HaloPlan.build(pos, atoms.cell, cutoff=CUTOFF, n_devices=mesh.size)
    program = compile(DistributionSpec(policy=HaloStoragePolicy(), adapters=(lj,)), mesh, plan,
                      positions={lj: [0]})
    x, mask = program.owned(pos, positions=True), program.halo_owned_mask()
    energy, forces_halo = program.call(lj, x, mask, eps, sigma, CUTOFF)  # ghost rows folded into owners
    t = program.tables
    halo = np.asarray(multihost_utils.process_allgather(forces_halo, tiled=True))
    forces = program.to_global(halo.reshape(t.n_devices, t.halo_rows, 3)[:, : t.owned_capacity].reshape(-1, 3))
    return {"positions": pos.tolist(), "energy": float(np.asarray(energy.addressable_data(0))),
            "forces": forces.tolist(), "n_devices": mesh.size}


def main() -> None:
    info = distributed.initialize(timeout_s=60)  # in the shared job: the job's, already initialised

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    jax.config.update("jax_enable_x64", True)

    mine = np.arange(3.0) + 10.0 * info.rank  # per-rank data
    result = {
        "rank": info.rank, "world": info.world_size, "local_rank": info.local_rank, "source": info.source,
        "coordinator": info.coordinator_address, "master_port": os.environ.get("MASTER_PORT"),
        "torchelastic": "TORCHELASTIC_RUN_ID" in os.environ,  # started by real torchrun
        "process_count": jax.process_count(), "devices": jax.device_count(),
        "gathered": np.asarray(multihost_utils.process_allgather(mine)).tolist(),
    }
    if "lj" in sys.argv[2:]:
        result["lj"] = lj_front_door()
    out = pathlib.Path(sys.argv[1]) / f"rank{info.rank}.json"
    out.write_text(json.dumps(result))
    distributed.shutdown()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's teardown of torch and jax (seconds on a busy machine); all is written
