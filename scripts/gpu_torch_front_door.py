"""Multi-process parity of the torch front door on GPUs (NCCL), one process per GPU.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python scripts/gpu_torch_front_door.py [-n 2]

Runs tests/torch/worker.py through the launcher with `gpu` on N processes
(process k drives GPU k), then checks energies and forces against the numpy
reference and, for N == 2, the golden 2-rank vectors. Prints PASS or FAIL and
exits 0 / 1. Needs no pip index: jax (CUDA), torch and numpy only.
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--nprocs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=420.0)
    a = p.parse_args()

    from nvalchemi_jaxbridge.torch.launch import launch

    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.pop("JAX_PLATFORMS", None)
    with tempfile.TemporaryDirectory() as out_dir:
        log = io.StringIO()
        code = launch([str(ROOT / "tests/torch/worker.py"), out_dir, "gpu"], a.nprocs, timeout_s=a.timeout,
                      env=env, out=log)
        print(log.getvalue()[-8000:])
        if code != 0:
            print(f"FAIL: the {a.nprocs}-process GPU run exited with {code}")
            return 1
        ranks = [json.loads((pathlib.Path(out_dir) / f"rank{r}.json").read_text()) for r in range(a.nprocs)]

    import numpy as np

    from tests.torch import model
    from tests.torch import test_multiprocess as t

    checks = [("energy and forces vs numpy reference",
               lambda: t._check_model(ranks, model.reference(model.system(40, 7.0, 3), 7.0)))]
    if a.nprocs == 2:
        checks += [(f.__name__, lambda f=f: f(ranks)) for f in (
            t.test_golden_gather_inputs_forward_and_reverse, t.test_golden_scatter_outputs_value_and_adjoint,
            t.test_golden_all_reduce_sum_both_adjoints, t.test_golden_gather_full_and_slice_outputs_owned)]
    failed = 0
    for name, check in checks:
        try:
            check()
            print(f"ok   {name}")
        except Exception:  # report every check, then fail once
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()}")
    del np
    print(f"{'PASS' if not failed else 'FAIL'}: torch front door on {a.nprocs} GPU process(es), "
          f"{len(checks) - failed}/{len(checks)} checks")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
