"""The garbage collector during a command's start (`fsd_chat.support.start_gc`): paused from the
command's first line until its models are loaded, then the objects made so far frozen and
collection resumed; never left paused by a command that fails or loads nothing."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsd_chat.models.default_model import default_model_path
from fsd_chat.support import start_gc
from fsd_chat.support.config import ENV_CACHE_DIR
from tests.conftest import LLAMA_CPP_MISSING


@pytest.fixture
def collecting() -> Iterator[None]:
    """The test process's collector as it was (enabled, nothing frozen by the test) afterwards."""
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    yield
    gc.enable()
    if gc.get_freeze_count() > frozen:
        gc.unfreeze()


def test_a_paused_start_freezes_what_it_made_and_collects_again_once_resumed(collecting: None) -> None:
    before = gc.get_freeze_count()
    with start_gc.paused():
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]  # tracked containers, made during the start
        start_gc.resume()
        assert gc.isenabled()
        assert gc.get_freeze_count() >= before + len(made)
        start_gc.resume()  # a second load (a model switched in the chat): nothing more frozen
        assert gc.get_freeze_count() >= before + len(made)
    assert gc.isenabled()


def test_a_start_that_fails_or_loads_nothing_collects_again_and_freezes_nothing(collecting: None) -> None:
    before = gc.get_freeze_count()
    with pytest.raises(ValueError), start_gc.paused():
        raise ValueError("a command that failed before loading")
    # At most `before`: frozen objects still die (an earlier test's threads ending lowered the count
    # by 2 once), while a freeze would add every tracked object (hundreds of thousands).
    assert gc.isenabled() and gc.get_freeze_count() <= before
    start_gc.resume()  # outside a paused start: nothing
    assert gc.get_freeze_count() <= before


def test_a_collector_paused_by_the_caller_is_left_to_it(collecting: None) -> None:
    gc.disable()
    with start_gc.paused():
        start_gc.resume()
        assert not gc.isenabled()
    assert not gc.isenabled()


@pytest.mark.slow
def test_a_new_gguf_files_first_prompt_makes_no_full_collection_before_it_is_loaded(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)
    # A fresh process on the default model, a copy under a new name into an empty cache (its
    # tokenizer built from the file): every full (generation 2) collection must come after the
    # start's objects were frozen. Before, this start ran four over torch's and transformers'
    # objects, 0.5 s of collecting in a 5.5 s start.
    copy = shutil.copy(default_model_path(), tmp_path / "new.gguf")
    code = (
        "import gc, sys\n"
        "full = []\n"
        "gc.callbacks.append(lambda phase, info: phase == 'start' and info['generation'] == 2"
        " and full.append(gc.get_freeze_count()))\n"
        "from fsd_chat.cli import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "finally:\n"
        "    print('full collections before the freeze:', sum(count == 0 for count in full))\n"
        "    print('collecting:', gc.isenabled(), 'frozen:', gc.get_freeze_count() > 0)\n"
    )
    args = ["generate", "--target", str(copy), "--max-new-tokens", "1", "--threads", "1", "Hi"]
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, ENV_CACHE_DIR: str(tmp_path / "cache")},
    )
    assert done.stdout.splitlines()[-2:] == [
        "full collections before the freeze: 0",
        "collecting: True frozen: True",
    ]
