"""Tiny random-weight causal LMs of several architectures, saved with the stories260K tokenizer.

Random weights exercise the mechanics (KV-cache rollback, sliding windows, padded heads), not
quality or acceptance figures.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    FalconH1Config,
    Gemma2Config,
    Gemma4TextConfig,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
)

VOCAB = 512


def config_for(arch: str, *, vocab_size: int = VOCAB, layers: int = 2) -> PretrainedConfig:
    """A small config of the given architecture ("llama", "qwen2", "gpt2", "gemma2", "gemma4": the
    last two layers share the KV cache of earlier ones, "falcon-h1": hybrid attention + Mamba 2)."""
    tokens = {"vocab_size": vocab_size, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if arch == "gpt2":
        return GPT2Config(n_embd=64, n_layer=layers, n_head=4, n_positions=512, **tokens)
    llama_like = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        **tokens,
    }
    if arch == "llama":
        return LlamaConfig(**llama_like)
    if arch == "qwen2":
        return Qwen2Config(**llama_like)
    if arch == "gemma2":
        # A window much shorter than the replies, so rollback crosses the window edge.
        return Gemma2Config(head_dim=16, sliding_window=16, **llama_like)
    if arch == "gemma4":
        return Gemma4TextConfig(
            head_dim=16,
            sliding_window=16,
            num_kv_shared_layers=2,
            **{**llama_like, "num_hidden_layers": 4},
            layer_types=["sliding_attention", "full_attention"] * 2,
        )
    if arch == "falcon-h1":
        return FalconH1Config(
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=16,
            **llama_like,
        )
    raise ValueError(arch)


def save_tiny_model(
    directory: Path, arch: str, *, seed: int, tokenizer_dir: Path, vocab_size: int = VOCAB, layers: int = 2
) -> Path:
    """Build a random model, save it with the tokenizer from `tokenizer_dir`; return its directory."""
    torch.manual_seed(seed)
    config = config_for(arch, vocab_size=vocab_size, layers=layers)
    # Untied: with tied random embeddings the residual stream makes every model repeat its input
    # token, so any two models would agree. (Set after construction: some configs ignore the kwarg.)
    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config)
    # Sharpen the random logits so greedy choices are not near-ties that rounding could flip.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return directory
