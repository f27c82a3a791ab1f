"""The chat's CPU threads on the llama.cpp engine: one-token forwards on the idle cores less one (the
UI thread's; on this 2-core CPU two threads a token ran the chat at 0.94 of one, docs/benchmarks.md),
forwards of several on every idle core; `--threads` and `--threads-batch` win when given. Real
offline pair as GGUF files on llama.cpp, real app, Pilot; the counts read back from llama.cpp."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from fsd_chat.engines.llama_calibration import TIMING_NOTE
from fsd_chat.engines.llama_cpp import LlamaCppModel
from fsd_chat.models.pair import ModelPair
from fsd_chat.support import threads
from fsd_chat.support.config import ENV_CALIBRATION_DIR
from fsd_chat.tui.screens.loading import LoadingScreen
from tests.tui.helpers import SIZE, make_app, wait_for_chat

llama_cpp = pytest.importorskip("llama_cpp")


def counts(pair: ModelPair) -> set[tuple[int, int]]:
    """Each model's (one-token, batch) thread counts as llama.cpp's contexts hold them."""
    models = [pair.target] if pair.draft is None else [pair.target, pair.draft]
    assert all(isinstance(m, LlamaCppModel) for m in models)
    return {
        (llama_cpp.llama_n_threads(m.llama.ctx), llama_cpp.llama_n_threads_batch(m.llama.ctx))
        for m in models
        if isinstance(m, LlamaCppModel)
    }


async def test_the_chat_keeps_a_core_for_its_ui_on_one_token_forwards(
    llama_pair: ModelPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No count given: the policy's split of the idle cores the chat saw as it loaded, one core
    reserved. The real policy runs on the real idle cores; the wrapper only records its arguments
    (the reserve asked: on a busy machine both reserves give one thread, so the counts alone could
    not tell them apart) and its answer."""
    calls: list[tuple[int, int, tuple[int, int]]] = []
    split = threads.split_threads

    def recording(idle: int, *, reserve: int = 0) -> tuple[int, int]:
        calls.append((idle, reserve, split(idle, reserve=reserve)))
        return calls[-1][2]

    monkeypatch.setattr(threads, "split_threads", recording)
    try:
        app = make_app(llama_pair, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for_chat(pilot)
            ((idle, reserve, chosen),) = calls
            assert reserve == 1
            assert counts(llama_pair) == {chosen} == {split(idle, reserve=1)}
    finally:
        llama_pair.use_threads(1)


@pytest.mark.parametrize(
    ("given", "expected"),
    [({"threads": 2}, (2, 2)), ({"threads": 1, "threads_batch": 2}, (1, 2)), ({"threads_batch": 3}, None)],
)
async def test_given_counts_win_in_the_chat(
    llama_pair: ModelPair, tmp_path: Path, given: dict[str, int], expected: tuple[int, int] | None
) -> None:
    """`--threads N` sets both counts (llama.cpp's `-tb` defaults to `-t`), `--threads-batch` the
    batches' alone (a token then the policy's: the idle cores less one)."""
    try:
        app = make_app(llama_pair, tmp_path, **given)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for_chat(pilot)
            (chosen,) = counts(llama_pair)
            if expected is None:
                assert chosen[1] == 3 and 1 <= chosen[0] <= max(1, (psutil.cpu_count() or 1) - 1)
            else:
                assert chosen == expected
    finally:
        llama_pair.use_threads(1)


async def test_the_loading_screen_says_it_times_llama_cpps_forwards(
    llama_pair: ModelPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a machine with no prices kept for the file and split, setting the threads times them in
    the load worker, and the loading screen says so (a spy around the real `show_progress`); then
    the chat opens."""
    monkeypatch.setenv(ENV_CALIBRATION_DIR, str(tmp_path / "times"))
    shown: list[str] = []
    real = LoadingScreen.show_progress

    def spy(screen: LoadingScreen, text: str) -> None:
        shown.append(text)
        real(screen, text)

    monkeypatch.setattr(LoadingScreen, "show_progress", spy)
    try:
        app = make_app(llama_pair, tmp_path, threads=1, threads_batch=2)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for_chat(pilot)
        names = [
            Path(m.path).name for m in (llama_pair.target, llama_pair.draft) if isinstance(m, LlamaCppModel)
        ]
        assert shown == [TIMING_NOTE.format(name=name) for name in names]
    finally:
        llama_pair.use_threads(1)
