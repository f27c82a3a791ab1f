"""GGUF files the tests write: a model folder converted to one GGUF file with the `gguf` package's
writer, as llama.cpp's convert_hf_to_gguf.py does (tensor names from `gguf.get_tensor_name_map`, the
tokenizer in the metadata), for two architectures:

- a Llama (the offline stories260K pair) with a SentencePiece-style BPE tokenizer: the Q and K rows
  permuted for llama.cpp's rotary layout, the merges written;
- a Gemma 3 text model (`tests.tiny_models.save_gemma3`), as its class Gemma3Model writes it: the
  RMSNorm weights stored +1 (llama.cpp's norm multiplies by the weight, Gemma 3's by 1 + weight),
  key and value lengths, the sliding window, and a SentencePiece tokenizer ("llama") without merges
  or a space prefix. No key says which layers slide: llama.cpp and transformers both assume Gemma
  3's pattern (five sliding layers, then a full one), so a folder with other layer types is refused.

Both write the folder's RoPE scaling as llama.cpp's converter does: linear and YaRN as
`{arch}.rope.scaling.*` keys (conversion/base.py TextModel.set_gguf_parameters, from the
full-attention layers' parameters), Llama 3's as the tensor `rope_freqs.weight` (conversion/llama.py
LlamaModel.generate_extra_tensors).

Tensors are float32 unless given another ggml type: the gguf package's quantizer writes the types it
has (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, TQ1_0, TQ2_0, MXFP4), and `k_quantize` the K-quants
Q4_K and Q6_K, which it does not quantize (llama.cpp's own K-quant files are those it writes most)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, Gemma3TextConfig, PretrainedConfig

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


def _rope_scaling_keys(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    """The scaling keys llama.cpp writes for any architecture (TextModel.set_gguf_parameters): for
    linear and YaRN scaling of the full-attention layers; Llama 3's goes into a tensor instead."""
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)
    kind = rope["rope_type"]
    if kind in ("default", "llama3"):
        return
    if kind not in ("linear", "yarn"):
        raise ValueError(f"llama.cpp's converter writes no {kind} RoPE scaling")
    writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
    writer.add_rope_scaling_factor(rope["factor"])
    if kind == "yarn":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for field, add in (
            ("extrapolation_factor", writer.add_rope_scaling_yarn_ext_factor),
            ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
            ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", writer.add_rope_scaling_yarn_beta_slow),
        ):
            if rope.get(field) is not None:
                add(rope[field])


