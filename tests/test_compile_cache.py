"""torch.compile's artifacts kept in the user's cache (`compile_cache`): keyed by the models, the
versions and the device; saved after a compilation, loaded back into torch's caches before the
next; a damaged or missing file is a miss, not an error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._dynamo

from fsd_chat.engines.torch_engine import compile_cache
from fsd_chat.models.pair import ModelPair


def test_the_key_is_the_models_versions_and_device(pair: ModelPair, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    both = compile_cache.artifact_key([pair.target, pair.draft], cpu, "whole-step")
    assert both == compile_cache.artifact_key([pair.target, pair.draft], cpu, "whole-step")
    assert both != compile_cache.artifact_key([pair.target], cpu, "whole-step")
    assert both != compile_cache.artifact_key([pair.target, pair.draft], cpu, "other")
    monkeypatch.setattr(compile_cache, "device_identity", lambda device: "cuda H100 sm90")
    assert both != compile_cache.artifact_key([pair.target, pair.draft], cpu, "whole-step")
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert both != compile_cache.artifact_key([pair.target, pair.draft], cpu, "whole-step")


def test_the_default_folder_is_the_users_cache(
    pair: ModelPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FSD_CHAT_CACHE_DIR", str(tmp_path))
    path = compile_cache.artifact_path([pair.target], torch.device("cpu"), "whole-step")
    assert path.parent == tmp_path / compile_cache.FOLDER and path.name.startswith("whole-step-")


@pytest.mark.slow  # inductor builds a C++ kernel
def test_saved_artifacts_load_back(tmp_path: Path) -> None:
    """A compiled function's artifacts round-trip through the file: what is saved is what torch
    loads back, after its in-memory state is reset."""
    compiled = torch.compile(lambda x: torch.sin(x) * 3 + 1, fullgraph=True, dynamic=False)
    x = torch.randn(16)
    want = compiled(x)
    path = tmp_path / "nested" / "whole-step-key.bin"
    assert compile_cache.save(path) and path.stat().st_size > 0
    assert not list(path.parent.glob("*.partial"))
    saved = torch.compiler.save_cache_artifacts()
    assert saved is not None and path.read_bytes() == saved[0]  # torch's blob, whole
    torch._dynamo.reset()
    assert compile_cache.load(path)
    assert torch.equal(compiled(x), want)
    # A damaged file, or none, is a miss.
    path.write_bytes(b"not an artifact")
    assert not compile_cache.load(path)
    assert not compile_cache.load(tmp_path / "missing.bin")


def test_an_unwritable_folder_is_no_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder would be")
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"blob", None))
    assert not compile_cache.save(blocked / "whole-step-key.bin")
