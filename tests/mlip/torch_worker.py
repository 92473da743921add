"""One rank of the model-level PyTorch front-door checks; run via the launcher.

    python -m nvalchemi_jaxbridge.torch.launch -n 2 tests/mlip/torch_worker.py OUT_DIR CASES

CASES is a comma-separated list of `model:structure:exchange` (see `CASES` below).
Writes OUT_DIR/rank<k>.json with what this rank computed for each case; the
pytest side (tests/mlip/test_torch_door.py) compares it against a single-device
reference. Nothing here asserts results.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from nvalchemi_jaxbridge.torch import distributed  # noqa: E402

info = distributed.initialize(platform="cpu", timeout_s=60)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

from nvalchemi_jaxbridge.mlip.torch_model import TorchDistributedMLIP  # noqa: E402
from tests.mlip import cases  # noqa: E402


def main() -> None:
    out_dir = pathlib.Path(sys.argv[1])
    results = {}
    for case in sys.argv[2].split(","):
        model_name, structure, exchange = case.split(":")
        wrapper = cases.wrapper(model_name)
        atoms = cases.structure(structure)
        t0 = time.perf_counter()
        dm = TorchDistributedMLIP(wrapper, exchange=exchange)
        out = dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
        results[case] = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in out.items()}
        print(f"rank {info.rank}: {case} in {time.perf_counter() - t0:.1f} s", flush=True)
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(results))
    print(f"rank {info.rank}/{info.world_size}: done", flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main()
