"""The chat screen: the conversation, the prompt, the threshold dial and the live stats.

The screen renders; its `ChatController` (`fsd_chat.conversation.controller`) decides what a message
sends, which steps count, when a reply ends and what is saved. A message is sent through the
generation worker (a thread), which first builds the prompt (`ChatController.build_prompt`: the
chat template under time and size limits, the conversation fitted into the context window) and
then decodes: the decoder yields one `Step` per target forward pass, and the worker adds each to a
`StepBuffer` (`fsd_chat.tui.stream`), waking the UI only when the buffer was empty. The UI takes
everything buffered as one batch when its `BatchPacer` allows: about 30 batches a second at most,
fewer when drawing is costly. A batch goes to the streaming `ReplyView`, which folds its steps into
the reply's record and re-renders only its live tail (the text after its last finished line), and
to the stats strip, which refreshes once. The reply is rendered whole once, when it ends. Keys
change the shared `Controls` (by the dial's arithmetic, `fsd_chat.tui.widgets.dial`), which the
decoder reads at the start of every step.
"""

from __future__ import annotations

from typing import ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.content import Content
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Button, Footer, Static
from textual.worker import Worker, WorkerState, get_current_worker

from fsd_chat.conversation.controller import (
    SAVE_RECOVERED,
    ChatController,
    ChatOptions,
    Notice,
    Sent,
    save_failed_notice,
)
from fsd_chat.conversation.session import Session, Turn
from fsd_chat.conversation.store import BUSY_TIMEOUT
from fsd_chat.decoding.controls import Controls
from fsd_chat.decoding.events import Step
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.errors import FsdChatError
from fsd_chat.support.text import counted
from fsd_chat.tui.keys import CHAT_BINDINGS
from fsd_chat.tui.messages import (
    PrefillProgress,
    PromptFailed,
    PromptReady,
    SaveFailed,
    SaveRecovered,
    StepsReady,
)
from fsd_chat.tui.screens.export import ExportScreen
from fsd_chat.tui.screens.help import HelpScreen
from fsd_chat.tui.stream import BatchPacer, StepBuffer
from fsd_chat.tui.widgets.conversation import ReplyView, UserMessage
from fsd_chat.tui.widgets.dial import (
    EXACT,
    DialChange,
    ThresholdDial,
    cycle_divergence,
    cycle_rule,
    lower_threshold,
    raise_threshold,
)
from fsd_chat.tui.widgets.legend import Legend
from fsd_chat.tui.widgets.prompt import PromptInput
from fsd_chat.tui.widgets.stats import StatsStrip

GROUP = "generation"
SHOWN_TURNS = 10
"""Turns kept on screen (up to twice as many before the oldest are put away)."""


NARROW_BELOW = 164
"""Columns below which the dial and the stats strip take a line each (`ChatScreen.-narrow`)."""


