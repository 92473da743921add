"""Sphinx configuration: Markdown pages (MyST), API pages from Google-style docstrings.

Built in the test suite (tests/docs/test_docs_build.py) with `-W --keep-going -n`: every warning,
including an unresolved reference, fails the build.
"""

import os
import re
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "nvalchemi_jaxbridge"
author = "nvalchemi_jaxbridge developers"
copyright = "2025, nvalchemi_jaxbridge developers"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields, not as second descriptions of the dataclass fields
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # signatures stay readable; types are described in the Args sections
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}

nitpicky = True
# No network in the build: names from other projects cannot be resolved, so they are not checked.
# References to this package's own objects and pages are checked.
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|numpy|np|torch|typing|collections|dataclasses|argparse|pathlib|os|abc)(\..*)?"),
    (r"py:.*", r"(Any|Callable|Mapping|Iterable|Sequence|Iterator|TextIO|None|int|float|str|bool|dict|list|tuple)"),
    (r"py:class", r"nvalchemi_jaxbridge(\.\w+)*\._\w+"),  # private base classes are not documented
]

_LEAD = re.compile(r"^([^:`]+): ")
_CODE = re.compile(r"(?<![`\\w])`([^`]+)`(?!`)(\w?)")
_RAISES_PAIR = re.compile(r"^(\s+)(\w+) / (\w+): (.*)$")


def _code(m: re.Match) -> str:
    """Markdown `code` as a reST literal; a letter right after it (`Array`s) needs an escaped space."""
    return f"``{m.group(1)}``" + (f"\\ {m.group(2)}" if m.group(2) else "")


def _plain_docstrings(app, what, name, obj, options, lines):
    """Read our Markdown-flavoured docstrings as reST before napoleon sees them.

    The package's docstrings write code in single backticks (Markdown), which reST would take as
    references; they become literals here. A property's first line "Rows of one block: ..." would be
    read as "type: text"; "*args, **kwargs" as emphasis; "Raises: A / B: text" as one class named
    "A / B"; a formula block that ends without a blank line as a broken definition list.
    """
    if what in ("property", "attribute") and lines and _LEAD.match(lines[0]):
        lines[0] = _LEAD.sub(r"\1 - ", lines[0], count=1)
    out: list[str] = []
    for line in lines:
        if line.lstrip().startswith("*args, **kwargs"):  # an Args entry, not code
            line = line.replace("*args, **kwargs", r"\*args, \*\*kwargs", 1)
        line = _CODE.sub(_code, line)
        if m := _RAISES_PAIR.match(line):
            indent, a, b, text = m.groups()
            out += [f"{indent}{a}: {text}", f"{indent}{b}: {text}"]
            continue
        prev = out[-1] if out else ""
        if line.strip() and prev.strip() and _indent(line) < _indent(prev) and not _indent(line) and \
                not line.rstrip().endswith(":"):
            out.append("")  # a dedent back to the margin closes the block above
        out.append(line)
    lines[:] = out


def _indent(line: str) -> int:
    """Leading spaces of a line."""
    return len(line) - len(line.lstrip(" "))


def setup(app):
    app.connect("autodoc-process-docstring", _plain_docstrings, priority=400)

html_theme = "alabaster"
html_static_path: list[str] = []
