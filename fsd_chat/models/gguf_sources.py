"""GGUF files (llama.cpp, LM Studio, ollama) wherever a model is named, and what both engines read
of one: the file itself (a `.gguf` path, a folder that holds one `.gguf` file and no config.json,
or a Hub `repo_id:file.gguf`), checked whole; its trained context. The llama.cpp engine runs the
file as it is, with llama.cpp's own tokenizer (`fsd_chat.engines.llama_cpp_tokenizer`), and needs
nothing more; the transformers engine converts it (`gguf_files`).

Nothing here imports transformers, which the llama.cpp engine does not use
(`tests/test_import_hygiene.py`)."""

from __future__ import annotations

import re
import struct
import sys
from collections.abc import Callable
from pathlib import Path

from fsd_chat.models.gguf_table import TensorTable, dequantizable, holders, identity, read_table, type_names
from fsd_chat.models.load_errors import first_line
from fsd_chat.support.config import ENV_CACHE_DIR, cache_dir
from fsd_chat.support.errors import ModelLoadError

Progress = Callable[[str], object]
SUFFIX = ".gguf"
_HUB_FILE = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+):(?P<file>[^:]+\.gguf)", re.IGNORECASE)
_SPLIT = re.compile(r"-(?P<part>\d{5})-of-(?P<parts>\d{5})\.gguf", re.IGNORECASE)
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


def unwritable_cache(path: Path, folder: Path, exc: OSError) -> ModelLoadError:
    return ModelLoadError(
        f"cannot write the converted copy of {path.name} into {folder.parent}: {exc.strerror or exc} "
        f"(set {ENV_CACHE_DIR} to a writable folder)"
    )


def on_stderr(message: str) -> None:
    """A progress line on stderr, "fsd-chat: ..." (what a command without a loading screen shows)."""
    print(f"fsd-chat: {message}", file=sys.stderr, flush=True)
