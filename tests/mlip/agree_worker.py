"""One rank of the "ranks must agree" checks of the PyTorch front door; runs inside the shared front-door job.

    python -m nvalchemi_jaxbridge.torch.launch -n 2 tests/mlip/agree_worker.py OUT_DIR

Each case of `CASES` gives some ranks a structure (or a state) other than rank 0's; every rank must raise the
same `RankMismatchError` before any exchange, so the job goes on and the next case runs in the same job. Then
every rank evaluates the same structure (the result must be the one-device result) and times the agreement
check alone. Writes OUT_DIR/rank<k>.json; tests/mlip/test_rank_agreement.py judges it. Nothing here asserts.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

STRUCTURE = "small"  # 108 atoms, triclinic
CASES = ("fewer", "swapped", "moved", "cell", "pbc", "state", "two_groups", "mliap_fewer")
TIMED = 20  # agreement checks timed on their own


def _inputs(case: str, rank: int, world: int, atoms) -> tuple:
    """(positions, numbers, cell, pbc) as rank `rank` passes them in `case`: the last rank (and in
    `two_groups` rank 1 too) differs from rank 0."""
    pos, num, cell, pbc = atoms.positions.copy(), atoms.numbers.copy(), atoms.cell.array.copy(), atoms.pbc.copy()
    last = world - 1
    if case in ("fewer", "mliap_fewer") and rank == last or case == "two_groups" and rank == 1 and world > 2:
        return pos[:-1], num[:-1], cell, pbc
    if case == "swapped" and rank == last:
        j = int(np.flatnonzero(num != num[0])[0])  # the first atom of the other species
        num[[0, j]] = num[[j, 0]]
    if case in ("moved", "two_groups") and rank == last:
        pos[5, 2] += 1e-9  # a nanometre's millionth: the layout may not change, the sum would
    if case == "cell" and rank == last:
        cell = cell * (1 + 1e-12)
    if case == "pbc" and rank == last:
        pbc = np.array([True, True, False])
    return pos, num, cell, pbc


def main() -> None:
    from nvalchemi_jaxbridge.torch import distributed

    info = distributed.initialize(platform="cpu", timeout_s=60)

    import jax

    jax.config.update("jax_enable_x64", True)

    from nvalchemi_jaxbridge.demo.mliap_models import MLIAPLennardJones
    from nvalchemi_jaxbridge.mlip.torch_model import TorchDistributedMLIP
    from nvalchemi_jaxbridge.torch.agreement import RankMismatchError, check_same_structure
    from tests.mlip import cases

    out_dir, rank, world = pathlib.Path(sys.argv[1]), info.rank, info.world_size
    atoms = cases.structure(STRUCTURE)
    dm = TorchDistributedMLIP(cases.wrapper("mpnn"))
    results: dict = {"errors": {}}
    for case in CASES:
        pos, num, cell, pbc = _inputs(case, rank, world, atoms)
        door, state = (TorchDistributedMLIP(MLIAPLennardJones()) if case.startswith("mliap") else dm), None
        if case == "state":  # same structure, but the last rank's state was laid out with more headroom
            mine = TorchDistributedMLIP(dm.wrapper, headroom=2.0) if rank == world - 1 else dm
            state = mine.prepare(pos, num, cell, pbc)
        try:
            door.evaluate(pos, num, cell, pbc, state=state)
            results["errors"][case] = None
        except RankMismatchError as e:  # raised on every rank alike, so the job goes on
            results["errors"][case] = f"{type(e).__name__}: {e}"
    t0 = time.perf_counter()
    out = dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    results["seconds_evaluate"] = time.perf_counter() - t0
    results.update(energy=out["energy"], forces=out["forces"].tolist())
    args = (atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    t0 = time.perf_counter()
    for _ in range(TIMED):
        check_same_structure(*args, caller="timing")
    results["seconds_check"] = (time.perf_counter() - t0) / TIMED
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    distributed.shutdown()


if __name__ == "__main__":
    main()
