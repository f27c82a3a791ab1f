"""Deferred imports, checked rather than hoped for.

The import-linter contracts (`[tool.importlinter]` in pyproject.toml, checked by `make lint`) read
the static graph, where an import deferred into a function counts like any other; the subprocess
checks here look at `sys.modules`, the only way to prove that a deferral defers.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import fsd_chat.decoding

pytestmark = pytest.mark.slow  # each test starts Python subprocesses


def loaded(code: str, watched: tuple[str, ...]) -> list[str]:
    """The `watched` top-level packages that running `code` in a fresh interpreter imports."""
    probe = f"{code}\nimport sys\nprint('\\n' + ','.join(m for m in {watched!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
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
