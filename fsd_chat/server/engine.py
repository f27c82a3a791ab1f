"""One model pair serving many requests: a worker thread decodes one reply at a time over the pair's
one decoder (whose KV caches keep the last sequence, so a prompt that extends it prefills only what
is new); the other requests wait first in, first out, in a bounded queue.

A reply's steps are handed to whoever asked for it through `Job.deliver`, called in the worker
thread. Cancelling the reply being decoded asks the decoder to stop through its `Controls`: the
reply ends after the step in progress.

When a reply ends and no other request waits, the worker reads the conversation ahead, as the chat
does while its user types (`Decoder.read_ahead`): the KV caches are fed what a client's next request
re-sends (`Job.history`: the messages and the reply as the client received it), so that request
prefills only its new message, however the model tokenised its reply. A request that arrives
meanwhile stops the reading between two chunks of the prefill.

`Engine.shutdown` (the server's SIGTERM or Ctrl+C) ends every job at once: the one decoding stops
after its step in progress, and each job, queued or decoding, receives `ShuttingDownError` before
its end, so that its client learns why (a 503, or an error event that ends its stream).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from fsd_chat.decoding.controls import Controls
from fsd_chat.decoding.events import Step, StopReason
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.decoding.settings import DecodingSettings, SamplingConfig
from fsd_chat.support.errors import FsdChatError
from fsd_chat.support.log import log_exception

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    """Every place in the queue is taken: the request is refused (HTTP 429).

    Attributes:
        retry_after: Whole seconds until the queue is expected to be empty (≥ 1): Retry-After.
    """

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


class ShuttingDownError(FsdChatError):
    """The server is shutting down: a job is refused or ended (HTTP 503)."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down: this request is not answered in full; retry later")


FIRST_REPLY_SECONDS = 5.0
"""The expected time of a reply before any has ended (`Engine.expected_wait`)."""

