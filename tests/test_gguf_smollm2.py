"""The real default chat model, SmolLM2-135M-Instruct as a Q4_1 GGUF file (fetched into the user's
cache by `make test`'s prerequisite `make model`, the same pinned fetch as `make chat`): it loads
through its converted copy, applies its own ChatML template, and answers greedily."""

from __future__ import annotations

import os

import pytest

from fsd_chat.cli import main
from fsd_chat.decoding.settings import LOOKUP
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.default_model import FETCH_COMMAND, default_model_path
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec

MODEL = default_model_path()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not MODEL.is_file() and not os.environ.get("CI"),
        reason=f"the default model is not fetched ({MODEL} is absent): make model, or {FETCH_COMMAND}",
    ),
]


def test_smollm2_applies_its_chat_template() -> None:
    # Its first start converts the file into the user's cache (a minute or two); later runs load the copy.
    pair = load_pair(
        ModelSpec(str(MODEL)),
        ModelSpec(LOOKUP),
        LoadOptions(device="cpu", dtype="float32", engine="transformers"),
    )
    ids = prompt_ids(pair.tokenizer, [Message("user", "What is the capital of France?")])
    text = pair.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_smollm2_answers_greedily_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "generate",
        "--target",
        str(MODEL),
        "--device",
        "cpu",
        "--temperature",
        "0",
        "--max-new-tokens",
        "24",
        # The converted model: llama.cpp's quantized matrix products (Q4_1 against 8-bit
        # activations) tip this 135M model's first token elsewhere, and it answers "L'Étoile, ..."
        # as llama.cpp's own create_chat_completion does (tests/test_llama_cpp_engine.py checks
        # that engine against llama.cpp's own decoding).
        "--engine",
        "transformers",
    ]
    main([*args, "What is the capital of France?"])
    assert "Paris" in capsys.readouterr().out
