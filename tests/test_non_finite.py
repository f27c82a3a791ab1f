"""A model whose logits stop being finite ends the reply in one line; nothing crashes.

The broken model is real: a copy of the offline target whose embedding of one token is +inf
(with its output layer untied, so that only feeding that token breaks the forward pass, as a
float16 overflow breaks it at one place). Its greedy reply emits that token a few tokens in, so the
reply runs, then the next forward pass gives NaN logits.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fsd_chat.conversation.controller import ChatController
from fsd_chat.conversation.store import SessionStore
from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig, Step
from fsd_chat.decoding.lookup import PromptLookup
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.decoding.sampling import draw, probabilities
from fsd_chat.engines.torch_engine.binding import speculative_decoder
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.errors import NonFiniteError
from tests.decoding_helpers import modelled
from tests.test_chat_controller import Saves, make_chat, start
from tests.test_cli_generate import run_cli

PROMPT = "Once upon a time"
OTHER_PROMPT = "The little dog"
CPU = LoadOptions(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def broken(
    pair: ModelPair, target_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[int]]:
    """A copy of the target whose embedding of one token of PROMPT's greedy reply is +inf, and that
    reply up to that token (≥ 2 tokens before it). The token is in neither prompt nor in
    OTHER_PROMPT's greedy reply."""
    reply = greedy_ids(pair.autoregressive(Controls()), pair, PROMPT, 24)
    other = greedy_ids(pair.autoregressive(Controls()), pair, OTHER_PROMPT, 24)
    avoid = set(pair.tokenizer(PROMPT).input_ids) | set(pair.tokenizer(OTHER_PROMPT).input_ids) | set(other)
    reply = reply[: breakable(reply, avoid) + 1]
    return break_target(target_dir, reply[-1], tmp_path_factory.mktemp("broken") / "target"), reply


def breakable(reply: list[int], avoid: set[int], first: int = 2) -> int:
    """The first position (≥ `first`) of `reply` whose token occurs neither before it nor in `avoid`."""
    return next(i for i, t in enumerate(reply) if i >= first and t not in avoid | set(reply[:i]))


def break_target(target_dir: Path, token: int, directory: Path) -> Path:
    """Save to `directory` a copy of the target whose embedding of `token` is +inf."""
    shutil.copytree(target_dir, directory)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
        model.get_input_embeddings().weight[token] = math.inf
    model.save_pretrained(directory)
    return directory


def greedy_ids(decoder: Decoder, pair: ModelPair, prompt: str, tokens: int) -> list[int]:
    steps = decoder.generate(pair.tokenizer(prompt).input_ids, max_new_tokens=tokens)
    return [t.id for s in steps for t in s.tokens]


def run_until_error(
    decoder: Decoder, prompt_ids: list[int], sampling: SamplingConfig
) -> tuple[list[Step], str]:
    steps: list[Step] = []
    with pytest.raises(NonFiniteError) as raised:
        for step in decoder.generate(prompt_ids, max_new_tokens=24, sampling=sampling):
            steps.append(step)
    return steps, str(raised.value)


@pytest.mark.parametrize("kind", ["target-only", "model", "lookup"])
def test_non_finite_logits_end_the_reply_and_the_next_one_works(
    broken: tuple[Path, list[int]], draft_dir: Path, kind: str
) -> None:
    directory, reply = broken
    token, before = reply[-1], len(reply) - 1
    spec_draft = ModelSpec(str(draft_dir))
    broken_pair = load_pair(ModelSpec(str(directory)), spec_draft, CPU)
    # Exact speculative decoding: greedy, every kind emits the target's own reply.
    controls = Controls(DecodingSettings(rule="exact", threshold=0.0, draft_tokens=4, draft_policy="fixed"))
    decoder: Decoder = {
        "target-only": lambda: broken_pair.autoregressive(controls),
        "model": lambda: broken_pair.speculative(controls),
        "lookup": lambda: speculative_decoder(
            broken_pair.target,
            PromptLookup(),
            broken_pair.tokenizer,
            controls=controls,
            timings=modelled(broken_pair.target),
        ),
    }[kind]()
    prompt_ids = broken_pair.tokenizer(PROMPT).input_ids
    steps, message = run_until_error(decoder, prompt_ids, SamplingConfig())
    emitted = [t.id for s in steps for t in s.tokens]
    # The reply keeps what its earlier steps emitted: the target's reply, up to the broken token at
    # most (a step that verifies it with tokens after it fails whole). Target-only decoding emits
    # the broken token, and fails on the forward pass that feeds it.
    assert emitted == reply[: len(emitted)] and len(emitted) <= before + 1
    if kind == "target-only":
        assert emitted[-1] == token and len(emitted) == before + 1
    assert "\n" not in message and "float16" in message and "bfloat16" in message
    # The same decoder answers the next message (its caches start again from the new prompt).
    other = broken_pair.tokenizer(OTHER_PROMPT).input_ids
    again = list(decoder.generate(other, max_new_tokens=24))
    assert again[-1].stop_reason is not None and sum(len(s.tokens) for s in again) > 0
    # Sampled replies stop the same way, without a device-side assert (a NaN row draws some index).
    if kind == "target-only":
        _, sampled = run_until_error(decoder, prompt_ids, SamplingConfig(temperature=1e-3, seed=0))
        assert sampled == message


