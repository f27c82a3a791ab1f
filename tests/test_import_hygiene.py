"""The layering, checked rather than hoped for.

The import-linter contracts (`[tool.importlinter]` in pyproject.toml) read the static graph, where an
import deferred into a function counts like any other; the subprocess checks here look at
`sys.modules`, the only way to prove that a deferral defers.
"""

from __future__ import annotations

import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fsd_chat.decoding

pytestmark = pytest.mark.slow  # each test starts Python subprocesses

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


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


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` on the `fsd_chat` package under `root`, with the project's contracts."""
    return subprocess.run(
        [LINT_IMPORTS, "--config", str(ROOT / "pyproject.toml"), "--no-cache", "--no-logo"],
        capture_output=True,
        text=True,
        cwd=root,
        # The package is found on the path: `root`'s copy comes before the installed one.
        env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(root)},
        timeout=120,
    )


def test_the_import_contracts_are_kept() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 broken" in result.stdout


def with_import(tmp_path: Path, module: str, statement: str) -> Path:
    """A copy of the package under `tmp_path` whose `module` (a path under fsd_chat/) also runs
    `statement`."""
    shutil.copytree(ROOT / "fsd_chat", tmp_path / "fsd_chat", ignore=shutil.ignore_patterns("__pycache__"))
    source = tmp_path / "fsd_chat" / module
    source.write_text(source.read_text() + f"\n{statement}\n")
    return tmp_path


def test_an_import_going_up_breaks_the_contracts(tmp_path: Path) -> None:
    result = lint_imports(with_import(tmp_path, "decoding/__init__.py", "import fsd_chat.tui.app"))
    assert result.returncode != 0
    assert "fsd_chat.decoding is not allowed to import fsd_chat.tui" in result.stdout
    assert "fsd_chat.decoding is not allowed to import textual" in result.stdout


def test_an_import_circle_breaks_the_contracts(tmp_path: Path) -> None:
    # events <- acceptance already; the way back closes a circle inside the engine.
    result = lint_imports(with_import(tmp_path, "decoding/events.py", "import fsd_chat.decoding.acceptance"))
    assert result.returncode != 0
    assert "No import circles" in result.stdout and "BROKEN" in result.stdout
