"""The README's Python example runs as written (in a fresh interpreter) and gives ASE's answer."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_one_python_example_of_about_15_lines():
    blocks = _python_blocks()
    assert len(blocks) == 1, f"expected one ```python block in README.md, found {len(blocks)}"
    assert len(blocks[0].strip().splitlines()) <= 18


def test_readme_links_point_to_files():
    links = re.findall(r"\]\(([^)#]+)\)", README.read_text())
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


@pytest.mark.slow
def test_readme_example_runs_and_matches_ase(tmp_path: pathlib.Path):
    from ase.calculators.lj import LennardJones

    from nvalchemi_jaxbridge.demo import argon_fcc

    out = tmp_path / "result.npz"
    script = _python_blocks()[0] + (
        "\nimport numpy as np\n"
        f"np.savez({str(out)!r}, energy=float(energy), forces=np.asarray(forces), positions=np.asarray(pos))\n"
    )
    # XLA flags: no intra-op Eigen threads, as in the test world, and LLVM optimisation level 0, since the
    # example compiles two programs and runs each once (measured -12 % CPU); none of the test world's others
    xla_flags = "--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0"
    env = os.environ | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags}
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    got = np.load(out)
    atoms = argon_fcc(4).to_ase()                      # the example's system, through ASE
    atoms.positions = got["positions"]                 # as rattled by the example
    atoms.calc = LennardJones(epsilon=0.0104, sigma=3.40, rc=8.5, smooth=False)
    f_ref = atoms.get_forces()
    assert np.abs(f_ref).max() > 1e-2                  # a rattled crystal: forces that can be wrong
    np.testing.assert_allclose(got["energy"], atoms.get_potential_energy(), rtol=1e-9)
    np.testing.assert_allclose(got["forces"], f_ref, rtol=1e-7, atol=1e-9)
