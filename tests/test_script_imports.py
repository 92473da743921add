"""Every import of the project's own code in `scripts/` and `benchmarks/` resolves.

Most of those files run only on the GPU machine, which CI does not have; an import left behind by a move
(a module split, tests merged into one file) would first fail there, at the cost of a device run. Imports
inside functions count too. `nvalchemi_jaxbridge` names are imported for real; `tests` names are looked up
in the test files' source (importing a test module a second time would register its torch ops again).
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = sorted([*ROOT.glob("scripts/*.py"), *ROOT.glob("benchmarks/*.py")])
OURS = ("nvalchemi_jaxbridge", "tests")


def _imports(path: pathlib.Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) for every import of our packages in `path`, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in OURS:
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] in OURS]
    return found


def _source_of(module: str) -> pathlib.Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _defines(path: pathlib.Path, name: str) -> bool:
    """Whether module source `path` binds `name` at its top level (def, class, assignment or import)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return True
    return False


def _problem(module: str, name: str | None) -> str | None:
    if module.split(".")[0] == "tests":
        src = _source_of(module)
        if src is None:
            return f"no module {module}"
        if name is None or _source_of(f"{module}.{name}") is not None or _defines(src, name):
            return None
        return f"{module} has no {name}"
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        return f"cannot import {module}: {e}"
    if name is None or name == "*" or hasattr(mod, name):
        return None
    try:
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        return f"{module} has no {name}"
    return None


def test_there_are_scripts_to_check():
    assert any(p.name == "gpu_torch_front_door.py" for p in FILES) and sum(len(_imports(p)) for p in FILES) > 50


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_imports_of_our_code_resolve(path):
    problems = [f"{path.relative_to(ROOT)}:{line}: {why}" for line, module, name in _imports(path)
                if (why := _problem(module, name)) is not None]
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_stale_import(tmp_path):
    """The check itself: the import that `scripts/gpu_torch_front_door.py` had after the exchange tests moved."""
    stale = tmp_path / "stale.py"
    stale.write_text("def main():\n    from tests.torch import test_exchange_multiprocess as te\n"
                     "    from nvalchemi_jaxbridge.torch import no_such_module\n")
    found = [_problem(module, name) for _, module, name in _imports(stale)]
    assert found == ["tests.torch has no test_exchange_multiprocess", "nvalchemi_jaxbridge.torch has no no_such_module"]
