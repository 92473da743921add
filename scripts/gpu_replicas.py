"""The JAX door's stages on GPUs where the model's weights are not: copies per device (`mlip.replicas`).

    PYTHONPATH=.:/tmp/site python3 scripts/gpu_replicas.py [--models mpnn,mace]

One process, every GPU there is. Per model (the MPNN float64; MACE float32 as in
scripts/gpu_cuda_graphs.py, if mace-torch imports), on a rattled fcc Cu/Au of 1,372 atoms:

(a) weights on the host, stages on the GPUs: `DistributedMLIP(wrapper_on_cpu)` over every GPU against
    `DistributedMLIP(wrapper_on_cuda0, n_devices=1)` (the reference: the weights where the stages run);
    energy and forces within 1e-10 (float64) / 5e-4 (float32) of the largest value;
(b) the same after an in-place change of the host weights (x 1.01, as an optimiser step), the reference
    model changed alike: the copies follow (CUDA graphs on, so replays read the refreshed copies);
(c) with more than one GPU: the weights on cuda:0, stages on every GPU, against (a)'s reference.

Exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from gpu_cuda_graphs import alloy, build_model, rel_err, say  # noqa: E402

TOL = {"float64": 1e-10, "float32": 5e-4}


def check(name: str, dtype: str) -> list[str]:
    import jax
    import torch

    from nvalchemi_jaxbridge.mlip import DistributedMLIP
    from nvalchemi_jaxbridge.mlip.replicas import copy_to
    from nvalchemi_jaxbridge.mlip.torch_device import weights

    fails = []
    atoms = alloy(7)
    args = (atoms.positions, atoms.numbers, np.asarray(atoms.cell), atoms.pbc)
    host, _ = build_model(name, getattr(torch, dtype), "cpu", torchscript=True)
    ref_w = copy_to(host, torch.device("cuda", 0))
    n_gpu = len(jax.devices())

    def compare(label: str, got: dict, want: dict) -> None:
        errs = [rel_err(got[k], want[k]) for k in ("energy", "forces")]
        ok = max(errs) <= TOL[dtype]
        say(f"  {name} {dtype} {label}: dE {errs[0]:.2e}, dF {errs[1]:.2e} -> {'ok' if ok else 'FAIL'}")
        if not ok:
            fails.append(f"{name} {dtype} {label}")

    ref = DistributedMLIP(ref_w, n_devices=1)
    bridge = DistributedMLIP(host, n_devices=n_gpu)
    compare(f"(a) weights on the host, stages on {n_gpu} GPU(s)", bridge.evaluate(*args), ref.evaluate(*args))
    copies = bridge.stages.replicas.copies()
    say(f"    copies made on: {sorted(str(d) for d in copies)}")
    if not copies:
        fails.append(f"{name} {dtype}: no copy made for the GPU")
    with torch.no_grad():
        for t in [*weights(host), *weights(ref_w)]:
            if torch.is_floating_point(t):
                t.mul_(1.01)
    compare("(b) after an in-place change of the host weights", bridge.evaluate(*args), ref.evaluate(*args))
    if n_gpu > 1:
        on0 = copy_to(host, torch.device("cuda", 0))
        compare(f"(c) weights on cuda:0, stages on {n_gpu} GPUs", DistributedMLIP(on0, n_devices=n_gpu).evaluate(*args),
                ref.evaluate(*args))
    else:
        say("  (c) one GPU here: weights on cuda:0 with stages on other GPUs not run")
    return fails


def main() -> int:
    import jax

    jax.config.update("jax_enable_x64", True)  # the MPNN runs in float64
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mpnn,mace")
    opt = p.parse_args()
    cases = [("mpnn", "float64"), ("mace", "float32")]
    fails = []
    for name, dtype in cases:
        if name not in opt.models.split(","):
            continue
        try:
            fails += check(name, dtype)
        except Exception:  # noqa: BLE001 - report and go on to the next case
            traceback.print_exc()
            fails.append(f"{name} {dtype}: error")
    say("replicas: " + ("all checks passed" if not fails else "FAILED: " + "; ".join(fails)))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
