"""The model level's PyTorch front door (`TorchDistributedMLIP`) on GPUs: model, block and exchanges on the GPU.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m nvalchemi_jaxbridge.torch.launch -n 1 \\
        scripts/gpu_torch_model_door.py [--cpu] [--reps 5] [--max-ell 3]

Every rank (process k drives GPU k, `initialize()`) builds, on rattled fcc Cu/Au:

- the project's MPNN (float64; per-layer exchange and deep halo),
- a random MACE (`random_mace`, 2 layers, r_max 5 Å) in float32 (per layer) and float64 (per layer, deep halo),

moves it to its device (`TorchDistributedMLIP(..., device=...)`) and checks:

1. every stage input and output (positions, node attributes, edges, shifts, edge and node features) is on the
   rank's device (the wrapper runs as tests/mlip/device_probe.py's `recording`), and so is the model;
2. energy, forces, stress and atomic energies equal the model's own forward on the whole periodic system on the
   same device (`MPNN.forward` on a full neighbour list; MACE's own `forward` with its own neighbour list);
3. they equal the JAX front door's (`DistributedMLIP` on this rank's device alone, in the same process);
4. `evaluate(as_tensors=True)` gives torch tensors on the rank's device, with the same numbers;
5. on a GPU, a model left on the CPU is refused with the error naming both devices;
6. with the deep halo, the same in `--tiles` tiles per rank (`tiles=`) equals the door without tiles, on the device.

Prints one PASS/FAIL line per check (prefixed by the rank under the launcher), a timing line per case (median
of warm evaluations: torch door, JAX door, the model's own forward), and `PASS` / `FAIL` at the end; exits 0 / 1.
`--cpu` (or no GPU) is a dry run of the same checks on CPU processes (gloo between ranks). Needs mace-torch for
the MACE cases (skipped with a line if it is missing).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import statistics
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

# (|dE|/|E|, max |dF| / max |F|, max |d stress| / max |stress|, max |d e_i| / max |e_i|) allowed, by dtype;
# float32: summation order (GPU atomics, blocks vs whole system) moves the last bits
TOL = {"float64": (1e-10, 1e-9, 1e-9, 1e-10), "float32": (2e-5, 2e-4, 5e-4, 2e-5)}
KEYS = ("energy", "forces", "stress", "atomic_energies")


class Checks:
    """PASS/FAIL lines, counted."""

    def __init__(self) -> None:
        self.passed = self.failed = 0

    def run(self, name: str, fn: Any) -> Any:
        try:
            detail = fn()
        except Exception as e:  # report every check, then fail once
            self.failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}", flush=True)
            return None
        self.passed += 1
        print(f"PASS {name}" + (f" ({detail})" if isinstance(detail, str) and detail else ""), flush=True)
        return detail


def _compare(got: dict, want: dict, dtype: str) -> str:
    """Raise if `got` differs from `want` beyond `TOL[dtype]`; the errors as a string."""
    parts, bad = [], []
    for key, tol in zip(KEYS, TOL[dtype]):
        a, b = np.asarray(got[key], np.float64), np.asarray(want[key], np.float64)
        err = float(np.max(np.abs(a - b), initial=0.0)) / max(float(np.max(np.abs(b), initial=0.0)), 1e-300)
        parts.append(f"{key} {err:.1e}")
        if not err <= tol:
            bad.append(f"{key}: relative error {err:.2e} > {tol:g}")
    if bad:
        raise AssertionError("; ".join(bad))
    return ", ".join(parts)


def own_forward(wrapper: Any, atoms: Any, device: Any) -> dict[str, np.ndarray]:
    """The model's own forward on the whole periodic system, on `device` (no bridge code but the neighbour list)."""
    import torch

    from nvalchemi_jaxbridge.app.model_reference import periodic_graph

    model, dtype = wrapper.model, wrapper.dtype
    volume = abs(float(np.linalg.det(atoms.cell.array)))
    if type(wrapper).__name__.endswith("MACEWrapper"):
        from nvalchemi_jaxbridge.mlip.mace import mace_input

        batch = mace_input(model, atoms, device=device)
        out = model(batch, training=False, compute_force=True, compute_stress=True)
        mace_volume = abs(float(torch.linalg.det(batch["cell"].view(3, 3).double())))
        return {"energy": float(out["energy"][0].detach()), "forces": out["forces"].detach().cpu().numpy(),
                "stress": out["stress"][0].detach().cpu().numpy() * mace_volume / volume,
                "atomic_energies": out["node_energy"].detach().cpu().numpy()}
    ei, unit = periodic_graph(atoms.positions, atoms.cell.array, atoms.pbc, wrapper.cutoff)
    pos = torch.tensor(atoms.positions, dtype=dtype, device=device, requires_grad=True)
    eps = torch.zeros((3, 3), dtype=dtype, device=device, requires_grad=True)
    sym = (eps + eps.T) / 2
    cell = torch.tensor(atoms.cell.array, dtype=dtype, device=device)
    shifts = torch.tensor(unit, dtype=dtype, device=device) @ (cell + cell @ sym)
    attrs = torch.tensor(wrapper.node_attrs(atoms.numbers), dtype=dtype, device=device)
    node_e = model(pos + pos @ sym, attrs, torch.as_tensor(ei, device=device), shifts)
    energy = node_e.sum()
    g_pos, g_eps = torch.autograd.grad(energy, (pos, eps))
    return {"energy": float(energy.detach()), "forces": -g_pos.cpu().numpy(), "stress": g_eps.cpu().numpy() / volume,
            "atomic_energies": node_e.detach().cpu().numpy()}


