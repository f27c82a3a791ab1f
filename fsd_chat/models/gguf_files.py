"""GGUF model files on the transformers engine: converted once into a model folder in the user's
cache, and loaded from there like any other folder (the llama.cpp engine runs the file itself).

A source is a GGUF model as `gguf_sources.gguf_file` finds one. transformers reads it (`from_pretrained(folder,
gguf_file=name)`, weights dequantized) in about 48 s for a 270M model, parsing the file once each for
the config, the tokenizer and the weights; a start from a safetensors folder takes a few seconds. So
the first start converts the file (`save_pretrained` of the model in float32, the dequantized values
exactly, and of the tokenizer with its chat template), and every later start loads the copy. The
copy is keyed by the file's content (`gguf_table.identity`: its header and tensor table, its size and
samples of its data), so that a copy or a move of the file reuses it, and written to a temporary
folder renamed into place, so an interrupted conversion leaves no half copy.

Every tensor type the `gguf` package dequantizes loads, in any mix (llama.cpp's K-quant files hold
Q5_0, Q5_1 or Q8_0 tensors wherever a row is not a multiple of 256 values). transformers reads most
architectures through its older GGUF loader, which dequantizes each tensor with the gguf package;
its newer one (lfm2, qwen35, qwen35moe: `GGUF_ARCHS`) dequantizes with its own code, bit for bit the
gguf package's values for the types it has, and refuses the others (Q5_0, Q5_1, TQ1_0, TQ2_0, MXFP4,
NVFP4): it is handed a copy of the file with those tensors stored as the gguf package's float32
values (`gguf_table.with_values`).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig
from transformers.integrations.gguf import GGUF_ARCHS, is_gguf_arch_supported
from transformers.integrations.gguf.dequant import GGML_BLOCK
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

from fsd_chat.models.generation import end_of_turn_ids, file_generation
from fsd_chat.models.gguf_rope import scaled_rope_parameters
from fsd_chat.models.gguf_sources import (
    Progress,
    converted_dir,
    gguf_file,
    on_stderr,
    readable_table,
    unwritable_cache,
)
from fsd_chat.models.gguf_table import FLOATS, TensorTable, with_values
from fsd_chat.models.load_errors import first_line
from fsd_chat.support.errors import ModelLoadError

if TYPE_CHECKING:  # the modeling stack (torch._dynamo with it): imported by the torch engine alone
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_UNSUPPORTED = re.compile(r"architecture (?P<arch>\S+) is not supported")
TRANSFORMERS_READS = frozenset(GGML_BLOCK) | FLOATS
"""The ggml types transformers' newer GGUF loader (its `GGUF_ARCHS`) reads itself."""


def converted_model(path: Path, progress: Progress) -> Path:
    """The model folder converted from the GGUF file `path`, converting it on the first start.

    Args:
        path: A local GGUF file.
        progress: Told "converting NAME.gguf (first start only)" before a conversion, or "loading
            the converted copy of NAME.gguf (converted on an earlier start)" when there is one.

    Returns:
        A folder with config.json, model.safetensors (float32), the tokenizer with its chat template,
        and generation_config.json (sampling from the file's general.sampling.* keys, else greedy).

    Raises:
        ModelLoadError: the file is damaged or truncated, holds a tensor type no dequantizer reads
            (`readable_table`), holds an architecture transformers cannot load, or scales its rotary
            embedding in a way transformers cannot represent (`scaled_rope_parameters`).
    """
    table = readable_table(path)
    folder = converted_dir(path, table)
    if (folder / "config.json").is_file():
        progress(f"loading the converted copy of {path.name} (converted on an earlier start)")
    else:
        _convert_into(path, table, folder, progress)
    _remove_older_copies(path, folder, progress)
    return folder


def _convert_into(path: Path, table: TensorTable, folder: Path, progress: Progress) -> None:
    """The converted copy of `path` written to `folder`: into a staging folder beside it, renamed
    into place once whole (a conversion that finished first, in another process, is kept).

    Raises:
        ModelLoadError: as `converted_model`.
    """
    progress(f"converting {path.name} (first start only)")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    except OSError as exc:
        raise unwritable_cache(path, folder, exc) from None
    try:
        model, tokenizer = _convert(path, table, folder.parent)
        try:
            _save(
                model,
                tokenizer,
                _generation_config(model.generation_config, table, tokenizer),
                path,
                staging,
            )
            staging.rename(folder)
        except OSError as exc:
            if not (folder / "config.json").is_file():  # not a conversion that finished first
                raise unwritable_cache(path, folder, exc) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_older_copies(path: Path, folder: Path, progress: Progress) -> None:
    """Removes the converted copies `path` had before `folder` (each its own size of float32
    weights): those of its earlier contents, or of an earlier `CONVERSION_FORMAT`, which no key
    leads to any more. A copy is `path`'s when its gguf-source.json names it; a file of the same
    earlier content elsewhere, which shared that copy, is converted again on its next start."""
    source = str(path.resolve())
    for other in folder.parent.iterdir():
        if other == folder or other.name.startswith("."):  # staging folders of running conversions
            continue
        try:
            named = json.loads((other / "gguf-source.json").read_text(encoding="utf-8")).get("gguf")
        except (OSError, ValueError, AttributeError):  # not a converted copy, or not one we can read
            continue
        if named == source:
            shutil.rmtree(other, ignore_errors=True)
            progress(f"removed an older converted copy of {path.name} ({other.name})")


