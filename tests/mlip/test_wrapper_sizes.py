"""The README's wrapper sizes are measured: non-blank lines of the class, docstrings and comments left out."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re
import textwrap

from nvalchemi_jaxbridge.mlip import MPNNWrapper
from nvalchemi_jaxbridge.mlip.mace import MACEWrapper

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def code_lines(cls: type) -> int:
    """Lines of `cls`'s source that are neither blank, nor a comment, nor part of a docstring."""
    src = textwrap.dedent(inspect.getsource(cls))
    docs = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str):
            docs |= set(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    return sum(1 for k, line in enumerate(src.splitlines(), 1)
               if k not in docs and line.strip() and not line.strip().startswith("#"))


def test_code_lines_leave_out_docstrings_comments_and_blank_lines():
    class Small:
        """One line
        and a second."""

        def f(self):  # a comment after code counts
            # a comment line does not

            return 1

    assert code_lines(Small) == 3


def test_the_readme_states_the_measured_wrapper_sizes():
    text = " ".join(README.read_text().split())
    m = re.search(r"MPNN's wrapper is (\d+) lines, MACE's (\d+)", text)
    assert m, "README.md should say how long MPNN's and MACE's wrappers are"
    assert (int(m.group(1)), int(m.group(2))) == (code_lines(MPNNWrapper), code_lines(MACEWrapper))
