"""Facts the docs state in several places agree with the code and with each other."""

from __future__ import annotations

import inspect
import json
import pathlib
import re

from nvalchemi_jaxbridge import OpAdapter

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_ffi_build_time_is_stated_once_and_everywhere_the_same():
    from nvalchemi_jaxbridge.kernels.ffi.build import EXPECTED_SECONDS

    said = {}
    for path in DOCS:
        text = " ".join(path.read_text().split())
        for m in re.finditer(r"(?:built|compiled) on first use \(about (\d+) s", text):
            said.setdefault(int(m.group(1)), []).append(path.name)
    assert said, "the README or guide should say how long the first-use FFI build takes"
    assert set(said) == {EXPECTED_SECONDS}, f"build time stated as {said}, the code says {EXPECTED_SECONDS} s"


def test_the_guide_lists_every_role_keyword_of_op_adapter():
    params = inspect.signature(OpAdapter.__init__).parameters
    keywords = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n.endswith(("_inputs", "_outputs",
                                                                                        "_inputs_full"))]
    assert "neighbors_inputs" in keywords and "gather_inputs" in keywords
    guide = (ROOT / "docs" / "guide.md").read_text()
    table = [line for line in guide.splitlines() if line.startswith("| `") and "=[i]`" in line]
    listed = {re.match(r"\| `(\w+)=", line).group(1) for line in table}
    assert set(keywords) <= listed, f"role keywords missing from the guide's table: {sorted(set(keywords) - listed)}"


def test_the_readme_says_what_jax_grad_through_a_torch_op_needs():
    text = " ".join((ROOT / "README.md").read_text().split())
    assert "register_autograd" in text and "forces output" in text


def test_notebooks_do_not_need_a_checkout():
    # They import the package and launch its modules (`-m ...`), never files found by walking up to the repo.
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        code = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                         if c["cell_type"] == "code")
        for marker in ("pyproject.toml", "sys.path.insert", "examples/", '"examples"', "tests."):
            assert marker not in code, f"{path.name} depends on the source tree ({marker!r})"


def test_the_symptom_index_points_at_sections_that_exist():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    index = text.split("## Index by symptom", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in index.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    assert len(rows) >= 10
    headings = set(re.findall(r"^### `([\w/.]+\.py)` · `(\w+)`", text, flags=re.M))
    modules = {m for m, _ in headings}
    for row in rows:
        for module, cls in re.findall(r"`([\w/]+\.py)` · `(\w+)`", row):
            assert (module, cls) in headings, f"index row names a missing section: {module} · {cls}"
        for module in re.findall(r"`([\w/]+/[\w]+\.py)`", row):
            assert module in modules, f"index row names a module without a section: {module}"


def _texts() -> dict[str, str]:
    out = {p.name: p.read_text() for p in DOCS}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        out[path.name] = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])
    return out


def test_each_function_has_one_name_in_the_docs_and_notebooks():
    """A function the docs reach by a dotted module path is named by one path only (`app.model_run.x` and
    `app.model_reference.x` for the same function confuse a reader), and that path resolves."""
    import importlib

    dotted = re.compile(r"\b((?:nvalchemi_jaxbridge\.)?(?:app|mlip|integrations|layout|lower|kernels|torch|spec|demo)"
                        r"(?:\.\w+)*)\.(\w+)\b")
    imported = re.compile(r"from (nvalchemi_jaxbridge[.\w]*) import ([\w, ]+)")
    names: dict[int, set[str]] = {}
    for name, text in _texts().items():
        aliases = {alias: f"{pkg}.{alias}" for pkg, listed in imported.findall(text)
                   for alias in (a.strip() for a in listed.split(",")) if alias}  # `from ...app import model_run`
        found = [(m.group(1), m.group(2)) for m in dotted.finditer(text)]
        found += [(aliases[a], n) for a, n in re.findall(r"\b(\w+)\.(\w+)\b", text) if a in aliases]
        for mod, attr in found:
            module = mod if mod.startswith("nvalchemi_jaxbridge") else f"nvalchemi_jaxbridge.{mod}"
            try:
                obj = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError):
                continue  # not a module path (a method, an attribute, prose)
            if inspect.isfunction(obj):
                names.setdefault(id(obj), set()).add(f"{module}.{attr}")
    twice = sorted(sorted(paths) for paths in names.values() if len(paths) > 1)
    assert not twice, f"functions named by more than one path in the docs and notebooks: {twice}"


def test_troubleshooting_is_ordered_by_symptom_with_a_module_appendix():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    chapters = re.findall(r"^## (.+)$", text, flags=re.M)
    assert chapters[0] == "Index by symptom" and chapters[-1] == "Appendix: sections by module"
    body = chapters[1:-1]
    assert not [c for c in body if "layer" in c.lower()], f"chapters named by layer, not symptom: {body}"
    appendix = text.split("## Appendix: sections by module", 1)[1]
    modules = set(re.findall(r"^### `([\w/.]+\.py)` · `\w+`", text, flags=re.M))
    listed = set(re.findall(r"^\| `([\w/.]+\.py)` \| \[", appendix, flags=re.M))
    assert modules == listed, f"appendix misses {sorted(modules - listed)}, lists stale {sorted(listed - modules)}"
    for target in re.findall(r"\]\(#([\w-]+)\)", appendix):
        assert any(re.sub(r"[^\w\- ]", "", c.lower()).strip().replace(" ", "-") == target for c in body), target
