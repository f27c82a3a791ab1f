"""Shared fixtures: the real offline model pair from ../shared/models, loaded once per session."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import DistilBertConfig, DistilBertModel

from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.config import ENV_CALIBRATION_DIR
from tests.mapped_pairs import permuted_draft

MODELS_DIR = Path(
    os.environ.get("FSD_CHAT_MODELS", Path(__file__).resolve().parents[1] / ".." / "shared" / "models")
)
TARGET_DIR = MODELS_DIR / "stories260K"
DRAFT_DIR = MODELS_DIR / "stories260K-draft"

# The test models are tiny: a second intra-op thread only adds synchronisation, and on a shared
# 2-core machine it oversubscribes the cores (measured: hundreds of times slower under load).
torch.set_num_threads(1)

if not TARGET_DIR.is_dir():  # pragma: no cover - a broken checkout, not a test outcome
    raise RuntimeError(f"offline models not found at {MODELS_DIR} (set FSD_CHAT_MODELS)")


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point the config and data folders at tmp_path, so that no test touches the user's (the
    sessions, the error log, which llama.cpp's warnings reach once a command has set logging up)."""
    monkeypatch.setenv("FSD_CHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("FSD_CHAT_DATA_DIR", str(tmp_path / "data"))


@pytest.fixture(scope="session", autouse=True)
def calibration_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep llama.cpp's forward times (`fsd_chat.engines.llama_calibration`) in a folder of the
    session's, not the user's cache: timed once a worker for a file and thread split where the timing
    was steady, then read by every later load of the worker (commands run as subprocesses inherit
    it)."""
    folder = tmp_path_factory.mktemp("forward-times")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV_CALIBRATION_DIR, str(folder))
        yield folder


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under `--dist loadgroup` (the Makefile's) tests are spread over the workers one by one, so that
    no big file holds a worker while the other idles; but the tests of a module with a module-scoped
    fixture (a bench sweep, a converted model) stay on one worker, where the fixture runs once. A
    module that names its own group (`COMPILED_FORWARDS`) keeps it."""
    for item in items:
        definitions = getattr(item, "_fixtureinfo", None)
        if definitions is None or item.get_closest_marker("xdist_group") is not None:
            continue
        if any(d.scope == "module" for defs in definitions.name2fixturedefs.values() for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


COMPILED_FORWARDS = pytest.mark.xdist_group("compiled-forwards")
"""The group of the modules that compile the session pair's forwards (`--compile`): torch.compile
builds them once a process (`kv_cache.compiled_forward`), seconds a graph, so these modules share a
worker rather than each worker compiling them again (test_prefix_reuse's compiled conversation:
32 s compiling, 3 s after test_compile's replies)."""


@pytest.fixture(scope="session")
def target_dir() -> Path:
    """Directory of the stories260K target (a real pretrained Llama)."""
    return TARGET_DIR


@pytest.fixture(scope="session")
def draft_dir() -> Path:
    """Directory of its distilled draft."""
    return DRAFT_DIR


@pytest.fixture(scope="session")
def pair() -> ModelPair:
    """The offline pair on the CPU in float32 (shared: decoders never modify the models)."""
    return load_pair(
        ModelSpec(str(TARGET_DIR)), ModelSpec(str(DRAFT_DIR)), LoadOptions(device="cpu", dtype="float32")
    )


@pytest.fixture(scope="session")
def shuffled(tmp_path_factory: pytest.TempPathFactory) -> ModelPair:
    """The target with its draft under shuffled token ids (a mapped pair: same strings, other ids)."""
    directory, _ = permuted_draft(DRAFT_DIR, tmp_path_factory.mktemp("mapped") / "shuffled", seed=0)
    return load_pair(
        ModelSpec(str(TARGET_DIR)), ModelSpec(str(directory)), LoadOptions(device="cpu", dtype="float32")
    )


@pytest.fixture(scope="session")
def mismatched_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real draft with a tokenizer none of whose text tokens is the target's (each token's
    string starts with ☃; no merges), so its vocabulary cannot be mapped onto the target's."""
    other = tmp_path_factory.mktemp("models") / "mismatched-draft"
    shutil.copytree(DRAFT_DIR, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    special = {t["content"] for t in tokenizer["added_tokens"]}
    bpe = tokenizer["model"]
    bpe["vocab"] = {(t if t in special else "☃" + t): i for t, i in bpe["vocab"].items()}
    bpe["merges"] = []
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    return other


@pytest.fixture(scope="session")
def encoder_only_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny encoder-only model (DistilBERT) with the stories tokenizer: not a causal LM."""
    directory = tmp_path_factory.mktemp("models") / "encoder"
    config = DistilBertConfig(vocab_size=512, dim=32, n_layers=1, n_heads=2, hidden_dim=64)
    DistilBertModel(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TARGET_DIR / name, directory)
    return directory


@pytest.fixture
def failing_4bit_kernel(monkeypatch: pytest.MonkeyPatch) -> str:
    """bitsandbytes' 4-bit kernel failing at the first forward pass, injected at the boundary.

    Whether a real kernel refuses a model changes between releases (0.45's CPU kernel refused
    stories260K's 172-wide MLP; 0.50 runs it), so the failure is made here, in the one call the
    load-time check makes through a quantized layer: ``Linear4bit.forward``."""
    import bitsandbytes

    reason = "injected: this kernel does not support the layer's shape"

    def refuse(*_: object, **__: object) -> object:
        raise RuntimeError(reason)

    monkeypatch.setattr(bitsandbytes.nn.Linear4bit, "forward", refuse)
    return reason


LLAMA_CPP_MISSING = (
    "llama-cpp-python is not installed (make setup builds it): the llama.cpp engine's tests need it"
)


@pytest.fixture(scope="session")
def stories_gguf_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The offline pair written as float32 GGUF files (`tests.gguf_models.write_gguf`): (target, draft)."""
    from tests.gguf_models import write_gguf

    folder = tmp_path_factory.mktemp("stories-gguf")
    return write_gguf(TARGET_DIR, folder / "stories.gguf"), write_gguf(DRAFT_DIR, folder / "draft.gguf")


@pytest.fixture(scope="session")
def llama_pair(stories_gguf_files: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> ModelPair:
    """The offline pair as GGUF files on the llama.cpp engine, one thread (skipped without
    llama-cpp-python), set as a command sets it (`use_threads`, which finds its forward prices)."""
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)
    cache = tmp_path_factory.mktemp("llama-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FSD_CHAT_CACHE_DIR", str(cache))  # the tokenizers read from the files go there
        target, draft = stories_gguf_files
        pair = load_pair(
            ModelSpec(str(target)),
            ModelSpec(str(draft)),
            LoadOptions(device="cpu", engine="llama.cpp", threads=1),
        )
    pair.use_threads(1)
    return pair


@pytest.fixture(params=["transformers", "llama.cpp"])
def engine_pair(request: pytest.FixtureRequest) -> ModelPair:
    """The offline pair on each engine: transformers (`pair`) and llama.cpp (`llama_pair`)."""
    return request.getfixturevalue("pair" if request.param == "transformers" else "llama_pair")
