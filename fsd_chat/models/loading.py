"""Loading a target/draft model pair: device, dtype, bitsandbytes quantization, compatibility.

Sources may be Hugging Face Hub ids (downloaded by transformers), local directories, or GGUF files
(`gguf_files`: a `.gguf` path, a folder holding one, a Hub `repo_id:file.gguf`; converted to a
folder in the user's cache on their first start). Every failure
becomes a `ModelLoadError` / `IncompatibleModelsError` / `DeviceMemoryError` with a one-line
message (`load_errors`)."""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from fsd_chat.decoding.fused_linear import fuse_projections
from fsd_chat.decoding.packed_linear import pack_linear_layers
from fsd_chat.decoding.settings import LOOKUP
from fsd_chat.decoding.vocab_map import VocabularyMap, coverage, map_vocabularies
from fsd_chat.models.gguf_files import Progress as Progress  # re-exported: the TUI's loading screen
from fsd_chat.models.gguf_files import local_model
from fsd_chat.models.load_errors import (
    check_load_report,
    check_quantized_forward,
    damaged_file,
    first_line,
    load_failure,
    out_of_memory,
    refused_pickle,
)
from fsd_chat.models.options import (
    LoadOptions,
    ModelSpec,
    check_device_name,
    check_dtype_name,
    check_quantization,
)
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.errors import IncompatibleModelsError, ModelLoadError

MIN_COVERAGE = 0.9
"""Least share of the target's probability mass (on `CALIBRATION_TEXT`) that the tokens of a draft
with another tokenizer must cover. The draft's acceptance is bounded by that share, and falls
faster: measured on the CPU-scale pair with drafts missing part of their vocabulary, 95% coverage
breaks even with the target alone and 80% runs at 0.72× (README, "A draft with another
tokenizer"; `scripts/bench_mapped.py`)."""


def resolve_device(device: str) -> torch.device:
    """The torch device for a `--device` value.

    Raises:
        ModelLoadError: CUDA was asked for but is not available, or the value is malformed.
    """
    check_device_name(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} asked for, but this torch build sees no CUDA GPU")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ModelLoadError(f"device {device!r} asked for, but only {torch.cuda.device_count()} GPU(s)")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The compute dtype for a `--dtype` value on `device`.

    Raises:
        ModelLoadError: unknown dtype name.
    """
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    check_dtype_name(dtype)
    return getattr(torch, dtype)


def target_device_map(options: LoadOptions) -> str | None:
    """ "auto" (accelerate spreads the target's layers over every GPU) when `--device` is auto or
    cuda and there are several GPUs; None (the whole model on one device) otherwise. An explicit
    cuda:N keeps the target on that GPU."""
    several_gpus = torch.cuda.is_available() and torch.cuda.device_count() > 1
    return "auto" if several_gpus and options.device in ("auto", "cuda") else None


def _is_local(source: str) -> bool:
    return source.startswith((".", "/", "~")) or Path(source).expanduser().exists()


def _load_config(
    spec: ModelSpec, options: LoadOptions, progress: Progress | None
) -> tuple[str, PretrainedConfig]:
    """(what to load the model and tokenizer from, its config); a GGUF source's is its converted folder."""
    source = local_model(spec.source, progress) or spec.source
    if _is_local(source):
        path = Path(source).expanduser()
        if not path.exists():
            raise ModelLoadError(f"model path not found: {source}")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{source} is not a model directory (it has no config.json)")
        source = str(path)
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=options.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"could not load a model config from {spec.source!r}: {first_line(exc)}"
        ) from exc
    if getattr(config, "is_encoder_decoder", False):
        raise ModelLoadError(
            f"{spec.source} is an encoder-decoder model ({type(config).__name__}); fsd-chat needs causal LMs"
        )
    remote_causal = options.trust_remote_code and "AutoModelForCausalLM" in (
        getattr(config, "auto_map", None) or {}
    )
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not remote_causal:
        raise ModelLoadError(
            f"{spec.source} is not a causal language model (model type {config.model_type!r})"
        )
    return source, config


def _quantization_config(
    spec: ModelSpec, dtype: torch.dtype, device: torch.device
) -> BitsAndBytesConfig | None:
    if spec.quantization == "none":
        return None
    check_quantization(spec.quantization)
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ModelLoadError(f"{spec.quantization} quantization needs bitsandbytes: pip install bitsandbytes")
    if device.type == "cuda":
        check_bitsandbytes_cuda(spec)
    if spec.quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)


