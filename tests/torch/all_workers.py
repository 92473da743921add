"""Every multi-process worker of the PyTorch front door in one job: one start and one jax.distributed per rank.

    python -m nvalchemi_jaxbridge.torch.launch -n 2 tests/torch/all_workers.py OUT_DIR [cpu|gpu]

Runs tests/torch/worker.py, exchange_worker.py and, on 2 ranks, meaning_worker.py in turn, each writing
its JSON into OUT_DIR/<worker name>/. Importing and starting torch, JAX and gloo cost most of a small
launch, and the CI machine has 2 cores, so the suite pays for them once per world size.
"""

from __future__ import annotations

import importlib
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from nvalchemi_jaxbridge.torch import distributed  # noqa: E402

out, platform = pathlib.Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cpu"
info = distributed.initialize(platform=platform, timeout_s=60)
WORKERS = ("worker", "exchange_worker") + (("meaning_worker",) if info.world_size == 2 and platform == "cpu" else ())

shutdown = distributed.shutdown
distributed.shutdown = lambda: None  # each worker's main() ends with it; this job leaves once, at the end
for name in WORKERS:
    (out / name).mkdir(exist_ok=True)
    sys.argv = [sys.argv[0], str(out / name), platform]  # what the worker reads at import and in main()
    importlib.import_module(f"tests.torch.{name}").main()
shutdown()
