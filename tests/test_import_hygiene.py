"""Deferred imports, checked rather than hoped for.

The import-linter contracts (`[tool.importlinter]` in pyproject.toml, checked by `make lint`) read
the static graph, where an import deferred into a function counts like any other; the subprocess
checks here look at `sys.modules`, the only way to prove that a deferral defers.
"""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import fsd_chat.decoding
from fsd_chat.support.config import ENV_CACHE_DIR
from tests.conftest import LLAMA_CPP_MISSING
from tests.test_bench_cli import DATA_DIR

pytestmark = pytest.mark.slow  # each test starts Python subprocesses


def loaded(code: str, watched: tuple[str, ...], env: dict[str, str] | None = None) -> list[str]:
    """The `watched` modules that running `code` in a fresh interpreter (in `env`) imports."""
    probe = f"{code}\nimport sys\nprint('\\n' + ','.join(m for m in {watched!r} if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    # The last line: what `code` printed (a command's help) comes before.
    return [name for name in result.stdout.split("\n")[-2].split(",") if name]


HEAVY = ("torch", "transformers", "textual")


def test_importing_the_command_line_loads_no_heavy_module() -> None:
    assert loaded("import fsd_chat.cli", HEAVY) == []


@pytest.mark.parametrize("command", ["", "generate", "chat", "bench"])
def test_help_loads_no_heavy_module(command: str) -> None:
    argv = [command, "-h"] if command else ["-h"]
    code = f"from fsd_chat.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass"
    assert loaded(code, HEAVY) == []


def test_the_engine_loads_no_renderer() -> None:
    modules = [f"fsd_chat.decoding.{m.name}" for m in pkgutil.iter_modules(fsd_chat.decoding.__path__)]
    assert len(modules) > 5  # the package's modules were found
    imports = "\n".join(f"import {module}" for module in ["fsd_chat.decoding", *modules])
    assert loaded(imports, ("textual", "rich")) == []


def test_the_transformers_engine_imports_no_llama_cpp(target_dir) -> None:  # type: ignore[no-untyped-def]
    """llama-cpp-python is imported only when the llama.cpp engine is chosen: a model folder loads
    and decodes without it (the GPU image has none)."""
    code = (
        "from fsd_chat.models.loading import load_pair\n"
        "from fsd_chat.models.options import LoadOptions, ModelSpec\n"
        "from fsd_chat.decoding import Controls\n"
        f"pair = load_pair(ModelSpec({str(target_dir)!r}), ModelSpec('lookup'), LoadOptions(device='cpu'))\n"
        "ids = pair.tokenizer('Once upon a time').input_ids\n"
        "list(pair.speculative(Controls()).generate(ids, max_new_tokens=4))"
    )
    assert loaded(code, ("llama_cpp",)) == []


UNUSED_ON_LLAMA_CPP = (
    "transformers",  # any of it: llama.cpp's tokenizer, our chat template render, our generation defaults
    "torch._dynamo",
    "torch._inductor",
    "sympy",  # torch's symbolic shapes: the compiler's, or a transformers model module's
)
"""What a process on the llama.cpp engine does not use: transformers (0.9 s of imports a start, and
24 MB), torch's compiler (docs/engines.md)."""
UNUSED_BY_GENERATE = ("fsd_chat.conversation.store", "fsd_chat.conversation.transcript")
"""The saved sessions' modules, which `generate` does not use (`fsd_chat.cli.chat`)."""


def generated_on_llama_cpp(target: Path, draft: str, cache: Path) -> list[str]:
    """The `UNUSED_ON_LLAMA_CPP` and `UNUSED_BY_GENERATE` modules a real `fsd-chat generate` of
    `target` on llama.cpp imports, with llama_cpp itself first (which proves it ran there), the user's cache at `cache`."""
    argv = ["generate", "--target", str(target), "--draft", draft, "--engine", "llama.cpp"]
    argv += ["--threads", "1", "--max-new-tokens", "4", "Once upon a time"]
    code = (
        "from fsd_chat.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as exc:\n"
        "    assert exc.code in (0, None), exc.code"
    )
    modules = ("llama_cpp", *UNUSED_ON_LLAMA_CPP, *UNUSED_BY_GENERATE)
    return loaded(code, modules, {**os.environ, ENV_CACHE_DIR: str(cache)})


