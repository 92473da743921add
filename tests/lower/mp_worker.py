"""One process of the 2-process CPU test: `python -m tests.lower.mp_worker PID NPROC PORT`.

Builds the same small argon system in every process, runs the LJ adapter on a
mesh spanning both processes' devices, and prints a JSON line with the energy,
forces and gradient max-errors against a numpy minimum-image reference.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np


def reference(pos, cell_len, sigma, eps, rc):
    """Dense minimum-image LJ energy and forces (cubic box, rc < L/2), ASE's shift convention."""
    d = pos[:, None, :] - pos[None, :, :]
    d -= cell_len * np.round(d / cell_len)
    r2 = np.sum(d * d, axis=-1)
    np.fill_diagonal(r2, np.inf)
    inside = r2 <= rc * rc
    c6 = np.where(inside, (sigma * sigma / r2) ** 3, 0.0)
    e0 = 4 * eps * ((sigma / rc) ** 12 - (sigma / rc) ** 6)
    energy = 0.5 * np.sum(np.where(inside, 4 * eps * (c6 * c6 - c6) - e0, 0.0))
    du = np.where(inside, -24 * eps * (2 * c6 * c6 - c6) / r2, 0.0)   # (1/r) dphi/dr
    return energy, -np.sum(du[:, :, None] * d, axis=1)        # d points from j to i


def main(pid: int, nproc: int, port: int) -> None:
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                               initialization_timeout=60, heartbeat_timeout_seconds=10,
                               shutdown_timeout_seconds=10)
    from nvalchemi_jaxbridge.layout import HaloPlan
    from nvalchemi_jaxbridge.lower import compile, make_mesh
    from nvalchemi_jaxbridge.spec.adapter import OpAdapter
    from nvalchemi_jaxbridge.spec.policies import HaloStoragePolicy

    from .plans import make_spec
    from .test_lj import EPS, RC, SIGMA, argon, lj_block

    atoms = argon(seed=3, size=4)                                          # 256 atoms, same in every process
    adapter = OpAdapter(lj_block, gather_inputs=[0], scatter_outputs=[0], all_reduce_outputs=[1])
    mesh = make_mesh()                                                     # all 4 devices of both processes
    plan = HaloPlan.build(atoms.positions, atoms.cell.array, cutoff=RC, n_devices=mesh.size)
    cs = compile(make_spec(HaloStoragePolicy(), adapter), mesh, plan, positions={adapter: [0]})
    x, mask, oc = cs.owned(atoms.positions, positions=True), cs.halo_owned_mask(), cs.tables.owned_capacity
    forces, energy = cs.call(adapter, x, mask, oc)
    grad = jax.jit(jax.grad(lambda p, cs, m: cs.call(adapter, p, m, oc)[1]))(x, cs, mask)
    t = cs.tables
    f_owned = cs.to_global(np.asarray(jax.experimental.multihost_utils.process_allgather(forces, tiled=True))
                           .reshape(t.n_devices, t.halo_rows, 3)[:, : t.owned_capacity].reshape(-1, 3))
    e_ref, f_ref = reference(atoms.positions, atoms.cell.array[0, 0], SIGMA, EPS, RC)
    e = float(np.asarray(energy.addressable_data(0)))
    print(json.dumps({
        "pid": pid, "devices": mesh.size, "local": jax.local_device_count(),
        "energy": e, "energy_ref": e_ref,
        "force_err": float(np.abs(f_owned - f_ref).max()), "force_scale": float(np.abs(f_ref).max()),
        "grad_err": float(np.abs(-cs.to_global(grad) - f_ref).max()),
    }), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    import jax.experimental.multihost_utils  # noqa: F401

    main(*(int(a) for a in sys.argv[1:4]))
