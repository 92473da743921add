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


BROKEN = {  # kind: (a broken reference of that kind, the name its warning gives)
    "page": ("[a page that does not exist](nowhere.md)", "nowhere"),
    "python-object": ("{py:func}`nvalchemi_jaxbridge.lower.no_such_function`", "no_such_function"),
    "anchor": ("[a heading that does not exist](#no-such-heading)", "no-such-heading"),
}


@pytest.fixture(scope="module")
def broken_build(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess:
    """One build of a page with every kind of broken reference, one per paragraph.

    With `-W --keep-going` Sphinx reports every warning on its own line and fails if there is any, so
    a warning line naming a reference means that a page with only that reference fails too; one build
    for all kinds saves two Sphinx start-ups.
    """
    tmp = tmp_path_factory.mktemp("broken")
    src = tmp / "src"
    src.mkdir()
    shutil.copy(DOCS / "conf.py", src / "conf.py")
    (src / "index.md").write_text("# Index\n" + "".join(f"\nSee {ref}.\n" for ref, _ in BROKEN.values()))
    return _build(src, tmp / "html")


@pytest.mark.parametrize("kind", list(BROKEN))
def test_the_same_configuration_fails_on_a_broken_reference(broken_build: subprocess.CompletedProcess, kind: str):
    """The guard itself: our conf.py turns each kind of broken reference into a failed build."""
    named = BROKEN[kind][1]
    assert broken_build.returncode != 0, "a broken reference built without error"
    warned = [line for line in broken_build.stderr.splitlines() if "WARNING" in line and named in line]
    assert warned, broken_build.stderr  # it failed on this reference, not (only) on another
