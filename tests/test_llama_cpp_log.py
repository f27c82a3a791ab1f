"""llama.cpp's own output never touches the terminal, on a real llama.cpp: loading a GGUF file
redirects no file descriptor (a thread writing to fd 2 meanwhile, as the chat's screen does, loses
nothing), llama.cpp's log lines reach fsd-chat's logger at their levels and its warnings the error
log, and `generate` on llama.cpp prints its own lines and nothing else."""

from __future__ import annotations

import io
import logging
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fsd_chat.bench.llama_baselines import llama_generate
from fsd_chat.bench.records import ForwardTally
from fsd_chat.cli import main
from fsd_chat.decoding.settings import SamplingConfig
from fsd_chat.engines.llama_cpp import open_gguf, prints_to_log
from fsd_chat.support.errors import ModelLoadError
from fsd_chat.support.log import LLAMA_CPP_LOG, log_path, quiet_libraries
from tests.conftest import LLAMA_CPP_MISSING

pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)

WRITER = """
import os, sys, threading, time
from pathlib import Path
from fsd_chat.engines.llama_cpp import open_gguf, prints_to_log

written = 0
loaded = threading.Event()

def draw() -> None:  # the chat's screen: frames written to fd 2 while a worker loads the model
    global written
    while not loaded.is_set():
        os.write(2, b"frame\\n")
        written += 1
        time.sleep(0.0005)

screen = threading.Thread(target=draw)
screen.start()
time.sleep(0.01)
open_gguf(Path(sys.argv[1]), threads=1, gpu=False)
loaded.set()
screen.join()
print(written)
"""


def test_loading_redirects_no_file_descriptor(stories_gguf_files: tuple[Path, Path]) -> None:
    """Every frame a thread writes to fd 2 (a pipe here) while llama.cpp loads the model arrives,
    and nothing else does: llama-cpp-python's `verbose=False` pointed fds 1 and 2 at /dev/null for
    the load, which lost the frames drawn meanwhile (the chat's loading screen)."""
    done = subprocess.run(
        [sys.executable, "-c", WRITER, str(stories_gguf_files[0])],
        capture_output=True,
        timeout=120,
        check=True,
    )
    written = int(done.stdout.decode().split()[-1])
    assert written > 0
    assert done.stderr.count(b"frame\n") == written  # none lost
    assert done.stderr == b"frame\n" * written  # and nothing of llama.cpp's


def test_llama_cpps_lines_reach_the_logger_at_their_levels(
    stories_gguf_files: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A KV cache longer than the model's trained context is a warning of llama.cpp's; a file it
    cannot read, an error; a tensor's line as the model loads, debug."""
    with caplog.at_level(logging.DEBUG, logger=LLAMA_CPP_LOG):
        open_gguf(stories_gguf_files[0], threads=1, gpu=False, context=1024)  # trained on 512
        broken = tmp_path / "broken.gguf"
        broken.write_bytes(b"GGUF" + bytes(60))
        with pytest.raises(ModelLoadError):
            open_gguf(broken, threads=1, gpu=False)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LLAMA_CPP_LOG]
    assert (
        logging.WARNING,
        "llama_context: n_ctx_seq (1024) > n_ctx_train (512) -- possible training context overflow",
    ) in lines
    assert any(level == logging.ERROR and "broken.gguf" in line for level, line in lines), lines
    assert any(level == logging.DEBUG and "tensor" in line for level, line in lines), lines
    assert any(level == logging.DEBUG and "Model metadata" in line for level, line in lines), (
        lines
    )  # a print of llama-cpp-python's
    assert all(line and not line.endswith("\n") for _, line in lines)


def test_prints_to_log_takes_its_own_threads_prints_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A model loads in a worker while the chat's app prints on its own thread: the worker's prints
    go to the log, the app's to its stream; and a `sys.stderr` set meanwhile (the app ending puts
    the terminal's back) is left as it is."""
    screen = io.StringIO()
    monkeypatch.setattr(sys, "stderr", screen)
    inside, printed = threading.Event(), threading.Event()

    def load() -> None:
        with prints_to_log():
            print("Model metadata: {}", file=sys.stderr)
            inside.set()
            assert printed.wait(10)

    with caplog.at_level(logging.DEBUG, logger=LLAMA_CPP_LOG):
        worker = threading.Thread(target=load)
        worker.start()
        assert inside.wait(10)
        print("a frame", file=sys.stderr)
        printed.set()
        worker.join()
    assert screen.getvalue() == "a frame\n" and sys.stderr is screen
    assert "Model metadata: {}" in caplog.messages
    terminal = io.StringIO()
    with prints_to_log():
        sys.stderr = terminal
    assert sys.stderr is terminal


def test_the_bench_baselines_llama_cpp_notes_go_to_the_logger(
    stories_gguf_files: tuple[Path, Path], capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """`Llama.generate` (the llama.cpp baselines' loop) notes the prefix it reuses on a prompt read
    before: on the logger, not the terminal."""
    llama = open_gguf(stories_gguf_files[0], threads=1, gpu=False, context=512)
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG, logger=LLAMA_CPP_LOG):
        for _ in range(2):
            ids = list(
                llama_generate(
                    llama,
                    [1, 400, 300, 200],
                    SamplingConfig(temperature=0.0),
                    max_new_tokens=4,
                    eos=frozenset(),
                    stop_strings=(),
                    tally=ForwardTally(),
                    stop=lambda: False,
                )
            )
            assert len(ids) == 4
    assert capfd.readouterr() == ("", "")
    assert "Llama.generate: 3 prefix-match hit, remaining 1 prompt tokens to eval" in caplog.messages


def test_the_commands_keep_llama_cpps_warnings_in_the_error_log(
    stories_gguf_files: tuple[Path, Path], capfd: pytest.CaptureFixture[str]
) -> None:
    """Logging as every command sets it up: a warning of llama.cpp's is appended to the error log
    (private to its owner), its info lines are not, and nothing reaches fds 1 and 2."""
    quiet_libraries()
    open_gguf(stories_gguf_files[0], threads=1, gpu=False, context=1024)
    assert capfd.readouterr() == ("", "")
    text = log_path().read_text()
    assert "llama.cpp warning\nllama_context: n_ctx_seq (1024) > n_ctx_train (512)" in text
    assert "tensor" not in text and "Model metadata" not in text
    assert stat.S_IMODE(log_path().stat().st_mode) == 0o600


def test_generate_on_llama_cpp_prints_its_own_lines_and_nothing_else(
    stories_gguf_files: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The real command, the file descriptors read: stderr holds fsd-chat's own line (the engine;
    a first start reads nothing more than later ones: llama.cpp's tokenizer is the file's), stdout
    the reply; and nothing is written into the user's cache."""
    monkeypatch.setenv("FSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    args = ["generate", "--target", str(stories_gguf_files[0]), "--engine", "llama.cpp", "--threads", "1"]
    main([*args, "--max-new-tokens", "8", "Once upon a time"])
    out, err = capfd.readouterr()
    assert err.splitlines() == ["fsd-chat: engine llama.cpp (--engine llama.cpp)"]
    assert len(out.splitlines()) == 1 and out.strip()
    assert not (tmp_path / "cache").exists()
