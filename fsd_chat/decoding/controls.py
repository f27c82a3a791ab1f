"""Live decoding controls, shared between the UI thread and the generation thread.

The UI changes settings at any time; the decoder takes one consistent `snapshot()` at the start of
every step, so a change applies from the next step and never half-way through one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fsd_chat.decoding.settings import DecodingSettings


class Controls:
    """Thread-safe holder of `DecodingSettings`, of a stop request, and of who hears the progress
    of a long prefill."""

    def __init__(self, settings: DecodingSettings | None = None) -> None:
        self._lock = threading.Lock()
        self._settings = settings or DecodingSettings()
        self._stop = threading.Event()
        self._prefill_listener: Callable[[int, int], object] | None = None
        self.cached_prompt_tokens = 0
        """Prompt tokens the target's KV cache kept from the sequence before, at the start of the
        latest reply (prefix reuse; set by `fsd_chat.decoding.reply.begin` in the decoding thread):
        the rest of the prompt was fed to it (llama-server's `cache_n`)."""

    def snapshot(self) -> DecodingSettings:
        """The settings in force now (immutable)."""
        with self._lock:
            return self._settings

    def update(self, **changes: Any) -> DecodingSettings:
        """Change some settings (fields of `DecodingSettings`); returns the new settings.

        Raises:
            SettingsError: a value out of range (the settings stay as they were).
        """
        with self._lock:
            self._settings = replace(self._settings, **changes)
            return self._settings

    def request_stop(self) -> None:
        """Ask the running generation to end after the step in progress."""
        self._stop.set()

    def clear_stop(self) -> None:
        """Forget a stop request: the reply it ended consumed it, or a UI starts a new reply."""
        self._stop.clear()

    @property
    def stop_requested(self) -> bool:
        """Whether a stop was requested since the last `clear_stop`."""
        return self._stop.is_set()

    def listen_prefill(self, listener: Callable[[int, int], object] | None) -> None:
        """Have `listener(done, total)` called (in the decoding thread) as a long prompt is read:
        the prompt tokens every model has read so far (kept from the previous prompt, or fed), of
        the `total` to read (see `fsd_chat.decoding.reply.begin`); None stops it."""
        self._prefill_listener = listener

    def report_prefill(self, done: int, total: int) -> None:
        """Every model has read `done` of the `total` prompt tokens of a long prefill."""
        listener = self._prefill_listener
        if listener is not None:
            listener(done, total)
