"""How many CPU threads torch decodes with: chosen, not left to torch.

torch's default is one intra-op thread per core. Its OpenMP threads spin-wait for each other at
every operation, so when any core is busy with other work (another process, or the chat's own UI
thread) every operation waits for the thread that lost its core: on a 2-core machine with one
other busy process, `generate` at the default ran at 14.7 tokens/s against 347 with one thread.
The policy: an explicit `--threads` (or `threads` in config.toml) wins; otherwise one thread per
core that is idle when decoding starts, minus the cores kept for other work of this process (the
chat's UI thread), and at least one.
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
    if requested is not None:
        if requested < 1:
            raise SettingsError(f"--threads must be ≥ 1, got {requested}")
        return requested
    return max(1, idle_cores() - reserve)


def apply_threads(requested: int | None, *, reserve: int = 0) -> int:
    """Set torch's intra-op thread count by `choose_threads`; returns it."""
    import torch

    threads = choose_threads(requested, reserve=reserve)
    torch.set_num_threads(threads)
    return threads
