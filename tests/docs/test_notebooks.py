"""The notebooks in notebooks/ run top to bottom in a fresh kernel (the venv's python), and are stored clean.

Each notebook checks its own results against independent references (ASE, numpy loops,
single-device runs) with `np.testing` asserts, so a wrong answer fails its cell here.
"""

from __future__ import annotations

import os
import pathlib
import sys

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 120
# The kernels' XLA flags, in place of the test world's: no intra-op Eigen threads, as tests/conftest.py sets
# (on a loaded machine they only contend).
KERNEL_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"
# Notebook 04 compiles seven model programs and runs each a few times: with LLVM optimisation level 0 XLA
# compiles them in 2/3 of the time, ~10 % of the notebook's CPU time (measured). The other notebooks run
# their programs often enough that level 0's slower code costs as much as or more than it saves.
COMPILE_BOUND = {"04_distribute_a_message_passing_mlip": " --xla_backend_optimization_level=0"}


def test_the_six_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names == ["01_jax_front_door.ipynb", "02_pytorch_front_door.ipynb", "03_bring_your_own_kernel.ipynb",
                     "04_distribute_a_message_passing_mlip.ipynb", "05_ase_and_functional_api.ipynb",
                     "06_your_model_from_a_file_to_ase_md.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path: pathlib.Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; clear them before committing"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    # the kernel inherits this environment: its own XLA flags, not those the test world set for this process
    monkeypatch.setenv("XLA_FLAGS", KERNEL_XLA_FLAGS + COMPILE_BOUND.get(path.stem, ""))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    ran = [c for c in nb.cells if c.cell_type == "code"]
    assert ran and all(c.execution_count is not None for c in ran)
    assert sys.executable  # the kernel command "python" is replaced by this interpreter (jupyter_client)
