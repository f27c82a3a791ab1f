"""The README's key table is the app's: every binding, with its default keys."""

from __future__ import annotations

from pathlib import Path

from fsd_chat.tui.keys import key_rows

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_key_table_matches_the_bindings() -> None:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## The chat") : text.index("## Benchmark")]
    for keys, binding_id, what in key_rows({}):
        assert f"| `{keys}` | {what} | `{binding_id}` |" in section
    assert (README.parent / "docs" / "chat.svg").is_file()
