"""llama.cpp's forward times measured on this machine and cached (`fsd_chat.engines.llama_calibration`),
on a real llama.cpp: the offline pair written as float32 GGUF files (`stories_gguf_files`), loaded
afresh where a test needs a pair of its own (a pair keeps its times once found).

- the cache key follows what the times depend on: the threads and the file;
- a second load reads the cache and times nothing: a table written by hand is the pair's prices;
- a damaged file, or one of another key, is timed again; an unwritable folder is no error;
- a calibration is sane: positive, non-decreasing, at most w·V(1), over the policy's widths;
- a seeded reply of a lossy rule under goodput is the same on two loads on the same machine.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
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
    fresh_dir: Path, stories_gguf_files: tuple[Path, Path]
) -> None:
    """The file's times are the pair's prices as they are: a table written by hand (no machine times
    these) comes back as the pair's V(1)..V(6), and the draft's V(1) as its draft position."""
    pair = load(stories_gguf_files)
    for model, times in zip(models(pair), (KNOWN, KNOWN_DRAFT), strict=True):
        key = calibration.calibration_key(model)
        calibration.write_times(calibration.cache_path(key), key, times)
    assert fresh_dir.stat().st_mode & 0o777 == 0o700  # private to the user, as the error log
    assert {p.stat().st_mode & 0o777 for p in fresh_dir.iterdir()} == {0o600}
    timings = pair.forward_timings()
    assert timings.verify_table()[1:7] == pytest.approx(KNOWN, rel=1e-12)
    assert timings.draft == pytest.approx(KNOWN_DRAFT[0], rel=1e-12)
    assert timings.catch_up == pytest.approx(KNOWN_DRAFT[2] - KNOWN_DRAFT[1], rel=1e-12)
    assert not timings.follows_clock  # fixed before the reply: no clock in the loop
    assert pair.forward_timings() is timings  # kept for the pair's decoders
    # Wider verifies: the model's shape scaled to V(6), so still increasing from it.
    table = timings.verify_table()
    assert table[6] < table[7] < table[33]


def test_a_damaged_file_is_timed_again(fresh_dir: Path, stories_gguf_files: tuple[Path, Path]) -> None:
    pair = load(stories_gguf_files, lookup=True)
    target = pair.target
    assert isinstance(target, LlamaCppModel)
    key = calibration.calibration_key(target)
    path = calibration.cache_path(key)
    for damaged in ("{not json", json.dumps({"key": key, "seconds": [0.01, -1, 0, 0, 0, 0]}), "\udcff"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(damaged, errors="surrogateescape")
        pair.timings = None
        timings = pair.forward_timings()  # no error: timed again, and written
        kept = json.loads(path.read_text())
        assert kept["key"] == key and timings.verify_table()[1:7] == pytest.approx(kept["seconds"])
    # A file whose key is not the model's (edited by hand, or copied from another machine).
    path.write_text(json.dumps({"key": key | {"cpu": "another"}, "seconds": KNOWN}))
    pair.timings = None
    assert pair.forward_timings().verify_table()[1:7] != pytest.approx(KNOWN)


def test_an_unwritable_folder_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stories_gguf_files: tuple[Path, Path]
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(ENV_CALIBRATION_DIR, str(blocked / "times"))
    monkeypatch.setenv("FSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    pair = load(stories_gguf_files, lookup=True)
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
    times = calibration.calibrate(target)
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
