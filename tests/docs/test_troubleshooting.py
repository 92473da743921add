"""docs/troubleshooting.md covers every error the package raises, and nothing it no longer raises.

The package side comes from an AST scan of `raise X(...)` statements (tests/docs/_errors.py), not from
the page; the page side from its `### `module` · `Class`` headings. Each section must also quote the
wording of at least one of the messages it explains, so a heading alone does not pass.
"""

from __future__ import annotations

import collections
import pathlib
import re

from ._errors import scan

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"
HEADING = re.compile(r"^### `([\w/.]+\.py)` · `(\w+)`\s*$", re.M)


def _sections() -> dict[tuple[str, str], str]:
    text = PAGE.read_text()
    marks = list(HEADING.finditer(text))
    out = {}
    for m, nxt in zip(marks, marks[1:] + [None]):
        end = nxt.start() if nxt else len(text)
        body = text[m.end():end].split("\n## ")[0]
        assert (m.group(1), m.group(2)) not in out, f"duplicate section {m.group(0)!r}"
        out[(m.group(1), m.group(2))] = body
    return out


def _quoted_pieces(body: str) -> list[str]:
    """The page's quotes of message wording ("`...`"), cut at each `…` (an inserted value or a cut)."""
    pieces = []
    for quote in re.findall(r'"`([^`]+)`"', " ".join(body.split())):
        pieces += [p.strip(" .,;") for p in quote.split("…") if len(p.strip(" .,;")) >= 10]
    return pieces


def test_scan_finds_known_raises():
    """The scanner itself: a few statements we know are there (class, module, wording)."""
    raised = {(r.module, r.cls): r for r in scan()}
    assert ("layout/_assemble.py", "HaloOverflowError") in raised
    assert ("spec/op_ref.py", "OpResolutionError") in raised
    assert ("torch/handler.py", "ValueError") in raised  # raised through the _rows_error helper too
    assert any("is a plain callable and has no 'ns::name'" in r.message for r in scan())


def test_every_raised_error_has_a_section():
    raised = {r.key for r in scan()}
    missing = sorted(raised - set(_sections()))
    assert not missing, (
        "errors raised in nvalchemi_jaxbridge/ without a section in docs/troubleshooting.md: "
        + ", ".join(f"`{m}` · `{c}`" for m, c in missing)
        + ". Add a '### `module` · `Class`' section that says what each message means and the fix."
    )


def test_no_section_for_an_error_no_longer_raised():
    stale = sorted(set(_sections()) - {r.key for r in scan()})
    assert not stale, f"docs/troubleshooting.md has sections for errors nothing raises any more: {stale}"


def test_each_section_quotes_a_message_it_explains_and_every_quote_is_real():
    by_key: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for r in scan():
        by_key[r.key].append(r.message.replace("{}", "…"))
    everything = " ".join(m for msgs in by_key.values() for m in msgs)
    unquoted, misquoted = [], []
    for key, body in _sections().items():
        pieces = _quoted_pieces(body)
        if not any(p in m for p in pieces for m in by_key.get(key, [])):
            unquoted.append(key)
        misquoted += [(key, p) for p in pieces if p not in everything]
    assert not unquoted, f"sections that quote none of their own messages: {unquoted}"
    assert not misquoted, f"quotes that match no message the package raises: {misquoted}"
