"""`run --model ... --tiles N|auto --memory-budget BYTES`: tiles change memory, not numbers; bad values are refused
naming the option."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nvalchemi_jaxbridge.app import model_run
from nvalchemi_jaxbridge.app.cli import main

SMALL = ["--model", "mpnn", "--devices", "2", "--cells", "2", "--steps", "4", "--check-every", "2", "--quiet"]


def _run(tmp_path, capsys, *argv) -> tuple[int, str, dict]:
    path = tmp_path / "report.json"
    rc = main(["run", *SMALL, *argv, "--json-report", str(path)])
    return rc, capsys.readouterr().out, json.loads(path.read_text())


def test_a_run_in_three_tiles_has_the_energies_of_the_run_without(tmp_path, capsys):
    rc1, _, one = _run(tmp_path, capsys, "--exchange", "deep_halo")
    rc3, out, three = _run(tmp_path, capsys, "--tiles", "3", "--memory-budget", "2GiB")  # deep halo implied
    assert rc1 == rc3 == 0, out
    assert three["exchange"] == "deep_halo" and three["tiles"] == 3 and three["memory_budget_bytes"] == 2**31
    assert one["md_steps"] == three["md_steps"] == [0, 2, 4]
    np.testing.assert_allclose(three["potential_energy_eV"], one["potential_energy_eV"], rtol=1e-12, atol=0)
    np.testing.assert_allclose(three["kinetic_energy_eV"], one["kinetic_energy_eV"], rtol=1e-12, atol=0)
    assert three["parity"]["forces_rel"] < 1e-10
    rows = three["rows_per_device"]
    assert all(r["tiles"] == 3 and 0 < r["tile_rows"] <= r["owned"] + r["ghost"] for r in rows)
    assert all(r["predicted_bytes"] == 2048 * r["tile_rows"] + 4096 * r["tile_edges"] for r in rows)  # budget cost
    assert "tiles" not in one["rows_per_device"][0]
    line = next(x for x in out.splitlines() if x.startswith("  tiles"))
    assert line.count("3 x ") == 2 and "MiB" in line, line
    assert "budget 2.0 GiB per device" in out


@pytest.mark.parametrize("argv,message", [
    (["--tiles", "0"], "--tiles must be an int >= 1 (tiles per device, evaluated one after another) or 'auto'"),
    (["--tiles", "many"], "--tiles must be an int >= 1"),
    (["--tiles", "3", "--exchange", "per_layer"], "--tiles 3 evaluates each tile with its own deep halo, but "
                                                  "--exchange is per_layer; pass --exchange deep_halo"),
    (["--memory-budget", "8XB"], "--memory-budget must be bytes per device > 0, as a number (8e9) or with a unit"),
    (["--memory-budget", "-1"], "--memory-budget must be bytes per device > 0"),
    (["--tiles", "2", "--memory-budget", "5MB"], "of 2 tiles), about"),  # the tables fit, a tile does not
    (["--tiles", "2", "--memory-budget", "5MB"], "Fix: use more tiles (tiles=4 or more)"),
    (["--tiles", "2", "--memory-budget", "5MB"], "(on the command line: tiles= is --tiles N|auto, memory_budget= is "
                                                 "--memory-budget BYTES"),
])
def test_bad_tiles_and_budgets_are_refused_naming_the_option(capsys, argv, message):
    assert main(["run", *SMALL, *argv]) == 2
    assert message in capsys.readouterr().err


def test_tiles_and_budget_belong_to_a_model_run(capsys):
    assert main(["run", "--tiles", "2", "--cells", "2", "--quiet"]) == 2
    assert "--tiles apply to a model run" in capsys.readouterr().err
    assert main(["run", "--memory-budget", "8GiB", "--cells", "2", "--quiet"]) == 2
    assert "--memory-budget apply to a model run" in capsys.readouterr().err


def test_budget_units():
    assert model_run.parse_bytes("8e9") == 8e9 and model_run.parse_bytes("8GiB") == 8 * 2**30
    assert model_run.parse_bytes("500 MB") == 5e8 and model_run.parse_bytes(None) is None
    assert model_run.parse_tiles("AUTO") == "auto" and model_run.parse_tiles("4") == 4
    assert model_run.parse_tiles(None) == 1
