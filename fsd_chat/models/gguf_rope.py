"""The RoPE scaling a GGUF file holds, carried into the config transformers rebuilds from it.

transformers' GGUF reader rebuilds a model's config from the file's metadata, but reads RoPE
scaling for gpt-oss only: any other file loads with its base frequencies unscaled, which is another
model than the file holds (its attention weighs positions otherwise). llama.cpp's converter
(convert_hf_to_gguf.py, its model classes in conversion/) stores the scaling in one of two ways:

- keys (conversion/base.py TextModel.set_gguf_parameters, from the Hugging Face config's
  full-attention parameters): `{arch}.rope.scaling.type` ("linear", "yarn", "longrope"),
  `.factor`, and for YaRN `.original_context_length`, `.yarn_ext_factor`, `.yarn_attn_factor`,
  `.yarn_beta_fast`, `.yarn_beta_slow`. Gemma 3 4B to 27B (linear, factor 8 on their full-attention
  layers) and Qwen2.5 files converted with YaRN hold these;
- a tensor `rope_freqs.weight`, [rotary_dim / 2] float32 (conversion/llama.py
  LlamaModel.generate_extra_tensors, conversion/deci.py): Llama 3.1 and 3.2's "llama3" scaling as
  one divisor of each base frequency, computed from factor, low_freq_factor, high_freq_factor and
  original_max_position_embeddings, none of which the file keeps.

llama.cpp applies them as llama-model.cpp load_hparams reads them (the type defaulting to linear,
a factor of 0 meaning none) and get_rope_factors / get_rope_freq_scale apply them (the factor to
every layer but sliding-window ones, the divisors to every layer). `scaled_rope_parameters` turns
either into transformers' `config.rope_parameters`; what it cannot represent, it refuses.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from fsd_chat.models.gguf_table import TensorTable
from fsd_chat.support.errors import ModelLoadError

ROPE_FREQS = "rope_freqs.weight"
"""llama.cpp's per-frequency divisors (gguf-py constants.py MODEL_TENSOR.ROPE_FREQS)."""
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
"""Phi-3's LongRoPE factors (llama.cpp conversion/phi.py), which transformers' reader drops too."""
OWN_ROPE = frozenset({"gpt-oss", "gemma4"})
"""Architectures whose RoPE transformers' reader rebuilds itself: gpt-oss from its scaling keys,
Gemma 4 from its config class's defaults (its `rope_freqs.weight` is the proportional RoPE of its
full-attention layers, llama.cpp conversion/gemma.py Gemma4Model, not Llama 3's scaling)."""
LLAMA3_ARCHITECTURES = frozenset({"llama", "deci"})
"""Architectures whose `rope_freqs.weight` holds Llama 3's factors."""
CARRIED = "it carries linear and YaRN scaling keys and Llama 3's rope_freqs.weight"
"""What is carried over, as the refusals say it."""
_MATCH = 1e-5
"""Relative tolerance of the recomputed Llama 3 factors against the file's. The file holds float32
values llama.cpp computed in double precision from float32 frequencies; transformers computes them
in float32 (measured: within 1e-7 of Llama 3.1's and 3.2's factors)."""
Scaling = dict[str, Any]
_NO_FIT = "that no Llama 3 parameters reproduce"


def scaled_rope_parameters(table: TensorTable, config: PretrainedConfig) -> dict[str, Any] | None:
    """The `rope_parameters` that give `config` the RoPE scaling of the GGUF file it was rebuilt
    from, or None when the file scales nothing (or its architecture is in `OWN_ROPE`).

    Args:
        table: The file's metadata keys and tensor table (`gguf_table.read_table`), to read
            `rope_freqs.weight` from.
        config: transformers' config rebuilt from it. Its `rope_parameters` hold the base frequency
            (`rope_theta`): one dict for all layers, or one per layer type (Gemma 3), where the
            scaling goes to "full_attention" only, as llama.cpp applies it (get_rope_freq_scale:
            1 on sliding layers), and "sliding_attention" keeps its own base.

    Returns:
        A new `rope_parameters` (the config's is not modified) in transformers 5's form: its base
        and "linear" with `factor`; "yarn" with `factor`, `original_max_position_embeddings` (the
        file's original_context_length, else its context_length, as llama.cpp's n_ctx_orig_yarn),
        and `beta_fast`, `beta_slow`, `attention_factor` where the file has them; or "llama3" with
        the parameters `llama3_parameters` fits to `rope_freqs.weight`.

    Raises:
        ModelLoadError: the file's scaling has no transformers form: a scaling type other than
            linear or yarn (longrope), LongRoPE factor tensors, keys transformers has no field for
            (attn_factor, alpha, yarn_log_multiplier, a yarn_ext_factor other than 1), or a
            `rope_freqs.weight` that no Llama 3 parameters reproduce, on an architecture whose
            converter writes no Llama 3 factors, or beside a scaling factor.
    """
    arch, metadata, path = table.architecture, table.metadata, table.path
    if arch in OWN_ROPE:
        return None

    def refuse(what: str) -> ModelLoadError:
        return ModelLoadError(f"{path} {what}, which fsd-chat cannot carry into transformers ({CARRIED})")

    tensors = {entry.name: entry for entry in table.tensors}
    if tensors.keys() & set(LONGROPE_TENSORS):
        raise refuse("scales its rotary embedding by LongRoPE factors (rope_factors_long/short.weight)")
    scaling = _scaling_from_keys(arch, metadata, refuse)
    nested = "full_attention" in config.rope_parameters
    if ROPE_FREQS in tensors:
        if arch not in LLAMA3_ARCHITECTURES or nested:
            raise refuse(f"holds {ROPE_FREQS} for a {arch} model (llama.cpp writes Llama 3's factors there)")
        if scaling is not None:
            raise refuse(f"holds both {ROPE_FREQS} and a {scaling['rope_type']} scaling factor")
        try:
            scaling = llama3_parameters(torch.from_numpy(table.values(tensors[ROPE_FREQS])), config)
        except ValueError as exc:
            raise refuse(f"holds a {ROPE_FREQS} {exc}") from None
    if scaling is None:
        return None
    parameters = copy.deepcopy(config.rope_parameters)
    (parameters["full_attention"] if nested else parameters).update(scaling)
    return parameters