SMOOTHING = 0.2
"""Weight of the latest reply in the moving average of replies' times (`Engine.expected_wait`)."""


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
        history: The token ids a follow-up request would start with, given this reply's text as
            the client received it (cut at a stop string); called in the worker thread after the
            reply ends (None: nothing is read ahead). May raise `FsdChatError` (a template that
            cannot render the conversation): nothing is read then.
    """

    prompt_ids: list[int]
    settings: DecodingSettings
    sampling: SamplingConfig
    max_new_tokens: int
    stop_strings: tuple[str, ...]
    deliver: Callable[[Delivery], None]
    cancelled: bool = field(default=False)
    cached_tokens: int = 0
    history: Callable[[str], list[int]] | None = None


def stop_index(text: str, stop_strings: tuple[str, ...]) -> int:
    """Where the first stop string in `text` starts (-1: none): the client receives `text` up to it."""
    return min((i for s in stop_strings if (i := text.find(s)) >= 0), default=-1)


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
        self._reading_ahead = False
        """The worker is reading a conversation ahead (guarded by `_lock`): a new job stops it."""
        self._idle = threading.Event()
        """Set while no job is queued, decoded or read ahead."""
        self._idle.set()
        self.steps = 0
        """Decoding steps run since the start (read by tests and the load script's checks)."""
        self._closing = False
        """Set by `shutdown` (guarded by `_lock`): every job is refused or ended."""
        self._started_at = 0.0
        """When the current job started (monotonic seconds)."""
        self._reply_seconds = FIRST_REPLY_SECONDS
        """Moving average of a reply's wall time, from its start to its end."""
        self._thread = threading.Thread(target=self._run, name="fsd-chat-serve-decoder", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`; its steps arrive through `job.deliver`.

        Raises:
            QueueFullError: the queue is full.
            ShuttingDownError: the server is shutting down.
        """
        with self._lock:
            if self._closing:
                raise ShuttingDownError
            try:
                self._jobs.put_nowait(job)
            except queue.Full:
                raise QueueFullError(self._expected_wait()) from None
            self._idle.clear()
            if self._reading_ahead:  # the job waits for nothing that is only an optimisation
                self.controls.request_stop()

    def _expected_wait(self) -> int:
        """Whole seconds until the queue is expected to be empty (≥ 1): what is left of the reply
        decoding now, and an average reply's time for each one waiting (guarded by `_lock`). Not
        just until one place frees: the clients refused together would all come back for it."""
        left = 0.0
        if self._current is not None:
            left = max(self._reply_seconds - (time.monotonic() - self._started_at), 0.0)
        return max(1, math.ceil(left + self._jobs.qsize() * self._reply_seconds))

    @property
    def closing(self) -> bool:
        """Whether `shutdown` was called."""
        return self._closing

    def shutdown(self) -> None:
        """End every job now (the server is stopping): the one decoding stops after the step in
        progress and each one receives `ShuttingDownError`, queued ones at once; any job submitted
        later is refused. The worker stays, to end the current job; `close` ends it."""
        with self._lock:
            self._closing = True
            queued = self._drain()
            if self._current is not None or self._reading_ahead:
                self.controls.request_stop()
        for job in queued:
            job.deliver(ShuttingDownError())
            job.deliver(None)

    def _drain(self) -> list[Job]:
        """Take every queued job out, marked cancelled (the caller holds `_lock`, or the worker is
        gone)."""
        jobs: list[Job] = []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return jobs
            if job is not None:
                job.cancelled = True
                jobs.append(job)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no job is queued, decoded or read ahead (or `timeout` seconds pass); returns
        whether it is so."""
        return self._idle.wait(timeout)

    def cancel(self, job: Job) -> None:
        """Give up `job` (its client left): skipped if it is still queued, stopped after the step in
        progress if it is being decoded; nothing if it ended."""
        with self._lock:
            job.cancelled = True
            if self._current is job:
                self.controls.request_stop()

    def close(self, timeout: float = 5.0) -> None:
        """Cancel every job and end the worker, waiting at most `timeout` seconds for it."""
        with self._lock:
            self._drain()
            if self._current is not None:
                self._current.cancelled = True
            if self._current is not None or self._reading_ahead:
                self.controls.request_stop()
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._jobs.empty():
                    self._idle.set()
            if (job := self._jobs.get()) is None:
                return
            with self._lock:
                if self._closing and not job.cancelled:  # taken out of the queue as it closed
                    job.deliver(ShuttingDownError())
                    job.deliver(None)
                    continue
                if job.cancelled:
                    continue
                self._current = job
                self._started_at = time.monotonic()
                # A stop requested for the previous reply after its last step is not this one's.
                self.controls.clear_stop()
                self.controls.update(**asdict(job.settings))
            text: list[str] = []
            ended: StopReason | None = None
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
                    text.append(step.text)
                    ended = step.stop_reason
                    job.deliver(step)
            except Exception as exc:  # handed to the request, which answers it in OpenAI's shape
                ended = None
                job.deliver(exc)
            finally:
                with self._lock:
                    self._current = None
                    seconds = time.monotonic() - self._started_at
                    self._reply_seconds += SMOOTHING * (seconds - self._reply_seconds)
                    # Taken before the last delivery: the request marks its job cancelled once answered.
                    kept = not job.cancelled and ended not in (None, StopReason.STOPPED)
                    # Stopped by the shutdown (not by its client, nor ended by an error delivered above).
                    shut = self._closing and ended == StopReason.STOPPED
                if shut:
                    job.deliver(ShuttingDownError())
                job.deliver(None)
            if kept and job.history is not None and not self._closing:
                self._read_ahead(job.history, "".join(text), job.stop_strings)

    def _read_ahead(
        self, history: Callable[[str], list[int]], text: str, stop_strings: tuple[str, ...]
    ) -> None:
        """Read the conversation of a reply that ended (its `text`) ahead, unless a job waits."""
        if (cut := stop_index(text, stop_strings)) >= 0:
            text = text[:cut]
        with self._lock:
            if not self._jobs.empty():
                return
            self._reading_ahead = True
            self.controls.clear_stop()
        try:
            self.decoder.read_ahead(history(text))
        except FsdChatError as exc:  # a template that cannot render it, or out of memory: the next
            # request prefills what it needs, and says why if it cannot
            log.info("not read ahead: %s", exc)
        except Exception as exc:  # a bug: logged, and the worker goes on serving
            log_exception(exc, "reading a conversation ahead")
        finally:
            with self._lock:
                self._reading_ahead = False
