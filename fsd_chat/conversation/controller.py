"""The chat's decisions, without a UI: what a message sends, which steps count, when a reply ends and
is saved, what a new chat, an export or an unsaved quit writes.

`ChatController` is a plain object the chat screen calls and whose small result values it renders
(`Sent`, `Finished`, `Notice`); it never draws and never starts a thread. The screen's generation
worker (a thread) calls its blocking pieces, `build_prompt` and `steps`, under `decoder_lock`; every
other method runs on the UI thread. Saving runs in the controller's `SessionWriter` thread: once its
prompt is built, a message is appended together with the reply it asks for (stored as `streaming`),
so the stored session always alternates; the reply's row is rewritten at most once every
`SAVE_INTERVAL` while it streams and once when it ends (stopped, if a new chat, quit or a signal
cut it short).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from fsd_chat.conversation.session import (
    DIAL_FIELDS,
    STOPPED,
    ReplyRecord,
    Session,
    Turn,
    final_dial,
    new_session_id,
    now,
)
from fsd_chat.conversation.store import SessionStore
from fsd_chat.conversation.transcript import default_path, render_markdown, write_atomic
from fsd_chat.conversation.writer import SessionWriter
from fsd_chat.decoding.controls import Controls
from fsd_chat.decoding.events import Step, StopReason
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.decoding.settings import (
    DEFAULT_MAX_NEW_TOKENS,
    DecodingSettings,
    SamplingConfig,
    SamplingRequest,
    default_threshold,
)
from fsd_chat.models.chat_template import (
    ChatTemplateError,
    Message,
    PromptBuilder,
    RenderLimits,
    TemplateLimitError,
    prompt_ids,
)
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.errors import FsdChatError
from fsd_chat.support.log import log_exception, log_path

SAVE_INTERVAL = 1.0
"""Seconds between two saves of a streaming reply: what a kill -9 can lose at most."""


@dataclass(slots=True)
class ChatOptions:
    """What `fsd-chat chat` was asked for: everything the app, the chat screen and the controller run with.

    Attributes:
        target, draft, load: The models and how to load them.
        settings: Decoding settings at the start (the dial moves them).
        threshold_given: T was given (a flag, config.toml, a resumed session); else the setup's
            default replaces it once the sampling is known (`default_threshold`).
        sampling: The sampling asked for; the rest comes from the target's generation_config.
        max_new_tokens: Cap per reply.
        raw: Plain-text turns even for chat models.
        autoregressive: Target-only decoding (the dial is off).
        system: System prompt (None: none, or the resumed session's).
        theme: Theme name (None: the default).
        transcripts_dir: Folder the export dialog suggests.
        store: Where sessions are saved.
        resume: A saved session to continue.
        keymap: Binding id -> keys (also listed by the help screen).
        user_themes_dir: Folder of the user's theme files.
        threads: CPU threads for torch (None: the thread policy's choice, see `fsd_chat.support.threads`).
        threads_batch: llama.cpp's threads for forwards of several tokens (None: the policy's).
        compiled: Compile the models' decoding steps (`--compile`; None: on a CUDA device only).
        whole_step: Each step as one captured graph on CUDA, eager on the CPU (`--whole-step`;
            None: `ModelPair.whole_step`'s default).
    """

    target: ModelSpec
    draft: ModelSpec
    store: SessionStore
    load: LoadOptions = field(default_factory=LoadOptions)
    settings: DecodingSettings = field(default_factory=DecodingSettings)
    threshold_given: bool = True
    sampling: SamplingRequest = field(default_factory=SamplingRequest)
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    raw: bool = False
    autoregressive: bool = False
    system: str | None = None
    theme: str | None = None
    transcripts_dir: Path = field(default_factory=Path.cwd)
    resume: Session | None = None
    keymap: dict[str, str] = field(default_factory=dict)
    user_themes_dir: Path | None = None
    threads: int | None = None
    threads_batch: int | None = None
    compiled: bool | None = None
    whole_step: bool | None = None


@dataclass(frozen=True, slots=True)
class Notice:
    """One line for the user (the UI shows it as a notification).

    Attributes:
        text: What to say.
        title: Its heading ("" for none).
        severity: How it is shown.
        timeout: Seconds it stays (None: the UI's default).
    """

    text: str
    title: str = ""
    severity: Literal["information", "warning", "error"] = "information"
    timeout: float | None = None


def save_failed_notice(reason: str) -> Notice:
    """What to say when saving fails (`on_save_failed`'s reason): the writer keeps the save and retries."""
    return Notice(
        f"{reason}. It is kept and retried on the next save.", title="Session not saved", severity="error"
    )


SAVE_RECOVERED = Notice("Session saved again.", timeout=3)
"""What to say when saving works again."""

BUSY = Notice("A reply is streaming: wait for it, or press Esc to stop it.", severity="warning")
"""What `send` answers while a reply is streaming (the text is given back to the prompt)."""


@dataclass(frozen=True, slots=True)
class Sent:
    """A message on its way: its prompt is still to be built (`ChatController.build_prompt`).

    Attributes:
        generation: Its number; steps and prompts of any other are stale.
        messages: The conversation the prompt is built from, this message last.
        question: The user turn (in the session once the prompt is built).
        reply: The assistant turn it asks for; its `reply` record is the one the steps fill.
    """

    generation: int
    messages: list[Message]
    question: Turn
    reply: Turn

    @property
    def record(self) -> ReplyRecord:
        """The reply's record, filled by folding the steps into it (`ReplyBuilder`)."""
        assert self.reply.reply is not None
        return self.reply.reply


@dataclass(frozen=True, slots=True)
class Finished:
    """How a reply in flight ended.

    Attributes:
        sent: The message it answered.
        stored: False when its prompt was never built: the message is withdrawn, nothing is
            stored, and its text goes back to the prompt.
        retry: The reply failed before producing any text: the message may be sent again.
        notice: Something to say once (a model runs eagerly: `--compile` was refused or failed).
    """

    sent: Sent
    stored: bool
    retry: bool = False
    notice: Notice | None = None


class ChatController:
    """The reply lifecycle of one chat over a loaded pair: send, stream, stop, finish, save.

    Args:
        options: What the chat was asked for.
        pair: The loaded models (tokenizer, vocabulary, generation config, description).
        decoder: Built once over the pair; reused for every reply.
        controls: Shared with the decoder (the dial moves them; Esc requests a stop).
        tracebacks: Where unexpected errors' tracebacks are collected (`--debug` prints them).
        on_save_failed: Called (in the writer thread) with a one-line reason when saving fails,
            once per run of failures; the UI says so (`save_failed_notice`).
        on_save_recovered: Called (in the writer thread) when saving works again.
    """

    def __init__(
        self,
        options: ChatOptions,
        pair: ModelPair,
        decoder: Decoder,
        controls: Controls,
        *,
        tracebacks: list[str] | None = None,
        on_save_failed: Callable[[str], object],
        on_save_recovered: Callable[[], object] = lambda: None,
    ) -> None:
        self.options = options
        self.decoder = decoder
        self.controls = controls
        self.tracebacks: list[str] = [] if tracebacks is None else tracebacks
        o = options
        resolved = o.sampling.resolve(pair.generation_config, Path(o.target.source).name)
        self.sampling: SamplingConfig = resolved.config
        """The sampling in force: the request over the target's generation_config."""
        # T not given: the setup's default (greedy: a regret bound with its own scale).
        start = default_threshold(o.settings, o.threshold_given, self.sampling.greedy)
        if start != o.settings:
            controls.update(threshold=start.threshold)
        self.sampling_source = resolved.source + (
            f"; not applied: {', '.join(resolved.not_applied)}" if resolved.not_applied else ""
        )
        """Where the sampling came from, and the model's processors not applied (help screen)."""
        self.describe = f"{pair.describe(target_only=o.autoregressive)} · {self.sampling.describe()}"
        """The header line: models, quantization, device, mode and sampling."""
        self.draft_label = pair.draft_label
        """The kind of draft the legend names (`ModelPair.draft_label`)."""
        self.session = o.resume or _new_session(o, pair, self.sampling)
        self.prompts = PromptBuilder(pair.tokenizer, raw=o.raw, vocab_size=pair.vocab_size)
        self.writer = SessionWriter(o.store, on_error=on_save_failed, on_recovered=on_save_recovered)
        self.generation = 0
        """Number of the latest message sent; prompts and steps of older ones are stale."""
        self.sent: Sent | None = None
        """The message whose reply is in flight (None when none is)."""
        self._stored = False
        """Whether `sent` is in `session.turns` (its prompt was built)."""
        self._last_save = 0.0
        # One generation at a time uses the decoder's KV caches, even when a cancelled one is
        # still finishing its last step.
        self.decoder_lock = threading.Lock()
        """Held by the generation worker while it builds a prompt and decodes."""
        self._compile_error_shown = False

    # --- sending ----------------------------------------------------------------------------

    def send(self, text: str) -> Sent | Notice | None:
        """Start a message: the prompt is built next, in the worker (`build_prompt`).

        Returns:
            The message sent; `BUSY` while a reply is streaming (the text goes back to the
            prompt); None for a blank text (nothing happens).
        """
        text = text.strip()
        if not text:
            return None
        if self.sent is not None:
            return BUSY
        # Cleared here, not when decoding starts: Esc pressed before the first step still counts.
        self.controls.clear_stop()
        self.generation += 1
        self.sent = Sent(
            self.generation,
            [*self.session.messages(), Message("user", text)],
            Turn("user", text),
            Turn("assistant", "", reply=ReplyRecord()),
        )
        self._stored = False
        return self.sent

    def is_current(self, generation: int) -> bool:
        """Whether `generation`'s prompt and steps still count: it is the latest and its reply is
        in flight (a new chat, a stop or a failure makes them stale)."""
        return generation == self.generation and self.sent is not None

    def reserve(self) -> int:
        """Tokens kept for the reply: half the window at most, so that a large --max-new-tokens
        does not make every prompt impossible (the reply then ends at the window's edge instead)."""
        context = self.decoder.context
        limit = self.options.max_new_tokens
        return limit if context is None else min(limit, context // 2)

    def build_prompt(self, messages: list[Message], cancelled: Callable[[], bool]) -> tuple[int, list[int]]:
        """Build the prompt (blocking; called by the worker under `decoder_lock`).

        Args:
            messages: `Sent.messages`.
            cancelled: Polled while the template renders; Esc also cuts it short.

        Returns:
            (messages left out because they no longer fit the context, the prompt's token ids).

        Raises:
            Whatever the template raises (`TemplateLimitError` past the limits, a prompt too long).
        """
        return self.prompts.build(
            messages,
            context=self.decoder.context,
            reserve=self.reserve(),
            cancelled=lambda: cancelled() or self.controls.stop_requested,
        )

    def steps(self, prompt_ids: list[int]) -> Iterator[Step]:
        """The reply's decoding steps (blocking; iterated by the worker under `decoder_lock`)."""
        return self.decoder.generate(
            prompt_ids, max_new_tokens=self.options.max_new_tokens, sampling=self.sampling
        )

    def read_ahead(self, steps: list[Step], cancelled: Callable[[], bool]) -> None:
        """Feed the target's KV cache the conversation as the next prompt will start, the reply of
        `steps` (those just decoded) included, while the user types the next message: that prompt
        then prefills only the new message, however the model tokenised its reply (blocking;
        called by the worker under `decoder_lock` when a reply ends). Nothing after a reply the
        user stopped (esc, ctrl+n, quit: the machine is wanted back), and nothing when the template
        cannot render the conversation (the next prompt says why).

        Raises:
            DeviceMemoryError: see `Decoder.read_ahead`.
        """
        if not steps or steps[-1].stop_reason == StopReason.STOPPED:
            return
        try:
            ids = self.prompts.history(Message("assistant", "".join(s.text for s in steps)), cancelled)
        except FsdChatError:
            return
        self.decoder.read_ahead(ids)

    def check_template(self) -> Notice | None:
        """Render the chat template once over a short conversation (the system prompt, if any, and
        one user turn), as `generate` does before decoding, so that a broken template is told when
        the chat opens rather than on the first send (blocking; called by a worker under
        `decoder_lock`: the tokenizer is not to be used by two threads at once).

        Returns:
            None when the template renders (or there is none, or `--raw` is on); else why it
            failed, with what `--raw` would do instead.
        """
        probe = [*self.session.messages()[:1], Message("user", "Hello")]
        if probe[0].role != "system":
            probe = probe[-1:]
        limits = RenderLimits(self.prompts.seconds, self.prompts.size)
        try:
            prompt_ids(self.prompts.tokenizer, probe, raw=self.options.raw, limits=limits)
        except (ChatTemplateError, TemplateLimitError) as exc:
            return Notice(
                f"{exc}. With --raw the chat would send the turns as plain text, one after another, "
                "without the template's role markers: a chat model may then continue the text rather "
                "than answer it.",
                title="The chat template fails",
                severity="error",
                timeout=30,
            )
        return None

    def prompt_ready(self, dropped: int) -> Notice | None:
        """The current message's prompt is built: the message and the reply it asks for (as
        `streaming`) join the session and are stored.

        Returns:
            A warning when `dropped` earlier messages were left out of the prompt.
        """
        sent = self.sent
        assert sent is not None
        turns = [sent.question, sent.reply]
        self.session.turns += turns
        self.writer.append(self.session, turns)
        self._stored = True
        self._last_save = time.monotonic()
        if not dropped:
            return None
        return Notice(
            f"{dropped} earlier message(s) no longer fit the model's context "
            f"({self.decoder.context} tokens) and were left out of the prompt.",
            severity="warning",
        )

    def prompt_failed(self, error: BaseException) -> Notice:
        """The current message's prompt could not be built (too long, a failing or runaway
        template, Esc): it is withdrawn (`withdraw`); returns why, to show."""
        self.controls.clear_stop()  # an Esc that cut the template short is spent
        reason = self.error_line(error, "building the prompt")
        return Notice(reason, title="Message not sent", severity="error")

    def withdraw(self) -> Sent:
        """Take back the message whose prompt was never built; returns it (its text goes back to
        the prompt)."""
        sent = self.sent
        assert sent is not None and not self._stored
        self.sent = None
        return sent

    # --- streaming and ending -----------------------------------------------------------------

    def steps_shown(self, steps: tuple[Step, ...], ended: bool) -> bool:
        """The UI showed `steps` (already folded into `Sent.record`); the stored reply is rewritten
        when `SAVE_INTERVAL` has passed.

        Args:
            steps: The batch just shown (may be empty).
            ended: The decoder finished.

        Returns:
            Whether the reply ended (the UI then calls `finish`).
        """
        if ended or (steps and steps[-1].stop_reason is not None):
            return True
        # Not before the prompt is built: the reply joins the store then (`prompt_ready`), and the
        # writer can only update a turn it has appended.
        if self._stored and time.monotonic() - self._last_save >= SAVE_INTERVAL:
            self._last_save = time.monotonic()
            assert self.sent is not None
            self.writer.update_reply(self.session.id, self.sent.reply)
        return False

    def stop(self) -> None:
        """Ask the decoder to stop the reply in flight after the step in progress (kept)."""
        if self.sent is not None:
            self.controls.request_stop()

    def finish(self, error: str | None = None) -> Finished:
        """End the reply in flight (stopped, unless it has its own reason; `error` if it failed)
        and save it; a message whose prompt was still building is withdrawn instead."""
        if not self._stored:
            return Finished(self.withdraw(), stored=False)
        sent = self.sent
        assert sent is not None
        self.sent = None
        record = sent.record
        if record.stop_reason is None:
            record.stop_reason = "error" if error is not None else STOPPED
        sent.reply.content = record.text
        self.writer.update_reply(self.session.id, sent.reply)
        notice = None
        compile_error = self.decoder.compile_error
        if compile_error and not self._compile_error_shown:
            self._compile_error_shown = True
            notice = Notice(f"running eagerly: {compile_error}", title="--compile failed", severity="warning")
        return Finished(sent, stored=True, retry=error is not None and not sent.reply.content, notice=notice)

    def generation_failed(self, error: BaseException) -> Notice:
        """Decoding raised `error`: returns what to show (the UI then finishes the reply with its
        text)."""
        return Notice(self.error_line(error, "decoding a reply"), title="Generation failed", severity="error")

    def error_line(self, error: BaseException, doing: str) -> str:
        """One line for `error`: its own message for an `FsdChatError`; otherwise the error is
        unexpected, logged with its traceback (collected in `tracebacks`) and named with the log."""
        if isinstance(error, FsdChatError):
            return str(error)
        self.tracebacks.append(log_exception(error, doing))
        return f"{type(error).__name__} while {doing}: {error} (details in {log_path()})"

    # --- the session --------------------------------------------------------------------------

    def dial_moved(self, settings: DecodingSettings) -> None:
        """The dial now stands at `settings`: the session keeps them (`--resume` reopens there),
        saved at once when the session is stored already, else with its first message."""
        dial = {key: value for key, value in asdict(settings).items() if key in DIAL_FIELDS}
        # A new dict, never one changed in place: the writer thread may be serialising the old one.
        self.session.settings = {**self.session.settings, "dial": dial}
        if self.session.turns:
            self.writer.update_settings(self.session)

    def new_chat(self) -> Notice:
        """Start a new session with the same models and settings (the old one stays saved); the
        reply in flight must have been finished (steps still coming for it are then stale, and
        every later message takes a new generation number)."""
        old = self.session
        # It starts where the dial stands.
        settings = {key: value for key, value in old.settings.items() if key != "dial"} | final_dial(
            old.settings
        )
        self.session = Session(new_session_id(), now(), dict(old.models), settings, old.system)
        return Notice(f"New chat {self.session.id}", timeout=2)

    def close(self, timeout: float) -> bool:
        """Write everything pending, waiting at most `timeout` seconds; the reply in flight must
        have been finished.

        Returns:
            Whether everything was saved.
        """
        return self.writer.close(timeout)

    def keep_unsaved(self) -> str:
        """Write the session as a Markdown transcript beside the session store (in the
        transcripts folder if that fails), for when saving it failed.

        Returns:
            One line for the user: where the transcript is, or, when it could not be written
            anywhere, the transcript itself.
        """
        text = render_markdown(self.session)
        for folder in (self.options.store.path.parent, self.options.transcripts_dir):
            path = default_path(folder, self.session)
            try:
                written = write_atomic(path.with_name("unsaved-" + path.name), text)
            except FsdChatError:
                continue
            return f"the unsaved session is in {written}"
        return "the unsaved session could not be written to a file either; here it is:\n" + text

    def export_path(self) -> Path:
        """Where the export dialog suggests writing the transcript."""
        return default_path(self.options.transcripts_dir, self.session)

    def write_transcript(self, path: Path) -> Path:
        """Write the session's transcript to `path` (atomically); returns the path written.

        Raises:
            FsdChatError: The file could not be written (the reason in one line).
        """
        return write_atomic(path, render_markdown(self.session))


def _new_session(options: ChatOptions, pair: ModelPair, sampling: SamplingConfig) -> Session:
    """A fresh session recording the models and the settings it starts with."""
    o = options
    models = {
        "target": o.target.source,
        "draft": o.draft.source,
        "quantize_target": o.target.quantization,
        "quantize_draft": o.draft.quantization,
        "draft_kind": "none" if o.autoregressive else pair.draft_kind,
        "device": str(pair.device),
        "dtype": str(pair.dtype).removeprefix("torch."),
    }
    settings = {
        **asdict(o.settings),
        **asdict(sampling),
        "max_new_tokens": o.max_new_tokens,
        "mode": "autoregressive" if o.autoregressive else "speculative",
    }
    return Session(new_session_id(), now(), models, settings, o.system)
