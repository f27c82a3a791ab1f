"""`fsd-chat bench` as a process: its help lists every choice the parser takes; it says up front what
the sweep will take, and --quick cuts the counts it chose to keep its time; Ctrl-C or SIGTERM in the
middle of a sweep (a real signal, sent once the sweep has started measuring) keeps what was
measured, with one progress line per run on a redirected stderr.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fsd_chat.bench.advice import ADVICE_COST
from fsd_chat.bench.pipeline import MIN_PROMPTS, MIN_TOKENS, TimeBudget, fit
from fsd_chat.bench.prompts import PRESETS
from fsd_chat.bench.records import BASELINES, FSD_RULES
from fsd_chat.bench.runner import Timing
from fsd_chat.cli import main
from fsd_chat.decoding.settings import DEFAULT_DRAFT_POLICY

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
    # Before the sweep: what it will take, from a timed target-only reply.
    assert any(
        re.match(r"estimate: about \d+ (s|minutes), 5 configurations × 20 prompts", line) for line in progress
    )
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


def test_quick_cuts_what_the_preset_chose_to_fit_its_time() -> None:
    """`fit` on timings as a slow pair gives them: the token cap first, to the largest that fits,
    then the prompts; never below the floors, never a count given on the command line."""
    quick = TimeBudget(540.0, prompts=True, tokens=True)
    # 10 configurations × 8 prompts × ≤96 tokens: 87 s at 10 ms a token; nothing to cut.
    assert fit(quick, Timing(0.1, 0.01), 10, 8, 1, 96) == (8, 96)
    # At 100 ms a token, 794 s: the cap is cut to the largest that fits.
    slow = Timing(0.2, 0.1)
    prompts, tokens = fit(quick, slow, 10, 8, 1, 96)
    assert prompts == 8 and slow.estimate(10, 8, 1, tokens) <= 540 < slow.estimate(10, 8, 1, tokens + 1)
    # At 500 ms a token, the cap stops at its floor, then the prompts at theirs: still over.
    slower = Timing(0.2, 0.5)
    assert fit(quick, slower, 10, 8, 1, 96) == (MIN_PROMPTS, MIN_TOKENS)
    # --max-new-tokens given: only the prompts are cut; both given: nothing is.
    assert fit(replace(quick, tokens=False), slower, 10, 8, 1, 96) == (MIN_PROMPTS, 96)
    assert fit(TimeBudget(540.0, prompts=False, tokens=False), slower, 10, 8, 1, 96) == (8, 96)
    # A set smaller than the floors is never made larger.
    assert fit(quick, Timing(0.2, 5.0), 10, 2, 1, 16) == (2, 16)


@pytest.mark.slow  # a sweep
def test_quick_measures_the_chats_policy_and_ends_with_advice_from_its_table(
    target_dir: Path, draft_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--quick runs fsd-chat's methods under the chat's draft policy; stdout and report.md end
    with the advice, which is the table's fastest speculative row within the stated cost (or the
    target alone when none beats it); no line is wider than 160 columns."""
    out = tmp_path / "quick"
    threads = torch.get_num_threads()  # --quick sets one torch thread for the process
    main(
        [
            "bench", "--quick", "--target", str(target_dir), "--draft", str(draft_dir),
            "--prompts", "tinystories", "--data-dir", str(DATA_DIR), "--limit", "2", "--max-new-tokens", "8",
            "--divergences", "js", "--thresholds", "0.05,0.3", "--rules", "fuzzy,mixture",
            "--mixture-thresholds", "0.01", "--device", "cpu", "--output", str(out),
        ]
    )  # fmt: skip
    torch.set_num_threads(threads)
    printed = capsys.readouterr()
    assert all(len(line) <= 160 for line in (printed.out + printed.err).splitlines())
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    speculative = [c for c in report["configs"] if c["method"] in ("exact", "fuzzy", "mixture")]
    assert len(speculative) == 4 and {c["draft_policy"] for c in speculative} == {DEFAULT_DRAFT_POLICY}
    advice = report["advice"]
    assert printed.out.splitlines()[-1] == advice
    assert (out / "report.md").read_text(encoding="utf-8").splitlines()[-1] == advice
    within = [c for c in speculative if c["quality"]["cost_per_token"] <= ADVICE_COST]
    best = max(within, key=lambda c: c["speedup"]["autoregressive"])
    if best["speedup"]["autoregressive"] > 1:
        rule = f"--rule {best['method']}" + (
            f" --divergence {best['divergence']}" if best["divergence"] else ""
        )
        assert advice.startswith(
            f"advice: run `{rule} -T {best['threshold']:g}"
            if best["threshold"]
            else f"advice: run `{rule} -k"
        )
        assert f"{best['speedup']['autoregressive']:.2f}× the target alone" in advice
    else:
        assert advice.startswith("advice: run the target alone")


@pytest.mark.slow  # two small sweeps
def test_whole_step_rows_decode_as_the_usual_ones(
    target_dir: Path, draft_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench --whole-step` builds fsd-chat's decoders (target-only and exact) with whole steps,
    says so in report.json, and its greedy rows decode as the same rows without it."""
    from fsd_chat.engines.torch_engine import step_graph

    made: list[int] = []
    make_steps = step_graph.make_steps

    def recording(*args: object, **kwargs: object) -> step_graph.EagerSteps | None:
        steps = make_steps(*args, **kwargs)  # type: ignore[arg-type]
        made.append(steps is not None)
        return steps

    monkeypatch.setattr(step_graph, "make_steps", recording)
    threads = torch.get_num_threads()
    reports = []
    for flag in ("--no-whole-step", "--whole-step"):
        out = tmp_path / flag
        main(
            [
                "bench", "--target", str(target_dir), "--draft", str(draft_dir), "--device", "cpu",
                "--prompts", "tinystories", "--data-dir", str(DATA_DIR), "--limit", "2",
                "--max-new-tokens", "16", "--rules", "none", "--baselines", "autoregressive,exact",
                "--draft-tokens", "4", "--draft-policies", "fixed", "--temperature", "0",
                "--repeats", "1", "--output", str(out), flag,
            ]
        )  # fmt: skip
        reports.append(json.loads((out / "report.json").read_text(encoding="utf-8")))
    torch.set_num_threads(threads)
    plain, whole = reports
    assert plain["sweep"]["whole_step"] is False and whole["sweep"]["whole_step"] is True
    # The timing pass's target-only decoder (whole steps too: it compiles nothing), then two
    # configurations, each one decoder with whole steps, kept for its warm-up and two prompts.
    assert made == [True] * 3
    for before, after in zip(plain["configs"], whole["configs"], strict=True):
        assert (before["method"], after["method"]) in {("autoregressive",) * 2, ("exact",) * 2}
        assert after["quality"]["greedy_agreement"] == before["quality"]["greedy_agreement"] == 1.0
        assert after["acceptance_rate"] == before["acceptance_rate"]
