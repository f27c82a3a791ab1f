"""Which engine runs a model pair (`--engine`), and why, and the pair loaded on llama.cpp.

- transformers: any model (Hub ids, folders, GGUF files converted once to float32, bitsandbytes
  quantization);
- llama.cpp: GGUF files, natively quantized, through llama-cpp-python (`fsd_chat.engines.llama_cpp`);
- auto: llama.cpp when the target (and the draft, unless drafts come from prompt lookup) is a GGUF
  file, no bitsandbytes quantization is asked for, and llama-cpp-python loads; else transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsd_chat.decoding.settings import LOOKUP
from fsd_chat.engines.llama_cpp import CONTEXT, LlamaCppModel, gpu_offload, open_gguf, unavailable
from fsd_chat.engines.llama_cpp_tokenizer import LlamaCppTokenizer
from fsd_chat.models.default_model import resolve_target
from fsd_chat.models.generation import file_generation
from fsd_chat.models.gguf_sources import (
    Progress,
    gguf_file,
    on_stderr,
    readable_table,
    trained_context,
)
from fsd_chat.models.gguf_table import TensorTable
from fsd_chat.models.options import Engine, LoadOptions, ModelSpec, check_device_name
from fsd_chat.models.pair import ModelPair
from fsd_chat.models.vocabulary import checked_coverage, draft_vocabulary
from fsd_chat.support.errors import ModelLoadError

LLAMA_CPP = "llama.cpp"
TRANSFORMERS = "transformers"


@dataclass(frozen=True, slots=True)
class EngineChoice:
    """The engine a pair runs on, and why, in a few words (the loading screen and stderr say it).

    Attributes:
        engine: "llama.cpp" or "transformers".
        reason: e.g. "a GGUF file, llama-cpp-python installed", "--engine transformers".
        target_file: The target's GGUF file (None: not a GGUF model).
        draft_file: The draft's GGUF file (None: prompt lookup, or not a GGUF model).
        target_is_gguf: The target is a GGUF file, which either engine runs (the choice is worth
            saying).
    """

    engine: str
    reason: str
    target_file: Path | None = None
    draft_file: Path | None = None
    target_is_gguf: bool = False

    def describe(self) -> str:
        """One line: "engine llama.cpp (a GGUF file, llama-cpp-python installed)"."""
        return f"engine {self.engine} ({self.reason})"


def choose_engine(
    target: ModelSpec, draft: ModelSpec, options: LoadOptions, progress: Progress
) -> EngineChoice:
    """The engine `options.engine` asks for, over these models.

    Raises:
        ModelLoadError: `--engine llama.cpp` with a model that is not a GGUF file, with
            bitsandbytes quantization, or without llama-cpp-python (the one-line reason).
    """
    asked = options.engine
    if asked == TRANSFORMERS:
        return EngineChoice(TRANSFORMERS, "--engine transformers")
    target_file = gguf_file(target.source, progress)
    gguf = target_file is not None
    draft_file = None if draft.source == LOOKUP else gguf_file(draft.source, progress)
    not_gguf = next(
        (
            spec.name
            for spec, file in ((target, target_file), (draft, draft_file))
            if file is None and spec.source != LOOKUP
        ),
        None,
    )
    quantized = next((s.name for s in (target, draft) if s.quantization != "none"), None)
    if asked == LLAMA_CPP:
        if not_gguf is not None:
            raise ModelLoadError(
                f"--engine llama.cpp runs GGUF files, and {not_gguf} is not one: name a .gguf file, "
                "or use --engine transformers"
            )
        if quantized is not None:
            raise ModelLoadError(
                f"--engine llama.cpp runs a GGUF file as it is quantized: drop --quantize-target / "
                f"--quantize-draft (bitsandbytes, asked for {quantized}), or use --engine transformers"
            )
        if (missing := unavailable()) is not None:
            raise ModelLoadError(missing)
        return EngineChoice(LLAMA_CPP, "--engine llama.cpp", target_file, draft_file, True)
    if not_gguf is not None:
        return EngineChoice(TRANSFORMERS, f"{not_gguf} is not a GGUF file", target_is_gguf=gguf)
    if quantized is not None:
        return EngineChoice(TRANSFORMERS, "bitsandbytes quantization asked for", target_is_gguf=gguf)
    # Asked last: it imports llama_cpp, which no other choice needs.
    if (missing := unavailable()) is not None:
        reason = f"a GGUF file, but llama-cpp-python is not available: {missing}"
        return EngineChoice(TRANSFORMERS, reason, target_is_gguf=True)
    return EngineChoice(LLAMA_CPP, "a GGUF file, llama-cpp-python installed", target_file, draft_file, True)


def engine_for(target: str, draft: str, engine: Engine) -> str:
    """The engine `choose_engine` would take for these sources (target "default": the default chat
    model), before anything loads: "llama.cpp" or "transformers".

    Raises:
        ModelLoadError: as `choose_engine`.
    """
    return choose_engine(
        ModelSpec(resolve_target(target)), ModelSpec(draft), LoadOptions(engine=engine), on_stderr
    ).engine


def _wants_gpu(options: LoadOptions) -> bool:
    """Whether llama.cpp offloads the layers to a GPU: --device auto on a build that can, or cuda.

    Raises:
        ModelLoadError: --device cuda with a llama-cpp-python built without GPU support.
    """
    device = check_device_name(options.device)
    if device == "cpu":
        return False
    if device == "auto":
        return gpu_offload()
    if not gpu_offload():
        raise ModelLoadError(
            f"--device {device} asked for, but this llama-cpp-python was built for the CPU only: rebuild it "
            'with CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-binary :all: llama-cpp-python'
        )
    return True


def _open(table: TensorTable, threads: int, gpu: bool) -> Any:
    """`open_gguf` of the file whose table `table` is, with a KV cache of its trained context, at most
    CONTEXT tokens."""
    context = min(trained_context(table) or CONTEXT, CONTEXT)
    return open_gguf(table.path, threads=threads, gpu=gpu, context=context)


def load_llama_cpp_pair(
    choice: EngineChoice,
    target: ModelSpec,
    draft: ModelSpec,
    options: LoadOptions,
    progress: Progress | None,
) -> ModelPair:
    """The pair on llama.cpp: the GGUF files loaded as they are (no conversion, no float32 copy),
    with llama.cpp's own tokenizers (`LlamaCppTokenizer`) and the target file's generation defaults
    (`file_generation`), on `options.threads` (None: torch's thread count), torch then on one
    (`ModelPair.use_threads` says why; a command sets both there after loading). `progress` is told
    each phase (None: nothing shown).

    Raises:
        ModelLoadError: llama.cpp cannot load a file.
        IncompatibleModelsError: the draft's vocabulary cannot be mapped onto the target's.
        UnsupportedCacheError: a model keeps recurrent state.
    """
    assert choice.target_file is not None
    report = progress or (lambda _message: None)
    gpu = _wants_gpu(options)
    threads = options.threads or torch.get_num_threads()
    torch.set_num_threads(1)  # see `ModelPair.use_threads`
    target_table = readable_table(choice.target_file, dequantized=False)  # read once: 0.1 s
    where = "GPU" if gpu else f"CPU, {threads} thread{'s' * (threads > 1)}"
    report(f"loading target model {target.name} on llama.cpp ({where})")
    target_llama = _open(target_table, threads, gpu)
    tokenizer = LlamaCppTokenizer(target_llama)
    target_model = LlamaCppModel(target_llama, len(tokenizer))
    generation = file_generation(
        target_table.metadata,
        bos=tokenizer.bos_token_id,
        eos=target_model.eos_token_ids,  # llama.cpp's end-of-generation ids
        pad=tokenizer.pad_token_id,
    )
    vocab_size = target_model.vocab_size
    draft_model = vocab_map = share = draft_tokenizer = None
    if choice.draft_file is not None:
        draft_table = readable_table(choice.draft_file, dequantized=False)
        report(f"loading draft model {draft.name} on llama.cpp")
        draft_llama = _open(draft_table, threads, gpu)
        draft_tokenizer = LlamaCppTokenizer(draft_llama)
        draft_model = LlamaCppModel(draft_llama, len(draft_tokenizer))
        vocab_size, vocab_map = draft_vocabulary(
            tokenizer, draft_tokenizer, target_model.vocab_size, draft_model.vocab_size
        )
        target_model.vocab_size = vocab_size
        if vocab_map is None:
            draft_model.vocab_size = vocab_size
        else:
            share = checked_coverage(target_model, tokenizer, vocab_map, draft, report)
    report("ready")
    return ModelPair(
        target=target_model,
        draft=draft_model,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        target_spec=target,
        draft_spec=draft,
        device=torch.device("cuda" if gpu else "cpu"),
        dtype=torch.float32,
        vocab_map=vocab_map,
        coverage=share,
        draft_tokenizer=None if vocab_map is None else draft_tokenizer,
        engine=LLAMA_CPP,
        generation=generation,
    )
