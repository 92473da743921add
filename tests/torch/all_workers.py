"""Every multi-process worker of the PyTorch front door in one job: one start and one jax.distributed per rank.

    python -m nvalchemi_jaxbridge.torch.launch -n 2 tests/torch/all_workers.py OUT_DIR [cpu|gpu]

Runs tests/torch/worker.py, exchange_worker.py, on 2 ranks meaning_worker.py, on the CPU the model level's
tests/mlip/torch_worker.py, mliap_worker.py and agree_worker.py (their cases for this world size) and, under real torchrun, torchrun_worker.py
in turn, each writing its JSON into OUT_DIR/<name>/. Importing and starting torch, JAX and gloo cost most of
a small launch (about 6 CPU-s a rank), and the CI machine has 2 cores, so the suite pays for them once per
world size (tests/_launch.py: front_door_run; torchrun starts the 2-process job).
"""

from __future__ import annotations

import importlib
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from nvalchemi_jaxbridge.torch import distributed  # noqa: E402

out, platform = pathlib.Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cpu"
info = distributed.initialize(platform=platform, timeout_s=60)
WORKERS = {  # output folder: (module, its arguments after OUT_DIR)
    "worker": ("tests.torch.worker", [platform]),
    "exchange_worker": ("tests.torch.exchange_worker", [platform]),
}
if platform == "cpu":  # the CPU-only workers
    if info.world_size == 2:
        WORKERS["meaning_worker"] = ("tests.torch.meaning_worker", [])
    WORKERS["mlip"] = ("tests.mlip.torch_worker", [])
    WORKERS["mliap"] = ("tests.mlip.mliap_worker", [])
    WORKERS["agree"] = ("tests.mlip.agree_worker", [])
if "TORCHELASTIC_RUN_ID" in os.environ:  # started by real torchrun: its checks (tests/torch/test_torchrun.py)
    WORKERS["torchrun"] = ("tests.torch.torchrun_worker", ["lj"])

shutdown = distributed.shutdown
distributed.shutdown = lambda: None  # each worker's main() ends with it; this job leaves once, at the end
for name, (module, args) in WORKERS.items():
    (out / name).mkdir(exist_ok=True)
    sys.argv = [sys.argv[0], str(out / name), *args]  # what the worker reads at import and in main()
    importlib.import_module(module).main()
shutdown()
if info.world_size > 2:
    # All is written and every rank has left jax.distributed: skip the interpreter's teardown of torch and
    # JAX (about 2 CPU-s a rank on 2 busy cores). The 2-rank job still exits the normal way, so a crash in
    # that teardown still fails the suite.
    sys.stdout.flush()
    os._exit(0)
