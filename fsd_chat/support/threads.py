"""How many CPU threads torch decodes with: chosen, not left to torch.

torch's default is one intra-op thread per core. Its OpenMP threads spin-wait for each other at
every operation, so when any core is busy with other work (another process, or the chat's own UI
thread) every operation waits for the thread that lost its core: on a 2-core machine with one
other busy process, `generate` at the default ran at 14.7 tokens/s against 347 with one thread.
The policy: an explicit `--threads` (or `threads` in config.toml) wins; otherwise one thread per
core that is idle when decoding starts, minus the cores kept for other work of this process (the
chat's UI thread), and at least one.

llama.cpp runs a forward of one token and a forward of several (the prompt's prefill, a verify) on
thread counts of their own (`n_threads`, `n_threads_batch`; llama.cpp's `-t` and `-tb`). A batch
takes every idle core, the UI's included: the chat's UI thread has little to draw while a prompt is
read, and a batch's quantized products scale with the cores where a one-token forward barely does
(the default model, 2 cores: the prefill and a 6-token verify take 0.55 and 0.5 of their one-thread
time on two threads, a one-token forward 0.62). So an explicit `--threads-batch` wins, else an
explicit `--threads`, as llama.cpp's `-tb` defaults to `-t`; else the idle cores, never fewer than
the one-token forwards' threads. llama-cpp-python's own default is the same split (half the cores
for one token, all of them for a batch).

The chat keeps its UI's core on llama.cpp too, though a one-token forward of the default model
takes 7.0 ms on two threads against 11.0 on one (docs/llama-forward-table.json): in the chat
(prompt lookup, the goodput policy, batches on two threads either way; 2-core CPU) two threads a
token decoded at 0.94× one (95% CI 0.90-0.96, median of 10 paired 300-token replies), 0.88×
(0.73-0.94) with one more process keeping a core busy, keys taking effect alike (median 1 ms, 95th
percentile under 6 ms). The policy, pricing V(1) at two threads, drafted half as much (τ 1.40
against 2.38), and its cheaper single forwards did not pay for the extra ones
(`scripts/bench_chat.py --compare-threads`; docs/benchmarks.md, "The chat's threads on llama.cpp").
"""

from __future__ import annotations

import psutil

from fsd_chat.support.errors import SettingsError

SAMPLE_SECONDS = 0.2
"""How long the idle cores are measured for."""


def idle_cores(sample_seconds: float = SAMPLE_SECONDS) -> int:
    """Cores this process may run on that were idle over `sample_seconds` (rounded to nearest)."""
    total = psutil.cpu_count() or 1
    affinity = getattr(psutil.Process(), "cpu_affinity", None)  # not on macOS
    allowed = len(affinity()) if affinity is not None else total
    busy_share = psutil.cpu_percent(interval=sample_seconds) / 100  # over all the machine's cores
    return max(0, min(allowed, round(total * (1 - busy_share))))


def choose_threads(requested: int | None, *, reserve: int = 0) -> int:
    """The torch thread count: `requested` if given, else the idle cores minus `reserve`.

    Raises:
        SettingsError: `requested` < 1.
    """
    return choose_thread_counts(requested, reserve=reserve)[0]


def choose_thread_counts(
    requested: int | None, requested_batch: int | None = None, *, reserve: int = 0
) -> tuple[int, int]:
    """llama.cpp's threads for forwards of one token and of several (module docstring): `requested`
    (`--threads`) if given, else the idle cores minus `reserve`, at least one; `requested_batch`
    (`--threads-batch`) if given, else `requested` if given, else the idle cores (sampled once),
    never fewer than the first.

    Raises:
        SettingsError: `requested` or `requested_batch` < 1.
    """
    if requested_batch is not None:
        check_threads_batch(requested_batch)
    if requested is not None:
        if requested < 1:
            raise SettingsError(f"--threads must be ≥ 1, got {requested}")
        return requested, requested_batch or requested
    threads, batch = split_threads(idle_cores(), reserve=reserve)
    return threads, requested_batch or batch


def split_threads(idle: int, *, reserve: int = 0) -> tuple[int, int]:
    """The policy's counts when no count is given and `idle` cores are idle: forwards of one token
    on the idle cores less `reserve`, at least one; forwards of several on every idle core, never
    fewer (the chat on an idle 2-core CPU, `reserve` 1: one and two)."""
    threads = max(1, idle - reserve)
    return threads, max(threads, idle)


def check_threads_batch(requested: int) -> int:
    """`--threads-batch` once checked.

    Raises:
        SettingsError: `requested` < 1.
    """
    if requested < 1:
        raise SettingsError(f"--threads-batch must be ≥ 1, got {requested}")
    return requested


def apply_threads(requested: int | None, *, reserve: int = 0) -> int:
    """Set torch's intra-op thread count by `choose_threads`; returns it."""
    import torch

    threads = choose_threads(requested, reserve=reserve)
    torch.set_num_threads(threads)
    return threads