def _number(metadata: Mapping[str, object], key: str) -> float | None:
    value = metadata.get(key)
    return float(value) if isinstance(value, int | float) else None


def _scaling_from_keys(
    arch: str, metadata: Mapping[str, object], refuse: Callable[[str], ModelLoadError]
) -> Scaling | None:
    """transformers' form of the file's `{arch}.rope.scaling.*` keys as llama.cpp reads them
    (llama-model.cpp load_hparams: the type defaults to linear, a factor of 0 or none means 1, the
    older `{arch}.rope.scale_linear` stands in for a missing factor); None when they scale nothing."""
    prefix = f"{arch}.rope.scaling."
    kind = str(metadata.get(f"{prefix}type", "linear"))
    factor = _number(metadata, f"{prefix}factor") or _number(metadata, f"{arch}.rope.scale_linear") or 1.0
    for name, neutral in (("attn_factor", 1.0), ("alpha", 0.0), ("yarn_log_multiplier", 0.0)):
        # llama.cpp scales the attention by attn_factor (Phi-3) and yarn_log_multiplier (DeepSeek),
        # and the base by alpha (HunYuan's NTK): transformers' linear and YaRN have no such fields.
        value = _number(metadata, f"{prefix}{name}")
        if value is not None and value != neutral:
            raise refuse(f"holds rope.scaling.{name} {value:g}")
    if kind == "none" or (factor == 1.0 and kind in ("linear", "yarn")):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind != "yarn":
        raise refuse(f"scales its rotary embedding by RoPE type {kind!r}")
    ext_factor = _number(metadata, f"{prefix}yarn_ext_factor")
    if ext_factor not in (None, 1.0):
        # transformers' YaRN mixes interpolation and extrapolation fully: llama.cpp's ext_factor 1.
        raise refuse(f"holds rope.scaling.yarn_ext_factor {ext_factor:g}")
    original = _number(metadata, f"{prefix}original_context_length") or _number(
        metadata, f"{arch}.context_length"
    )
    if original is None:
        raise refuse("scales its rotary embedding by YaRN without an original context length")
    yarn: Scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(original)}
    for name, field in (
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
        ("yarn_attn_factor", "attention_factor"),
    ):
        if (value := _number(metadata, f"{prefix}{name}")) is not None:
            yarn[field] = value
    return yarn


