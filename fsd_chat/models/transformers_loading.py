"""Loading a target/draft pair on the transformers engine: Hub ids, model folders, GGUF files
converted once to a float32 copy (`gguf_files`), on a device, in a dtype, bitsandbytes quantization.
Every failure becomes a `ModelLoadError` / `IncompatibleModelsError` / `DeviceMemoryError` with a
one-line message (`load_errors`).

Imported only when `loading.load_pair` takes this engine: transformers' modeling stack (70 MB with
torch._dynamo) is no part of a process on llama.cpp."""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from fsd_chat.decoding.settings import LOOKUP
from fsd_chat.decoding.tokenizer import Tokenizer
from fsd_chat.engines.torch_engine.fused_linear import fuse_projections
from fsd_chat.engines.torch_engine.packed_linear import pack_linear_layers
from fsd_chat.models.devices import resolve_device, resolve_dtype, target_device_map
from fsd_chat.models.gguf_files import local_model
from fsd_chat.models.gguf_sources import Progress
from fsd_chat.models.load_errors import (
    check_load_report,
    check_quantized_forward,
    damaged_file,
    first_line,
    load_failure,
    out_of_memory,
    refused_pickle,
)
from fsd_chat.models.options import LoadOptions, ModelSpec, check_quantization
from fsd_chat.models.pair import ModelPair
from fsd_chat.models.vocabulary import checked_coverage, draft_vocabulary
from fsd_chat.support.errors import ModelLoadError


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


def _load_tokenizer(spec: ModelSpec, source: str, options: LoadOptions) -> Tokenizer:
    """The model's tokenizer: transformers' own, which meets `Tokenizer` as it is (cast: its
    annotations are wider, e.g. `decode` of a batch gives `list[str]`)."""
    try:
        loaded = AutoTokenizer.from_pretrained(source, trust_remote_code=options.trust_remote_code)
        return cast("Tokenizer", loaded)
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


def load_transformers_pair(
    target: ModelSpec, draft: ModelSpec, options: LoadOptions, progress: Progress | None
) -> ModelPair:
    """`loading.load_pair` on the transformers engine (its errors)."""
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
        share = checked_coverage(target_model, target_tokenizer, vocab_map, draft, report)
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
    """`load_transformers_pair` with no draft model: the target and its tokenizer."""
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