def _llama_keys(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    writer.add_rope_dimension_count(config.head_dim)


def llama3_rope_freqs(config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """`rope_freqs.weight` for Llama 3's RoPE scaling, as llama.cpp computes it
    (LlamaModel.generate_extra_tensors, with its defaults): each base frequency's divisor, 1 for
    short wavelengths, `factor` for long ones, smoothly in between."""
    rope = config.rope_parameters
    if rope["rope_type"] != "llama3":
        return {}
    base, dim = rope["rope_theta"], config.head_dim
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < old / high:
            factors.append(1.0)
        elif wavelength > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return {f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS]}.weight": torch.tensor(factors)}


def _llama_tensor(name: str, tensor: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    if name.endswith("q_proj.weight"):
        return _permute(tensor, config.num_attention_heads)
    if name.endswith("k_proj.weight"):
        return _permute(tensor, config.num_key_value_heads)
    return tensor


def _llama_untensor(name: str, tensor: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    heads = {"q_proj.weight": config.num_attention_heads, "k_proj.weight": config.num_key_value_heads}
    for suffix, count in heads.items():
        if name.endswith(suffix):  # `_permute` undone: the same reshapes, the other way round
            rows = tensor.shape[0]
            return (
                tensor.reshape(count, rows // count // 2, 2, *tensor.shape[1:])
                .swapaxes(1, 2)
                .reshape(tensor.shape)
            )
    return tensor


def _gemma3_keys(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    """Gemma 3's keys. Neither the layer types nor the attention scale (query_pre_attn_scalar) has
    one: transformers' reader takes Gemma3TextConfig's defaults (llama.cpp assumes the same layer
    pattern), so a folder with others is refused. The sliding layers' RoPE has no key either (both
    readers assume a base of 10 000, unscaled)."""
    implied = Gemma3TextConfig(num_hidden_layers=config.num_hidden_layers)
    for name in ("layer_types", "query_pre_attn_scalar"):
        if getattr(config, name) != getattr(implied, name):
            raise ValueError(
                f"a Gemma 3 GGUF file implies {name} {getattr(implied, name)}, not {getattr(config, name)}"
            )
    sliding, implied_sliding = (c.rope_parameters["sliding_attention"] for c in (config, implied))
    if sliding != implied_sliding:
        raise ValueError(f"a Gemma 3 GGUF file implies sliding layers' RoPE {implied_sliding}, not {sliding}")
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_add_space_prefix(False)
    writer.add_pad_token_id(config.pad_token_id)


def _gemma3_tensor(name: str, tensor: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    return tensor + 1 if name.endswith("norm.weight") else tensor


def _gemma3_untensor(name: str, tensor: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    return tensor - 1 if name.endswith("norm.weight") else tensor


def _add(
    writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, qtype: gguf.GGMLQuantizationType | None
) -> None:
    values = np.ascontiguousarray(tensor.numpy())
    if qtype is None or qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, values)
    else:
        writer.add_tensor(name, quantized(values, qtype), raw_dtype=qtype)


K_QUANTS = (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K)
"""The K-quants `k_quantize` writes."""


def quantized(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """`values` (float32, rows of a multiple of the type's block) as stored in type `qtype`: float16
    values, or the blocks' bytes (uint8, one row of bytes per row)."""
    if qtype in K_QUANTS:
        return k_quantize(values, qtype)
    return gguf.quants.quantize(values, qtype)


def k_quantize(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """`values` (float32, rows of a multiple of 256) as Q4_K or Q6_K blocks, uint8 (rows, bytes a
    row): a plain round-to-nearest quantizer (llama.cpp's searches for better scales) that writes
    the blocks ggml-common.h lays out and `gguf.quants.dequantize` reads."""
    rows = values.shape[0]
    blocks = values.reshape(-1, 256).astype(np.float32)
    encode = _q4_k if qtype == gguf.GGMLQuantizationType.Q4_K else _q6_k
    return encode(blocks).reshape(rows, -1)


def _half(values: np.ndarray) -> np.ndarray:
    """One float16 scale a block, as stored (2 bytes), and its value as stored, float32."""
    half = values.astype(np.float16).reshape(-1, 1)
    return half.view(np.uint8), half.astype(np.float32)


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, 0 where b is 0 (an all-zero group)."""
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: 16 groups of 16, each value d * scale (int8) * q, q in -32..31; bytes ql (low 4 bits),
    qh (high 2 bits), the 16 scales, d (float16)."""
    n = blocks.shape[0]
    groups = blocks.reshape(n, 16, 16)
    group_scale = np.abs(groups).max(axis=2) / 31
    d_bytes, d = _half(group_scale.max(axis=1) / 127)
    scales = np.clip(np.round(_divide(group_scale, d)), -128, 127).astype(np.int8)
    step = d * scales.astype(np.float32)
    q = (
        (np.clip(np.round(_divide(groups, step[:, :, None])), -32, 31) + 32)
        .astype(np.uint8)
        .reshape(n, 2, 128)
    )
    # value h*128 + s*64 + j: low nibble s of ql byte h*64 + j (j < 64); value h*128 + k*32 + j:
    # bits 2k of qh byte h*32 + j (j < 32)
    ql = (q[:, :, :64] & 0xF) | ((q[:, :, 64:] & 0xF) << 4)
    high = (q >> 4).reshape(n, 2, 4, 32)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), scales.view(np.uint8), d_bytes], axis=1)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K: 8 groups of 32, each value d * scale * q - dmin * min, scale and min 6-bit, q in 0..15;
    bytes d and dmin (float16), the scales and mins packed in 12 bytes, then the nibbles."""
    n = blocks.shape[0]
    groups = blocks.reshape(n, 8, 32)
    low = np.minimum(groups.min(axis=2), 0)
    group_scale, group_min = (groups.max(axis=2) - low) / 15, -low
    d_bytes, d = _half(group_scale.max(axis=1) / 63)
    dmin_bytes, dmin = _half(group_min.max(axis=1) / 63)
    scales = np.clip(np.round(_divide(group_scale, d)), 0, 63).astype(np.uint8)
    mins = np.clip(np.round(_divide(group_min, dmin)), 0, 63).astype(np.uint8)
    offset = (dmin * mins.astype(np.float32))[:, :, None]
    step = (d * scales.astype(np.float32))[:, :, None]
    q = np.clip(np.round(_divide(groups + offset, step)), 0, 15).astype(np.uint8)
    # 12 bytes: 0-3 scale j | (scale j+4 >> 4) << 6, 4-7 the same of the mins, 8-11 the low
    # nibbles of scale j+4 and min j+4 (gguf.quants Q4_K.get_scale_min reads them back)
    packed = np.concatenate(
        [
            scales[:, :4] | ((scales[:, 4:] >> 4) << 6),
            mins[:, :4] | ((mins[:, 4:] >> 4) << 6),
            (scales[:, 4:] & 0xF) | ((mins[:, 4:] & 0xF) << 4),
        ],
        axis=1,
    )
    # group 2c in the low nibbles of bytes 32c..32c+31, group 2c+1 in their high nibbles
    nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)
    return np.concatenate([d_bytes, dmin_bytes, packed, nibbles], axis=1)


def set_tensor_type(path: Path, name: str, type_id: int) -> None:
    """Rewrite the ggml type id of the tensor `name` in the GGUF file `path`'s tensor table (to
    write a type no writer writes: one no dequantizer reads)."""
    data = bytearray(path.read_bytes())
    encoded = name.encode()
    # the table entry: name length (u64), name, dimension count (u32), dimensions (u64 each), type (u32)
    at = data.index(len(encoded).to_bytes(8, "little") + encoded) + 8 + len(encoded)
    dims = int.from_bytes(data[at : at + 4], "little")
    at += 4 + 8 * dims
    data[at : at + 4] = type_id.to_bytes(4, "little")
    path.write_bytes(data)


def _lfm2_keys(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    writer.add_shortconv_l_cache(config.conv_L_cache)


def _lfm2_tensor(name: str, tensor: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    # llama.cpp's converter (conversion/lfm2.py) squeezes the short convolution's kernel to 2-D.
    return tensor.squeeze(1) if name.endswith("conv.conv.weight") else tensor


def _lfm2_untensor(name: str, tensor: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    return tensor.unsqueeze(1) if name.endswith("conv.conv.weight") else tensor


def _lfm2_kv_heads(config: PretrainedConfig) -> int | list[int]:
    """LFM2's key/value heads by layer, 0 for a convolution layer: how llama.cpp tells them apart."""
    return [config.num_key_value_heads if kind == "full_attention" else 0 for kind in config.layer_types]


@dataclass(frozen=True)
class _Layout:
    """What llama.cpp's converter writes differently for one architecture."""

    arch: gguf.MODEL_ARCH
    keys: Callable[[gguf.GGUFWriter, PretrainedConfig], None]
    """Writes the architecture's own metadata keys."""
    tensor: Callable[[str, torch.Tensor, PretrainedConfig], torch.Tensor]
    """A folder's tensor (by its name there) as the file stores it."""
    untensor: Callable[[str, torch.Tensor, PretrainedConfig], torch.Tensor]
    """`tensor` undone: the folder's tensor (by its name there) from the file's values."""
    merges: bool
    """Whether the file lists the BPE merges (Gemma's leaves them to be rebuilt from the token order)."""
    extra_tensors: Callable[[PretrainedConfig], dict[str, torch.Tensor]] = lambda config: {}
    """Tensors the converter computes from the config (by their names in the file)."""
    kv_heads: Callable[[PretrainedConfig], int | list[int]] = lambda config: config.num_key_value_heads
    """`{arch}.attention.head_count_kv`: one count, or one a layer."""


_LAYOUTS = {
    "llama": _Layout(
        gguf.MODEL_ARCH.LLAMA, _llama_keys, _llama_tensor, _llama_untensor, True, llama3_rope_freqs
    ),
    "lfm2": _Layout(
        gguf.MODEL_ARCH.LFM2, _lfm2_keys, _lfm2_tensor, _lfm2_untensor, merges=True, kv_heads=_lfm2_kv_heads
    ),
    "gemma3_text": _Layout(
        gguf.MODEL_ARCH.GEMMA3, _gemma3_keys, _gemma3_tensor, _gemma3_untensor, merges=False
    ),
}


def file_names(folder: Path) -> dict[str, str]:
    """The name in the GGUF file (`write_gguf`'s) of each tensor of the Llama or Gemma 3 model in
    `folder`, by its name there (a tied output head has none)."""
    config = AutoConfig.from_pretrained(folder)
    names = gguf.get_tensor_name_map(_LAYOUTS[config.model_type].arch, config.num_hidden_layers)
    state = load_file(folder / "model.safetensors")
    tied = config.tie_word_embeddings
    return {
        name: f"{names.get_name(name.removesuffix('.weight'))}.weight"
        for name in state
        if not (name == "lm_head.weight" and tied)
    }


def dequantized_state(folder: Path, path: Path) -> dict[str, torch.Tensor]:
    """The state dict of the model in `folder` with each tensor the GGUF file `path` (`write_gguf`'s
    of that folder) holds for it, dequantized by `gguf.quants.dequantize` and laid out again as the
    folder's: the folder "dequantized through gguf.quants"."""
    config = AutoConfig.from_pretrained(folder)
    layout = _LAYOUTS[config.model_type]
    stored = {tensor.name: tensor for tensor in gguf.GGUFReader(path).tensors}
    state = {}
    for name, file_name in file_names(folder).items():
        tensor = stored[file_name]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(
            tuple(reversed(tensor.shape))
        )
        state[name] = layout.untensor(name, torch.from_numpy(np.array(values, dtype=np.float32)), config)
    return state


def write_gguf(
    folder: Path,
    path: Path,
    *,
    sampling: Mapping[str, float | int] | None = None,
    architecture: str | None = None,
    rename: Mapping[str, str] | None = None,
    keys: Mapping[str, str | float] | None = None,
    tensors: Mapping[str, torch.Tensor] | None = None,
    tensor_types: Mapping[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """Write the Llama or Gemma 3 model in `folder` (config.json, model.safetensors, tokenizer.json)
    as the GGUF file `path`, its weights in float32, with CHATML as its chat template.

    Args:
        folder: A local Llama or Gemma 3 (text) model folder.
        path: The file to write.
        sampling: general.sampling.* keys to write, by name ("temp", "top_k", "top_p", "min_p").
        architecture: general.architecture, if not the folder's (another name writes a file
            transformers cannot load).
        rename: Tokens to write under another string (a draft whose vocabulary maps less of the target's).
        keys: More metadata keys, by their full names (strings, or numbers as float32), e.g. a file
            whose RoPE scaling has no transformers form.
        tensors: More tensors, by their names in the file, written in float32.
        tensor_types: The ggml type of each tensor named here (by its name in the file, e.g.
            "blk.0.ffn_down.weight"), written by `quantized`; the others are float32.

    Returns:
        `path`.

    Raises:
        ValueError: a Gemma 3 folder whose layer types, attention scale or sliding layers' RoPE are
            not those a GGUF file implies, or a RoPE scaling llama.cpp's converter does not write.
    """
    config = AutoConfig.from_pretrained(folder)
    layout = _LAYOUTS[config.model_type]
    state = load_file(folder / "model.safetensors")
    writer = gguf.GGUFWriter(path, architecture or gguf.MODEL_ARCH_NAMES[layout.arch])
    writer.add_name(folder.name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(layout.kv_heads(config))
    writer.add_layer_norm_rms_eps(getattr(config, "rms_norm_eps", None) or config.norm_eps)  # LFM2: norm_eps
    rope = config.rope_parameters  # Gemma 3's has one entry per layer type: the file holds the full layers'
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, types, scores, merges = _vocabulary(folder, rename or {})
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    if layout.merges:
        writer.add_token_merges(merges)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHATML)
    layout.keys(writer, config)
    _rope_scaling_keys(writer, config)
    for key, value in (sampling or {}).items():
        (writer.add_int32 if isinstance(value, int) else writer.add_float32)(f"general.sampling.{key}", value)
    for key, value in (keys or {}).items():
        (writer.add_string if isinstance(value, str) else writer.add_float32)(key, value)
    names = gguf.get_tensor_name_map(layout.arch, config.num_hidden_layers)
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base = names.get_name(name.removesuffix(".weight"))
        assert base is not None, name
        stored = layout.tensor(name, tensor.float(), config)
        _add(writer, f"{base}.weight", stored, (tensor_types or {}).get(f"{base}.weight"))
    for name, tensor in {**layout.extra_tensors(config), **(tensors or {})}.items():
        _add(writer, name, tensor.float(), (tensor_types or {}).get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
