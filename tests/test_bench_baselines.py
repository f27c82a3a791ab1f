"""What keeps the bench honest, on the real offline pair: transformers' baselines run on models of
their own (hf-autoregressive, hf-static, hf-assisted), compilation stays in the warm-ups and is
counted where it does not, and a configuration that runs past its time budget is cut without
holding up the sweep.

On the CPU transformers compiles nothing unless told to: hf-static is made to compile here with
torch.compile's "eager" backend (dynamo traces, no code generation: a second), as it does on CUDA
with CUDA graphs, so that the warm-up and the graphs counter are checked for real.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from transformers import PreTrainedModel
from transformers.generation.configuration_utils import CompileConfig

from fsd_chat.bench.meter import ForwardMeter
from fsd_chat.bench.methods import Deadline, PairRunner
from fsd_chat.bench.metrics import summarize
from fsd_chat.bench.pipeline import write_outputs
from fsd_chat.bench.prompts import load_prompt_set
from fsd_chat.bench.records import Configuration, Setup
from fsd_chat.bench.runner import compiled_graphs, run_sweep
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from tests.conftest import DRAFT_DIR, TARGET_DIR
from tests.test_bench import DATA_DIR

SETUP = Setup("float32")
AUTOREGRESSIVE = Configuration(SETUP, 0.0, "autoregressive")
EXACT = Configuration(SETUP, 0.0, "exact", 3)
HF_AUTOREGRESSIVE = Configuration(SETUP, 0.0, "hf-autoregressive")
HF_STATIC = Configuration(SETUP, 0.0, "hf-static")
HF_ASSISTED = Configuration(SETUP, 0.0, "hf-assisted", 3)


def _load() -> ModelPair:
    return load_pair(
        ModelSpec(str(TARGET_DIR)), ModelSpec(str(DRAFT_DIR)), LoadOptions(device="cpu", dtype="float32")
    )


@pytest.fixture(scope="module")
def hf() -> ModelPair:
    """The offline pair loaded apart, for transformers' methods."""
    return _load()


class _Calls:
    """Counts a model's forward calls (a hook of the test's own, beside the bench's meters)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.count = 0
        self.handle = model.register_forward_hook(self._add)

    def _add(self, *_args: object) -> None:
        self.count += 1


@pytest.mark.parametrize("config", [HF_AUTOREGRESSIVE, HF_STATIC, HF_ASSISTED, AUTOREGRESSIVE, EXACT])
def test_transformers_runs_on_its_own_models(pair: ModelPair, hf: ModelPair, config: Configuration) -> None:
    """transformers' methods call only the models loaded for them, fsd-chat's decoders only theirs;
    and they give the same greedy reply (they decode the same weights)."""
    calls = {name: _Calls(model) for name, model in (("fsd", pair.target), ("hf", hf.target))}
    runner = PairRunner(pair, hf=hf)
    prompt = prompt_ids(pair.tokenizer, [Message("user", "Lily and Ben went to the park.")])
    try:
        generation = runner.run(config, prompt, max_new_tokens=8, seed=0, stop_strings=())
        reference = runner.run(AUTOREGRESSIVE, prompt, max_new_tokens=8, seed=0, stop_strings=())
    finally:
        runner.close()
        for counter in calls.values():
            counter.handle.remove()
    ours = config.method.startswith("hf-")
    assert (calls["hf"].count > 0) == ours
    assert calls["fsd"].count > 0  # the reference run, and fsd-chat's own method
    assert generation.token_ids == reference.token_ids
    if config == HF_STATIC:  # unmetered (its step may be compiled): one forward a token
        assert generation.target.calls == len(generation.token_ids) and generation.target.decode_calls == 0
    else:
        assert generation.target.calls > 0


@pytest.mark.slow  # sweeps
def test_hf_static_compiles_in_its_warm_up_only(pair: ModelPair) -> None:
    """transformers sizes hf-static's static cache to the longest reply asked for so far, and
    compiles its step for that size: warmed up on the longest prompt to the token cap, its measured
    replies compile nothing, and the counter sees a reply that outgrows the cache compile again.

    torch's compiled code is the process's: a test before this one on the same worker that had
    compiled transformers' step for these cache sizes would leave nothing to compile (seen in a
    fresh clone's suite), so it starts from none (`torch.compiler.reset`)."""
    torch.compiler.reset()
    hf = _load()
    config = CompileConfig(backend="eager", mode=None, fullgraph=False)
    config._compile_all_devices = True  # transformers compiles on CUDA only, unless told otherwise
    hf.target.generation_config.compile_config = config
    prompt_set = load_prompt_set("tinystories", data_dir=DATA_DIR, limit=3)
    before = compiled_graphs()
    result = run_sweep(
        {SETUP: pair}, [HF_STATIC, AUTOREGRESSIVE], prompt_set, max_new_tokens=12, seed=0, repeats=1,
        hf_pairs={SETUP: hf},
    )  # fmt: skip
    assert compiled_graphs() > before  # it did compile: in its warm-up
    record = result.records[HF_STATIC]
    assert record.compiled_graphs == 0 and not record.cut and record.warmup_seconds is not None
    assert len([r for r in result.runs if r.config == HF_STATIC]) == 3
    static, _ = summarize([HF_STATIC, AUTOREGRESSIVE], result.runs, result.records, None)
    # Unmetered: no forward times, no share outside them; one forward a token.
    assert static.target_forward_seconds is None and static.outside_forward_share is None
    assert static.mean_accepted_length == 1.0 and static.speedup["autoregressive"] > 0
    # A longer reply than the warm-up prepared for: a bigger cache, a new graph, counted.
    runner = PairRunner(pair, hf=hf)
    prompt = prompt_ids(pair.tokenizer, [Message("user", prompt_set.items[0].text)])
    before = compiled_graphs()
    try:
        runner.run(HF_STATIC, prompt, max_new_tokens=200, seed=0, stop_strings=())
    finally:
        runner.close()
    assert compiled_graphs() > before


