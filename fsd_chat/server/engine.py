"""One model pair serving many requests: a worker thread decodes one reply at a time over the pair's
one decoder (whose KV caches keep the last sequence, so a prompt that extends it prefills only what
is new); the other requests wait first in, first out, in a bounded queue.

A reply's steps are handed to whoever asked for it through `Job.deliver`, called in the worker
thread. Cancelling the reply being decoded asks the decoder to stop through its `Controls`: the
reply ends after the step in progress.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from fsd_chat.decoding.controls import Controls
from fsd_chat.decoding.events import Step
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.decoding.settings import DecodingSettings, SamplingConfig


class QueueFullError(Exception):
    """Every place in the queue is taken: the request is refused (HTTP 429)."""


Delivery = Step | BaseException | None
"""What a job receives: a decoding step, the error that ended the reply, or None once it ended."""


@dataclass(slots=True)
class Job:
    """One reply to decode.

    Attributes:
        prompt_ids: The prompt's token ids (non-empty, within the context window).
        settings: The acceptance rule and its parameters for this reply (the dial per request).
        sampling: How its tokens are drawn.
        max_new_tokens: Cap on its tokens (tokens).
        stop_strings: Texts that end it once generated.
        deliver: Called in the worker thread with each `Delivery`, None last.
        cancelled: Set by `Engine.cancel`: a queued job is skipped, a running one stopped.
        cached_tokens: Prompt tokens the target's KV cache kept from the reply before (prefix
            reuse; not prefilled again): set before the first step is delivered.
    """

    prompt_ids: list[int]
    settings: DecodingSettings
    sampling: SamplingConfig
    max_new_tokens: int
    stop_strings: tuple[str, ...]
    deliver: Callable[[Delivery], None]
    cancelled: bool = field(default=False)
    cached_tokens: int = 0


class Engine:
    """The decoder of one pair behind a FIFO queue of at most `queue_size` waiting jobs.

    Args:
        decoder: The pair's decoder, driven by `controls`; reused for every reply.
        controls: Shared with the decoder: each job's settings are put in force before it runs, and
            a cancelled job's stop is requested through them.
        queue_size: Most jobs waiting (the one being decoded is not counted), ≥ 1.
    """

    def __init__(self, decoder: Decoder, controls: Controls, queue_size: int) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be ≥ 1, got {queue_size}")
        self.decoder = decoder
        self.controls = controls
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        """Guards `_current` and the stop flag: a cancel and the switch to the next job exclude
        each other, so a late cancel never stops the next reply."""
        self._current: Job | None = None
        self.steps = 0
        """Decoding steps run since the start (read by tests and the load script's checks)."""
        self._thread = threading.Thread(target=self._run, name="fsd-chat-serve-decoder", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`; its steps arrive through `job.deliver`.

        Raises:
            QueueFullError: the queue is full.
        """
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFullError from None

    def cancel(self, job: Job) -> None:
        """Give up `job` (its client left): skipped if it is still queued, stopped after the step in
        progress if it is being decoded; nothing if it ended."""
        with self._lock:
            job.cancelled = True
            if self._current is job:
                self.controls.request_stop()

    def close(self, timeout: float = 5.0) -> None:
        """Cancel every job and end the worker, waiting at most `timeout` seconds for it."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled = True
        with self._lock:
            if self._current is not None:
                self._current.cancelled = True
                self.controls.request_stop()
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                if job.cancelled:
                    continue
                self._current = job
                # A stop requested for the previous reply after its last step is not this one's.
                self.controls.clear_stop()
                self.controls.update(**asdict(job.settings))
            try:
                for index, step in enumerate(
                    self.decoder.generate(
                        job.prompt_ids,
                        max_new_tokens=job.max_new_tokens,
                        sampling=job.sampling,
                        stop_strings=job.stop_strings,
                    )
                ):
                    if index == 0:  # the prompt is read: its cached tokens are this reply's
                        job.cached_tokens = self.controls.cached_prompt_tokens
                    self.steps += 1
                    job.deliver(step)
            except Exception as exc:  # handed to the request, which answers it in OpenAI's shape
                job.deliver(exc)
            finally:
                with self._lock:
                    self._current = None
                job.deliver(None)
