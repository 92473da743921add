"""One rank of the ML-IAP checks of the PyTorch front door; run via the launcher (or the shared job).

    python -m nvalchemi_jaxbridge.torch.launch -n 2 tests/mlip/mliap_worker.py OUT_DIR

Writes OUT_DIR/rank<k>.json with what this rank computed for each case of `RUNS[world size]`
(`model:structure`); tests/mlip/test_mliap_torch.py compares them with references that share no code
with the door. Nothing here asserts results.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

HAVE_MACE = importlib.util.find_spec("mace") is not None
ALL_RUNS = {
    2: ["lj:cubic", "lj:slab", "mp:triclinic", "mp:slab", "mace:cubic", "mace:slab"],
    4: ["lj:triclinic", "mp:cubic", "mp:half", "mace:triclinic"],
}
RUNS = {w: [c for c in cs if HAVE_MACE or not c.startswith("mace:")] for w, cs in ALL_RUNS.items()}


def model(name: str):
    """The ML-IAP object of a case (seeded: every rank builds the same)."""
    from nvalchemi_jaxbridge.demo.mliap_models import MLIAPLennardJones, MLIAPMessagePassing

    if name == "lj":
        return MLIAPLennardJones()
    if name == "mp":
        return MLIAPMessagePassing()
    from mace.calculators.lammps_mliap_mace import LAMMPS_MLIAP_MACE

    from tests.mlip import cases

    return LAMMPS_MLIAP_MACE(cases.wrapper("mace").model)


def structure(name: str):
    """32 rattled fcc Cu/Au atoms (cubic, sheared, a slab), or atoms in half of a 108-site box (empty ranks)."""
    from tests.mlip._reference import alloy

    if name == "half":
        return alloy(reps=(3, 3, 3), half_empty=True)
    return alloy(reps=(2, 2, 2), triclinic=name == "triclinic", slab=name == "slab")


def main() -> None:
    from nvalchemi_jaxbridge.torch import distributed

    info = distributed.initialize(platform="cpu", timeout_s=60)

    import jax

    jax.config.update("jax_enable_x64", True)

    from nvalchemi_jaxbridge.mlip.torch_model import TorchDistributedMLIP

    out_dir = pathlib.Path(sys.argv[1])
    results = {}
    for case in RUNS[info.world_size]:
        name, shape = case.split(":")
        atoms = structure(shape)
        t0 = time.perf_counter()
        dm = TorchDistributedMLIP(model(name))
        out = dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
        results[case] = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in out.items()}
        results[case]["driver"] = type(dm).__name__
        print(f"rank {info.rank}: {case} in {time.perf_counter() - t0:.1f} s", flush=True)
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(results))
    distributed.shutdown()


if __name__ == "__main__":
    main()
