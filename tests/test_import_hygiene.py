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
import fsd_chat.engines.torch_engine
from fsd_chat.support.config import ENV_CACHE_DIR
from tests.conftest import LLAMA_CPP_MISSING
from tests.test_bench_cli import DATA_DIR

pytestmark = pytest.mark.slow  # each test starts Python subprocesses


def loaded(code: str, watched: tuple[str, ...], env: dict[str, str] | None = None) -> list[str]:
    """The `watched` modules that running `code` in a fresh interpreter (in `env`) imports."""
    return loaded_after(("code", code), watched=watched, env=env)["code"]


MARK = "loaded after "
"""The start of the line that names a flow's loaded modules."""


def loaded_after(
    *flows: tuple[str, str], watched: tuple[str, ...], env: dict[str, str] | None = None
) -> dict[str, list[str]]:
    """The `watched` modules loaded after each of `flows` ((name, code), run in order in one fresh
    interpreter, in `env`), by name. A module stays loaded once imported, so one absent after a flow
    was imported neither by it nor by any before it: each flow's claim is that of a fresh
    interpreter, for one Python start and the imports the flows share (one present may have come
    from an earlier flow: the first flow whose test fails is the one that imported it)."""
    probe = ["import sys"]
    for name, code in flows:
        probe.append(f"exec(compile({code!r}, {name!r}, 'exec'), {{'__name__': '__flow__'}})")
        # A line of its own: what the flow printed (a command's help) comes before.
        probe.append(f"print('\\n{MARK}{name}=' + ','.join(m for m in {watched!r} if m in sys.modules))")
    result = subprocess.run(
        [sys.executable, "-c", "\n".join(probe)], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    found = dict(line.removeprefix(MARK).split("=", 1) for line in lines if line.startswith(MARK))
    return {name: [m for m in found[name].split(",") if m] for name, _ in flows}


HEAVY = ("torch", "transformers", "textual")
HELPS = ["", "generate", "chat", "bench"]


def help_code(command: str) -> str:
    """`fsd-chat [command] -h` (which exits)."""
    argv = [command, "-h"] if command else ["-h"]
    return f"from fsd_chat.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass"


@pytest.fixture(scope="module")
def without_an_engine() -> dict[str, list[str]]:
    """What the command line loads before an engine is chosen, in one interpreter: importing it,
    each command's help, then the modules of chat, serve and bench (these last: they import
    textual, one of `HEAVY`, and their own claim is no transformers)."""
    commands = ("fsd_chat.tui.app", "fsd_chat.server.run", "fsd_chat.bench.pipeline", "fsd_chat.cli.bench")
    return loaded_after(
        ("import", "import fsd_chat.cli"),
        *((f"help {command}", help_code(command)) for command in HELPS),
        ("commands", "\n".join(f"import {m}" for m in commands)),
        watched=(*HEAVY, *UNUSED_ON_LLAMA_CPP),
    )


def heavy(found: list[str]) -> list[str]:
    """The `HEAVY` modules among `found`."""
    return [m for m in found if m in HEAVY]


def test_importing_the_command_line_loads_no_heavy_module(without_an_engine: dict[str, list[str]]) -> None:
    assert heavy(without_an_engine["import"]) == []


@pytest.mark.parametrize("command", HELPS)
def test_help_loads_no_heavy_module(without_an_engine: dict[str, list[str]], command: str) -> None:
    assert heavy(without_an_engine[f"help {command}"]) == []


@pytest.fixture(scope="module")
def on_transformers(target_dir: Path) -> dict[str, list[str]]:
    """In one interpreter: every module of the decoding package and of the torch engine imported,
    then a model folder loaded and decoded on the transformers engine (with prompt lookup)."""
    modules = [
        f"{package.__name__}.{m.name}"
        for package in (fsd_chat.decoding, fsd_chat.engines.torch_engine)
        for m in pkgutil.iter_modules(package.__path__)
    ]
    assert len(modules) > 15  # the packages' modules were found
    decode = (
        "from fsd_chat.models.loading import load_pair\n"
        "from fsd_chat.models.options import LoadOptions, ModelSpec\n"
        "from fsd_chat.decoding import Controls\n"
        f"pair = load_pair(ModelSpec({str(target_dir)!r}), ModelSpec('lookup'), LoadOptions(device='cpu'))\n"
        "ids = pair.tokenizer('Once upon a time').input_ids\n"
        "list(pair.speculative(Controls()).generate(ids, max_new_tokens=4))"
    )
    return loaded_after(
        ("decoding", "\n".join(f"import {module}" for module in ["fsd_chat.decoding", *modules])),
        ("transformers engine", decode),
        watched=("textual", "rich", "llama_cpp"),
    )


def test_the_engine_loads_no_renderer(on_transformers: dict[str, list[str]]) -> None:
    assert on_transformers["decoding"] == []  # neither textual nor rich (nor llama_cpp)


def test_the_transformers_engine_imports_no_llama_cpp(on_transformers: dict[str, list[str]]) -> None:
    """llama-cpp-python is imported only when the llama.cpp engine is chosen: a model folder loads
    and decodes without it (the GPU image has none)."""
    assert "llama_cpp" not in on_transformers["transformers engine"]


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


def test_the_commands_modules_import_no_transformers(without_an_engine: dict[str, list[str]]) -> None:
    """What chat, serve and bench import before they choose an engine: no transformers (the
    transformers engine's loading, its baselines and torch.compile's counters are imported where
    they run)."""
    assert [m for m in without_an_engine["commands"] if m in UNUSED_ON_LLAMA_CPP] == []


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
