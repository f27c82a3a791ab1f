"""GGUF files the tests write: a Llama model folder (the offline stories260K pair), or a Gemma 3 one
with sliding-window layers, converted to one GGUF file with the `gguf` package's writer, as
llama.cpp's convert_hf_to_gguf.py does for them with a SentencePiece-style BPE tokenizer (tensor
names from `gguf.get_tensor_name_map`; a Llama's Q and K rows permuted for llama.cpp's rotary
layout, a Gemma's norm weights stored plus one; the tokenizer in the metadata)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A chat template for the written files (stories260K has none): ChatML, as SmolLM2's."""


def _permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's rotary layout for Q and K rows (convert_hf_to_gguf.py, LlamaModel.permute):
    transformers' GGUF loader undoes it."""
    rows = weights.shape[0]
    return (
        weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _vocabulary(
    folder: Path, rename: Mapping[str, str]
) -> tuple[list[str], list[int], list[float], list[str]]:
    """(tokens by id, token types, scores, merges) of the folder's tokenizer.json, each token renamed
    by `rename` where it is listed (the merges keep only pairs whose parts and result are unrenamed)."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    special = {t["content"] for t in tokenizer["added_tokens"]}
    tokens = [rename.get(token, token) for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    kinds = gguf.TokenType
    types = [
        int(
            kinds.UNKNOWN
            if t == "<unk>"
            else kinds.CONTROL
            if t in special
            else kinds.BYTE
            if t.startswith("<0x")
            else kinds.NORMAL
        )
        for t in tokens
    ]
    merges = [f"{a} {b}" for a, b in tokenizer["model"]["merges"] if not {a, b, a + b} & rename.keys()]
    # SentencePiece's scores order the merges; the merges are written, so the scores only rank tokens.
    scores = [-float(i) for i in range(len(tokens))]
    return tokens, types, scores, merges


def write_gguf(
    folder: Path,
    path: Path,
    *,
    sampling: Mapping[str, float | int] | None = None,
    architecture: str = "llama",
    rename: Mapping[str, str] | None = None,
) -> Path:
    """Write the Llama or Gemma 3 model in `folder` (config.json, model.safetensors, tokenizer.json)
    as the GGUF file `path`, its weights in float32, with CHATML as its chat template.

    Args:
        folder: A local Llama model folder.
        path: The file to write.
        sampling: general.sampling.* keys to write, by name ("temp", "top_k", "top_p", "min_p").
        architecture: general.architecture of a Llama (another name writes a file transformers
            cannot load); a Gemma 3 is written as "gemma3".
        rename: Tokens to write under another string (a draft whose vocabulary maps less of the target's).

    Returns:
        `path`.
    """
    config = AutoConfig.from_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    gemma = config.model_type == "gemma3_text"
    writer = gguf.GGUFWriter(path, "gemma3" if gemma else architecture)
    writer.add_name(folder.name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    # Gemma 3's file holds the full layers' rotary base (its sliding layers' is transformers' default).
    rope = config.rope_parameters["full_attention"] if gemma else config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if gemma:
        # llama.cpp's Gemma3Model: the head size as key and value lengths, and the window (the
        # layers' pattern is not written: llama.cpp and transformers both take one full layer in six).
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_sliding_window(config.sliding_window)
    else:
        writer.add_rope_dimension_count(config.head_dim)
    tokens, types, scores, merges = _vocabulary(folder, rename or {})
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHATML)
    for key, value in (sampling or {}).items():
        (writer.add_int32 if isinstance(value, int) else writer.add_float32)(f"general.sampling.{key}", value)
    names = gguf.get_tensor_name_map(
        gguf.MODEL_ARCH.GEMMA3 if gemma else gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers
    )
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if gemma and name.endswith("norm.weight"):
            tensor = tensor + 1  # Gemma's RMSNorm scales by 1 + weight; llama.cpp's by the weight
        elif not gemma and name.endswith("q_proj.weight"):
            tensor = _permute(tensor, config.num_attention_heads)
        elif not gemma and name.endswith("k_proj.weight"):
            tensor = _permute(tensor, config.num_key_value_heads)
        base = names.get_name(name.removesuffix(".weight"))
        assert base is not None, name
        writer.add_tensor(f"{base}.weight", np.ascontiguousarray(tensor.float().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
