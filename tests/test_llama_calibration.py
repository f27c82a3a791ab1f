"""llama.cpp's forward times measured on this machine and cached (`fsd_chat.engines.llama_calibration`),
on a real llama.cpp: the offline pair written as float32 GGUF files (`stories_gguf_files`), loaded
afresh where a test needs a pair of its own (a pair keeps its times once found).

- the cache key follows what the times depend on: the threads and the file;
- the prices are found at `use_threads`, never in a reply: a reply switched to goodput mid-way times
  nothing, and what was read ahead survives the first priced reply; none asked before `use_threads`;
- a second load reads the cache and times nothing: a table written by hand is the pair's prices;
- a damaged file, or one of another key, is timed again; an unwritable folder is no error;
- a calibration is sane: positive, non-decreasing, at most w·V(1), over the policy's widths;
- noise: a burst of slow forwards does not raise the kept V(1); one slowing most V(1) samples is
  used but not kept (timed again next load);
- a seeded reply of a lossy rule under goodput is the same on two loads on the same machine.

Tests of the cache file keep every calibration (`STEADY_SPREAD` infinite): on a loaded machine the
tiny model's samples (tenths of a millisecond) can spread past the rule, which has its own test.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
import time
from pathlib import Path

import pytest
import torch

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.decoding.forward_timings import ForwardTimings
from fsd_chat.decoding.settings import DEFAULT_DRAFT_TOKENS
from fsd_chat.engines import llama_calibration as calibration
from fsd_chat.engines.llama_cpp import LlamaCppModel
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.default_model import resolve_target
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.config import ENV_CALIBRATION_DIR
from tests.conftest import LLAMA_CPP_MISSING

pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)

KNOWN = [0.010, 0.013, 0.016, 0.019, 0.022, 0.025]
"""A hand-written target table, V(1)..V(6) in seconds: no machine times these exactly."""
KNOWN_DRAFT = [0.002, 0.0025, 0.003, 0.0035, 0.004, 0.0045]


@pytest.fixture
def fresh_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty folder of forward times of the test's own (and one for the tokenizers read)."""
    monkeypatch.setenv(ENV_CALIBRATION_DIR, str(tmp_path / "times"))
    monkeypatch.setenv("FSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "times"


@pytest.fixture
def keep_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every calibration kept, however its V(1) samples spread (see the module's docstring)."""
    monkeypatch.setattr(calibration, "STEADY_SPREAD", math.inf)


@pytest.fixture
def calibrations(monkeypatch: pytest.MonkeyPatch) -> list[LlamaCppModel]:
    """The models `calibrate` times, in order: a spy around the real one (it still times)."""
    calls: list[LlamaCppModel] = []
    real = calibration.calibrate

    def spy(model: LlamaCppModel) -> calibration.Calibration:
        calls.append(model)
        return real(model)

    monkeypatch.setattr(calibration, "calibrate", spy)
    return calls


def load(files: tuple[Path, Path], *, lookup: bool = False) -> ModelPair:
    """The offline GGUF pair (or its target with prompt lookup) loaded afresh, one thread."""
    target, draft = files
    return load_pair(
        ModelSpec(str(target)),
        ModelSpec("lookup" if lookup else str(draft)),
        LoadOptions(device="cpu", engine="llama.cpp", threads=1),
    )


def models(pair: ModelPair) -> tuple[LlamaCppModel, LlamaCppModel]:
    assert isinstance(pair.target, LlamaCppModel) and isinstance(pair.draft, LlamaCppModel)
    return pair.target, pair.draft


def test_the_key_follows_the_threads_and_the_file(
    fresh_dir: Path, stories_gguf_files: tuple[Path, Path], tmp_path: Path
) -> None:
    pair = load(stories_gguf_files)
    target, draft = models(pair)
    key = calibration.calibration_key(target)
    assert key["threads"] == key["batch_threads"] == 1 and key["file_bytes"] > 0
    pair.use_threads(1, requested_batch=2)
    split = calibration.calibration_key(target)
    assert split["batch_threads"] == 2 and calibration.cache_path(split) != calibration.cache_path(key)
    other = calibration.calibration_key(draft)
    assert other["file"] != key["file"] and calibration.cache_path(other) != calibration.cache_path(split)
    # The same bytes under another name, then touched: another file, priced apart.
    copy = shutil.copy(stories_gguf_files[0], tmp_path / "copy.gguf")
    copied = load((Path(copy), stories_gguf_files[1]), lookup=True)
    assert isinstance(copied.target, LlamaCppModel)
    copied_key = calibration.calibration_key(copied.target)
    assert copied_key["file"] != key["file"] and copied_key["file_bytes"] == key["file_bytes"]
    before = calibration.cache_path(copied_key)
    Path(copy).touch()
    assert calibration.cache_path(calibration.calibration_key(copied.target)) != before


def test_a_second_load_reads_the_cache_and_times_nothing(
    fresh_dir: Path, stories_gguf_files: tuple[Path, Path], calibrations: list[LlamaCppModel]
) -> None:
    """The file's times are the pair's prices as they are: a table written by hand (no machine times
    these) comes back as the pair's V(1)..V(6), and the draft's V(1) as its draft position."""
    pair = load(stories_gguf_files)
    for model, times in zip(models(pair), (KNOWN, KNOWN_DRAFT), strict=True):
        key = calibration.calibration_key(model)
        calibration.write_times(calibration.cache_path(key), key, times)
    assert fresh_dir.stat().st_mode & 0o777 == 0o700  # private to the user, as the error log
    assert {p.stat().st_mode & 0o777 for p in fresh_dir.iterdir()} == {0o600}
    with pytest.raises(RuntimeError, match="use_threads"):  # no command reaches a reply without it
        pair.forward_timings()
    pair.use_threads(1)  # the split the files were written at: read, not timed
    assert calibrations == []
    timings = pair.forward_timings()
    assert timings.verify_table()[1:7] == pytest.approx(KNOWN, rel=1e-12)
    assert timings.draft == pytest.approx(KNOWN_DRAFT[0], rel=1e-12)
    assert timings.catch_up == pytest.approx(KNOWN_DRAFT[2] - KNOWN_DRAFT[1], rel=1e-12)
    assert not timings.follows_clock  # fixed before the reply: no clock in the loop
    assert pair.forward_timings() is timings  # kept for the pair's decoders
    # Wider verifies: the model's shape scaled to V(6), so still increasing from it.
    table = timings.verify_table()
    assert table[6] < table[7] < table[33]


@pytest.mark.usefixtures("keep_all")
def test_a_damaged_file_is_timed_again(fresh_dir: Path, stories_gguf_files: tuple[Path, Path]) -> None:
    pair = load(stories_gguf_files, lookup=True)
    target = pair.target
    assert isinstance(target, LlamaCppModel)
    key = calibration.calibration_key(target)
    path = calibration.cache_path(key)
    for damaged in ("{not json", json.dumps({"key": key, "seconds": [0.01, -1, 0, 0, 0, 0]}), "\udcff"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(damaged, errors="surrogateescape")
        pair.use_threads(1)  # no error: timed again, and written
        timings = pair.forward_timings()
        kept = json.loads(path.read_text())
        assert kept["key"] == key and timings.verify_table()[1:7] == pytest.approx(kept["seconds"])
    # A file whose key is not the model's (edited by hand, or copied from another machine).
    path.write_text(json.dumps({"key": key | {"cpu": "another"}, "seconds": KNOWN}))
    pair.use_threads(1)
    assert pair.forward_timings().verify_table()[1:7] != pytest.approx(KNOWN)


def test_an_unwritable_folder_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stories_gguf_files: tuple[Path, Path]
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(ENV_CALIBRATION_DIR, str(blocked / "times"))
    monkeypatch.setenv("FSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    pair = load(stories_gguf_files, lookup=True)
    pair.use_threads(1)
    assert pair.forward_timings().verify_table()[1] > 0


def test_a_calibration_is_sane_over_the_policys_widths(
    fresh_dir: Path, stories_gguf_files: tuple[Path, Path]
) -> None:
    """Positive, non-decreasing, no verify dearer than its tokens one by one; every verify width of
    the settings' draft length is timed, not priced from the model."""
    pair = load(stories_gguf_files, lookup=True)
    target = pair.target
    assert isinstance(target, LlamaCppModel)
    assert tuple(range(1, DEFAULT_DRAFT_TOKENS + 2)) == calibration.CALIBRATED_WIDTHS
    times = calibration.calibrate(target).seconds
    assert target.seen == 0  # its KV cache emptied for the decoders
    assert len(times) == len(calibration.CALIBRATED_WIDTHS) and times[0] > 0
    assert all(a <= b for a, b in itertools.pairwise(times))
    assert all(v <= w * times[0] for w, v in zip(calibration.CALIBRATED_WIDTHS, times, strict=True))


@pytest.mark.slow
def test_a_seeded_lossy_reply_is_the_same_on_two_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Goodput decides each k from the prices, and under a lossy rule an undrafted position is the
    target's token: two loads on one machine price alike (the second reads the first's times, timed
    once), so the same seed writes the same reply. The default model with prompt lookup at the
    chat's split, on a prompt it copies from; whether drafting pays at the times measured depends
    on the machine's load, so a third load at a table written by hand, where verifies are cheap,
    shows that these replies do follow the prices (on the tiny story pair a drafting step's own
    work outweighs its forwards: goodput never drafts there)."""
    target = resolve_target("default")
    monkeypatch.setattr(calibration, "STEADY_SPREAD", math.inf)  # kept however noisy: two loads alike
    folder = tmp_path / "times"
    monkeypatch.setenv(ENV_CALIBRATION_DIR, str(folder))
    settings = DecodingSettings(rule="fuzzy", divergence="js", threshold=1.0, draft_policy="goodput")
    text = "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank."

    def reply() -> tuple[list[int], list[int]]:
        pair = load_pair(ModelSpec(target), ModelSpec("lookup"), LoadOptions(engine="llama.cpp", threads=1))
        pair.use_threads(1, requested_batch=2)
        prompt = prompt_ids(pair.tokenizer, [Message("user", text)])
        sampling = SamplingConfig(temperature=1.0, seed=3)
        steps = list(
            pair.speculative(Controls(settings)).generate(prompt, max_new_tokens=48, sampling=sampling)
        )
        return [t.id for s in steps for t in s.tokens], [s.stats.drafted for s in steps]

    first = reply()
    (path,) = folder.iterdir()
    written = path.stat().st_mtime_ns
    assert reply() == first
    assert path.stat().st_mtime_ns == written and list(folder.iterdir()) == [path]  # read, not timed
    record = json.loads(path.read_text())
    cheap = [0.010 * (1 + 0.05 * w) for w in range(6)]
    calibration.write_times(path, record["key"], cheap)
    assert any(reply()[1])  # drafting pays at these prices: the reply follows the table


def test_the_prices_are_found_at_use_threads_never_in_a_reply(
    fresh_dir: Path,
    stories_gguf_files: tuple[Path, Path],
    calibrations: list[LlamaCppModel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A load times nothing (its threads are not yet the command's); `use_threads` finds both models'
    prices; a reply begun under `fixed` and switched to `goodput` mid-way (the dial's keys) asks for
    the prices (a spy around the real `forward_timings`) and times nothing."""
    pair = load(stories_gguf_files)
    assert calibrations == []
    pair.use_threads(1, requested_batch=2)
    assert calibrations == list(models(pair))
    asked: list[ModelPair] = []
    real = ModelPair.forward_timings

    def spy(self: ModelPair) -> ForwardTimings:
        asked.append(self)
        return real(self)

    monkeypatch.setattr(ModelPair, "forward_timings", spy)
    controls = Controls(DecodingSettings(draft_policy="fixed"))
    steps = pair.speculative(controls).generate(
        pair.tokenizer.encode("Once upon a time"), max_new_tokens=16, sampling=SamplingConfig(temperature=0)
    )
    next(steps)
    assert asked == []  # fixed needs no prices
    controls.update(draft_policy="goodput")
    assert len(list(steps)) >= 1
    assert asked == [pair] and calibrations == list(models(pair))  # priced, nothing timed


def test_what_was_read_ahead_survives_the_first_priced_reply(
    fresh_dir: Path, stories_gguf_files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chat reads the conversation ahead while the user types (`read_ahead`); the first goodput
    reply on a new file prefills only what the cache lacks: the prices were found, and the cache
    emptied, at `use_threads`, before anything was read. A spy around the real `_decode` (every
    prefill and forward goes through it) records where each feed starts."""
    pair = load(stories_gguf_files, lookup=True)
    target = pair.target
    assert isinstance(target, LlamaCppModel)
    pair.use_threads(1, requested_batch=2)
    decoder = pair.speculative(Controls(DecodingSettings(draft_policy="goodput")))
    conversation = pair.tokenizer.encode("Once upon a time, there was a little girl named Lily.")
    decoder.read_ahead(conversation)
    read = target.seen
    assert read >= len(conversation) - 1
    starts: list[int] = []
    real = target._decode

    def spy(seq: torch.Tensor, upto: int, keep: int) -> None:
        starts.append(target.seen)
        real(seq, upto, keep)

    monkeypatch.setattr(target, "_decode", spy)
    prompt = conversation + pair.tokenizer.encode(" She liked to play")
    list(decoder.generate(prompt, max_new_tokens=8, sampling=SamplingConfig(temperature=0)))
    assert starts[0] == read  # the reply's prefill began where the read-ahead ended


DELAY = 0.02
"""Seconds a disturbed forward is slowed by: a hundred times the story target's V(1)."""


def slow_ones(monkeypatch: pytest.MonkeyPatch, model: LlamaCppModel, count: int) -> None:
    """The model's next `count` 1-token forwards slowed by `DELAY` (another process's burst of work),
    by a wrapper around the real forward."""
    real = model.forward
    calls = itertools.count()

    def forward(seq: torch.Tensor, upto: int, keep: int) -> torch.Tensor:
        if keep == 1 and next(calls) < count:
            time.sleep(DELAY)
        return real(seq, upto, keep)

    monkeypatch.setattr(model, "forward", forward)


def test_a_burst_of_slow_forwards_does_not_raise_the_kept_v1(
    fresh_dir: Path,
    stories_gguf_files: tuple[Path, Path],
    calibrations: list[LlamaCppModel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """V(1) is timed before every wider width in every pass, and is the least of its samples: a
    burst slowing the whole first pass leaves it at the undisturbed passes' time. A burst over all
    passes but the last (10 of V(1)'s 15 samples) leaves V(1) as low, but the times unsure: used for
    this load, not kept, timed again at the next `use_threads`."""
    pair = load(stories_gguf_files, lookup=True)
    target = pair.target
    assert isinstance(target, LlamaCppModel)
    per_pass = 1 + calibration.INTERLEAVED.count(1)  # `time_widths`' untimed lead is one of them
    slow_ones(monkeypatch, target, per_pass)
    burst = calibration.calibrate(target)
    assert sum(v >= DELAY for v in burst.samples[0]) == per_pass - 1  # the first pass's, all timed
    assert len(burst.samples[0]) == calibration.CALIBRATION_PASSES * (per_pass - 1)
    assert burst.seconds[0] == min(burst.samples[0]) < DELAY
    slow_ones(monkeypatch, target, (calibration.CALIBRATION_PASSES - 1) * per_pass)
    pair.use_threads(1)
    assert len(calibrations) == 2 and not list(fresh_dir.glob("*.json"))  # used, not kept
    assert pair.forward_timings().verify_table()[1] < DELAY
    pair.use_threads(1)
    assert len(calibrations) == 3  # nothing was kept: timed again