@pytest.mark.parametrize("config", [AUTOREGRESSIVE, EXACT, HF_AUTOREGRESSIVE, HF_ASSISTED])
def test_a_reply_past_its_deadline_stops_at_its_next_step(
    pair: ModelPair, hf: ModelPair, config: Configuration
) -> None:
    runner = PairRunner(pair, hf=hf)
    prompt = prompt_ids(pair.tokenizer, [Message("user", "Tom had a red ball.")])
    try:
        generation = runner.run(
            config, prompt, max_new_tokens=200, seed=0, stop_strings=(), deadline=Deadline.after(0.0)
        )
    finally:
        runner.close()
    # One step: a token, or a verified block of at most k + 1.
    assert 1 <= len(generation.token_ids) <= (config.draft_tokens or 0) + 1


@pytest.mark.slow  # sweeps
def test_configurations_past_their_budget_are_cut_and_reported(
    pair: ModelPair, hf: ModelPair, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A budget no reply can keep: every configuration is cut in its first measured reply, which
    stops at its next step and is dropped; the sweep ends at once and the report says so."""
    configs = [AUTOREGRESSIVE, EXACT, HF_ASSISTED]
    prompt_set = load_prompt_set("tinystories", data_dir=DATA_DIR, limit=3)
    phases: list[str] = []
    start = time.monotonic()
    result = run_sweep(
        {SETUP: pair}, configs, prompt_set, max_new_tokens=400, seed=0, repeats=1,
        on_run=lambda _config, phase: phases.append(phase), hf_pairs={SETUP: hf},
        cut_after=0.0, warmup_cut_after=60.0,
    )  # fmt: skip
    assert time.monotonic() - start < 30  # 9 replies of 400 tokens, had they run
    assert not result.runs and all(record.cut for record in result.records.values())
    assert phases.count("warm-up") == 3 and phases.count("cut") == 3 and phases.count("skip") == 6
    write_outputs(
        tmp_path, runs=result.runs, configs=configs, pairs={"float32": pair}, sweep={}, interrupted=False,
        title="t", records=result.records, cut_after=result.cut_after,
    )  # fmt: skip
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["cut"] == [f"float32 · temperature 0 · {c.label}" for c in configs]
    assert data["advice"].startswith("advice: none")
    out = capsys.readouterr().out
    assert "cut for time before finishing a reply" in out and out.splitlines()[-1] == data["advice"]
    assert (tmp_path / "report.md").read_text().splitlines()[-1] == data["advice"]


@pytest.mark.slow  # sweeps
def test_a_configuration_cut_midway_keeps_its_finished_replies(pair: ModelPair, tmp_path: Path) -> None:
    """Target-only decoding held to a budget of about two and a half of its six replies: its row
    is marked cut, with the replies it finished (those past the budget are not run)."""
    prompt_set = load_prompt_set("tinystories", data_dir=DATA_DIR, limit=6)
    warm = run_sweep({SETUP: pair}, [AUTOREGRESSIVE], prompt_set, max_new_tokens=48, seed=0, repeats=1)
    reply = sum(r.generation.seconds for r in warm.runs) / len(warm.runs)
    result = run_sweep(
        {SETUP: pair}, [AUTOREGRESSIVE], prompt_set, max_new_tokens=48, seed=0, repeats=1,
        cut_after=2.5 * reply, warmup_cut_after=60.0,
    )  # fmt: skip
    assert result.records[AUTOREGRESSIVE].cut
    kept = len(result.runs)
    assert kept < 6
    write_outputs(
        tmp_path, runs=result.runs, configs=[AUTOREGRESSIVE], pairs={"float32": pair}, sweep={},
        interrupted=False, title="t", records=result.records, cut_after=result.cut_after,
    )  # fmt: skip
    data = json.loads((tmp_path / "report.json").read_text())
    if kept:  # a machine slowed down may have cut it in its first reply: then it has no row
        (row,) = data["configs"]
        assert (row["status"], row["runs"], row["cut_after_seconds"]) == ("cut", kept, 2.5 * reply)
        assert row["compiled_graphs"] == 0 and row["warmup_seconds"] > 0
    else:
        assert data["cut"] == ["float32 · temperature 0 · autoregressive"]


class _Event:
    """torch.cuda.Event on the host clock: `record` notes the time, `elapsed_time` is in ms."""

    synchronized = 0

    def __init__(self, enable_timing: bool = False) -> None:
        self.at: float | None = None

    def record(self, _stream: object = None) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: _Event) -> float:
        assert _Event.synchronized, "read before the device was synchronised"
        assert self.at is not None and end.at is not None
        return 1000 * (end.at - self.at)


def test_on_cuda_forwards_are_timed_by_events_read_after_the_reply(
    pair: ModelPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The meter's CUDA bookkeeping with torch.cuda's events and synchronisation stood in for on
    the host clock: no synchronisation while the reply runs, one when it is over, and the same
    counts and times as the host clock's."""

    def synchronize(_device: object = None) -> None:
        _Event.synchronized += 1

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda _device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    _Event.synchronized = 0
    meter = ForwardMeter(pair.target, torch.device("cuda"))
    ids = torch.tensor([[1, 2, 3]])
    try:
        tally = meter.start()
        with torch.inference_mode():
            for _ in range(3):
                pair.target(ids)
        assert _Event.synchronized == 0 and tally.calls == 3 and tally.seconds == 0.0
        meter.stop()
    finally:
        meter.close()
    assert _Event.synchronized == 1
    assert (tally.calls, tally.decode_calls) == (3, 2)
    assert 0 < tally.decode_seconds < tally.seconds


def test_whole_step_decoders_are_built_once_a_configuration(pair: ModelPair) -> None:
    """Under --whole-step the bench keeps one decoder a configuration (on CUDA its graphs are
    captured once, not at every reply), and each reply is a fresh decoder's: the same tokens, and
    the same prefill, the whole prompt but its last token in one forward pass (a kept decoder that
    kept its KV cache would prefill only what the last prompt did not share, and time less than
    its reply)."""
    built: list[object] = []
    original = ModelPair.decoder

    def counted(self: ModelPair, *args: Any, **kwargs: Any) -> object:
        built.append(decoder := original(self, *args, **kwargs))
        return decoder

    widest: list[int] = []  # a reply's widest forward pass of the target: its prefill

    def feeds(_module: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        widest[-1] = max(widest[-1], 0 if ids is None else int(ids.shape[-1]))

    def replies_of(runner: Callable[[], PairRunner]) -> list[tuple[list[int], int]]:
        replies = []
        for prompt in prompts:
            for config in (EXACT, AUTOREGRESSIVE):
                widest.append(0)
                reply = runner().run(config, prompt, max_new_tokens=8, seed=0, stop_strings=())
                replies.append((reply.token_ids, widest[-1]))
        return replies

    whole = PairRunner(pair, whole_step=True)
    fresh: list[PairRunner] = []

    def fresh_runner() -> PairRunner:  # a runner a reply: a fresh decoder each
        fresh.append(PairRunner(pair, whole_step=True))
        return fresh[-1]

    # Two prompts that begin alike, as a chat template's prompts do.
    prompts = [
        prompt_ids(pair.tokenizer, [Message("user", text)])
        for text in ("Tom had a red ball and a blue car.", "Tom had a red ball. He liked it.")
    ]
    hook = pair.target.register_forward_pre_hook(feeds, with_kwargs=True)
    try:
        with mock.patch.object(ModelPair, "decoder", counted):
            kept = replies_of(lambda: whole)
        assert len(built) == 2 and built[0] is not built[1]
        expected = replies_of(fresh_runner)
    finally:
        hook.remove()
        for runner in (whole, *fresh):
            runner.close()
    assert kept == expected
    assert [width for _, width in kept] == [len(p) - 1 for p in prompts for _ in range(2)]
