"""Find the errors the package raises: an AST scan of `raise X(...)` statements (no import of the package).

A statement's key is `(module, class)`: the module path under `nvalchemi_jaxbridge/` and the class it
raises. A call of a module-level helper that builds the error (`raise _rows_error(...)`) counts as the
class that helper returns. `raise type(e)(...)` re-raises an error already counted (with a longer path)
and is skipped, as are bare `raise` and `raise err`.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "nvalchemi_jaxbridge"


@dataclasses.dataclass(frozen=True)
class Raise:
    """One `raise` statement: where, which class, and the literal text of its arguments (`{}` for values)."""

    module: str
    line: int
    cls: str
    message: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.module, self.cls)


def _text(node: ast.AST | None) -> str:
    """The message template: literal parts kept, interpolations as `{}`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp):
        return _text(node.left) + _text(node.right)
    return "{}"


def _callee(call: ast.Call) -> str | None:
    """The called name: `ValueError`, `errors.SpecError` -> `SpecError`; None for `type(e)(...)`."""
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f.attr
    return None


def _helpers(tree: ast.Module) -> dict[str, str]:
    """Module-level functions that return an exception instance: name -> the class they build."""
    out = {}
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
                    name = _callee(node.value)
                    if name and name.endswith(("Error", "Exception")):
                        out[fn.name] = name
                        break
    return out


def scan(package: pathlib.Path = PACKAGE) -> list[Raise]:
    """Every `raise X(...)` in the package's Python files, in file and line order."""
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        helpers = _helpers(tree)
        module = path.relative_to(package).as_posix()
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            name = _callee(node.exc)
            if name is None:  # raise type(e)(...): a re-raise
                continue
            cls = helpers.get(name, name)
            # every positional argument: helpers such as _rows_error(label, where, x, "text") take the text last
            msg = " {} ".join(_text(a) for a in node.exc.args)
            found.append(Raise(module, node.lineno, cls, " ".join(msg.split())))
    return sorted(found, key=lambda r: (r.module, r.line))
