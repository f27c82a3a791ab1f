"""GGUF model files (llama.cpp, LM Studio, ollama): recognised wherever a model is named, converted
once into a model folder in the user's cache, and loaded from there like any other folder.

A source is a GGUF model when it is a `.gguf` path, a folder that holds one `.gguf` file and no
config.json, or a Hub `repo_id:file.gguf`. transformers reads it (`from_pretrained(folder,
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
import struct
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    GgufConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TokenizersBackend,
)
from transformers.integrations.gguf import GGUF_ARCHS, is_gguf_arch_supported
from transformers.integrations.gguf.dequant import GGML_BLOCK
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

from fsd_chat.models.gguf_rope import scaled_rope_parameters
from fsd_chat.models.gguf_table import (
    FLOATS,
    TensorTable,
    dequantizable,
    holders,
    identity,
    read_table,
    type_names,
    with_values,
)
from fsd_chat.models.load_errors import first_line
from fsd_chat.support.config import ENV_CACHE_DIR, cache_dir
from fsd_chat.support.errors import ModelLoadError

Progress = Callable[[str], object]

SUFFIX = ".gguf"
_HUB_FILE = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+):(?P<file>[^:]+\.gguf)", re.IGNORECASE)
_SPLIT = re.compile(r"-(?P<part>\d{5})-of-(?P<parts>\d{5})\.gguf", re.IGNORECASE)
_UNSUPPORTED = re.compile(r"architecture (?P<arch>\S+) is not supported")
SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p"}
"""general.sampling.* keys (llama.cpp's gguf constants) -> the generation_config fields they set."""
CONVERSION_FORMAT = 4
"""Bumped when the converted copy's contents or key change, so older copies are converted again (2:
the end-of-turn tokens among the generation config's end-of-sequence ids; 3: the file's RoPE scaling
in the config's rope_parameters; 4: keyed by the file's content, not its path and mtime)."""
TRANSFORMERS_READS = frozenset(GGML_BLOCK) | FLOATS
"""The ggml types transformers' newer GGUF loader (its `GGUF_ARCHS`) reads itself."""


def gguf_file(source: str, progress: Progress) -> Path | None:
    """The local GGUF file a model source names, downloaded first for a Hub `repo_id:file.gguf`;
    None when the source is not a GGUF model.

    Raises:
        ModelLoadError: the file is missing or split, a folder holds several GGUF files, or the
            Hub download fails.
    """
    path = Path(source).expanduser()
    hub = _HUB_FILE.fullmatch(source)
    if hub and not path.exists():
        return _check_not_split(_download(hub["repo"], hub["file"], progress))
    if path.suffix.lower() == SUFFIX:
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {source}")
        return _check_not_split(path)
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX)
    if len(files) > 1 and not all(_SPLIT.search(p.name) for p in files):
        names = ", ".join(p.name for p in files)
        raise ModelLoadError(f"{source} holds {len(files)} GGUF files ({names}): name one, e.g. {files[0]}")
    return _check_not_split(files[0]) if files else None


def _check_not_split(path: Path) -> Path:
    split = _SPLIT.search(path.name)
    if split:
        raise ModelLoadError(
            f"{path} is part {int(split['part'])} of {int(split['parts'])} of a split GGUF model, which "
            f"transformers cannot load: merge the parts into one file (llama.cpp: llama-gguf-split --merge "
            f"{path.name} {_SPLIT.sub(SUFFIX, path.name)}) and name that"
        )
    return path


