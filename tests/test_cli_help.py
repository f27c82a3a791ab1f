"""Every command's --help, as the real command prints it."""

from __future__ import annotations

import re

import pytest
import typer

from fsd_chat.cli import app, main

COMMANDS = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
METAVAR = re.compile(r"\[([^\]\s|]+(?:\|[^\]\s|]+)+)\]")
"""An option's choices as its metavar shows them, e.g. [auto|float32|bfloat16|float16]."""


def help_rows(command: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The rows of `fsd-chat COMMAND --help`, the table's borders removed."""
    main([command, "--help"])
    return [" ".join(re.sub(r"[│╭╮╰╯─]", " ", row).split()) for row in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("command", COMMANDS)
def test_choices_are_listed_once(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The metavar lists an option's choices; its help may explain each ("exact (standard SD), fuzzy
    # (...)") but not list them again: two choices side by side, joined by a comma, "or", "and", a
    # slash or a bar, are a second list. Wide, so that no row is folded.
    monkeypatch.setenv("COLUMNS", "500")
    checked = 0
    for row in help_rows(command, capsys):
        metavar = METAVAR.search(row)
        if metavar is None:
            continue
        names = "|".join(re.escape(name) for name in sorted(metavar[1].split("|"), key=len, reverse=True))
        listed = re.compile(rf"(?<![\w-])(?:{names})(?:, | or | and |/|\|)(?:{names})(?![\w-])")
        help_text = row[metavar.end() :]
        assert listed.search(help_text) is None, row
        checked += 1
    # generate, chat, serve and bench take options with choices (--dtype at least); history and
    # export take none.
    assert checked > 0 or command in ("history", "export"), command
