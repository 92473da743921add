"""Multi-process parity and stress of the torch front door on GPUs (NCCL), one process per GPU.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python scripts/gpu_torch_front_door.py [-n 2] [--stress-iters 200]

1. Parity: runs tests/torch/worker.py through the launcher on N processes
   (process k drives GPU k) and checks energies and forces against the numpy
   reference and, for N == 2, the golden 2-rank vectors; then
   tests/torch/exchange_worker.py (`refresh_halo` / `fold_halo`, values and
   adjoints against references from the plan's ids).
2. Stress (the DLPack memory-ordering race): runs tests/torch/stress.py on N
   processes. Every iteration uses fresh input tensors and refills freed memory
   with NaN right after each transform; GatherInputs + ScatterOutputs forward
   and backward on a large fcc block, and the pair model with a fresh plan per
   iteration, are compared with closed forms / the numpy reference, on the
   front door's stream-ordered path (the old host-sync mode was removed from the
   library; its results are in benchmarks/RESULTS.md). A negative control (the
   unsafe order, done by hand with JAX and torch, no library switch) says
   whether this machine shows the race.

Prints PASS or FAIL and exits 0 / 1. Needs no pip index: jax (CUDA), torch and
numpy only. `--platform cpu` is a dry run of the same checks on CPU processes.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import sys
import tempfile
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EXCHANGE_TOL = 1e-10  # float64 sums of a few copies; a race gives NaN or O(1) errors
ENERGY_RTOL, FORCE_TOL = 1e-12, 1e-8


def _launch(args: list[str], n: int, timeout: float, platform: str) -> tuple[int, str]:
    """Run a script on `n` processes with the package's launcher; (exit code, log tail)."""
    from nvalchemi_jaxbridge.torch.launch import launch

    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.pop("JAX_PLATFORMS", None)
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env.pop("XLA_FLAGS", None)
    log = io.StringIO()
    code = launch(args, n, timeout_s=timeout, env=env, out=log)
    return code, log.getvalue()[-8000:]


def _stress_checks(ranks: list[dict]) -> list[tuple[str, object]]:
    """One check per (mode, quantity) over all ranks, plus informational lines."""
    checks = []
    for mode in ranks[0]["modes"]:
        for part, key, tol in (("exchange", "forward", EXCHANGE_TOL), ("exchange", "backward", EXCHANGE_TOL),
                               ("model", "energy", ENERGY_RTOL), ("model", "forces", FORCE_TOL)):
            errs = [(r["rank"], i, e) for r in ranks for i, e in enumerate(r["modes"][mode][part][key])]

            def check(errs=errs, tol=tol) -> None:
                bad = [(rk, i, e) for rk, i, e in errs if not e <= tol]
                if bad:
                    raise AssertionError(f"{len(bad)}/{len(errs)} (rank, iteration, error) over {tol:g}; "
                                         f"first: {bad[:5]}")

            n_it = len(ranks[0]["modes"][mode][part][key])
            worst = max(e for _, _, e in errs)
            checks.append((f"stress [{mode}] {part} {key}: {n_it} iterations x {len(ranks)} ranks, "
                           f"worst error {worst:.1e} (limit {tol:g})", check))
    return checks


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--nprocs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=420.0)
    p.add_argument("--platform", choices=("gpu", "cpu"), default="gpu", help="cpu: dry run on CPU processes")
    p.add_argument("--stress-iters", type=int, default=200, help="iterations per stress check (0: skip)")
    p.add_argument("--cells", type=int, default=16, help="fcc cells per axis of the stress exchange system")
    a = p.parse_args()

    from tests.torch import model
    from tests.torch import test_multiprocess as t

    checks: list[tuple[str, object]] = []
    failed = launch_failures = 0
    with tempfile.TemporaryDirectory() as out_dir:
        code, log = _launch([str(ROOT / "tests/torch/worker.py"), out_dir, a.platform], a.nprocs, a.timeout,
                            a.platform)
        print(log)
        if code != 0:
            print(f"FAIL parity: the {a.nprocs}-process {a.platform} run exited with {code}")
            launch_failures += 1
        else:
            ranks = [json.loads((pathlib.Path(out_dir) / f"rank{r}.json").read_text()) for r in range(a.nprocs)]
            checks += [("energy and forces vs numpy reference",
                        lambda: t._check_model(ranks, model.reference(model.system(40, 7.0, 3), 7.0)))]
            if a.nprocs == 2:
                checks += [(f.__name__, lambda f=f: f(ranks)) for f in (
                    t.test_golden_gather_inputs_forward_and_reverse, t.test_golden_scatter_outputs_value_and_adjoint,
                    t.test_golden_all_reduce_sum_both_adjoints, t.test_golden_gather_full_and_slice_outputs_owned)]
        code, log = _launch([str(ROOT / "tests/torch/exchange_worker.py"), out_dir, a.platform], a.nprocs,
                            a.timeout, a.platform)
        print(log)
        if code != 0:
            print(f"FAIL exchanges: the {a.nprocs}-process {a.platform} run exited with {code}")
            launch_failures += 1
        else:
            ex = [json.loads((pathlib.Path(out_dir) / f"rank{r}_exchange.json").read_text()) for r in range(a.nprocs)]
            exchange = [t.test_refresh_halo_puts_owner_values_on_ghosts_and_its_adjoint_sums_into_owners,
                        t.test_fold_halo_gives_every_copy_the_total_and_is_self_adjoint,
                        t.test_switched_off_exchanges_are_the_identity]
            if a.nprocs > 1:  # rows spread over ranks: meaningful from two processes
                exchange.append(t.test_graph_parallel_refresh_gathers_all_rows_and_reduce_scatters_back)
            checks += [(f.__name__, lambda f=f: f(ex)) for f in exchange]
        if a.stress_iters > 0:
            code, log = _launch([str(ROOT / "tests/torch/stress.py"), out_dir, a.platform, "--iters",
                                 str(a.stress_iters), "--cells", str(a.cells)], a.nprocs, a.timeout, a.platform)
            print(log)
            if code != 0:
                print(f"FAIL stress: the {a.nprocs}-process {a.platform} run exited with {code}")
                launch_failures += 1
            else:
                stress = [json.loads((pathlib.Path(out_dir) / f"rank{r}_stress.json").read_text())
                          for r in range(a.nprocs)]
                s0 = stress[0]
                print(f"stress: {s0['atoms']} atoms, halo_rows {s0['halo_rows']}, {s0['features']} float64 "
                      f"features, {s0['iters']} iterations per mode; seconds per mode "
                      + ", ".join(f"{m} {v['seconds']:.1f}" for m, v in s0["modes"].items()))
                checks += _stress_checks(stress)
                for r in stress:
                    nc = r.get("negative_control")
                    if nc is not None:
                        seen = "the race is visible here, so the stress can see it" if nc["corrupted"] else (
                            "this machine did not show the race in the control; the stress's power is unproven")
                        print(f"INFO rank {r['rank']} negative control (unordered release, by hand): "
                              f"{nc['corrupted']}/{nc['iterations']} runs corrupted: {seen}")
    for name, check in checks:
        try:
            check()
            print(f"ok   {name}")
        except Exception:  # report every check, then fail once
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()}")
    ok = not failed and not launch_failures
    print(f"{'PASS' if ok else 'FAIL'}: torch front door on {a.nprocs} {a.platform.upper()} process(es), "
          f"{len(checks) - failed}/{len(checks)} checks passed, {launch_failures} launch(es) failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
