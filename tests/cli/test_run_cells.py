"""`run --kernel torch-cells`: the cell-list LJ op gives the dense torch op's run, and argon only."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from nvalchemi_jaxbridge.app import run_config, simulate
from nvalchemi_jaxbridge.app.cli import _build_parser, main

# 32 argon atoms on 2 devices, hot and with a thin skin: plan rebuilds happen within the 8 steps.
ARGS = ["run", "--cells", "2", "--devices", "2", "--steps", "8", "--temperature", "600", "--skin", "0.3",
        "--check-every", "2", "--quiet"]


def _run(kernel, tmp_path, monkeypatch):
    """Run the CLI with `kernel`; returns the JSON report and the step-1 forces in global-ID order."""
    seen = []
    real = simulate._parity

    def spy(cs, state, pot, sys_, energy):
        seen.append(cs.to_global(state.forces))
        return real(cs, state, pot, sys_, energy)

    monkeypatch.setattr(simulate, "_parity", spy)
    path = tmp_path / f"{kernel}.json"
    assert main([*ARGS, "--kernel", kernel, "--json-report", str(path)]) == 0
    (forces,) = seen
    return json.loads(path.read_text()), np.asarray(forces)


def test_cells_kernel_run_matches_the_dense_torch_kernel(tmp_path, monkeypatch):
    cells, f_cells = _run("torch-cells", tmp_path, monkeypatch)
    dense, f_dense = _run("torch", tmp_path, monkeypatch)
    assert cells["op"] == "jaxbridge_demo::lj_energy_forces_cells" and cells["kernel"] == "torch-cells"
    assert cells["spec"].endswith("lj_argon_cells.json")
    assert dense["op"] == "jaxbridge_demo::lj_energy_forces"
    assert cells["rebuilds"] and cells["rebuilds"] == dense["rebuilds"]  # padding rows after a rebuild too
    assert f_cells.shape == (32, 3) and np.max(np.abs(f_dense)) > 1e-3
    np.testing.assert_allclose(f_cells, f_dense, rtol=0, atol=1e-12 * np.max(np.abs(f_dense)))
    np.testing.assert_allclose(cells["energy_per_atom_eV"], dense["energy_per_atom_eV"], rtol=1e-11)
    assert cells["parity_force_max_rel"] < 1e-10 and cells["parity_energy_rel"] < 1e-10  # vs numpy


@pytest.mark.parametrize("argv, match", [
    (["--system", "rocksalt", "--kernel", "torch-cells"],
     r"--kernel torch-cells has no op for --system rocksalt \(torch-cells is the cell-list Lennard-Jones op, "
     r"argon only\); use --system argon, or --kernel jax / torch / triton for rocksalt"),
    (["--kernel", "torch-cells", "--spec", "x.json"],
     r"--kernel torch-cells picks the default spec file.*drop --kernel"),
])
def test_cells_kernel_errors_name_the_fix(argv, match, capsys):
    assert main(["run", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: run: ") and re.search(match, err), err
    with pytest.raises(ValueError, match=match):
        run_config.RunConfig(**{a[2:]: b for a, b in zip(argv[::2], argv[1::2])})


def test_cli_offers_every_kernel_the_job_knows(capsys):
    for kernel in run_config.KERNELS:
        assert _build_parser().parse_args(["run", "--kernel", kernel]).kernel == kernel
    for (system, kernel), name in run_config.DEFAULT_SPECS.items():
        assert run_config.RunConfig(system=system, kernel=kernel).spec_path().endswith(name)
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "torch-cells (the same LJ op with an O(N) cell list" in " ".join(capsys.readouterr().out.split())
