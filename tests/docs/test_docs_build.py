"""The docs build with Sphinx as warnings-are-errors and nitpicky: a broken reference fails the suite."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _build(src: pathlib.Path, out: pathlib.Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-E", "-q", "-b", "html", str(src), str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)


@pytest.mark.slow
def test_docs_build_without_warnings(tmp_path: pathlib.Path):
    run = _build(DOCS, tmp_path / "html")
    assert run.returncode == 0, f"sphinx failed:\n{run.stderr[-6000:]}"
    for page in ("index", "guide", "spec_files", "transforms", "troubleshooting", "api", "design"):
        assert (tmp_path / "html" / f"{page}.html").exists(), page
    api = (tmp_path / "html" / "api.html").read_text()
    assert 'id="nvalchemi_jaxbridge.lower.compile"' in api and "checked against the storage kind now" in api


@pytest.mark.parametrize(("broken", "named"), [
    ("[a page that does not exist](nowhere.md)", "nowhere"),
    ("{py:func}`nvalchemi_jaxbridge.lower.no_such_function`", "no_such_function"),
    ("[a heading that does not exist](#no-such-heading)", "no-such-heading"),
], ids=["page", "python-object", "anchor"])
def test_the_same_configuration_fails_on_a_broken_reference(tmp_path: pathlib.Path, broken: str, named: str):
    """The guard itself: our conf.py turns each kind of broken reference into a failed build."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(DOCS / "conf.py", src / "conf.py")
    (src / "index.md").write_text(f"# Index\n\nSee {broken}.\n")
    run = _build(src, tmp_path / "html")
    assert run.returncode != 0, "a broken reference built without error"
    assert named in run.stderr, run.stderr  # it failed on the reference, not on something else
