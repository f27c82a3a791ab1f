"""The chat screen: the conversation, the prompt, the threshold dial and the live stats.

A message is sent through the generation worker (a thread), which first builds the prompt
(`PromptBuilder`: the chat template under time and size limits, the conversation fitted into the
context window) and then decodes: the decoder yields one `Step` per target forward pass, and the
worker adds each to a `StepBuffer` (`fsd_chat.tui.stream`), waking the UI only when the buffer was
empty. The UI takes everything buffered as one batch when its
`BatchPacer` allows: about 30 batches a second at most, fewer when drawing is costly. A batch goes
to the streaming `ReplyView`, which adds its steps to the reply and re-renders only its live tail
(the text after its last finished line), and to the stats strip, which refreshes once. The reply
is rendered whole once, when it ends. Keys change the shared `Controls`, which the decoder reads at
the start of every step.

Saving runs in a `SessionWriter` thread, never on the UI thread: once its prompt is built, a
message is appended together with the reply it asks for (stored as `streaming`), so the stored
session always alternates; the reply's row is rewritten at most once a second while it streams and
once when it ends (stopped, if a new chat, quit or a signal cut it short).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.content import Content
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Button, Footer, Static
from textual.worker import Worker, WorkerState, get_current_worker

from fsd_chat.conversation.session import STOPPED, Session, Turn, new_session_id, now
from fsd_chat.conversation.store import BUSY_TIMEOUT, SessionStore
from fsd_chat.conversation.transcript import default_path, render_markdown, write_atomic
from fsd_chat.conversation.writer import SessionWriter
from fsd_chat.decoding.controls import Controls
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.decoding.settings import DIVERGENCE_NAMES, Rule, SamplingConfig
from fsd_chat.models.chat_template import Message, PromptBuilder
from fsd_chat.support.errors import FsdChatError
from fsd_chat.support.log import log_exception, log_path
from fsd_chat.tui.keys import CHAT_BINDINGS
from fsd_chat.tui.messages import PromptFailed, PromptReady, SaveFailed, SaveRecovered, StepsReady
from fsd_chat.tui.screens.export import ExportScreen
from fsd_chat.tui.screens.help import HelpScreen
from fsd_chat.tui.stream import BatchPacer, StepBuffer
from fsd_chat.tui.widgets.conversation import ReplyView, UserMessage
from fsd_chat.tui.widgets.dial import ThresholdDial, dial_scale
from fsd_chat.tui.widgets.legend import Legend
from fsd_chat.tui.widgets.prompt import PromptInput
from fsd_chat.tui.widgets.stats import StatsStrip

if TYPE_CHECKING:  # transformers is loaded by the models, not by the screen
    from transformers import PreTrainedTokenizerBase

GROUP = "generation"
RULE_CYCLE: tuple[Rule, ...] = ("fuzzy", "mixture", "pure", "exact")
"""The order ctrl+g steps through the acceptance rules."""
SHOWN_TURNS = 10
"""Turns kept on screen (up to twice as many before the oldest are put away)."""
SAVE_INTERVAL = 1.0
"""Seconds between two saves of a streaming reply: what a kill -9 can lose at most."""


@dataclass(frozen=True, slots=True)
class ChatSetup:
    """Everything the chat screen runs with.

    Attributes:
        tokenizer: The pair's shared tokenizer (for the prompt).
        vocab_size: The pair's shared vocabulary (prompts beyond it are refused).
        decoder: Built once over the loaded pair; reused for every reply.
        controls: Shared with the decoder.
        describe: The header line (models, quantization, device).
        draft_label: The kind of draft the legend names (`ModelPair.draft_label`); None for a draft
            model sharing the target's tokenizer, which the origins' names already say.
        sampling: Sampling settings (also shown in the header line).
        sampling_source: Where they came from, and the model's processors not applied (help screen).
        max_new_tokens: Cap per reply.
        raw: Plain-text turns even when the tokenizer has a chat template.
        autoregressive: Target-only decoding (the dial is off).
        store: Where sessions are saved.
        session: The session to continue (a fresh one, or a resumed one).
        transcripts_dir: Folder the export dialog suggests.
        keymap: Binding id -> keys (for the help screen).
        tracebacks: Where unexpected errors' tracebacks are collected (`--debug` prints them).
    """

    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    decoder: Decoder
    controls: Controls
    describe: str
    draft_label: str | None
    sampling: SamplingConfig
    sampling_source: str
    max_new_tokens: int
    raw: bool
    autoregressive: bool
    store: SessionStore
    session: Session
    transcripts_dir: Path
    keymap: dict[str, str]
    tracebacks: list[str]


class ChatScreen(Screen[None]):
    """The main screen."""

    BINDINGS: ClassVar[list[BindingType]] = [*CHAT_BINDINGS]

    def __init__(self, setup: ChatSetup) -> None:
        super().__init__()
        self.setup = setup
        self.session = setup.session
        self.controls = setup.controls
        self.generation = 0
        """Number of the current generation; steps of older ones (before ctrl+n) are dropped."""
        self.streaming: ReplyView | None = None
        self._hidden = 0
        """Turns at the start of the session that are not mounted (see `_trim_turns`)."""
        self.reply_turn: Turn | None = None
        """The streaming reply's turn (in `session.turns` and stored)."""
        self._sent_text = ""
        self._question: Turn | None = None
        self._stored = False
        """Whether the message in flight is in `session.turns` (its prompt was built)."""
        self._sent_widgets: tuple[UserMessage, ReplyView] | None = None
        self.prompts = PromptBuilder(setup.tokenizer, raw=setup.raw, vocab_size=setup.vocab_size)
        self._last_save = 0.0
        self._buffer = StepBuffer()
        self._pacer = BatchPacer()
        self._batch_timer: Timer | None = None
        self.writer = SessionWriter(
            setup.store,
            on_error=lambda reason: self.post_message(SaveFailed(reason)),
            on_recovered=lambda: self.post_message(SaveRecovered()),
        )
        # One generation at a time uses the decoder's KV caches, even when a cancelled one is
        # still finishing its last step.
        self._decoder_lock = threading.Lock()
        self._compile_error_shown = False

    def compose(self) -> ComposeResult:
        """Header, conversation, legend, dial and stats, prompt, footer."""
        yield Static(Content.assemble(("fsd-chat ", "bold $accent"), self.setup.describe), id="header")
        yield VerticalScroll(id="conversation")
        yield Legend(self.setup.autoregressive, draft_label=self.setup.draft_label, id="legend")
        with Horizontal(id="controls"):
            yield ThresholdDial(id="dial")
            yield StatsStrip(id="stats")
        yield PromptInput(id="prompt", placeholder="Message (Enter sends, ctrl+j newline, F1 help)")
        yield Footer()

    def on_mount(self) -> None:
        """Show the session so far, the settings, and focus the prompt."""
        dial = self.query_one(ThresholdDial)
        dial.autoregressive = self.setup.autoregressive
        dial.settings = self.controls.snapshot()
        self._show_turns()
        self.query_one("#conversation", VerticalScroll).anchor()
        self.query_one(PromptInput).focus()

    def _show_turns(self) -> None:
        self._hidden = len(self.session.turns)
        self._trim_turns()

    @staticmethod
    def _turn_widgets(turns: list[Turn]) -> list[UserMessage | ReplyView]:
        return [UserMessage(t.content) if t.reply is None else ReplyView(t.reply) for t in turns]

    def _trim_turns(self) -> None:
        """Keep at most `SHOWN_TURNS` (to `2 * SHOWN_TURNS`) turns mounted: Textual lays out every
        mounted widget on each frame, so a long conversation would slow down every update of the
        streaming reply. Earlier turns are one button press away."""
        conversation = self.query_one("#conversation", VerticalScroll)
        shown = len(self.session.turns) - self._hidden
        if shown > 2 * SHOWN_TURNS:
            mounted = conversation.query_children(".turn")
            for widget in list(mounted)[: shown - SHOWN_TURNS]:
                widget.remove()
            self._hidden += shown - SHOWN_TURNS
        elif self._hidden and shown < SHOWN_TURNS:
            reveal = min(self._hidden, SHOWN_TURNS - shown)
            self._hidden -= reveal
            widgets = self._turn_widgets(self.session.turns[self._hidden : self._hidden + reveal])
            conversation.mount_all(widgets, before=0 if shown else None)
        earlier = conversation.query_children("#earlier")
        if self._hidden and not earlier:
            conversation.mount(Button("", id="earlier", compact=True), before=0)
        elif not self._hidden:
            earlier.remove()
        for button in conversation.query_children("#earlier").results(Button):
            button.label = f"Show {self._hidden} earlier turns"

    def on_button_pressed(self, event: Button.Pressed) -> None:
        """Show every earlier turn (the per-frame work then grows with them)."""
        if event.button.id == "earlier":
            conversation = self.query_one("#conversation", VerticalScroll)
            widgets = self._turn_widgets(self.session.turns[: self._hidden])
            self._hidden = 0
            conversation.mount_all(widgets, after=event.button)
            event.button.remove()

    # --- sending and streaming -------------------------------------------------------------

    def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        """Send the prompt's text, unless a reply is streaming. The prompt is built in the worker;
        the message is stored once it is (`on_prompt_ready`), or given back (`on_prompt_failed`)."""
        text = event.text.strip()
        if not text:
            return
        if self.streaming is not None:
            self.notify("A reply is streaming: wait for it, or press Esc to stop it.", severity="warning")
            self.query_one(PromptInput).give_back(event.text)
            return
        messages = [*self.session.messages(), Message("user", text)]
        # Cleared here, not when decoding starts: Esc pressed before the first step still counts.
        self.controls.clear_stop()
        reply = ReplyView()
        self._question = Turn("user", text)
        self.reply_turn = Turn("assistant", "", reply=reply.record)
        self._stored = False
        self._sent_text = text
        self._sent_widgets = (UserMessage(text), reply)
        self.streaming = reply
        self.generation += 1
        self._buffer = StepBuffer()
        self._pacer = BatchPacer()
        self.query_one("#conversation", VerticalScroll).mount_all(self._sent_widgets)
        self._generate(messages, self.generation, self._buffer)

    def _reserve(self) -> int:
        """Tokens kept for the reply: half the window at most, so that a large --max-new-tokens
        does not make every prompt impossible (the reply then ends at the window's edge instead)."""
        context = self.setup.decoder.context
        return self.setup.max_new_tokens if context is None else min(self.setup.max_new_tokens, context // 2)

    @work(thread=True, exclusive=True, group=GROUP, exit_on_error=False)
    def _generate(self, messages: list[Message], generation: int, buffer: StepBuffer) -> None:
        """Build the prompt, then decode one reply in this thread into `buffer`, waking the UI when
        it was empty."""
        worker = get_current_worker()
        with self._decoder_lock:
            try:
                dropped, ids = self.prompts.build(
                    messages,
                    context=self.setup.decoder.context,
                    reserve=self._reserve(),
                    cancelled=lambda: worker.is_cancelled or self.controls.stop_requested,
                )
            except Exception as exc:  # any failure of the template is this message's, not the chat's
                self.post_message(PromptFailed(generation, exc))
                return
            self.post_message(PromptReady(generation, dropped))
            steps = self.setup.decoder.generate(
                ids, max_new_tokens=self.setup.max_new_tokens, sampling=self.setup.sampling
            )
            for step in steps:
                if buffer.add(step):
                    self.post_message(StepsReady(generation))
                if worker.is_cancelled:
                    return
        self.post_message(StepsReady(generation, ended=True))

    def on_prompt_ready(self, message: PromptReady) -> None:
        """The prompt is built: store the message with the reply it asks for (as `streaming`)."""
        if message.generation != self.generation or self.reply_turn is None:
            return
        assert self._question is not None
        turns = [self._question, self.reply_turn]
        self.session.turns += turns
        self.writer.append(self.session, turns)
        self._stored = True
        self._last_save = time.monotonic()
        self._trim_turns()
        if message.dropped:
            self.notify(
                f"{message.dropped} earlier message(s) no longer fit the model's context "
                f"({self.setup.decoder.context} tokens) and were left out of the prompt.",
                severity="warning",
            )

    def on_prompt_failed(self, message: PromptFailed) -> None:
        """The prompt could not be built (too long, a failing or runaway template, Esc): the
        message goes back to the prompt, nothing is stored."""
        if message.generation != self.generation or self.streaming is None:
            return
        self.controls.clear_stop()  # an Esc that cut the template short is spent
        error = message.error
        reason = (
            str(error) if isinstance(error, FsdChatError) else self.unexpected(error, "building the prompt")
        )
        self.notify(reason, title="Message not sent", severity="error")
        self._withdraw()

    def _withdraw(self) -> None:
        """Take back the message whose prompt was never built: off the screen, into the prompt."""
        assert self._sent_widgets is not None
        for widget in self._sent_widgets:
            widget.remove()
        self.streaming = self.reply_turn = None
        self.query_one(PromptInput).give_back(self._sent_text)

    def on_steps_ready(self, message: StepsReady) -> None:
        """Show the buffered steps: now, or when the pacer allows the next batch."""
        if message.generation != self.generation or self.streaming is None:
            return
        wait = self._pacer.wait()
        if message.ended or wait <= 0:
            self._show_steps(ended=message.ended)
        elif self._batch_timer is None:
            self._batch_timer = self.set_timer(wait, self._show_steps)

    def _show_steps(self, ended: bool = False) -> None:
        """Show the buffered steps as one batch in the streaming reply and the stats; finish the
        reply when it ended, else save it if `SAVE_INTERVAL` has passed."""
        self._batch_timer = None
        if self.streaming is None:
            return
        self._pacer.shown()
        steps = self._buffer.take()
        if steps:
            self.streaming.add_steps(steps)
            self.query_one(StatsStrip).add(steps)
        if ended or (steps and steps[-1].stop_reason is not None):
            self._finish_reply()
        elif time.monotonic() - self._last_save >= SAVE_INTERVAL:
            self._last_save = time.monotonic()
            assert self.reply_turn is not None
            self.writer.update_reply(self.session.id, self.reply_turn)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """A generation that failed ends its reply with the error; the conversation stays."""
        if event.worker.group != GROUP or event.state != WorkerState.ERROR:
            return
        error = event.worker.error
        assert error is not None
        message = (
            str(error) if isinstance(error, FsdChatError) else self.unexpected(error, "decoding a reply")
        )
        self.notify(message, title="Generation failed", severity="error")
        if self.streaming is not None:
            self._finish_reply(error=message)

    def unexpected(self, error: BaseException, doing: str) -> str:
        """Log an unexpected error with its traceback; returns the one line to show."""
        self.setup.tracebacks.append(log_exception(error, doing))
        return f"{type(error).__name__} while {doing}: {error} (details in {log_path()})"

    def _finish_reply(self, error: str | None = None) -> None:
        """End the streaming reply (stopped, unless it has its own reason) and save it; a message
        whose prompt was still building is taken back."""
        if not self._stored:
            self._withdraw()
            return
        reply, turn = self.streaming, self.reply_turn
        assert reply is not None and turn is not None
        self.streaming = self.reply_turn = None
        if reply.record.stop_reason is None:
            reply.record.stop_reason = "error" if error is not None else STOPPED
        reply.finish(error)
        if self.has_class("-markdown"):
            reply.show_markdown()
        turn.content = reply.record.text
        self.writer.update_reply(self.session.id, turn)
        compile_error = self.setup.decoder.compile_error
        if compile_error and not self._compile_error_shown:
            self._compile_error_shown = True
            self.notify(
                f"running the draft eagerly: {compile_error}", title="--compile failed", severity="warning"
            )
        prompt = self.query_one(PromptInput)
        if error is not None and not turn.content and not prompt.text:
            prompt.give_back(self._sent_text)  # nothing came of it: the message can be sent again

    def on_save_failed(self, message: SaveFailed) -> None:
        """Say once that saving fails; the writer retries on the next save."""
        self.notify(
            f"{message.reason}. It is kept and retried on the next save.",
            title="Session not saved",
            severity="error",
        )

    def on_save_recovered(self, message: SaveRecovered) -> None:
        """Saving works again."""
        self.notify("Session saved again.", timeout=3)

    # --- the dial ---------------------------------------------------------------------------

    def _update_controls(self, **changes: object) -> None:
        try:
            settings = self.controls.update(**changes)
        except FsdChatError as exc:
            self.notify(str(exc), severity="error")
            return
        self.query_one(ThresholdDial).settings = settings

    def action_raise_threshold(self) -> None:
        """T up one step of the dial in use (capped at the dial's top)."""
        s = self.controls.snapshot()
        top, step = dial_scale(s)
        if s.threshold < top:
            self._update_controls(threshold=round(min(s.threshold + step, top), 6))

    def action_lower_threshold(self) -> None:
        """T down one step (not below 0); from above the dial's top, to the top."""
        s = self.controls.snapshot()
        top, step = dial_scale(s)
        self._update_controls(threshold=round(max(min(s.threshold - step, top), 0.0), 6))

    def action_exact(self) -> None:
        """T = 0: exact speculative decoding."""
        self._update_controls(threshold=0.0)

    def action_cycle_divergence(self) -> None:
        """The next divergence; T stays, capped at the new divergence's dial range."""
        s = self.controls.snapshot()
        following = DIVERGENCE_NAMES[(DIVERGENCE_NAMES.index(s.divergence) + 1) % len(DIVERGENCE_NAMES)]
        top, _ = dial_scale(replace(s, divergence=following))
        self._update_controls(divergence=following, threshold=min(s.threshold, top))

    def action_cycle_rule(self) -> None:
        """The next acceptance rule (fuzzy, mixture, pure, exact); T stays, capped at its dial's top."""
        s = self.controls.snapshot()
        following = RULE_CYCLE[(RULE_CYCLE.index(s.rule) + 1) % len(RULE_CYCLE)]
        top, _ = dial_scale(replace(s, rule=following))
        self._update_controls(rule=following, threshold=min(s.threshold, top))

    def action_stop(self) -> None:
        """Stop the streaming reply after the step in progress; the partial reply is kept."""
        if self.streaming is not None:
            self.controls.request_stop()

    def action_toggle_view(self) -> None:
        """Finished replies: origin colours <-> Markdown."""
        self.toggle_class("-markdown")
        markdown = self.has_class("-markdown")
        if markdown:
            for reply in self.query(ReplyView):
                reply.show_markdown()
        self.notify(f"Finished replies: {'Markdown' if markdown else 'origin colours'}", timeout=2)

    def action_new_chat(self) -> None:
        """Stop any reply (kept, as stopped) and start a new session (the old one stays saved)."""
        self.stop_generation()
        self.generation += 1
        old = self.session
        self.session = Session(new_session_id(), now(), dict(old.models), dict(old.settings), old.system)
        self.query_one("#conversation", VerticalScroll).remove_children()
        self._hidden = 0
        self.query_one(StatsStrip).clear()
        self.query_one(PromptInput).focus()
        self.notify(f"New chat {self.session.id}", timeout=2)

    def stop_generation(self) -> None:
        """End the running generation (if any) now: its reply is kept, marked stopped."""
        if self.streaming is not None:
            self.controls.request_stop()
            self._finish_reply()
        self.app.workers.cancel_group(self, GROUP)

    def on_unmount(self) -> None:
        """Leaving the chat (however the app ends): the reply in flight and all saves are written."""
        self.shut_down(BUSY_TIMEOUT + 1)

    def shut_down(self, timeout: float) -> bool:
        """Stop any reply and write everything pending (waiting at most `timeout` seconds).

        Returns:
            Whether everything was saved.
        """
        self.stop_generation()
        return self.writer.close(timeout)

    def keep_unsaved(self) -> str:
        """Write the session as a Markdown transcript beside the session store (in the
        transcripts folder if that fails), for when saving it failed.

        Returns:
            One line for the user: where the transcript is, or, when it could not be written
            anywhere, the transcript itself.
        """
        text = render_markdown(self.session)
        folders = (self.setup.store.path.parent, self.setup.transcripts_dir)
        for folder in folders:
            path = default_path(folder, self.session)
            try:
                written = write_atomic(path.with_name("unsaved-" + path.name), text)
            except FsdChatError:
                continue
            return f"the unsaved session is in {written}"
        return "the unsaved session could not be written to a file either; here it is:\n" + text

    def action_export(self) -> None:
        """Open the export dialog."""
        path = default_path(self.setup.transcripts_dir, self.session)
        self.app.push_screen(ExportScreen(path, self.write_transcript))

    def write_transcript(self, path: Path) -> Path:
        """Write the session's transcript to `path` (atomically); returns the path written."""
        return write_atomic(path, render_markdown(self.session))

    def action_help(self) -> None:
        """Open the help screen."""
        sampling = f"{self.setup.sampling.describe()}: {self.setup.sampling_source}"
        self.app.push_screen(HelpScreen(self.setup.keymap, sampling))
