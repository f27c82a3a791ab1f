"""`make gpu-carry`'s wheels: derived from requirements.lock, and enough for a bare GPU image.

The import test runs fsd-chat's commands' imports (chat, generate, bench, serve: the modules each
command imports in its body too), gpu-check's and the CUDA tests' in a fresh interpreter, decodes a
few tokens with the offline pair (transformers imports some modules only when a model loads), and
lists the distributions behind the modules that process holds: each must be carried or shipped by
the image. A module imported lazily by a path these do not take (an optional engine) is not
counted, as it is not on the image either.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from scripts.gpu_carry import (
    IMAGE,
    LOCK,
    PYPROJECT,
    TEST_RUNNER,
    carried_pins,
    prune_wheel,
    runtime_pins,
    shipped_with_torch,
)
from tests.conftest import DRAFT_DIR, TARGET_DIR

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("chat", "generate", "bench", "serve")
OURS = {"fsd_chat", "tests", "scripts", "__main__"}


def command_imports() -> list[str]:
    """The modules fsd-chat's commands import, at module level and in their bodies (absolute
    imports: the cli's own modules use no relative ones)."""
    modules = []
    for command in COMMANDS:
        tree = ast.parse((ROOT / "fsd_chat" / "cli" / f"{command}.py").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules.append(node.module)
            elif isinstance(node, ast.Import):
                modules += [alias.name for alias in node.names]
    return [f"fsd_chat.cli.{c}" for c in COMMANDS] + modules


PROBE = """
import importlib, importlib.abc, importlib.metadata, json, sys
from packaging.utils import canonicalize_name

allowed = set(json.loads(sys.argv[3]))
owners = importlib.metadata.packages_distributions()


class BareImage(importlib.abc.MetaPathFinder):
    # A top-level module of a distribution neither carried nor on the image is missing, as it is
    # there: an optional import falls back, a needed one fails.
    def find_spec(self, name, path=None, target=None):
        dists = {canonicalize_name(d) for d in owners.get(name, [])}
        if "." not in name and dists and not dists & allowed:
            raise ModuleNotFoundError(f"No module named {name!r} (neither carried nor on the GPU image)")
        return None


sys.meta_path.insert(0, BareImage())
for name in sys.argv[4:]:
    importlib.import_module(name)
from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
pair = load_pair(ModelSpec(sys.argv[1]), ModelSpec(sys.argv[2]), LoadOptions(device="cpu", dtype="float32"))
decoder = pair.decoder(Controls(DecodingSettings()))
steps = list(decoder.generate([1, 2, 3], max_new_tokens=4, sampling=SamplingConfig(temperature=0.0)))
assert steps
print(json.dumps(sorted({name.partition(".")[0] for name in sys.modules})))
"""


def bare_image_run(available: set[str]) -> subprocess.CompletedProcess[str]:
    """The entry points' imports and a short reply in a fresh interpreter that finds only the
    distributions in `available` (and the standard library, fsd-chat and its tests)."""
    modules = [*command_imports(), "scripts.gpu_check", "tests.conftest", "tests.test_cuda"]
    return subprocess.run(
        [
            sys.executable,
            "-c",
            PROBE,
            str(TARGET_DIR),
            str(DRAFT_DIR),
            json.dumps(sorted(available)),
            *modules,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


def on_the_image() -> set[str]:
    """What a GPU machine finds after `make gpu-carry`'s wheels are installed: the carry, the
    image's packages that fsd-chat uses, torch's own, and the tests' runner."""
    lock, pyproject = LOCK.read_text(encoding="utf-8"), PYPROJECT.read_text(encoding="utf-8")
    return set(carried_pins(lock, pyproject)) | IMAGE | shipped_with_torch() | TEST_RUNNER


@pytest.mark.slow  # fresh interpreters importing torch, transformers, Textual and FastAPI
def test_the_entry_points_import_on_a_bare_image_with_the_carry() -> None:
    done = bare_image_run(on_the_image())
    assert done.returncode == 0, done.stderr[-3000:]
    imported = set(json.loads(done.stdout.splitlines()[-1]))
    # The probe reached every layer: the commands, the GGUF reader, the TUI, the server, the tests.
    assert {"gguf", "textual", "fastapi", "uvicorn", "transformers", "torch", "pytest", "typer"} <= imported
    # The check has teeth: without gguf (the first GPU run's carry) the same run fails as it did there.
    without = bare_image_run(on_the_image() - {"gguf"})
    assert without.returncode != 0 and "No module named 'gguf'" in without.stderr


def test_the_carry_is_the_locks_runtime_dependencies_less_the_image() -> None:
    lock, pyproject = LOCK.read_text(encoding="utf-8"), PYPROJECT.read_text(encoding="utf-8")
    runtime = runtime_pins(lock, pyproject)
    carried = carried_pins(lock, pyproject)
    # What the first GPU run lacked, and what fsd-chat needs at the lock's version.
    for name in ("gguf", "transformers", "bitsandbytes", "typer", "pydantic", "textual", "fastapi"):
        assert carried[name] == next(
            line for line in lock.splitlines() if line.lower().startswith(f"{name}==")
        )
    # Test and docs tools are no runtime dependency; torch and what only torch asks for are the image's.
    assert not {"pytest", "mypy", "mkdocs", "ruff", "openai", "torch", "sympy", "networkx"} & runtime.keys()
    assert runtime.keys() >= IMAGE  # the image list names only packages fsd-chat runs on
    assert carried.keys() == runtime.keys() - IMAGE


def test_a_dependency_the_lock_lacks_is_an_error() -> None:
    pyproject = '[project]\ndependencies = ["torch>=2", "gguf>=0.17", "nonesuch>=1"]\n'
    with pytest.raises(ValueError, match="nonesuch"):
        runtime_pins("gguf==0.19.0\n    # via fsd-chat (pyproject.toml)\n", pyproject)


def test_pruning_keeps_the_images_cuda_library_and_the_record(tmp_path: Path) -> None:
    wheel = tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    kept = [
        "bitsandbytes/__init__.py",
        "bitsandbytes/libbitsandbytes_cuda130.so",
        "bitsandbytes/libbitsandbytes_cpu.so",
    ]
    dropped = ["bitsandbytes/libbitsandbytes_cuda128.so", "bitsandbytes/libbitsandbytes_rocm72.so"]
    record = "bitsandbytes-0.50.2.dist-info/RECORD"
    with zipfile.ZipFile(wheel, "w") as out:
        for name in kept + dropped:
            out.writestr(name, b"x" * 10_000)
        out.writestr(record, "".join(f"{name},sha256=0,10000\n" for name in kept + dropped))
    assert prune_wheel(wheel) > 0
    with zipfile.ZipFile(wheel) as pruned:
        assert sorted(pruned.namelist()) == sorted([*kept, record])
        assert [line.split(",")[0] for line in pruned.read(record).decode().splitlines()] == kept
    other = tmp_path / "gguf-0.19.0-py3-none-any.whl"
    other.write_bytes(b"not touched")
    assert prune_wheel(other) == 0 and other.read_bytes() == b"not touched"
