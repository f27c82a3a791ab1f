"""`FsdChatApp`: themes, keymap, the model-loading worker, and the command palette.

The models load in a thread worker behind `LoadingScreen`; once loaded, the app switches to the
`ChatScreen`. Tests inject `loader` (e.g. an already loaded pair) and `decoder_factory` (e.g. a
wrapper that pauses between steps).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterable
from typing import ClassVar

from textual import work
from textual.app import App, SystemCommand
from textual.binding import BindingType
from textual.command import CommandPalette
from textual.notifications import SeverityLevel
from textual.screen import Screen
from textual.worker import Worker, WorkerState

from fsd_chat.conversation.controller import ChatOptions
from fsd_chat.decoding.controls import Controls
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.engines.torch_engine import step_graph
from fsd_chat.models.loading import Progress
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.errors import FsdChatError
from fsd_chat.support.text import one_line
from fsd_chat.tui.keys import APP_BINDINGS, CHAT_BINDINGS
from fsd_chat.tui.messages import LoadProgress
from fsd_chat.tui.screens.chat import ChatScreen
from fsd_chat.tui.screens.loading import LoadingScreen
from fsd_chat.tui.theme_files import DEFAULT_THEME, load_themes
from fsd_chat.tui.themes import LiteralThemeProvider, default_variables, to_textual

Loader = Callable[[Progress], ModelPair]
DecoderFactory = Callable[[ModelPair, Controls], Decoder]
END_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class FsdChatApp(App[None]):
    """The fsd-chat TUI.

    Args:
        options: The command line's choices.
        loader: Loads the model pair, reporting progress (default: `load_pair` with the options).
        decoder_factory: Builds the decoder over the loaded pair, in the loading thread (default:
            `ModelPair.decoder`, with the options' `autoregressive`, `compiled` and `whole_step`,
            the capture of its step graphs shown on the loading screen).
    """

    CSS_PATH = "app.tcss"
    TITLE = "fsd-chat"
    BINDINGS: ClassVar[list[BindingType]] = [*APP_BINDINGS]

    def __init__(
        self,
        options: ChatOptions,
        *,
        loader: Loader | None = None,
        decoder_factory: DecoderFactory | None = None,
    ) -> None:
        super().__init__()
        self.options = options
        self.loader = loader or self._load_pair
        self.decoder_factory = decoder_factory or self._decoder
        self.controls = Controls(options.settings)
        self.theme_errors: list[str] = []
        self.tracebacks: list[str] = []
        """Tracebacks of unexpected errors (also in the log file; `--debug` prints them)."""
        self.exit_notes: list[str] = []
        """Lines for stderr once the terminal is restored (what could not be saved, and where it is)."""
        self._ending = False
        self._register_themes()

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        """Show a notification, always literally: its text quotes paths, error messages, theme and
        model names, none of which may be read as Textual markup (or reach the terminal as control
        characters)."""
        super().notify(
            one_line(message), title=one_line(title), severity=severity, timeout=timeout, markup=False
        )

    def action_help_quit(self) -> None:
        """ctrl+c: say how to quit (Textual's own notice is markup, which `notify` shows literally)."""
        for key, active in self.active_bindings.items():
            if active.binding.action in ("quit", "app.quit"):
                self.notify(f"Press {key} to quit the app", title="Do you want to quit?")
                return

    def search_themes(self) -> None:
        """The theme picker, with the names shown as text (see `LiteralThemeProvider`)."""
        self.push_screen(CommandPalette(providers=[LiteralThemeProvider], placeholder="Search for themes…"))

    def _decoder(self, pair: ModelPair, controls: Controls) -> Decoder:
        o = self.options

        def captured(done: int, total: int) -> None:
            self.post_message(LoadProgress(step_graph.capture_text(done, total, compile=o.compiled)))

        return pair.decoder(
            controls,
            autoregressive=o.autoregressive,
            compiled=o.compiled,
            whole_step=o.whole_step,
            capture_progress=captured,
        )

    def _load_pair(self, progress: Progress) -> ModelPair:
        from fsd_chat.models.loading import load_pair

        o = self.options
        return load_pair(o.target, o.draft, o.load, progress)

    def _register_themes(self) -> None:
        specs, self.theme_errors = load_themes(self.options.user_themes_dir)
        for spec in specs.values():
            self.register_theme(to_textual(spec))
        wanted = self.options.theme or DEFAULT_THEME
        if wanted not in self.available_themes:
            self.theme_errors.append(f"theme {wanted!r} is not available; using {DEFAULT_THEME}")
            wanted = DEFAULT_THEME
        self.theme = wanted

    def get_theme_variable_defaults(self) -> dict[str, str]:
        """Origin colours of the default theme, for themes without their own."""
        return default_variables()

    def on_mount(self) -> None:
        """Apply the keymap, report theme problems, and start loading the models."""
        self.set_keymap(self.options.keymap)
        for error in self.theme_errors:
            self.notify(error, title="Theme", severity="warning", timeout=8)
        o = self.options
        self.push_screen(LoadingScreen(f"target {o.target.source} · draft {o.draft.source}"))
        loop = asyncio.get_running_loop()
        for signum in END_SIGNALS:
            loop.add_signal_handler(signum, self.end_on_signal, signum)
        self._load()

    def on_unmount(self) -> None:
        """Give the signals back."""
        loop = asyncio.get_running_loop()
        for signum in END_SIGNALS:
            loop.remove_signal_handler(signum)

    def end_on_signal(self, signum: int) -> None:
        """SIGTERM / SIGHUP: save the reply in flight as stopped, restore the terminal, and exit
        with 128 + the signal's number, as a shell reports a process ended by it."""
        self.call_later(self._end, 128 + signum)

    async def _end(self, return_code: int = 0) -> None:
        """Stop any reply and save; exit with `return_code`. A session that cannot be saved (the
        store fails past its retries) is said to be unsaved, written as a transcript beside the
        store (`exit_notes` name it, for stderr), and the exit code is 1 if it was 0."""
        if self._ending:
            return
        self._ending = True
        for screen in self.screen_stack:  # under any dialog
            if not isinstance(screen, ChatScreen):
                continue
            screen.stop_generation()
            chat = screen.chat
            timeout = 2 * chat.options.store.busy_timeout + 1  # two tries at least
            closing = asyncio.ensure_future(asyncio.to_thread(chat.close, timeout))
            done, _ = await asyncio.wait({closing}, timeout=0.3)
            if not done:
                self.notify(
                    f"Saving the session before quitting: retrying for up to {timeout:g} s.",
                    title="Session not saved yet",
                    severity="warning",
                )
            if not await closing:
                note = chat.keep_unsaved()
                self.exit_notes.append(
                    f"fsd-chat: the last exchange could not be saved to {chat.options.store.path}; {note}"
                )
                return_code = return_code or 1
        self.exit(return_code=return_code)

    @work(thread=True, group="load", exit_on_error=False)
    def _load(self) -> tuple[ModelPair, Decoder]:
        """Load the pair, set its threads and build its decoder in a thread, posting progress: on
        llama.cpp, setting the threads times the forward prices on a new file or split (about a
        second), and the decoder's step graphs (`--whole-step` on CUDA) are captured as it is
        built, which takes seconds: the loading screen shows both."""

        def report(text: str) -> None:
            self.post_message(LoadProgress(text))

        pair = self.loader(report)
        # One core is left to the UI for one-token forwards; batches take it too (`support.threads`).
        # On llama.cpp this finds the forward prices, timing them where this machine has none kept
        # (said on the loading screen), before the chat reads anything ahead.
        pair.use_threads(
            self.options.threads, reserve=1, requested_batch=self.options.threads_batch, progress=report
        )
        return pair, self.decoder_factory(pair, self.controls)

    def on_load_progress(self, message: LoadProgress) -> None:
        """Show the loader's phase."""
        if isinstance(self.screen, LoadingScreen):
            self.screen.show_progress(message.text)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """Loaded: open the chat. Failed: show why on the loading screen."""
        if event.worker.group != "load" or not isinstance(self.screen, LoadingScreen):
            return
        if event.state == WorkerState.SUCCESS:
            result = event.worker.result
            assert isinstance(result, tuple)  # the "load" group's one worker is `_load`
            pair, decoder = result
            self.switch_screen(ChatScreen(self.options, pair, decoder, self.controls, self.tracebacks))
        elif event.state == WorkerState.ERROR:
            error = event.worker.error
            message = str(error) if isinstance(error, FsdChatError) else f"{type(error).__name__}: {error}"
            self.screen.show_error(message)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """Textual's commands (theme, quit, ...) plus every chat action."""
        yield from super().get_system_commands(screen)
        if isinstance(screen, ChatScreen):
            for binding in CHAT_BINDINGS:
                action = binding.action
                yield SystemCommand(
                    binding.tooltip,
                    f"{binding.description} ({binding.id})",
                    lambda a=action: screen.run_action(a),
                )

    async def action_quit(self) -> None:
        """Stop any reply (kept, as stopped; the decoder ends within one step), save, then quit
        (see `_end`)."""
        await self._end()