class ChatScreen(Screen[None]):
    """The main screen: it renders what its `ChatController` (`chat`) decides.

    Args:
        options: What the chat was asked for.
        pair: The loaded models.
        decoder: Built once over the pair; reused for every reply.
        controls: Shared with the decoder.
        tracebacks: Where unexpected errors' tracebacks are collected (`--debug` prints them).
    """

    BINDINGS: ClassVar[list[BindingType]] = [*CHAT_BINDINGS]
    # Textual declares it an instance variable of type list (ClassVar would not type-check).
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (NARROW_BELOW, "-wide")]  # noqa: RUF012
    """Narrower than the dial (60 cells) and the strip's full figures side by side: the two take a
    line each (app.tcss)."""

    def __init__(
        self,
        options: ChatOptions,
        pair: ModelPair,
        decoder: Decoder,
        controls: Controls,
        tracebacks: list[str],
    ) -> None:
        super().__init__()
        self.chat = ChatController(
            options,
            pair,
            decoder,
            controls,
            tracebacks=tracebacks,
            on_save_failed=lambda reason: self.post_message(SaveFailed(reason)),
            on_save_recovered=lambda: self.post_message(SaveRecovered()),
        )
        self.controls = controls
        self.streaming: ReplyView | None = None
        """The reply in flight's view (None when none is)."""
        self._hidden = 0
        """Turns at the start of the session that are not mounted (see `_trim_turns`)."""
        self._sent_widgets: tuple[UserMessage, ReplyView] | None = None
        self._buffer = StepBuffer()
        self._pacer = BatchPacer()
        self._batch_timer: Timer | None = None

    @property
    def session(self) -> Session:
        """The session shown (the controller's)."""
        return self.chat.session

    def show(self, notice: Notice) -> None:
        """Show the controller's `notice` as a notification."""
        self.notify(notice.text, title=notice.title, severity=notice.severity, timeout=notice.timeout)

    def compose(self) -> ComposeResult:
        """Header, conversation, legend, dial and stats, prompt, footer."""
        yield Static(Content.assemble(("fsd-chat ", "bold $accent"), self.chat.describe), id="header")
        yield VerticalScroll(id="conversation")
        yield Legend(self.chat.options.autoregressive, draft_label=self.chat.draft_label, id="legend")
        with Horizontal(id="controls"):
            yield ThresholdDial(id="dial")
            yield StatsStrip(target_only=self.chat.options.autoregressive, id="stats")
        yield PromptInput(id="prompt", placeholder="Message (Enter sends, ctrl+j newline, F1 help)")
        yield Footer()

    def on_mount(self) -> None:
        """Show the session so far, the settings, and focus the prompt."""
        dial = self.query_one(ThresholdDial)
        dial.autoregressive = self.chat.options.autoregressive
        dial.greedy = self.chat.sampling.greedy
        dial.settings = self.controls.snapshot()
        self._show_turns()
        self.query_one("#conversation", VerticalScroll).anchor()
        self.query_one(PromptInput).focus()
        self._check_template()

    @work(thread=True, group="template", exit_on_error=False)
    def _check_template(self) -> None:
        """Tell at once when the chat template fails (it is code from the model's files, run in
        this thread under the template's time limit)."""
        with self.chat.decoder_lock:
            notice = self.chat.check_template()
        if notice is not None:
            self.app.call_from_thread(self.show, notice)

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
            button.label = f"Show {counted(self._hidden, 'earlier turn')}"

    def on_button_pressed(self, event: Button.Pressed) -> None:
        """Show every earlier turn (the per-frame work then grows with them)."""
        if event.button.id == "earlier":
            conversation = self.query_one("#conversation", VerticalScroll)
            widgets = self._turn_widgets(self.session.turns[: self._hidden])
            self._hidden = 0
            conversation.mount_all(widgets, after=event.button)
            event.button.remove()

    # --- sending and streaming -------------------------------------------------------------

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        """Send the prompt's text, unless a reply is streaming. The prompt is built in the worker,
        started once the message and its reply are on screen; the message is stored once the
        prompt is built (`on_prompt_ready`), or given back (`on_prompt_failed`)."""
        sent = self.chat.send(event.text)
        if sent is None:
            return
        if isinstance(sent, Notice):
            self.show(sent)
            self.query_one(PromptInput).give_back(event.text)
            return
        reply = ReplyView(sent.record)
        self.query_one(StatsStrip).begin_reply()
        self._sent_widgets = (UserMessage(sent.question.content), reply)
        self.streaming = reply
        self._buffer = StepBuffer()
        self._pacer = BatchPacer()
        # Mounting the two widgets, laying out and drawing the screen is the reply's heaviest UI
        # work: done while the first steps decode, it holds the interpreter lock they need and
        # slows the start of every reply (most of its UI time, in a short fast one). Done first,
        # it delays the first token by about as much as it would have cost the decoder.
        await self.query_one("#conversation", VerticalScroll).mount_all(self._sent_widgets)
        self.call_after_refresh(self._start_generation, sent, self._buffer)

    def _start_generation(self, sent: Sent, buffer: StepBuffer) -> None:
        """Start decoding `sent`, unless it was withdrawn meanwhile (a new chat, the chat closing)."""
        if self.chat.is_current(sent.generation):
            self._generate(sent, buffer)

    @work(thread=True, exclusive=True, group=GROUP, exit_on_error=False)
    def _generate(self, sent: Sent, buffer: StepBuffer) -> None:
        """Build the prompt, then decode one reply in this thread into `buffer`, waking the UI when
        it was empty."""
        worker = get_current_worker()
        generation = sent.generation
        with self.chat.decoder_lock:
            try:
                dropped, ids = self.chat.build_prompt(sent.messages, cancelled=lambda: worker.is_cancelled)
            except Exception as exc:  # any failure of the template is this message's, not the chat's
                self.post_message(PromptFailed(generation, exc))
                return
            self.post_message(PromptReady(generation, dropped))
            self.controls.listen_prefill(
                lambda done, total: self.post_message(PrefillProgress(generation, done, total))
            )
            decoded: list[Step] = []
            try:
                for step in self.chat.steps(ids):
                    decoded.append(step)
                    if buffer.add(step):
                        self.post_message(StepsReady(generation))
                    if worker.is_cancelled:
                        return
            finally:
                self.controls.listen_prefill(None)
            self.post_message(StepsReady(generation, ended=True))
            self.chat.read_ahead(decoded, lambda: worker.is_cancelled)

    def on_prompt_ready(self, message: PromptReady) -> None:
        """The prompt is built: the message and its reply join the session (stored by the controller)."""
        if not self.chat.is_current(message.generation):
            return
        notice = self.chat.prompt_ready(message.dropped)
        self._trim_turns()
        if notice is not None:
            self.show(notice)

    def on_prompt_failed(self, message: PromptFailed) -> None:
        """The prompt could not be built (too long, a failing or runaway template, Esc): the
        message goes back to the prompt, nothing is stored."""
        if not self.chat.is_current(message.generation):
            return
        self.show(self.chat.prompt_failed(message.error))
        self._withdraw(self.chat.withdraw())

    def _withdraw(self, sent: Sent) -> None:
        """Take back the message whose prompt was never built: off the screen, into the prompt."""
        assert self._sent_widgets is not None
        for widget in self._sent_widgets:
            widget.remove()
        self.streaming = None
        self.query_one(PromptInput).give_back(sent.question.content)

    def on_prefill_progress(self, message: PrefillProgress) -> None:
        """Show how much of a long prompt is read (until its first tokens come)."""
        if self.chat.is_current(message.generation) and self.streaming is not None:
            self.streaming.show_prefill(message.done, message.total)

    def on_steps_ready(self, message: StepsReady) -> None:
        """Show the buffered steps: now, or when the pacer allows the next batch."""
        if not self.chat.is_current(message.generation):
            return
        wait = self._pacer.wait()
        if message.ended or wait <= 0:
            self._show_steps(ended=message.ended)
        elif self._batch_timer is None:
            self._batch_timer = self.set_timer(wait, self._show_steps)

    def _show_steps(self, ended: bool = False) -> None:
        """Show the buffered steps as one batch in the streaming reply and the stats; finish the
        reply when it ended (the controller saves it meanwhile)."""
        self._batch_timer = None
        if self.streaming is None:
            return
        self._pacer.shown()
        steps = self._buffer.take()
        if steps:
            self.streaming.add_steps(steps)
            self.query_one(StatsStrip).add(steps)
            self.query_one(ThresholdDial).paused = steps[-1].stats.paused
        if self.chat.steps_shown(steps, ended):
            self._finish_reply()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """A generation that failed ends its reply with the error; the conversation stays."""
        if event.worker.group != GROUP or event.state != WorkerState.ERROR:
            return
        error = event.worker.error
        assert error is not None
        notice = self.chat.generation_failed(error)
        self.show(notice)
        if self.streaming is not None:
            self._finish_reply(error=notice.text)

    def _finish_reply(self, error: str | None = None) -> None:
        """End the streaming reply (stopped, unless it has its own reason) and save it; a message
        whose prompt was still building is taken back."""
        if self._batch_timer is not None:  # its batch was this reply's: none is left to show
            self._batch_timer.stop()
            self._batch_timer = None
        finished = self.chat.finish(error)
        if not finished.stored:
            self._withdraw(finished.sent)
            return
        reply = self.streaming
        assert reply is not None
        self.streaming = None
        reply.finish(error)
        if self.has_class("-markdown"):
            reply.show_markdown()
        if finished.notice is not None:
            self.show(finished.notice)
        prompt = self.query_one(PromptInput)
        if finished.retry and not prompt.text:
            prompt.give_back(finished.sent.question.content)  # nothing came of it: it can be sent again

    def on_save_failed(self, message: SaveFailed) -> None:
        """Say once that saving fails; the writer retries on the next save."""
        self.show(save_failed_notice(message.reason))

    def on_save_recovered(self, message: SaveRecovered) -> None:
        """Saving works again."""
        self.show(SAVE_RECOVERED)

    # --- the dial ---------------------------------------------------------------------------

    def _update_controls(self, changes: DialChange) -> None:
        if not changes:
            return
        try:
            settings = self.controls.update(**changes)
        except FsdChatError as exc:
            self.notify(str(exc), severity="error")
            return
        self.query_one(ThresholdDial).settings = settings
        self.chat.dial_moved(settings)

    def action_raise_threshold(self) -> None:
        """T up one step of the dial in use (capped at the dial's top)."""
        self._update_controls(raise_threshold(self.controls.snapshot(), self.chat.sampling.greedy))

    def action_lower_threshold(self) -> None:
        """T down one step (not below 0); from above the dial's top, to the top."""
        self._update_controls(lower_threshold(self.controls.snapshot(), self.chat.sampling.greedy))

    def action_exact(self) -> None:
        """T = 0: exact speculative decoding."""
        self._update_controls(EXACT)

    def action_cycle_divergence(self) -> None:
        """The next divergence; T stays, capped at the new divergence's dial range."""
        self._update_controls(cycle_divergence(self.controls.snapshot(), self.chat.sampling.greedy))

    def action_cycle_rule(self) -> None:
        """The next acceptance rule (fuzzy, mixture, pure, exact); T stays, capped at its dial's top."""
        self._update_controls(cycle_rule(self.controls.snapshot(), self.chat.sampling.greedy))

    def action_stop(self) -> None:
        """Stop the streaming reply after the step in progress; the partial reply is kept."""
        self.chat.stop()

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
        notice = self.chat.new_chat()
        self.query_one("#conversation", VerticalScroll).remove_children()
        self._hidden = 0
        self.query_one(StatsStrip).clear()
        self.query_one(PromptInput).focus()
        self.show(notice)

    def stop_generation(self) -> None:
        """End the running generation (if any) now: its reply is kept, marked stopped."""
        if self.streaming is not None:
            self.chat.stop()
            # Steps decoded but held back by the pacer belong to the reply that is kept.
            if self._batch_timer is not None:
                self._batch_timer.stop()
            self._show_steps()
            if self.streaming is not None:  # _show_steps finishes a reply whose last step ended it
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
        return self.chat.close(timeout)

    def action_export(self) -> None:
        """Open the export dialog."""
        self.app.push_screen(ExportScreen(self.chat.export_path(), self.chat.write_transcript))

    def action_help(self) -> None:
        """Open the help screen."""
        sampling = f"{self.chat.sampling.describe()}: {self.chat.sampling_source}"
        self.app.push_screen(HelpScreen(self.chat.options.keymap, sampling))
