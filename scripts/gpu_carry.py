"""What `make gpu-carry` carries to a bare GPU image: fsd-chat's runtime dependencies, derived from
requirements.lock, less what the image ships.

The runtime dependencies are the lock's packages reachable from pyproject.toml's
`[project].dependencies` through the lock's `# via` lines (pip-compile's record of who asked for
each package), the test and docs extras left out. torch is left out with everything only torch asks
for (sympy, mpmath, networkx, jinja2, markupsafe, setuptools, and CUDA's nvidia-* libraries): a
CUDA torch image ships torch and its own requirements at the versions its torch was built with, and
a second copy of either would shadow them.

`IMAGE` lists the other packages the image ships (the workplace's 'cuda' image, as its package list
read on 2026-11-17 gives them, /work/.library/device/KINDS.md) that fsd-chat takes from it rather
than carrying: each is large or stable across the versions fsd-chat's ranges allow, and the carry
must stay under the 64 MiB a device call takes. Everything else is carried at the lock's version,
whatever the image has: transformers (the image's 5.17 predates the `cache` argument fsd-chat
needs), typer and its pydantic (the image has typer, not pydantic), bitsandbytes, gguf, textual,
the server's fastapi and uvicorn.

Run as `python -m scripts.gpu_carry` it prints the carried pins, one `name==version` a line
(`make gpu-carry` downloads them). `prune_wheel` drops bitsandbytes' libraries for the CUDA versions
the image has not.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LOCK = Path("requirements.lock")
PYPROJECT = Path("pyproject.toml")

SHIPPED_WITH_TORCH = "torch"
"""The image's torch: never carried, and nothing is carried only because torch asks for it."""

IMAGE = frozenset(
    canonicalize_name(name)
    for name in (
        # numpy 2.5 there; fsd-chat's pins of it come from matplotlib and gguf (numpy>=1.17).
        "numpy",
        # matplotlib and its own requirements: 12 MB of wheels for the bench's plot alone.
        *("matplotlib", "contourpy", "cycler", "fonttools", "kiwisolver", "pillow", "pyparsing"),
        "python-dateutil",
        # transformers' and huggingface-hub's helpers, at versions within their ranges.
        *("packaging", "pyyaml", "regex", "tqdm", "safetensors", "filelock", "fsspec", "requests"),
        *("certifi", "charset-normalizer", "idna", "urllib3", "psutil", "accelerate"),
        # rich's and typer's helpers.
        *("pygments", "markdown-it-py", "mdurl", "shellingham", "click"),
    )
)
"""Packages the GPU image ships that fsd-chat uses as they are there (see the module docstring)."""

TEST_RUNNER = frozenset({"pytest", "pluggy", "iniconfig"})
"""The CUDA tests' runner, on the image too (`pytest -m cuda tests/test_cuda.py` needs no plugin)."""


def shipped_with_torch() -> set[str]:
    """torch and what it requires, transitively (canonical names, from the installed torch's
    metadata; extras left out): what any CUDA torch image ships beside it."""
    shipped: set[str] = set()
    todo = [SHIPPED_WITH_TORCH]
    while todo:
        name = todo.pop()
        if name in shipped:
            continue
        shipped.add(name)
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:  # a CUDA-only requirement, on no CPU build
            continue
        for text in requirements:
            requirement = Requirement(text)
            if requirement.marker is None or "extra" not in str(requirement.marker):
                todo.append(canonicalize_name(requirement.name))
    return shipped


BITSANDBYTES_CUDA = "130"
"""The CUDA version of the image's torch (2.11.0+cu130): bitsandbytes loads
libbitsandbytes_cuda{torch.version.cuda without the dot}.so; the other CUDA versions', ROCm's and
XPU's libraries (over 100 MB unpacked, 40 MB of the wheel) are dead weight on an NVIDIA image."""


VIA = re.compile(r"#\s+(?:via\s+)?(?!via$)([A-Za-z0-9._-]+)(?: \(pyproject\.toml\))?")


def _pins(lock: str) -> dict[str, tuple[str, set[str]]]:
    """The lock's packages: canonical name -> (pin line, canonical names of those it is there for;
    "fsd-chat" for pyproject.toml)."""
    pins: dict[str, tuple[str, set[str]]] = {}
    name = ""
    for line in lock.splitlines():
        if match := re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", line.strip()):
            name = canonicalize_name(match[1])
            pins[name] = (f"{match[1]}=={match[2]}", set())
        # A pin's own comments are indented: "# via NAME", or "# via" and one "#   NAME" a line.
        elif name and line[:1].isspace() and (via := VIA.fullmatch(line.strip())):
            pins[name][1].add(canonicalize_name(via[1]))
    return pins


def runtime_pins(lock: str, pyproject: str) -> dict[str, str]:
    """fsd-chat's runtime dependencies in `lock` (requirements.lock's text): canonical name -> pin
    (`name==version`), torch and what only torch asks for left out (see the module docstring).

    Raises:
        ValueError: a runtime dependency of pyproject.toml's that the lock does not pin.
    """
    pins = _pins(lock)
    roots = {
        canonicalize_name(Requirement(d).name) for d in tomllib.loads(pyproject)["project"]["dependencies"]
    }
    roots.discard(SHIPPED_WITH_TORCH)
    missing = roots - pins.keys()
    if missing:
        raise ValueError(f"requirements.lock pins none of {sorted(missing)}: run make lock")
    runtime: set[str] = set(roots)
    grown = True
    while grown:  # to a fixed point: a package is runtime if some runtime package asks for it
        grown = False
        for name, (_pin, parents) in pins.items():
            if name not in runtime and parents & runtime:
                runtime.add(name)
                grown = True
    return {name: pins[name][0] for name in sorted(runtime)}


def carried_pins(lock: str, pyproject: str) -> dict[str, str]:
    """The runtime dependencies the GPU image lacks (`runtime_pins` less `IMAGE`)."""
    return {name: pin for name, pin in runtime_pins(lock, pyproject).items() if name not in IMAGE}


def prune_wheel(wheel: Path, cuda: str = BITSANDBYTES_CUDA) -> int:
    """Rewrite bitsandbytes' `wheel` in place without its native libraries other than CUDA `cuda`'s
    and the CPU's (the other CUDA versions', ROCm's, XPU's; its RECORD too); returns the bytes saved. A wheel of another package is left as it is
    (0)."""
    if not wheel.name.startswith("bitsandbytes-"):
        return 0
    unused = re.compile(rf"libbitsandbytes_(?!cuda{cuda}\.so$|cpu\.so$)\w+\.so$")
    before = wheel.stat().st_size
    pruned = wheel.with_suffix(".pruning")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(pruned, "w", zipfile.ZIP_DEFLATED) as out:
        for item in source.infolist():
            if unused.search(item.filename):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not unused.search(line.split(",")[0])).encode()
            out.writestr(item, data)
    pruned.replace(wheel)
    return before - wheel.stat().st_size


def main(argv: list[str] | None = None) -> int:
    """`python -m scripts.gpu_carry`: the carried pins, a line each; `--prune WHEEL...`: prune
    bitsandbytes' wheel among them (`prune_wheel`)."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--prune"]:
        for wheel in args[1:]:
            saved = prune_wheel(Path(wheel))
            if saved:
                print(
                    f"gpu-carry: {Path(wheel).name}: {saved / 2**20:.0f} MiB of unused native libraries dropped"
                )
        return 0
    pins = carried_pins(LOCK.read_text(encoding="utf-8"), PYPROJECT.read_text(encoding="utf-8"))
    print("\n".join(pins.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