def test_the_llama_cpp_engine_imports_no_transformers(
    stories_gguf_files: tuple[Path, Path], tmp_path: Path
) -> None:
    """`generate` on llama.cpp, with prompt lookup or a GGUF draft, on a file's first start and its
    next, imports no transformers module at all, nor torch's compiler: only torch's tensors; and
    writes nothing into the user's cache (no tokenizer is built from the file)."""
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)
    target, draft = stories_gguf_files
    for start in ("first", "second"):
        assert generated_on_llama_cpp(target, "lookup", tmp_path / "cache") == ["llama_cpp"], start
    assert generated_on_llama_cpp(target, str(draft), tmp_path / "cache") == ["llama_cpp"]
    assert not (tmp_path / "cache").exists()


def test_a_chat_on_llama_cpp_imports_no_transformers_through_its_first_reply(
    stories_gguf_files: tuple[Path, Path], tmp_path: Path
) -> None:
    """The real chat app over a GGUF file with a chat template (rendered by us) on llama.cpp,
    driven by Pilot through a first reply, imports no transformers module."""
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)
    code = f"""
import asyncio
from pathlib import Path
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.tui.screens.chat import ChatScreen
from tests.tui.helpers import SIZE, make_app, wait_for, wait_for_chat

async def chat() -> None:
    pair = load_pair(
        ModelSpec({str(stories_gguf_files[0])!r}), ModelSpec("lookup"),
        LoadOptions(device="cpu", engine="llama.cpp", threads=1),
    )
    assert pair.tokenizer.chat_template
    app = make_app(pair, Path({str(tmp_path)!r}), max_new_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        await pilot.press(*"Hi <|im_end|> there", "enter")
        await wait_for(pilot, lambda: len(screen.session.turns) == 2 and screen.streaming is None, 60)
        assert screen.session.turns[-1].content

asyncio.run(chat())
"""
    env = {**os.environ, ENV_CACHE_DIR: str(tmp_path / "cache")}
    assert loaded(code, ("llama_cpp", *UNUSED_ON_LLAMA_CPP), env) == ["llama_cpp"]


def test_the_commands_modules_import_no_transformers() -> None:
    """What chat, serve and bench import before they choose an engine: no transformers (the
    transformers engine's loading, its baselines and torch.compile's counters are imported where
    they run)."""
    modules = ("fsd_chat.tui.app", "fsd_chat.server.run", "fsd_chat.bench.pipeline", "fsd_chat.cli.bench")
    assert loaded("\n".join(f"import {m}" for m in modules), UNUSED_ON_LLAMA_CPP) == []


def test_a_bench_on_llama_cpp_imports_no_transformers(
    stories_gguf_files: tuple[Path, Path], tmp_path: Path
) -> None:
    """A real sweep on llama.cpp, with llama.cpp's own baselines, imports none of it either."""
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)
    argv = [
        "bench",
        "--target", str(stories_gguf_files[0]),
        "--prompts", "tinystories", "--data-dir", str(DATA_DIR),
        "--limit", "1", "--max-new-tokens", "8",
        "--rules", "fuzzy", "--divergences", "js", "--thresholds", "0.2", "--draft-tokens", "3",
        "--threads", "1", "--output", str(tmp_path / "out"),
    ]  # fmt: skip
    code = f"from fsd_chat.cli import main\nmain({argv!r})"
    env = {**os.environ, ENV_CACHE_DIR: str(tmp_path / "cache")}
    assert loaded(code, ("llama_cpp", *UNUSED_ON_LLAMA_CPP), env) == ["llama_cpp"]
    assert (tmp_path / "out" / "report.json").is_file()