def _download(repo: str, filename: str, progress: Progress) -> Path:
    """A Hub file through huggingface_hub's cache (offline: the cached copy, if any)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    progress(f"downloading {filename} from {repo}")
    try:
        return Path(hf_hub_download(repo, filename))
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelLoadError(f"could not download {filename} from {repo}: {first_line(exc)}") from None


def readable_table(path: Path, *, dequantized: bool = True) -> TensorTable:
    """The GGUF file's metadata and tensor table, once its tensors' types are all ones the gguf
    package dequantizes (`dequantized`: for a conversion; llama.cpp reads its file itself) and its
    data is all there (the sizes of types the gguf package does not know are not checked).

    Raises:
        ModelLoadError: the file is not GGUF, or is damaged or truncated, or holds a tensor type no
            dequantizer reads (named, with its id and the tensors that hold it).
    """
    try:
        table = read_table(path)
    except (ValueError, struct.error, UnicodeDecodeError) as exc:
        reason = first_line(exc).replace(str(path), "it")
        raise ModelLoadError(f"{path} is not a readable GGUF file (damaged or truncated: {reason})") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}") from None
    unreadable = {entry.type_id for entry in table.tensors} - dequantizable()
    if unreadable and dequantized:
        raise ModelLoadError(
            f"{path} holds tensors of a ggml type that no dequantizer reads: {holders(table, unreadable)} "
            f"(fsd-chat reads {type_names(dequantizable())})"
        )
    sized = [entry for entry in table.tensors if entry.type_id not in unreadable]
    needed = table.data_start + max((entry.offset + entry.nbytes for entry in sized), default=0)
    size = path.stat().st_size
    if size < needed:
        raise ModelLoadError(
            f"{path} is truncated: it holds {size} of the {needed} bytes its tensor table needs "
            "(an interrupted download? fetch it again)"
        )
    return table


def converted_dir(path: Path, table: TensorTable | None = None) -> Path:
    """Where the converted copy of the GGUF file `path` lives (whether or not it exists yet): under
    its content's identity, so that a copy of the file elsewhere, or under another name, finds it.
    `table` is the file's (`readable_table`), read here when not given.

    Raises:
        ModelLoadError: as `readable_table`.
    """
    key = identity(table or readable_table(path), f"fsd-chat gguf conversion {CONVERSION_FORMAT}")
    root = cache_dir() / "gguf"
    found = sorted(folder for folder in root.glob(f"*-{key}") if (folder / "config.json").is_file())
    return found[0] if found else root / f"{path.stem}-{key}"


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
        raise _unwritable(path, folder, exc) from None
    try:
        model, tokenizer = _convert(path, table, folder.parent)
        try:
            _save(
                model,
                tokenizer,
                _generation_config(model.generation_config, table.metadata, tokenizer),
                path,
                staging,
            )
            staging.rename(folder)
        except OSError as exc:
            if not (folder / "config.json").is_file():  # not a conversion that finished first
                raise _unwritable(path, folder, exc) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def trained_context(path: Path) -> int | None:
    """The context window the GGUF file `path` was trained for, in tokens (its
    `{architecture}.context_length` key; None when it has none or cannot be read)."""
    try:
        table = read_table(path)
    except (ValueError, struct.error, UnicodeDecodeError, OSError):
        return None
    value = table.metadata.get(f"{table.architecture}.context_length")
    return value if isinstance(value, int) and value > 0 else None


TOKENIZER_FORMAT = 1
"""Bumped when the cached tokenizer folder's contents change (`gguf_tokenizer`)."""


def gguf_tokenizer(path: Path, progress: Progress) -> tuple[PreTrainedTokenizerBase, GenerationConfig]:
    """The tokenizer of the GGUF file `path` (with its chat template) and its generation config
    (`_generation_config`: the file's sampling keys and end-of-turn ids), for the llama.cpp engine,
    which runs the file itself and needs of transformers only the tokenizer. transformers reads a
    GGUF file's vocabulary in seconds (3 s for SmolLM2's 49,152 tokens on a loaded 2-core CPU), so
    the first start saves it into the user's cache, keyed by the file's content as the converted
    copy is (0.3 s to load); a converted copy, where one exists, already holds it.

    Raises:
        ModelLoadError: the file is not a readable GGUF file, or is truncated (`readable_table`),
            or transformers cannot read its tokenizer, or the cache is not writable.
    """
    table = readable_table(path, dequantized=False)
    key = identity(table, f"fsd-chat gguf tokenizer {TOKENIZER_FORMAT}")
    root = cache_dir() / "gguf-tokenizers"
    folder = root / f"{path.stem}-{key}"
    converted = converted_dir(path, table)
    if not (folder / "generation_config.json").is_file() and (converted / "tokenizer_config.json").is_file():
        folder = converted
    if not (folder / "generation_config.json").is_file():
        progress(f"reading the tokenizer of {path.name} (first start only)")
        try:
            # The tokenizer class itself: AutoTokenizer would first read the file's config through
            # the gguf package's reader, which parses every vocabulary string (10 s of 13).
            tokenizer = TokenizersBackend.from_pretrained(str(path.parent), gguf_file=path.name)
        except (ValueError, OSError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"could not read the tokenizer of {path}: {first_line(exc)}") from None
        base = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        generation = _generation_config(base, table.metadata, tokenizer)
        try:
            root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
            try:
                tokenizer.save_pretrained(staging)
                generation.save_pretrained(staging)
                staging.rename(folder)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        except OSError as exc:
            if not (folder / "generation_config.json").is_file():  # not a save that finished first
                raise _unwritable(path, folder, exc) from None
    try:
        return AutoTokenizer.from_pretrained(str(folder)), GenerationConfig.from_pretrained(str(folder))
    except (ValueError, OSError) as exc:
        raise ModelLoadError(
            f"could not load the cached tokenizer of {path} ({folder}): {first_line(exc)}"
        ) from None


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