def check_bitsandbytes_cuda(spec: ModelSpec) -> None:
    """Check that bitsandbytes loaded its CUDA library (a CPU-only build, or one built for another
    CUDA version, imports fine and fails only at the first quantized matmul).

    Raises:
        ModelLoadError: bitsandbytes has no working CUDA library here.
    """
    from bitsandbytes import cextension

    if not isinstance(cextension.lib, cextension.CudaBNBNativeLibrary):
        raise ModelLoadError(
            f"{spec.quantization} quantization on CUDA needs a bitsandbytes build with CUDA support, and this one "
            f"has none (backend {cextension.BNB_BACKEND}, torch CUDA {torch.version.cuda}): reinstall bitsandbytes, "
            "or drop --quantize-target / --quantize-draft"
        )


def _load_model(
    spec: ModelSpec,
    options: LoadOptions,
    source: str,
    config: PretrainedConfig,
    *,
    device_map: str | dict[str, str] | None,
) -> PreTrainedModel:
    """Load one causal LM in eval mode (device_map None: all of it on the resolved device)."""
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    quantization = _quantization_config(spec, dtype, device)
    try:
        # With output_loading_info the result is (model, report), which transformers' types do not say.
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            source,
            config=config,
            dtype=dtype,
            device_map=device_map or {"": str(device)},
            quantization_config=quantization,
            trust_remote_code=options.trust_remote_code,
            # Report shape mismatches instead of raising a message that points at a hidden report:
            # check_load_report refuses them with the tensors' names.
            ignore_mismatched_sizes=True,
            output_loading_info=True,
        )
    except SafetensorError as exc:
        raise ModelLoadError(
            f"{damaged_file(source)} is damaged or truncated (safetensors: {first_line(exc)})"
        ) from None
    except pickle.UnpicklingError as exc:
        raise ModelLoadError(refused_pickle(spec, exc)) from None
    except torch.OutOfMemoryError as exc:
        raise out_of_memory(spec, exc) from None
    except (OSError, ValueError, RuntimeError, ImportError, TypeError) as exc:
        raise load_failure(spec, exc) from exc
    model, report = loaded
    check_load_report(spec, source, report)
    model.eval()
    if quantization is not None:
        # bitsandbytes' layers keep their separate GEMMs (`fused_linear`: not fused).
        check_quantized_forward(spec, model)
        return model
    # q, k, v one GEMM and gate, up another; then the fused weights are packed like any other.
    fuse_projections(model)
    if options.prepack:
        pack_linear_layers(model)
    return model


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
"""A local model folder whose tokenizer fails to load and holds none of these (fast, SentencePiece,
BPE, tiktoken) has none: said so, rather than transformers' list of what it tried."""


def _load_tokenizer(spec: ModelSpec, source: str, options: LoadOptions) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=options.trust_remote_code)
    except (OSError, ValueError, TypeError) as exc:
        folder = Path(source)
        if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise ModelLoadError(
                f"{spec.source} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the "
                "tokenizer files of the model it comes from into it"
            ) from exc
        # transformers' reasons run over several lines (a list of what it tried): all of it, as one.
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ModelLoadError(f"could not load the tokenizer of {spec.source}: {reason}") from exc


def check_compatible(
    target_tokenizer: PreTrainedTokenizerBase,
    draft_tokenizer: PreTrainedTokenizerBase,
    target_vocab: int,
    draft_vocab: int,
) -> int:
    """Check that the draft and target share a vocabulary; return the shared vocabulary size.

    Token strings must map to the same ids in both tokenizers. An lm_head padded beyond the
    tokenizer is fine: the shared size is the smallest of the tokenizer and the two output layers.

    Raises:
        IncompatibleModelsError: the tokenizers disagree on any token's id (`draft_vocabulary`
            then maps the draft's vocabulary onto the target's, where it can).
    """
    target_map = target_tokenizer.get_vocab()
    draft_map = draft_tokenizer.get_vocab()
    if target_map != draft_map:
        tokens = target_map.keys() | draft_map.keys()
        differing = sum(1 for tok in tokens if target_map.get(tok) != draft_map.get(tok))
        raise IncompatibleModelsError(
            f"the draft and target tokenizers differ: {differing} of the {len(tokens)} tokens in either "
            "are missing from one or have different ids (speculative decoding needs one shared vocabulary)"
        )
    return min(len(target_tokenizer), target_vocab, draft_vocab)


