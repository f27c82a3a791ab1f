"""Tiny random-weight causal LMs of several architectures, saved with the stories260K tokenizer.

Random weights exercise the mechanics (KV-cache rollback, sliding windows, padded heads), not
quality or acceptance figures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    FalconH1Config,
    Gemma2Config,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma4TextConfig,
    GPT2Config,
    Lfm2Config,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
)

VOCAB = 512


def config_for(
    arch: str,
    *,
    vocab_size: int = VOCAB,
    layers: int = 2,
    rope_parameters: dict[str, Any] | None = None,
    intermediate_size: int = 128,
) -> PretrainedConfig:
    """A small config of the given architecture ("llama", "qwen2", "gpt2", "gemma2", "gemma4": the
    last two layers share the KV cache of earlier ones, "falcon-h1": hybrid attention + Mamba 2,
    "lfm2": short-convolution layers, each followed by an attention layer),
    with `rope_parameters` (transformers' RoPE base and scaling) where given, else the class's, and
    an MLP `intermediate_size` wide (256 gives the MLP's down projection rows a K-quant block)."""
    tokens = {"vocab_size": vocab_size, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if arch == "gpt2":
        return GPT2Config(n_embd=64, n_layer=layers, n_head=4, n_positions=512, **tokens)
    llama_like = {
        "hidden_size": 64,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        **tokens,
        **({"rope_parameters": rope_parameters} if rope_parameters else {}),
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
            # Per-layer input embeddings as small as the rest (the class's default is a 262,144-id
            # table of 256 a layer: 268 M parameters, half a minute to save and load).
            vocab_size_per_layer_input=vocab_size,
            hidden_size_per_layer_input=16,
            **{**llama_like, "num_hidden_layers": 4},
            layer_types=["sliding_attention", "full_attention"] * 2,
        )
    if arch == "lfm2":
        # The MLP exactly intermediate_size wide (LFM2 otherwise shrinks it, as its GGUF files do not).
        layer_types = ["conv", "full_attention"] * (layers // 2)
        return Lfm2Config(**llama_like, layer_types=layer_types, block_auto_adjust_ff_dim=False)
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
    directory: Path,
    arch: str,
    *,
    seed: int,
    tokenizer_dir: Path,
    vocab_size: int = VOCAB,
    layers: int = 2,
    rope_parameters: dict[str, Any] | None = None,
    intermediate_size: int = 128,
) -> Path:
    """Build a random model (`config_for`'s), save it with the tokenizer from `tokenizer_dir`; return
    its directory."""
    torch.manual_seed(seed)
    config = config_for(
        arch,
        vocab_size=vocab_size,
        layers=layers,
        rope_parameters=rope_parameters,
        intermediate_size=intermediate_size,
    )
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


GEMMA3_WINDOW = 8
"""The sliding window of `save_gemma3`'s models, in tokens: far shorter than a reply."""


def save_gemma3(
    directory: Path,
    tokenizer_dir: Path,
    *,
    noise: float = 0.0,
    norm_spread: float = 0.0,
    layers: int = 6,
    layer_types: list[str] | None = None,
    rope_parameters: dict[str, dict[str, Any]] | None = None,
    intermediate_size: int = 128,
) -> Path:
    """A tiny random Gemma 3 with sliding-window layers (window GEMMA3_WINDOW) and full ones, saved
    with the tokenizer from `tokenizer_dir`. Without `layer_types`, Gemma 3's own pattern: five
    sliding layers, then a full one (the pattern a GGUF file implies, as it names no layer types).

    Args:
        noise: Perturb the weights by this fraction of their spread (a draft that agrees often).
        norm_spread: Draw the RMSNorm weights (scales of 1 + weight) with this spread about 0, as
            a trained model's are, where a new model's are all 0.
        rope_parameters: RoPE base and scaling by layer type ("full_attention", "sliding_attention"),
            where not Gemma3TextConfig's.
        intermediate_size: The MLP's width (256 gives its down projection rows a K-quant block).
    """
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        sliding_window=GEMMA3_WINDOW,
        layer_types=layer_types,
        rope_parameters=rope_parameters,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config.tie_word_embeddings = False  # tied random embeddings make a model repeat its input
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():  # sharp logits: greedy choices that rounding cannot flip
        model.get_output_embeddings().weight.mul_(8.0)
        for name, param in model.named_parameters():
            if norm_spread and name.endswith("norm.weight"):
                param.normal_(0.0, norm_spread)
            param.add_(noise * torch.randn_like(param) * param.std())
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return directory
