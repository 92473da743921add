"""A cell relaxation that shrinks the cell by 12 %: capacities grow geometrically and together, so the program
compiles at most three times (21 times when they grew row by row), each growth logged once with its cause, and
the results are those of a layout built afresh for the final structure."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

pytest.importorskip("ase", reason="the ASE calculator needs ASE: pip install ase")

from tests.compile_events import backend_compiles  # noqa: E402


def test_bfgs_under_frechet_cell_filter_compiles_at_most_three_times(caplog):
    from ase.build import bulk
    from ase.filters import FrechetCellFilter
    from ase.optimize import BFGS

    from nvalchemi_jaxbridge.integrations import JaxBridgeCalculator
    from nvalchemi_jaxbridge.mlip import MPNN, DistributedMLIP, MPNNWrapper

    atoms = bulk("Cu", "fcc", a=3.3, cubic=True).repeat((3, 3, 3))  # 108 atoms; this MPNN's minimum is denser
    atoms.positions += np.random.default_rng(0).normal(scale=0.05, size=atoms.positions.shape)
    model = DistributedMLIP(MPNNWrapper(MPNN([29], cutoff=4.0)), n_devices=2)  # default headroom 1.2
    atoms.calc = JaxBridgeCalculator(model)
    v0 = atoms.get_volume()
    with caplog.at_level(logging.INFO, logger="nvalchemi_jaxbridge"), backend_compiles() as compiles:
        BFGS(FrechetCellFilter(atoms), logfile=None).run(fmax=0.01, steps=121)
    assert 1 - (atoms.get_volume() / v0) ** (1 / 3) > 0.1  # the premise: the cell shrank by more than 10 %

    grew = [r.getMessage() for r in caplog.records if "capacities grew" in r.getMessage()]
    engine = atoms.calc.engine
    assert 1 <= len(grew) and len(compiles) == engine.traces <= 3  # one compilation, plus one per growth ...
    assert len(grew) == engine.traces - 1 == model.growth_log.events  # ... each logged once, with its cause
    for line in grew:
        assert re.search(r"(ghost|edge)_capacity \d+ -> \d+ \(needs \d+\)", line), line
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # no warning below its threshold

    # The grown layout gives what a layout built afresh for the final structure gives.
    ours = atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress(voigt=False)
    fresh = model.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    assert abs(ours[0] - fresh["energy"]) <= 1e-10 * abs(fresh["energy"])
    np.testing.assert_allclose(ours[1], fresh["forces"], rtol=0, atol=1e-10)
    np.testing.assert_allclose(ours[2], fresh["stress"], rtol=0, atol=1e-12)


def test_growth_log_warns_once_past_a_few_growths_naming_headroom(caplog):
    from nvalchemi_jaxbridge.layout.capacity import WARN_AFTER, Growth, GrowthLog

    log = GrowthLog("DistributedMLIP")
    with caplog.at_level(logging.INFO, logger="nvalchemi_jaxbridge.layout.capacity"):
        log.record((), 1.2)  # nothing grew: nothing logged or counted
        for i in range(WARN_AFTER + 2):
            log.record((Growth("ghost_capacity", 10 * (i + 1), 15 * (i + 1), 11 * (i + 1)),), 1.2)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert log.events == WARN_AFTER + 2 and len(infos) == WARN_AFTER + 2
    assert "ghost_capacity 10 -> 15 (needs 11)" in infos[0]
    assert len(warnings) == 1 and "headroom=1.2" in warnings[0] and f"grown {WARN_AFTER + 1} times" in warnings[0]