def _median_s(fn: Any, n: int, sync: Any) -> float:
    """Median wall time of `n` calls of `fn` (after the caller's first), each followed by `sync()`."""
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="dry run on CPU processes (also without a GPU)")
    p.add_argument("--reps", type=int, default=5, help="fcc cells per axis (4 atoms each)")
    p.add_argument("--max-ell", type=int, default=3, help="MACE's edge harmonics degree")
    p.add_argument("--repeats", type=int, default=3, help="warm evaluations timed per case (0: no timing)")
    p.add_argument("--cases", default="", help="comma-separated case names to run (default: all)")
    p.add_argument("--tiles", type=int, default=3, help="deep-halo cases: also in this many tiles per rank, "
                   "against the untiled door (0: not)")
    a = p.parse_args()

    from nvalchemi_jaxbridge.torch import distributed

    info = distributed.initialize(platform="cpu" if a.cpu else None, timeout_s=120)

    import jax
    import torch

    jax.config.update("jax_enable_x64", True)

    from nvalchemi_jaxbridge.lower.mesh import make_mesh
    from nvalchemi_jaxbridge.mlip import MPNN, MPNNWrapper
    from nvalchemi_jaxbridge.mlip.jax_model import DistributedMLIP
    from nvalchemi_jaxbridge.mlip.torch_model import TorchDistributedMLIP, model_devices, rank_device
    from tests.mlip._reference import alloy
    from tests.mlip.device_probe import recording, stage_devices

    device = rank_device()
    gpu = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if gpu else (lambda: None)
    print(f"rank {info.rank}/{info.world_size}: device {device} "
          f"({torch.cuda.get_device_name(device) if gpu else 'CPU'}), jax {jax.__version__}, torch "
          f"{torch.__version__}, platform {info.platform}", flush=True)
    checks = Checks()
    if not a.cpu and not gpu:
        print("INFO no GPU here: this is a CPU dry run", flush=True)
    local_mesh = make_mesh(devices=[jax.local_devices()[0]])  # the JAX door on this rank's device alone

    atoms = alloy(reps=(a.reps,) * 3, seed=1)
    print(f"structure: rattled fcc Cu/Au, {len(atoms)} atoms, cell {np.diag(atoms.cell.array).round(2).tolist()} Å",
          flush=True)

    def mpnn() -> Any:
        return MPNNWrapper(MPNN([29, 79], cutoff=4.0))

    def build_mace(dtype: Any) -> Any:
        from nvalchemi_jaxbridge.mlip.mace import MACEWrapper, random_mace

        return MACEWrapper(random_mace([29, 79], r_max=5.0, num_interactions=2, max_ell=a.max_ell, dtype=dtype))

    cases = [("mpnn-float64", mpnn, ("per_layer", "deep_halo")),
             ("mace-float32", lambda: build_mace(torch.float32), ("per_layer",)),
             ("mace-float64", lambda: build_mace(torch.float64), ("per_layer", "deep_halo"))]
    if a.cases:
        cases = [c for c in cases if c[0] in a.cases.split(",")]
    if importlib.util.find_spec("mace") is None:
        print("INFO mace-torch is not installed: the MACE cases are skipped (pip install mace-torch)", flush=True)
        cases = [c for c in cases if not c[0].startswith("mace")]

    for name, build, exchanges in cases:
        wrapper = build()
        dtype = str(wrapper.dtype).removeprefix("torch.")
        if gpu:  # a model left on the CPU is refused, naming both devices
            def refused(wrapper=wrapper) -> str:
                try:
                    TorchDistributedMLIP(wrapper).evaluate(atoms.positions, atoms.numbers, atoms.cell.array)
                except ValueError as e:
                    assert "cpu" in str(e) and str(device) in str(e), str(e)
                    return str(e).split(";")[0]
                raise AssertionError("a CPU model on a GPU rank was not refused")

            checks.run(f"{name}: a CPU model is refused on {device}", refused)
        for exchange in exchanges:
            tag = f"{name} {exchange}"
            probe = recording(wrapper)
            dm = TorchDistributedMLIP(probe, exchange=exchange, device=device)  # moves the model
            state = dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
            run_torch = lambda: dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,  # noqa: E731
                                            state=state)
            got = checks.run(f"{tag}: torch door evaluates", run_torch)
            if got is None:
                continue

            def on_device(probe=probe) -> str:
                seen = stage_devices(probe)
                assert model_devices(probe) == {device}, f"model on {model_devices(probe)}"
                off = {k: v for k, v in seen.items() if v != [str(device)]}
                assert not off, f"stage tensors off {device}: {off}"
                assert {"embed:positions", "interaction:features", "interaction:edge_index",
                        "interaction:shifts", "node_energies:node_attrs"} <= seen.keys(), sorted(seen)
                return f"{len(seen)} stage inputs/outputs, all on {device}"

            checks.run(f"{tag}: model and every stage tensor on {device}", on_device)
            want = own_forward(wrapper, atoms, device)
            checks.run(f"{tag}: torch door == the model's own forward on {device}",
                       lambda: _compare(got, want, dtype))
            jdm = DistributedMLIP(wrapper, mesh=local_mesh, exchange=exchange)
            jstate = jdm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
            run_jax = lambda: jdm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,  # noqa: E731
                                           state=jstate)
            jgot = checks.run(f"{tag}: JAX door evaluates", run_jax)
            if jgot is not None:
                checks.run(f"{tag}: torch door == JAX door (DistributedMLIP on {device})",
                           lambda: _compare(got, jgot, dtype))

            def tensors() -> str:
                out = dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc, state=state,
                                  as_tensors=True)
                for key in (*KEYS, "virial"):
                    v = out[key]
                    assert isinstance(v, torch.Tensor) and v.device == device, f"{key}: {type(v)} on {v.device}"
                host = {k: (out[k].cpu().numpy() if k != "energy" else float(out[k])) for k in KEYS}
                return _compare(host, got, dtype)

            checks.run(f"{tag}: as_tensors=True gives tensors on {device}, same numbers", tensors)
            if exchange == "deep_halo" and a.tiles > 1:
                tiled_probe = recording(wrapper)
                tdm = TorchDistributedMLIP(tiled_probe, exchange=exchange, device=device, tiles=a.tiles)
                tiled = checks.run(f"{tag}: in {a.tiles} tiles per rank, evaluates", lambda: tdm.evaluate(
                    atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc))
                if tiled is not None:
                    checks.run(f"{tag}: {a.tiles} tiles == no tiles on {device}", lambda: _compare(tiled, got, dtype))
                    checks.run(f"{tag}: {a.tiles} tiles: model and every stage tensor on {device}",
                               lambda: on_device(tiled_probe))
            if a.repeats > 0 and jgot is not None:
                native = lambda: own_forward(wrapper, atoms, device)  # noqa: E731
                t_torch = _median_s(run_torch, a.repeats, sync)
                t_jax = _median_s(run_jax, a.repeats, sync)
                t_own = _median_s(native, a.repeats, sync)
                print(f"TIME {tag}: {len(atoms)} atoms, E+F+stress, median of {a.repeats}: torch door "
                      f"{1e3 * t_torch:.1f} ms, JAX door {1e3 * t_jax:.1f} ms, the model's own forward "
                      f"{1e3 * t_own:.1f} ms (its neighbour list on the host included)", flush=True)
    ok = checks.failed == 0
    print(f"{'PASS' if ok else 'FAIL'}: model-level torch door on {info.world_size} {device.type.upper()} "
          f"process(es), {checks.passed}/{checks.passed + checks.failed} checks passed", flush=True)
    distributed.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
