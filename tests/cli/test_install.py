"""Installed as users install it: a wheel, installed non-editable into a fresh venv, runs `nvalchemi-jaxbridge run`
from another directory with only package data (no source tree on the path).

The fresh venv borrows jax, torch and numpy from this project's venv through a `.pth` line naming its
site-packages. A path line in a `.pth` file only adds the directory; the `.pth` files inside it (among
them the editable install's finder hook) are not run, so the only `nvalchemi_jaxbridge` importable there
is the wheel's copy.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _sh(*cmd, cwd, env=None, timeout=120):
    run = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"{cmd} failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run.stdout


@pytest.mark.slow
def test_wheel_installs_and_runs_from_another_directory(tmp_path):
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("building the wheel without network needs setuptools in this venv (--no-build-isolation)")
    src = tmp_path / "src"  # a copy, so the build leaves no build/ or egg-info in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "nvalchemi_jaxbridge", src / "nvalchemi_jaxbridge",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "./src",
        "-w", "dist", cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("nvalchemi_jaxbridge-*.whl")

    env_dir = tmp_path / "env"
    _sh(sys.executable, "-m", "venv", "--without-pip", env_dir, cwd=tmp_path)
    python = env_dir / "bin" / "python"
    _sh(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "--ignore-installed",
        "-q", wheel, cwd=tmp_path)  # before the .pth below, so pip does not see the editable install
    site = pathlib.Path(_sh(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                            cwd=tmp_path).strip())
    (site / "_project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["JAX_PLATFORMS"] = "cpu"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _sh(python, "-c", "import nvalchemi_jaxbridge as n, jax, torch; print(n.__file__); print(n.__version__)",
                cwd=elsewhere, env=env).split()
    assert pathlib.Path(where[0]).is_relative_to(site), where  # the wheel's copy, not the checkout
    assert not pathlib.Path(where[0]).is_relative_to(ROOT)

    cli = env_dir / "bin" / "nvalchemi-jaxbridge"
    assert _sh(cli, "--version", cwd=elsewhere, env=env).strip() == f"nvalchemi-jaxbridge {where[1]}"
    out = _sh(cli, "run", "--steps", "2", "--devices", "2", "--cells", "1", "--kernel", "jax", "--quiet",
              cwd=elsewhere, env=env)
    assert out.startswith("nvalchemi-jaxbridge run: report") and "result       ok" in out, out
    assert f"spec         {site / 'nvalchemi_jaxbridge' / 'app' / 'specs' / 'lj_argon.json'}" in out, out
