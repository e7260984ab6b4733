"""Every ``[Note: ...]`` the code points to is written once, in docs/design.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTE = re.compile(r"\[Note: ([^\]]+)\]")


def test_every_note_the_code_cites_exists_once():
    # A citation may break across lines of a docstring or a comment.
    cited = {re.sub(r"[\s#]+", " ", name) for path in (ROOT / "thunder_overlap").rglob("*.py") for name in NOTE.findall(path.read_text())}
    headings = re.findall(r"^## \[Note: ([^\]]+)\]", (ROOT / "docs" / "design.md").read_text(), flags=re.MULTILINE)
    assert cited, "the code cites no note: the pattern is wrong"
    assert sorted(set(headings)) == sorted(headings), "a note is written twice"
    assert cited <= set(headings), f"cited but not written: {sorted(cited - set(headings))}"
