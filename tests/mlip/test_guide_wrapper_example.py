"""The guide's own-model example ("Writing a wrapper for your own model") runs as written and passes its check."""

from __future__ import annotations

import pathlib
import re

GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guide.md"


def test_the_guides_wrapper_example_passes_check_wrapper(capsys):
    from tests.mlip import cases

    blocks = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), flags=re.S | re.M)
    model, wrapper = (next(b for b in blocks if marker in b) for marker in ("class TinyNet(", "class TinyNetWrapper("))
    assert "check_wrapper(" in wrapper
    scope = {"torch": __import__("torch"), "atoms": cases.structure("small")}
    exec(model, scope)
    exec(wrapper, scope)
    assert scope["report"].passed
    assert len(scope["report"].rows) == 2  # both exchanges
    assert "result: passed" in capsys.readouterr().out
