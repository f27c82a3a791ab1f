"""`fsd-chat bench` as a process: its help lists every choice the parser takes, and Ctrl-C or SIGTERM
in the middle of a sweep (a real signal, sent once the sweep has started measuring) keeps what was
measured, with one progress line per run on a redirected stderr.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fsd_chat.bench.prompts import PRESETS
from fsd_chat.bench.records import BASELINES, FSD_RULES
from fsd_chat.cli import main

DATA_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
# The command as a terminal's foreground process gets it: SIGINT raises KeyboardInterrupt even when
# the test runs in a background job, which starts its children with SIGINT ignored.
CLI = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from fsd_chat.cli import main; main(sys.argv[1:])"
)


def test_help_lists_every_choice(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "500")  # no names folded at the width of a small terminal
    main(["bench", "--help"])
    words = " ".join(re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().out).split())
    for intro, end, names in (
        ("Baselines:", "(comma-separated", BASELINES),
        ("Lossy rules:", "(comma-separated", FSD_RULES),
        ("Prompt set:", ", or a JSONL file", PRESETS),
    ):
        listed = words[words.index(intro) + len(intro) :].split(end)[0]
        assert [name.strip() for name in listed.split(",")] == list(names)


@pytest.mark.slow  # a sweep, stopped part way
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_keeps_what_was_measured(target_dir: Path, tmp_path: Path, signum: int, status: int) -> None:
    out = tmp_path / "out"
    args = [
        "bench",
        "--target", str(target_dir),  # no draft: prompt lookup, at its default baselines
        "--prompts", "tinystories", "--data-dir", str(DATA_DIR),
        "--limit", "20", "--max-new-tokens", "64",
        "--rules", "fuzzy", "--divergences", "js", "--thresholds", "0.1,0.2",
        "--device", "cpu", "--threads", "1", "--output", str(out),
    ]  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-c", CLI, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",
    )
    assert process.stderr is not None
    progress = []
    try:
        # Wait until the sweep measures: the first prompt's first run is written on stderr.
        while not progress or " measure · " not in progress[-1]:
            line = process.stderr.readline()
            assert line, "bench ended before measuring"
            progress.append(line)
        process.send_signal(signum)
        stdout, rest = process.communicate(timeout=300)
    finally:
        process.kill()
    progress += rest.splitlines(keepends=True)
    assert process.returncode == status, rest
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert report["interrupted"] is True
    measured = sum(config["runs"] for config in report["configs"])
    # Stopped part way: some runs measured, not all 20 prompts × 5 configurations.
    assert 1 <= measured < 100
    assert "**interrupted**" in (out / "report.md").read_text(encoding="utf-8")
    assert "(interrupted)" in stdout
    # Redirected: one line per run, counted, naming its configuration: first every configuration's
    # warm-up, then the measured runs, as many as report.json has (the signal may fall between a
    # run's measurement and its line).
    runs = [line for line in progress if re.match(r"\d+/105 (warm-up|measure) · ", line)]
    labels = [line.split(" · ")[3] for line in runs[:5]]
    assert labels == [
        "autoregressive", "hf-prompt-lookup k=5", "exact k=5", "fuzzy js T=0.1 k=5", "fuzzy js T=0.2 k=5"
    ] and all(" warm-up · " in line for line in runs[:5])  # fmt: skip
    assert [int(line.split("/")[0]) for line in runs] == list(range(1, len(runs) + 1))
    assert measured - (len(runs) - 5) in (0, 1)