def draft_vocabulary(
    target_tokenizer: PreTrainedTokenizerBase,
    draft_tokenizer: PreTrainedTokenizerBase,
    target_vocab: int,
    draft_vocab: int,
) -> tuple[int, VocabularyMap | None]:
    """The target's vocabulary size, and how the draft's maps onto it (None: they share one).

    Raises:
        IncompatibleModelsError: the tokenizers differ and no token of the draft's corresponds to
            one of the target's (`check_compatible`'s message).
    """
    try:
        return check_compatible(target_tokenizer, draft_tokenizer, target_vocab, draft_vocab), None
    except IncompatibleModelsError:
        target_size = min(len(target_tokenizer), target_vocab)
        mapping = map_vocabularies(
            target_tokenizer, draft_tokenizer, target_size, min(len(draft_tokenizer), draft_vocab)
        )
        if mapping is None:
            raise
        return target_size, mapping


def check_coverage(share: float, draft: ModelSpec) -> None:
    """Refuse a mapped draft whose paired tokens hold less than MIN_COVERAGE of the target's mass.

    Raises:
        IncompatibleModelsError: `share` < MIN_COVERAGE.
    """
    if share < MIN_COVERAGE:
        raise IncompatibleModelsError(
            f"the tokens {draft.name} shares with the target hold only {share:.0%} of the target's probability "
            f"mass (at least {MIN_COVERAGE:.0%} pays for a draft with another tokenizer): choose a draft "
            "whose vocabulary is closer to the target's"
        )


def load_pair(
    target: ModelSpec,
    draft: ModelSpec,
    options: LoadOptions,
    progress: Progress | None = None,
) -> ModelPair:
    """Load and check a target/draft pair.

    With several GPUs and `device` auto or cuda, the target is spread over them
    (`device_map="auto"`); the draft stays on the first.

    Args:
        target: The target model.
        draft: The draft model; source "lookup": none (drafts from prompt lookup).
        options: Device, dtype, trust_remote_code.
        progress: Called with a short description before each phase (None: none shown, but a GGUF
            file's first-start conversion is still announced, on stderr).

    Raises:
        ModelLoadError: either model or tokenizer fails to load.
        DeviceMemoryError: a model does not fit in GPU memory.
        IncompatibleModelsError: the draft's vocabulary cannot be mapped onto the target's, or
            its tokens cover too little of the target's probability mass (`check_coverage`).
    """
    report = progress or (lambda _message: None)
    device = resolve_device(options.device)
    if draft.source == LOOKUP:
        return _load_target_alone(target, draft, options, progress, device)
    report(f"loading tokenizers of {target.name} and {draft.name}")
    target_source, target_config = _load_config(target, options, progress)
    draft_source, draft_config = _load_config(draft, options, progress)
    target_tokenizer = _load_tokenizer(target, target_source, options)
    draft_tokenizer = _load_tokenizer(draft, draft_source, options)
    vocab_size, vocab_map = draft_vocabulary(
        target_tokenizer,
        draft_tokenizer,
        target_config.get_text_config().vocab_size,
        draft_config.get_text_config().vocab_size,
    )
    report(f"loading target model {target.name} ({target.quantization})")
    target_model = _load_model(
        target, options, target_source, target_config, device_map=target_device_map(options)
    )
    report(f"loading draft model {draft.name} ({draft.quantization})")
    draft_model = _load_model(draft, options, draft_source, draft_config, device_map=None)
    share = None
    if vocab_map is not None:
        report(f"mapping {draft.name}'s vocabulary onto the target's")
        share = coverage(target_model, target_tokenizer, vocab_map)
        check_coverage(share, draft)
    report("ready")
    return ModelPair(
        target=target_model,
        draft=draft_model,
        tokenizer=target_tokenizer,
        vocab_size=vocab_size,
        target_spec=target,
        draft_spec=draft,
        device=device,
        dtype=resolve_dtype(options.dtype, device),
        vocab_map=vocab_map,
        coverage=share,
        draft_tokenizer=None if vocab_map is None else draft_tokenizer,
    )


def _load_target_alone(
    target: ModelSpec, draft: ModelSpec, options: LoadOptions, progress: Progress | None, device: torch.device
) -> ModelPair:
    """`load_pair` with no draft model: the target and its tokenizer."""
    report = progress or (lambda _message: None)
    report(f"loading the tokenizer of {target.name}")
    source, config = _load_config(target, options, progress)
    tokenizer = _load_tokenizer(target, source, options)
    report(f"loading target model {target.name} ({target.quantization}); drafts from prompt lookup")
    model = _load_model(target, options, source, config, device_map=target_device_map(options))
    report("ready")
    return ModelPair(
        target=model,
        draft=None,
        tokenizer=tokenizer,
        vocab_size=min(len(tokenizer), config.get_text_config().vocab_size),
        target_spec=target,
        draft_spec=draft,
        device=device,
        dtype=resolve_dtype(options.dtype, device),
    )
