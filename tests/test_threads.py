"""The CPU thread policy: an explicit count wins, else the idle cores minus those kept for the UI.
Its effect under load is measured by scripts/bench_threads.py (figures in the README)."""

from __future__ import annotations

import psutil
import pytest
import torch

from fsd_chat.support.errors import SettingsError
from fsd_chat.support.threads import (
    apply_threads,
    choose_thread_counts,
    choose_threads,
    idle_cores,
    split_threads,
)


def test_an_explicit_count_wins_and_must_be_positive() -> None:
    assert choose_threads(3) == 3
    with pytest.raises(SettingsError, match="--threads must be ≥ 1, got 0"):
        choose_threads(0)


def test_the_default_counts_idle_cores_and_never_goes_below_one() -> None:
    idle = idle_cores(0.05)
    assert 0 <= idle <= (psutil.cpu_count() or 1)
    assert choose_threads(None, reserve=64) == 1  # more reserved than there are cores


def test_batches_take_the_explicit_counts_else_every_idle_core() -> None:
    """llama.cpp's forwards of several tokens: `--threads-batch` wins, else `--threads` (as
    llama.cpp's `-tb` defaults to `-t`), else the idle cores, never fewer than one token's threads,
    which alone lose the cores reserved for the UI."""
    assert choose_thread_counts(1, 3) == (1, 3)
    assert choose_thread_counts(2) == (2, 2)
    assert choose_thread_counts(None, 4, reserve=64) == (1, 4)
    threads, batch = choose_thread_counts(None, reserve=64)
    assert threads == 1 and 1 <= batch <= (psutil.cpu_count() or 1)
    with pytest.raises(SettingsError, match="--threads-batch must be ≥ 1, got 0"):
        choose_thread_counts(1, 0)
    with pytest.raises(SettingsError, match="--threads must be ≥ 1, got 0"):
        choose_thread_counts(0, 2)


@pytest.mark.parametrize(
    ("idle", "reserve", "counts"),
    [
        (2, 1, (1, 2)),  # the chat on an idle 2-core CPU: one thread a token, both cores a batch
        (1, 1, (1, 1)),  # one core busy elsewhere: what idle_cores then sees
        (0, 1, (1, 1)),  # every core busy: never below one
        (2, 0, (2, 2)),  # generate, serve, bench: every idle core for both
        (8, 1, (7, 8)),
        (8, 0, (8, 8)),
    ],
)
def test_the_split_with_no_count_given(idle: int, reserve: int, counts: tuple[int, int]) -> None:
    """The counts the policy takes from the idle cores: one token on the idle cores less the reserve
    (the chat's UI thread), a batch on every idle core."""
    assert split_threads(idle, reserve=reserve) == counts


def test_apply_sets_torchs_thread_count() -> None:
    before = torch.get_num_threads()
    try:
        assert apply_threads(2) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
