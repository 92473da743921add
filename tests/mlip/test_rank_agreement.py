"""Ranks must agree: on the PyTorch front door, ranks given different structures raise, naming the ranks.

tests/mlip/agree_worker.py runs inside the shared front-door job (2 ranks under torchrun, 4 under the project's
launcher). Each case gives the last rank (in `two_groups` on 4 ranks, rank 1 too) something other than rank 0's
structure: an atom fewer, two species swapped, one coordinate moved by 1e-9 Å, the cell scaled by 1 + 1e-12,
other pbc, a state laid out with other capacities, an atom fewer on the ML-IAP door. Before the check, the
first two returned an energy matching neither rank's input and the others aborted inside gloo. Every rank
must raise the same `RankMismatchError` naming the ranks and what differs, and the job must go on: then the
same structure on every rank gives the MPNN's own one-device result. The fingerprint rules themselves are
checked without launching (property tests below).
"""

from __future__ import annotations

import re

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from nvalchemi_jaxbridge.torch import agreement
from tests._launch import front_door_run, read_ranks
from tests.mlip import cases
from tests.mlip._reference import reference
from tests.mlip.agree_worker import CASES, STRUCTURE

FIX = "Every rank must pass the same global structure"


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request, tmp_path_factory) -> list[dict]:
    return read_ranks(front_door_run(request.param, tmp_path_factory) / "agree", request.param)


def _expected(world: int) -> dict[str, str]:
    last = world - 1
    return {
        "fewer": rf"rank {last} differs from rank 0 in atom count \(107 vs 108\), atomic numbers, positions\.",
        "swapped": rf"rank {last} differs from rank 0 in atomic numbers\.",
        "moved": rf"rank {last} differs from rank 0 in positions\.",
        "cell": rf"rank {last} differs from rank 0 in cell\.",
        "pbc": rf"rank {last} differs from rank 0 in pbc \(\(True, True, False\) vs \(True, True, True\)\)\.",
        "state": rf"rank {last} differs from rank 0 in layout \(state=\)\.",
        "two_groups": (rf"rank 1 differs from rank 0 in atom count \(107 vs 108\), atomic numbers, positions; "
                       rf"rank {last} differs from rank 0 in positions\." if world > 2 else
                       rf"rank {last} differs from rank 0 in positions\."),
        "mliap_fewer": rf"rank {last} differs from rank 0 in atom count \(107 vs 108\), atomic numbers, positions\.",
    }


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_ranks_given_different_structures_all_raise_naming_the_ranks(ranks, case):
    world = len(ranks)
    messages = [r["errors"][case] for r in ranks]
    assert all(m == messages[0] for m in messages), messages  # the same error on every rank
    m = messages[0]
    assert m is not None, f"{case}: no error on {world} ranks"
    assert m.startswith(f"RankMismatchError: TorchDistributedMLIP.evaluate: the {world} ranks were not given the "
                        "same structure: "), m
    assert re.search(_expected(world)[case], m), m
    assert FIX in m and "broadcast rank 0's" in m


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_same_structure_on_every_rank_gives_the_one_device_result_after_the_errors(ranks):
    w, atoms = cases.wrapper("mpnn"), cases.structure(STRUCTURE)
    want = reference(w.model, atoms, w.cutoff, w.node_attrs(atoms.numbers))  # the MPNN's own forward
    for r in ranks:
        np.testing.assert_allclose(r["energy"], want["energy"], rtol=1e-10)
        np.testing.assert_allclose(r["forces"], want["forces"], atol=1e-9)
    print(f"[agree] {len(ranks)} ranks: check {1e3 * max(r['seconds_check'] for r in ranks):.2f} ms per "
          f"evaluation; one evaluation {1e3 * max(r['seconds_evaluate'] for r in ranks):.0f} ms")


# ------------------------------------------------------------------ the fingerprint rules, without launching

def _structure(n: int, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    return rng.uniform(0, 9, (n, 3)), rng.choice([29, 79], n), np.diag([9.0, 9.0, 9.0]), np.array([True] * 3)


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
@hypothesis.given(n=st.integers(2, 40), seed=st.integers(0, 999), field=st.sampled_from(range(5)),
                  world=st.integers(2, 6), data=st.data())
def test_one_changed_field_on_one_rank_is_named_exactly(n, seed, field, world, data):
    pos, num, cell, pbc = _structure(n, seed)
    same = agreement.fingerprint(pos, num, cell, pbc)
    changed = [pos.copy(), num.copy(), cell.copy(), pbc.copy()]
    i = data.draw(st.integers(0, n - 1))
    if field == 0:  # an atom fewer (the count, and with it the numbers and positions)
        changed[0], changed[1] = np.delete(pos, i, 0), np.delete(num, i)
    elif field == 1:
        changed[1][i] = 79 if num[i] == 29 else 29
    elif field == 2:
        changed[2][data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))] += 1e-13
    elif field == 3:
        changed[3][data.draw(st.integers(0, 2))] = False
    else:  # one coordinate moved by one unit in the last place
        k = data.draw(st.integers(0, 2))
        changed[0][i, k] = np.nextafter(pos[i, k], 100.0)
    odd = data.draw(st.integers(1, world - 1))
    prints = np.stack([agreement.fingerprint(*changed) if r == odd else same for r in range(world)])
    groups = agreement.differences(prints)
    want = {0: ["atom count", "atomic numbers", "positions"], 1: ["atomic numbers"], 2: ["cell"], 3: ["pbc"],
            4: ["positions"]}[field]
    assert [g[0] for g in groups] == [[odd]]
    assert [w.split(" (")[0] for w in groups[0][1]] == want
    with pytest.raises(agreement.RankMismatchError,
                       match=rf"^X.evaluate: the {world} ranks were not given the same structure: rank {odd} differs"):
        agreement.check_fingerprints(prints, "X.evaluate")


def test_equal_values_in_other_dtypes_agree_and_swaps_do_not():
    pos, num, cell, pbc = _structure(12, 0)
    a = agreement.fingerprint(pos, num, cell, pbc)
    b = agreement.fingerprint(pos.tolist(), num.astype(np.float32), cell.tolist(), True)  # same values
    agreement.check_fingerprints(np.stack([a, b]), "X")  # no error
    j = int(np.flatnonzero(num != num[0])[0])
    swapped = num.copy()
    swapped[[0, j]] = swapped[[j, 0]]  # the same multiset of species, in another order
    c = agreement.fingerprint(pos, swapped, cell, pbc)
    assert agreement.differences(np.stack([a, a, c, a]))[0] == ([2], ["atomic numbers"])
    d = agreement.fingerprint(pos[::-1].copy(), num, cell, pbc)  # the same positions, atoms reordered
    assert agreement.differences(np.stack([a, d]))[0] == ([1], ["positions"])


def test_every_rank_but_rank_0_differing_is_named_against_rank_0_in_groups():
    pos, num, cell, pbc = _structure(8, 1)
    base = agreement.fingerprint(pos, num, cell, pbc)
    other = agreement.fingerprint(pos + 1, num, cell, pbc)
    assert agreement.differences(np.stack([base, other, other, base, other])) == [([1, 2, 4], ["positions"])]
    with pytest.raises(agreement.RankMismatchError, match=r": ranks 1, 2 differ from rank 0 in positions\. Every"):
        agreement.check_fingerprints(np.stack([base, other, other]), "Y")


def test_a_single_process_job_exchanges_nothing():
    agreement.check_same_structure(np.zeros((1, 3)), [1], None, False, caller="Z")  # world 1: no collective
