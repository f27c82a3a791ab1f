"""Prompt lookup through the commands: a target alone loads with lookup drafts, `generate` needs no
draft, the bench's `hf-prompt-lookup` baseline and lookup decoding reproduce greedy output, and the
bench refuses draft-model baselines without a draft model, in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsd_chat.bench.methods import PairRunner
from fsd_chat.bench.prompts import load_prompt_set
from fsd_chat.bench.records import Configuration, Setup
from fsd_chat.cli import main
from fsd_chat.decoding.settings import LOOKUP
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from tests.test_bench import DATA_DIR
from tests.test_cli_generate import run_cli

RETOLD = "Lily had a red ball. She played with the red ball in the park. Lily had a red ball."


@pytest.fixture(scope="module")
def lookup_pair(target_dir: Path) -> ModelPair:
    return load_pair(ModelSpec(str(target_dir)), ModelSpec(LOOKUP), LoadOptions(device="cpu"))


def test_a_target_alone_loads_with_lookup_drafts(lookup_pair: ModelPair) -> None:
    assert lookup_pair.draft is None
    assert (lookup_pair.draft_kind, lookup_pair.draft_label) == ("lookup", "prompt lookup (n ≤ 3)")
    assert "draft: prompt lookup (n ≤ 3), no draft model" in lookup_pair.describe()


def test_generate_with_no_draft_drafts_by_lookup(
    target_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--target", str(target_dir), "--device", "cpu", "--raw", "--json"]
    code, out, _ = run_cli([*args, "--max-new-tokens", "40", "-T", "0", RETOLD], capsys)
    assert code == 0
    stats = json.loads(out.splitlines()[-1])["stats"]
    assert stats["lookup_hits"] > 0 and stats["drafted"] > 0 and stats["draft_forwards"] == 0


def test_lookup_and_hf_prompt_lookup_reproduce_greedy_output(lookup_pair: ModelPair) -> None:
    runner = PairRunner(lookup_pair)
    setup = Setup("float32")
    ids = prompt_ids(lookup_pair.tokenizer, [Message("user", RETOLD)], raw=True)
    configs = [
        Configuration(setup, 0.0, "autoregressive"),
        Configuration(setup, 0.0, "exact", 4),
        Configuration(setup, 0.0, "hf-prompt-lookup", 4),
    ]
    try:
        runs = {c.method: runner.run(c, ids, max_new_tokens=40, seed=0, stop_strings=()) for c in configs}
    finally:
        runner.close()
    reference = runs["autoregressive"].token_ids
    assert len(reference) == 40
    assert runs["exact"].token_ids == reference and runs["hf-prompt-lookup"].token_ids == reference
    stats = runs["exact"].stats
    assert stats is not None and stats.lookup_hits > 0
    # transformers' lookup skips forward passes too: fewer target calls than tokens.
    assert runs["hf-prompt-lookup"].target.calls < len(reference)
    assert runs["hf-prompt-lookup"].draft.calls == 0  # no draft model to meter


def test_the_bench_refuses_assisted_generation_without_a_draft_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["bench", "--target", "t", "--data-dir", str(DATA_DIR), "--prompts", "tinystories"]
    with pytest.raises(SystemExit) as exited:
        main([*args, "--baselines", "exact,hf-assisted", "--output", "out"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert "hf-assisted baselines need a draft model" in err and "hf-prompt-lookup" in err
    assert not (tmp_path / "out").exists()


def test_the_retell_prompts_quote_a_story_then_begin_it_again() -> None:
    items = load_prompt_set("tinystories-retell", data_dir=DATA_DIR, limit=3).items
    opening = "One day, a little girl named Lily found a needle in her room."
    assert items[0].text.startswith(opening + " ") and items[0].text.endswith("\n\n" + opening)
    for item in items:
        story, first = item.text.split("\n\n")
        assert story.startswith(first) and story.endswith((".", "!", "?", '"'))


@pytest.mark.parametrize(
    ("name", "instruction"),
    [
        ("tinystories-retell-chat", "Retell this story in your own words."),
        ("tinystories-summarise-chat", "Summarise this story."),
    ],
)
def test_the_chat_sets_ask_for_the_same_quoted_stories(name: str, instruction: str) -> None:
    retell = load_prompt_set("tinystories-retell", data_dir=DATA_DIR, limit=3).items
    items = load_prompt_set(name, data_dir=DATA_DIR, limit=3).items
    assert len(items) == 3
    for item, base in zip(items, retell, strict=True):
        asked, story = item.text.split("\n\n")
        assert asked == instruction and story == base.text.split("\n\n")[0]