def llama3_parameters(factors: torch.Tensor, config: PretrainedConfig) -> Scaling | None:
    """Llama 3's RoPE parameters that reproduce `factors`, llama.cpp's `rope_freqs.weight`.

    llama.cpp (conversion/llama.py LlamaModel.generate_extra_tensors) divides each base frequency
    theta_i = rope_theta^(-2i/d) by 1 where its wavelength 2 pi / theta_i is under
    original_max_position_embeddings / high_freq_factor, by `factor` where it is over
    original_max_position_embeddings / low_freq_factor, and in between by 1 / ((1 - s) / factor + s),
    s = (original_max_position_embeddings / wavelength - low_freq_factor) / (high_freq_factor -
    low_freq_factor). transformers' "llama3" RoPE (modeling_rope_utils._compute_llama3_parameters)
    computes the same. `factor` is the largest divisor; the rest enter only through s, a linear
    function a / wavelength - b that the in-between divisors give (least squares over them; with
    fewer than two, any line that keeps the divisors of 1 and of `factor` on their sides does), and
    the one free scale is chosen to make low_freq_factor 1 and original_max_position_embeddings a
    whole number. The result is accepted only if transformers' own computation reproduces every
    divisor within `_MATCH`.

    Args:
        factors: The divisors, [d / 2] for a rotary dimension d.
        config: The model's config: its `rope_parameters` (base `rope_theta`), head_dim (or
            hidden_size / num_attention_heads) and partial_rotary_factor give d.

    Returns:
        {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings"}; {"rope_type": "linear", "factor"} when every divisor is
        `factor`; None when every divisor is 1.

    Raises:
        ValueError: no such parameters reproduce `factors`. The message completes "holds a
            rope_freqs.weight ...": "of 32 values for a rotary dimension of 128", "that no Llama 3
            parameters reproduce (the closest are 3.1e-02 off)".
    """
    divisors = factors.double().reshape(-1)
    base = _inverse_frequencies(config, {"rope_type": "linear", "factor": 1.0})
    if divisors.numel() != base.numel():
        raise ValueError(f"of {divisors.numel()} values for a rotary dimension of {2 * base.numel()}")
    factor = float(divisors.max())
    ones = torch.isclose(divisors, torch.ones_like(divisors), rtol=0.0, atol=_MATCH)
    if bool(ones.all()):
        return None
    if float(divisors.min()) < 1.0 - _MATCH:
        raise ValueError(f"{_NO_FIT} (it divides some frequency by less than 1)")
    full = torch.isclose(divisors, torch.full_like(divisors, factor), rtol=_MATCH, atol=0.0)
    if bool(full.all()):
        return {"rope_type": "linear", "factor": factor}
    # x = 1 / wavelength of each base frequency, computed as llama.cpp's converter does
    # (float32 frequencies, the rest in double precision): s = a x - b.
    theta = float(config.rope_parameters["rope_theta"])
    dim = 2 * divisors.numel()
    x = (1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)).double() / (2 * math.pi)
    middle = ~(ones | full)
    s = (1.0 / divisors - 1.0 / factor) / (1.0 - 1.0 / factor)
    if int(middle.sum()) >= 2:
        design = torch.stack([x[middle], -torch.ones_like(x[middle])], dim=1)
        a, b = (float(v) for v in torch.linalg.lstsq(design, s[middle, None]).solution.reshape(-1))
    else:
        # Any line that keeps the divisors of 1 at s >= 1 and those of `factor` at s <= 0 fits: one
        # that keeps them clear of those bounds, so that transformers' float32 arithmetic leaves
        # them exactly 1 and `factor`. Through the one in-between divisor, twice as steep as it
        # takes to put the nearest divisors of 1 and of `factor` on the bounds; with none between,
        # crossing 0 and 1 a third and two thirds of the way across the gap between those two.
        if bool(middle.any()):
            x0, s0 = float(x[middle][0]), float(s[middle][0])
            slopes = []
            if bool(ones.any()):
                slopes.append((1.0 - s0) / (float(x[ones].min()) - x0))
            if bool(full.any()):
                slopes.append(s0 / (x0 - float(x[full].max())))
            a = 2.0 * max(slopes, default=0.0)
        else:
            gap = float(x[ones].min()) - float(x[full].max())
            a, x0, s0 = 3.0 / gap, float(x[full].max()) + gap / 3.0, 0.0
        b = a * x0 - s0
    if not (a > 0.0 and b > 0.0):
        raise ValueError(f"{_NO_FIT} (its divisors do not rise from 1 to the largest with the wavelength)")
    original = max(1, round(a / b))
    scale = original / a  # low_freq_factor = b * scale, high_freq_factor = (b + 1) * scale
    scaling: Scaling = {
        "rope_type": "llama3",
        "factor": factor,
        # Six significant digits: the float32 divisors pin no more, and Llama 3's 1 and 4 come out.
        "low_freq_factor": float(f"{b * scale:.6g}"),
        "high_freq_factor": float(f"{(b + 1.0) * scale:.6g}"),
        "original_max_position_embeddings": original,
    }
    recomputed = base / _inverse_frequencies(config, scaling)
    if not torch.allclose(recomputed.double(), divisors, rtol=_MATCH, atol=0.0):
        worst = float(((recomputed.double() - divisors).abs() / divisors).max())
        raise ValueError(f"{_NO_FIT} (the closest are {worst:.1e} off)")
    return scaling


def _inverse_frequencies(config: PretrainedConfig, scaling: Scaling) -> torch.Tensor:
    """The inverse frequencies transformers gives a model of `config` under `scaling`, [d / 2]."""
    scaled = copy.deepcopy(config)
    scaled.rope_parameters = {**config.rope_parameters, **scaling}
    inverse, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](scaled)
    return inverse