def test_generate_prints_the_partial_reply_and_one_line(
    broken: tuple[Path, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    directory, _ = broken
    code, out, err = run_cli(
        [
            "generate",
            "--target",
            str(directory),
            "--device",
            "cpu",
            "--autoregressive",
            "--max-new-tokens",
            "24",
            PROMPT,
        ],
        capsys,
    )
    assert code == 2
    assert err.count("\n") == 1 and "bfloat16" in err
    assert out.strip()  # the tokens before the failure were printed


def test_a_nan_row_draws_without_an_error() -> None:
    """The exponential race takes any row: NaN logits give an index (the decoders then stop),
    where torch.multinomial raises (on CUDA: a device-side assert that ends the process)."""
    sampling = SamplingConfig(temperature=1.0, seed=0)
    probs = probabilities(torch.tensor([[0.0, 1.0, math.nan], [1.0, 2.0, 3.0]]), sampling)
    with pytest.raises(RuntimeError):
        torch.multinomial(probs, 1)
    token = draw(probs, sampling, torch.Generator().manual_seed(0))
    assert token.shape == (2,) and 0 <= int(token[0]) < 3


def chat_reply(chat: ChatController, text: str) -> tuple[str, list[int]]:
    """Send `text`, stream its reply to the end; returns its text and token ids."""
    _, steps, fold = start(chat, text)
    collected = list(steps)
    for step in collected:
        fold.add(step)
    chat.steps_shown(tuple(collected), ended=True)
    chat.finish()
    return "".join(s.text for s in collected), [t.id for s in collected for t in s.tokens]


def test_the_chat_keeps_the_partial_reply_says_why_and_goes_on(
    pair: ModelPair, target_dir: Path, draft_dir: Path, tmp_path: Path
) -> None:
    """What the chat screen does with the error (its worker hands it to the controller): a
    notification naming the cause, the partial reply kept and saved, and the chat goes on. The next
    message is in a new chat: this model breaks on a token, which the old one's history holds."""
    healthy = make_chat(pair, tmp_path / "healthy", Saves())
    healthy.controls.update(rule="exact", threshold=0.0)  # the dial at 0: greedy, the target's reply
    _, reply = chat_reply(healthy, PROMPT)
    # Past the first step's k + 1 = 5 tokens, so that a step has emitted something before.
    token = reply[breakable(reply, set(pair.tokenizer(PROMPT).input_ids), first=5)]
    for next_message in (OTHER_PROMPT, "Lily had a big dog", "The sun was hot", "Ben and Sam"):
        healthy.new_chat()
        _, other = chat_reply(healthy, next_message)
        if token not in {*other, *pair.tokenizer(next_message).input_ids}:
            break
    else:
        pytest.fail("no next message avoids the broken token")
    assert healthy.close(10)
    directory = break_target(target_dir, token, tmp_path / "broken")
    broken_pair = load_pair(ModelSpec(str(directory)), ModelSpec(str(draft_dir)), CPU)
    chat = make_chat(broken_pair, tmp_path, Saves())
    chat.controls.update(rule="exact", threshold=0.0)
    _, steps, fold = start(chat, PROMPT)
    shown = ""
    with pytest.raises(NonFiniteError) as raised:
        for step in steps:
            fold.add(step)
            shown += step.text
            chat.steps_shown((step,), ended=False)
    notice = chat.generation_failed(raised.value)
    assert notice.severity == "error" and "bfloat16" in notice.text and "\n" not in notice.text
    finished = chat.finish(error=notice.text)
    assert shown and finished.sent.reply.content == shown and not finished.retry
    first = chat.session.id
    chat.new_chat()
    text, _ = chat_reply(chat, next_message)
    assert text  # the next message gets its reply
    assert chat.close(10)
    saved = SessionStore(tmp_path / "data" / "sessions.sqlite3").load(first)
    assert [t.content for t in saved.turns] == [PROMPT, shown]
    assert saved.turns[1].reply is not None and saved.turns[1].reply.stop_reason == "error"
