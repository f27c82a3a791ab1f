"""GGUF files (llama.cpp, LM Studio, ollama) wherever a model is named, and what both engines read
of one: the file itself (a `.gguf` path, a folder that holds one `.gguf` file and no config.json,
or a Hub `repo_id:file.gguf`), checked whole; its trained context; its tokenizer and generation
config, cached by the file's content (`gguf_tokenizer`). The llama.cpp engine runs the file as it
is and needs nothing more; the transformers engine converts it (`gguf_files`).

Nothing here imports transformers' modeling or GGUF-conversion stack (torch._dynamo comes with it,
70 MB), which the llama.cpp engine does not use (`tests/test_import_hygiene.py`)."""

from __future__ import annotations

import re
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from transformers import GenerationConfig, PreTrainedTokenizerBase, TokenizersBackend

from fsd_chat.models.gguf_table import TensorTable, dequantizable, holders, identity, read_table, type_names
from fsd_chat.models.load_errors import first_line
from fsd_chat.support.config import ENV_CACHE_DIR, cache_dir
from fsd_chat.support.errors import ModelLoadError

Progress = Callable[[str], object]
SUFFIX = ".gguf"
_HUB_FILE = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+):(?P<file>[^:]+\.gguf)", re.IGNORECASE)
_SPLIT = re.compile(r"-(?P<part>\d{5})-of-(?P<parts>\d{5})\.gguf", re.IGNORECASE)
SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p"}
"""general.sampling.* keys (llama.cpp's gguf constants) -> the generation_config fields they set."""
CONVERSION_FORMAT = 4
"""Bumped when the converted copy's contents or key change, so older copies are converted again (2:
the end-of-turn tokens among the generation config's end-of-sequence ids; 3: the file's RoPE scaling
in the config's rope_parameters; 4: keyed by the file's content, not its path and mtime)."""


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


def trained_context(table: TensorTable) -> int | None:
    """The context window a GGUF file (its `table`) was trained for, in tokens (its
    `{architecture}.context_length` key; None when it has none)."""
    value = table.metadata.get(f"{table.architecture}.context_length")
    return value if isinstance(value, int) and value > 0 else None


TOKENIZER_FORMAT = 1
"""Bumped when the cached tokenizer folder's contents change (`gguf_tokenizer`)."""


def gguf_tokenizer(
    table: TensorTable, progress: Progress
) -> tuple[PreTrainedTokenizerBase, GenerationConfig]:
    """The tokenizer of a GGUF file (its `table`, `readable_table(path, dequantized=False)`: read
    once a start, 0.1 s for SmolLM2) with its chat template, and its generation config
    (`file_generation_config`: the file's sampling keys and end-of-turn ids), for the llama.cpp engine,
    which runs the file itself and needs of transformers only the tokenizer. The first start builds
    it from the file with transformers' own `from_pretrained(..., gguf_file=...)` (1.3-1.6 s for
    SmolLM2's 49,152 tokens on a loaded 2-core CPU, most of it transformers' reader and
    conversion and the imports they need) and saves it into the user's cache, keyed by the file's
    content as the converted copy is; later starts load that (0.15 s); a converted copy, where one
    exists, already holds it.

    Raises:
        ModelLoadError: transformers cannot build the file's tokenizer, or the cache is not writable.
    """
    path = table.path
    key = identity(table, f"fsd-chat gguf tokenizer {TOKENIZER_FORMAT}")
    root = cache_dir() / "gguf-tokenizers"
    folder = root / f"{path.stem}-{key}"
    converted = converted_dir(path, table)
    if not (folder / "generation_config.json").is_file() and (converted / "tokenizer_config.json").is_file():
        folder = converted
    if (folder / "generation_config.json").is_file():
        try:
            # The class the first read makes, named: AutoTokenizer would load the folder's model
            # config (a converted copy's), whose model module imports torch.distributed and sympy.
            # Its added tokens are the backend's own (tokenizer.json): without an (empty) list of
            # them, transformers parses the whole tokenizer.json in Python to find them again
            # (0.1 s, and 14 MB held after it), then the backend reads it.
            tokenizer = TokenizersBackend.from_pretrained(str(folder), added_tokens_decoder={})
            return tokenizer, GenerationConfig.from_pretrained(str(folder))
        except (ValueError, OSError) as exc:
            raise ModelLoadError(
                f"could not load the cached tokenizer of {path} ({folder}): {first_line(exc)}"
            ) from None
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
    generation = file_generation_config(base, table.metadata, tokenizer)
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
            raise unwritable_cache(path, folder, exc) from None
    return tokenizer, generation  # what the cache now holds: not read back (0.2 s)


def unwritable_cache(path: Path, folder: Path, exc: OSError) -> ModelLoadError:
    return ModelLoadError(
        f"cannot write the converted copy of {path.name} into {folder.parent}: {exc.strerror or exc} "
        f"(set {ENV_CACHE_DIR} to a writable folder)"
    )


def file_generation_config(
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


def on_stderr(message: str) -> None:
    """A progress line on stderr, "fsd-chat: ..." (what a command without a loading screen shows)."""
    print(f"fsd-chat: {message}", file=sys.stderr, flush=True)
