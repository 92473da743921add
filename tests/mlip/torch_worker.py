"""One rank of the model-level PyTorch front-door checks; run via the launcher.

    python -m nvalchemi_jaxbridge.torch.launch -n 2 tests/mlip/torch_worker.py OUT_DIR [CASES]

CASES is a comma-separated list of `model:structure:exchange[:tiles|:graphs]` (default: `RUNS[world size]`);
":graphs": the stages recorded and replayed by `FakeCapture` (`cuda_graphs=`), then a second geometry on the
same layout, graphed and eager, with the recording counts (GRAPHS_CASE).
Writes OUT_DIR/rank<k>.json with what this rank computed for each case; the
pytest side (tests/mlip/test_torch_door.py) compares it against a single-device
reference. Nothing here asserts results. In the suite it runs inside the shared
front-door job (tests/torch/all_workers.py), so importing this module starts nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

ALL_RUNS = {  # both exchanges, both world sizes; MACE once, on 2 ranks (importing and running it dominates a
    # launch, and 4 ranks share 2 cores in CI; the JAX door runs MACE on 4 and 8 devices)
    # "half:deep_halo:3": each rank's block in 3 tiles, rank 1's owning no atom (mlip/torch_tiles.py)
    2: ["mpnn:triclinic:per_layer", "mpnn:slab:deep_halo", "mace:slab:per_layer", "mpnn:half:deep_halo:3",
        "mpnn:triclinic:per_layer:graphs"],
    4: ["mpnn:half:per_layer", "mpnn:cubic:deep_halo"],
}
HAVE_MACE = importlib.util.find_spec("mace") is not None
RUNS = {w: [c for c in cs if HAVE_MACE or not c.startswith("mace:")] for w, cs in ALL_RUNS.items()}
NO_STRESS_CASE = "mpnn:triclinic:per_layer"  # also run with evaluate(stress=False) and as_tensors=True
DEVICES = "devices"  # key of a case's result: the rank's device, the model's, and each stage input's
GRAPHS_CASE = "mpnn:triclinic:per_layer:graphs"  # its eager twin is NO_STRESS_CASE
MACE_PT = "mace.pt"  # rank 0's copy of the test MACE in OUT_DIR; the pytest side checks it is the reference's


def _share_mace(out_dir: pathlib.Path, rank: int) -> None:
    """Rank 0 builds the test MACE and saves it; the others load that copy (building takes seconds, loading
    a tenth). The file appears whole (a rename), so a rank never reads half of it."""
    from tests.mlip import cases

    path = out_dir / MACE_PT
    if rank == 0:
        import torch

        torch.save(cases.wrapper("mace").model, out_dir / f"{MACE_PT}.part")
        (out_dir / f"{MACE_PT}.part").rename(path)
    else:
        while not path.exists():  # if rank 0 fails meanwhile, the launcher stops this rank
            time.sleep(0.05)
    os.environ[cases.MACE_FILE] = str(path)


def _second_geometry(results: dict, case: str, dm, atoms) -> None:
    """`case:moved` (graphed) and `case:moved_eager`: every atom moved by up to 0.1 Å (within skin/2); and the
    recording counts after both evaluations."""
    import numpy as np

    from nvalchemi_jaxbridge.mlip.torch_model import TorchDistributedMLIP

    pos = atoms.positions + np.random.default_rng(5).uniform(-0.1, 0.1, size=atoms.positions.shape)
    state = dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    eager = TorchDistributedMLIP(dm.wrapper, exchange=dm.exchange, cuda_graphs=False)
    for key, model, st in ((":moved", dm, state), (":moved_eager", eager, None)):
        out = model.evaluate(pos, atoms.numbers, atoms.cell.array, atoms.pbc, state=st)
        results[case + key] = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in out.items()}
    g = dm.stages.graphs
    results[case]["graphs"] = {"captures": g.captures, "replays": g.replays, "off": g.off,
                               "eager_backwards": g.eager_backwards, "stages": dm.wrapper.n_layers}


def main() -> None:
    from nvalchemi_jaxbridge.torch import distributed

    info = distributed.initialize(platform="cpu", timeout_s=60)  # returns the job's if already initialised

    import jax

    jax.config.update("jax_enable_x64", True)

    from nvalchemi_jaxbridge.kernels.cuda_graphs import FakeCapture
    from nvalchemi_jaxbridge.mlip.protocol import MessagePassingWrapper
    from nvalchemi_jaxbridge.mlip.torch_model import TorchDistributedMLIP, model_devices
    from tests.mlip import cases
    from tests.mlip.device_probe import recording, stage_devices

    out_dir = pathlib.Path(sys.argv[1])
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else RUNS[info.world_size]
    if any(c.startswith("mace:") for c in names) and not os.environ.get(cases.MACE_FILE):
        _share_mace(out_dir, info.rank)
    results = {}
    for case in names:
        model_name, structure, exchange, *extra = case.split(":")
        graphs = extra == ["graphs"]
        wrapper = cases.wrapper(model_name)
        if isinstance(wrapper, MessagePassingWrapper):  # the same wrapper, noting where each stage's inputs are
            wrapper = recording(wrapper)
        atoms = cases.structure(structure)
        t0 = time.perf_counter()
        dm = TorchDistributedMLIP(wrapper, exchange=exchange, tiles=int(extra[0]) if extra and not graphs else 1,
                                  cuda_graphs=FakeCapture() if graphs else False)
        out = dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
        results[case] = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in out.items()}
        if hasattr(wrapper, "seen"):
            results[case][DEVICES] = {"rank": str(dm.device), "model": sorted(map(str, model_devices(wrapper))),
                                      "stages": stage_devices(wrapper)}
        if graphs:  # a second geometry on the same layout: replayed, and eagerly for comparison
            _second_geometry(results, case, dm, atoms)
        if case == NO_STRESS_CASE:  # the same evaluation without the strain derivative, and as torch tensors
            out = dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc, stress=False)
            results[case + ":no_stress"] = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in out.items()}
            out = dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc, as_tensors=True)
            results[case + ":as_tensors"] = {
                k: {"type": type(v).__name__, "device": str(getattr(v, "device", "")), "value": v.tolist()}
                for k, v in out.items()}
            bad = atoms.positions.copy()
            bad[7, 0] = float("nan")  # with a state built for the good positions: no prepare to catch it
            state = dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
            try:
                dm.evaluate(bad, atoms.numbers, atoms.cell.array, atoms.pbc, state=state)
                results[case + ":nan"] = {"error": None}
            except ValueError as e:
                results[case + ":nan"] = {"error": f"{type(e).__name__}: {e}"}
        print(f"rank {info.rank}: {case} in {time.perf_counter() - t0:.1f} s", flush=True)
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(results))
    print(f"rank {info.rank}/{info.world_size}: done", flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main()