def _weights_file(path: Path, table: TensorTable, scratch: Path) -> Path:
    """The GGUF file transformers is to read the weights from: `path`, or, for an architecture its
    newer loader reads (which dequantizes with its own code and lacks some types), a copy in
    `scratch` whose tensors of the types it lacks hold the gguf package's float32 values."""
    lacking = {entry.type_id for entry in table.tensors} - TRANSFORMERS_READS
    if not lacking or not is_gguf_arch_supported(table.architecture):
        return path
    return with_values(table, frozenset(lacking), scratch / path.name)


def _convert(
    path: Path, table: TensorTable, scratch: Path
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The GGUF file's model (dequantized, float32) and tokenizer, through transformers; the model's
    config carries the file's RoPE scaling, which transformers' reader drops (`scaled_rope_parameters`).
    `scratch` is a folder for a temporary copy of the file (`_weights_file`), removed once it is read."""
    where, name = str(path.parent), path.name
    try:
        config = AutoConfig.from_pretrained(where, gguf_file=name)
        rope = scaled_rope_parameters(table, config)  # before the slow parts: it may refuse
        if rope is not None:
            config.rope_parameters = rope
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        with tempfile.TemporaryDirectory(prefix=f".{path.stem}.", dir=scratch) as copies:
            weights = _weights_file(path, table, Path(copies))
            model = AutoModelForCausalLM.from_pretrained(
                str(weights.parent),
                gguf_file=weights.name,
                config=config,
                dtype=torch.float32,
                quantization_config=GgufConfig(dequantize=True),
            )
    except ValueError as exc:
        unsupported = _UNSUPPORTED.search(str(exc))
        if unsupported:
            known = ", ".join(sorted(loadable_architectures()))
            raise ModelLoadError(
                f"{path} holds a {unsupported['arch']} model, an architecture transformers cannot load "
                f"from GGUF (it loads {known})"
            ) from None
        raise ModelLoadError(f"could not convert {path}: {first_line(exc)}") from exc
    except (OSError, RuntimeError, TypeError, KeyError) as exc:
        raise ModelLoadError(f"could not convert {path}: {first_line(exc)}") from exc
    # Dequantized, the model is a plain one: transformers refuses to save a model that still names
    # its quantizer, so the GGUF quantizer's own clean-up removes it.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model, tokenizer


def _generation_config(
    base: GenerationConfig, table: TensorTable, tokenizer: PreTrainedTokenizerBase
) -> GenerationConfig:
    """`base` (transformers' from the converted model's config) with the file's generation defaults
    (`file_generation`): transformers' type made of them, here alone."""
    ends = end_of_turn_ids(base.eos_token_id, table.metadata, tokenizer.get_vocab())
    defaults = file_generation(table.metadata, bos=base.bos_token_id, eos=ends, pad=base.pad_token_id)
    return GenerationConfig.from_dict({**base.to_dict(), **defaults.as_dict()})


def _save(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    generation: GenerationConfig,
    path: Path,
    folder: Path,
) -> None:
    """The converted copy into `folder`, with where it came from (gguf-source.json, for people)."""
    model.generation_config = generation
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # The first file converted into it: a copy elsewhere, of the same content, shares the folder.
    source = {"gguf": str(path.resolve()), "size": path.stat().st_size}
    (folder / "gguf-source.json").write_text(json.dumps(source, indent=2))


def loadable_architectures() -> set[str]:
    """The GGUF architectures transformers loads: its GGUF loader's and its older loader's (whose
    list is the keys of its metadata mapping, which also holds the "general" and "tokenizer" groups)."""
    return (set(GGUF_ARCHS) | set(GGUF_SUPPORTED_ARCHITECTURES)) - {"general", "tokenizer"}


def local_model(source: str, progress: Progress | None) -> str | None:
    """The model folder to load for a GGUF source (converted on its first start); None for any
    other source. Downloads and conversions are announced through `progress`, or on stderr when the
    caller shows no progress (a conversion takes one to two minutes for a 135M model on a 2-core CPU).

    Raises:
        ModelLoadError: as `gguf_file` and `converted_model`.
    """
    announce = progress or on_stderr
    path = gguf_file(source, announce)
    return None if path is None else str(converted_model(path, announce))
