"""ML-IAP unified models on a GPU, through both front doors, against the model's own forward on that GPU.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m nvalchemi_jaxbridge.torch.launch -n 1 \\
        scripts/gpu_mliap.py [--cpu] [--reps 4]

On rattled fcc Cu/Au, for MACE's own `LAMMPS_MLIAP_MACE` object (random MACE, 2 layers, r_max 5 Å,
max_ell 3, float64 and float32) and the project's `MLIAPMessagePassing` (float64):

1. the JAX front door (`DistributedMLIP(obj, n_devices=1)`, one program, the model's exchanges cut into it)
   and the PyTorch front door (`TorchDistributedMLIP(obj)`, this rank's block) give the energy, forces,
   stress and per-atom energies of the model's own forward (MACE's `forward` with its own neighbour list, on
   the same GPU; the message-passing model's `reference`);
2. the model ran on the GPU: MACE's object settles its device from the data it is given (`device` attribute),
   which must be the rank's GPU on both doors (a Kokkos-flavoured data object on a GPU block).

Prints PASS/FAIL lines, a timing line per case (median of warm evaluations), and PASS / FAIL at the end.
`--cpu` (or no GPU) is a dry run of the same checks on the CPU.
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

TOL = {"float64": 1e-9, "float32": 5e-4}  # largest error relative to the largest value, per quantity
KEYS = ("energy", "forces", "stress", "atomic_energies")


def _compare(got: dict, want: dict, dtype: str) -> str:
    parts, bad = [], []
    for key in KEYS:
        a, b = np.asarray(got[key], np.float64), np.asarray(want[key], np.float64)
        err = float(np.max(np.abs(a - b), initial=0.0)) / max(float(np.max(np.abs(b), initial=0.0)), 1e-300)
        parts.append(f"{key} {err:.1e}")
        if not err <= TOL[dtype]:
            bad.append(f"{key}: relative error {err:.2e} > {TOL[dtype]:g}")
    if bad:
        raise AssertionError("; ".join(bad))
    return ", ".join(parts)


def _median_s(fn, n: int = 5) -> float:
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", action="store_true", help="dry run on the CPU")
    p.add_argument("--reps", type=int, default=4, help="fcc cells per axis (4: 256 atoms)")
    args = p.parse_args(sys.argv[1:])

    from nvalchemi_jaxbridge.torch import distributed

    import torch

    gpu = torch.cuda.is_available() and not args.cpu
    info = distributed.initialize(platform="gpu" if gpu else "cpu", timeout_s=120)
    import jax

    jax.config.update("jax_enable_x64", True)

    from nvalchemi_jaxbridge.demo.mliap_models import MLIAPMessagePassing
    from nvalchemi_jaxbridge.mlip import DistributedMLIP, TorchDistributedMLIP
    from tests.mlip._reference import alloy

    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    print(f"rank {info.rank}/{info.world_size} on {device}; jax {jax.__version__}, torch {torch.__version__}, "
          f"jax devices {jax.devices()}", flush=True)
    atoms = alloy(reps=(args.reps,) * 3)
    passed = failed = 0

    def check(name, fn):
        nonlocal passed, failed
        try:
            detail = fn()
        except Exception as e:
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}", flush=True)
            return
        passed += 1
        print(f"PASS {name}" + (f" ({detail})" if detail else ""), flush=True)

    cases = [("mp", "float64")]
    try:
        import mace.modules  # noqa: F401
        from mace.calculators.lammps_mliap_mace import LAMMPS_MLIAP_MACE

        from nvalchemi_jaxbridge.mlip.mace import mace_input, random_mace
        cases += [("mace", "float64"), ("mace", "float32")]
    except ImportError:
        print("SKIP mace: mace-torch is not installed", flush=True)

    for name, dtype in cases:
        tdtype = getattr(torch, dtype)
        if name == "mp":
            obj = MLIAPMessagePassing(dtype=tdtype)
            want = obj.reference(atoms.positions, atoms.numbers, atoms.cell.array)
            own = None
        else:
            model = random_mace([29, 79], r_max=5.0, num_interactions=2, dtype=tdtype).to(device)
            batch = mace_input(model, atoms, device=device)

            def own(model=model, batch=batch):
                out = model(dict(batch), training=False, compute_force=True, compute_stress=True)
                if gpu:
                    torch.cuda.synchronize()
                return out

            ref = own()
            want = {"energy": float(ref["energy"][0]), "forces": ref["forces"].detach().cpu().numpy(),
                    "stress": ref["stress"][0].detach().cpu().numpy(),
                    "atomic_energies": ref["node_energy"].detach().cpu().numpy()}
            obj = LAMMPS_MLIAP_MACE(copy.deepcopy(model).cpu())
        args_ = (atoms.positions, atoms.numbers, atoms.cell.array)
        jd = DistributedMLIP(copy.deepcopy(obj), n_devices=1)
        td = TorchDistributedMLIP(copy.deepcopy(obj))
        label = f"{name} {dtype} ({len(atoms)} atoms)"
        check(f"jax door {label}", lambda: _compare(jd.evaluate(*args_), want, dtype))
        check(f"torch door {label}", lambda: _compare(td.evaluate(*args_), want, dtype))
        if name == "mace":
            def on_device():
                seen = {"jax door": str(jd.ops.model_for(0).device), "torch door": str(td.model.obj.device)}
                if any(torch.device(v) != device for v in seen.values()):
                    raise AssertionError(f"the model ran on {seen}, not on {device}")
                return ", ".join(f"{k} {v}" for k, v in seen.items())
            check(f"model on the rank's device {label}", on_device)
        state_j = jd.prepare(*args_)
        state_t = td.prepare(*args_)
        t_j = _median_s(lambda: jd.evaluate(*args_, state=state_j))
        t_t = _median_s(lambda: td.evaluate(*args_, state=state_t))
        line = f"TIME {label}: jax door {1e3 * t_j:.1f} ms, torch door {1e3 * t_t:.1f} ms"
        if own is not None:
            line += f", MACE's own forward (E+F+stress, its own neighbour list) {1e3 * _median_s(own):.1f} ms"
        print(line, flush=True)
    print(f"{'PASS' if failed == 0 else 'FAIL'}: {passed} passed, {failed} failed", flush=True)
    distributed.shutdown()
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