def _unwritable(path: Path, folder: Path, exc: OSError) -> ModelLoadError:
    return ModelLoadError(
        f"cannot write the converted copy of {path.name} into {folder.parent}: {exc.strerror or exc} "
        f"(set {ENV_CACHE_DIR} to a writable folder)"
    )


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


def _generation_config(
    base: GenerationConfig, metadata: Mapping[str, object], tokenizer: PreTrainedTokenizerBase
) -> GenerationConfig:
    """`base` (transformers' from the file's token ids) with the file's general.sampling.* keys,
    which turn sampling on (a file without them, or with temp <= 0, decodes greedily), and with the
    tokens that end a turn among its end-of-sequence ids (`end_of_turn_ids`)."""
    sampling = {
        field: metadata[f"general.sampling.{key}"]
        for key, field in SAMPLING_KEYS.items()
        if f"general.sampling.{key}" in metadata
    }
    if float(sampling.get("temperature", 1.0)) <= 0:  # type: ignore[arg-type]
        sampling = {}  # llama.cpp samples greedily at temperature <= 0
    ends = end_of_turn_ids(base.eos_token_id, metadata, tokenizer)
    return GenerationConfig.from_dict(
        {**base.to_dict(), **sampling, "do_sample": bool(sampling), "eos_token_id": ends}
    )


END_OF_TURN_TOKENS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
)
"""Tokens that end a turn wherever a vocabulary holds them: llama.cpp's list (llama-vocab.cpp, its
end-of-generation tokens found by text). A GGUF file names one end-of-sequence token, often not the
one its chat template ends a turn with: gemma-3-270m-it's names `<eos>`, while its replies end
with `<end_of_turn>` (its generation_config.json lists both; the file cannot)."""


def end_of_turn_ids(
    eos: int | list[int] | None, metadata: Mapping[str, object], tokenizer: PreTrainedTokenizerBase
) -> int | list[int] | None:
    """The ids that end a reply of a GGUF model, as llama.cpp ends one: `eos` (the file's
    end-of-sequence id, as transformers read it), the file's end-of-turn and end-of-message ids
    (tokenizer.ggml.eot_token_id, eom_token_id), and every `END_OF_TURN_TOKENS` token its
    vocabulary holds. One id stays an int (as transformers writes it); None when there are none."""
    ids = {eos} if isinstance(eos, int) else set(eos or ())
    ids |= {
        v for key in ("eot", "eom") if isinstance(v := metadata.get(f"tokenizer.ggml.{key}_token_id"), int)
    }
    vocabulary = tokenizer.get_vocab()
    ids |= {vocabulary[token] for token in END_OF_TURN_TOKENS if token in vocabulary}
    ordered = sorted(ids)
    return None if not ordered else ordered[0] if len(ordered) == 1 else ordered


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


def on_stderr(message: str) -> None:
    """A progress line on stderr, "fsd-chat: ..." (what a command without a loading screen shows)."""
    print(f"fsd-chat: {message}", file=sys.stderr, flush=True)
