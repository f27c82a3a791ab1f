"""The reply view, the stats strip and the threshold dial, driven with synthetic steps and settings
in a small host app with no model: what the user sees, text and colours, checked cell by cell."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from rich.color import Color
from textual.app import App, ComposeResult
from textual.geometry import Region
from textual.pilot import Pilot
from textual.widget import Widget
from textual.widgets import Sparkline, Static

import fsd_chat.tui
from fsd_chat.decoding.events import Origin, Step, StepStats, StopReason, Token
from fsd_chat.decoding.settings import MAX_DRAFT_TOKENS, DecodingSettings, DraftPolicyName, Rule
from fsd_chat.tui.theme_files import DEFAULT_THEME, ThemeSpec, load_themes
from fsd_chat.tui.themes import default_variables, to_textual
from fsd_chat.tui.widgets.conversation import ReplyView, UserMessage
from fsd_chat.tui.widgets.dial import BAR_CELLS, REGRET_RANGE, REGRET_STEP, ThresholdDial, dial_scale
from fsd_chat.tui.widgets.stats import FULL_WIDTH, WINDOW, StatsStrip

SIZE = (100, 24)
MARKUP = "[bold red]x[/] [@click=app.bell]y[/] [link=file:///etc]z[/link] [/]"
"""Model output that reads as Textual markup: it must be shown as written."""


class WidgetHost(App[None]):
    """The chat app's stylesheet and theme around bare widgets, with no model and no screen of its own.

    The theme is registered, and the origin colours given as defaults, by the same functions the
    chat app uses, so `$origin-*` styles resolve here as they do there.
    """

    CSS_PATH = Path(fsd_chat.tui.__file__).with_name("app.tcss")

    def __init__(self, *widgets: Widget, theme: str = DEFAULT_THEME) -> None:
        super().__init__()
        self._hosted = widgets
        self.specs, _ = load_themes()
        self.register_theme(to_textual(self.specs[theme]))
        self.theme = theme

    def get_theme_variable_defaults(self) -> dict[str, str]:
        """Origin colours of the default theme, for themes without their own."""
        return default_variables()

    def compose(self) -> ComposeResult:
        """The widgets under test."""
        yield from self._hosted

    @property
    def spec(self) -> ThemeSpec:
        """The theme file in use."""
        return self.specs[self.theme]


def theme_of(pilot: Pilot[None]) -> ThemeSpec:
    """The theme file in use in the host app `pilot` drives."""
    assert isinstance(pilot.app, WidgetHost)
    return pilot.app.spec


def hex_colour(colour: str) -> str:
    """A colour as lower-case #rrggbb."""
    return Color.parse(colour).get_truecolor().hex


def shown(widget: Widget) -> tuple[str, list[str]]:
    """What `widget` shows: its text (lines joined by newlines, trailing blanks dropped) and each
    character's foreground colour as #rrggbb ("" where the terminal's default applies)."""
    width, height = widget.size
    text: list[str] = []
    colours: list[str] = []
    for strip in widget.render_lines(Region(0, 0, width, height)):
        line: list[str] = []
        line_colours: list[str] = []
        for segment in strip:
            colour = segment.style.color if segment.style else None
            line += segment.text
            line_colours += [colour.get_truecolor().hex if colour else ""] * len(segment.text)
        kept = len("".join(line).rstrip())
        text += [*line[:kept], "\n"]
        colours += [*line_colours[:kept], ""]
    return "".join(text).rstrip("\n"), colours


def colour_of(widget: Widget, part: str) -> str:
    """The one foreground colour in which `widget` shows `part` (which must appear once)."""
    text, colours = shown(widget)
    assert text.count(part) == 1, (part, text)
    start = text.index(part)
    used = set(colours[start : start + len(part)])
    assert len(used) == 1, (part, used)
    return used.pop()


def stats(
    *,
    emitted: int,
    drafted: int = 0,
    exact: int = 0,
    fuzzy: int = 0,
    seconds: float = 0.01,
    cost: float = 0.0,
    threshold: float = 0.1,
    rule: str = "fuzzy",
) -> StepStats:
    """One step's statistics; its seconds split between the models and the rest."""
    return StepStats(
        drafted=drafted,
        accepted_exact=exact,
        accepted_fuzzy=fuzzy,
        emitted=emitted,
        target_forwards=1,
        draft_forwards=drafted,
        draft_seconds=seconds / 2,
        target_seconds=seconds / 4,
        other_seconds=seconds / 4,
        threshold=threshold,
        divergence="js",
        rule=rule,
        cost=cost,
    )


def step(
    *tokens: tuple[str, Origin], threshold: float = 0.1, stop: StopReason | None = None, flushed: str = ""
) -> Step:
    """A step emitting `tokens` (text, origin), with statistics consistent with them."""
    origins = [origin for _, origin in tokens]
    exact, fuzzy = origins.count(Origin.DRAFT_EXACT), origins.count(Origin.DRAFT_FUZZY)
    emitted = tuple(Token(i, text, origin) for i, (text, origin) in enumerate(tokens))
    drafted = exact + fuzzy + (Origin.TARGET_RESAMPLED in origins)
    return Step(
        emitted,
        stats(emitted=len(tokens), drafted=drafted, exact=exact, fuzzy=fuzzy, threshold=threshold),
        stop_reason=stop,
        flushed=flushed,
    )


@pytest.fixture
async def reply() -> AsyncIterator[tuple[ReplyView, Pilot[None]]]:
    """A streaming reply view under a user message."""
    view = ReplyView()
    app = WidgetHost(UserMessage("Tell me a story"), view)
    async with app.run_test(size=SIZE) as pilot:
        yield view, pilot


def provenance(view: ReplyView) -> Static:
    """The reply's coloured text (the live tail while it streams)."""
    return view.query_one(".provenance", Static)


async def test_each_origin_is_shown_in_its_theme_colour(reply: tuple[ReplyView, Pilot[None]]) -> None:
    view, pilot = reply
    parts = {
        Origin.DRAFT_EXACT: "Once",
        Origin.DRAFT_FUZZY: " upon",
        Origin.TARGET_RESAMPLED: " a",
        Origin.TARGET_BONUS: " time",
        Origin.TARGET: " there",
    }
    view.add_steps([step(*((text, origin) for origin, text in parts.items()))])
    await pilot.pause()
    text, _ = shown(provenance(view))
    assert text == "Once upon a time there"
    spec = theme_of(pilot)
    assert len(set(spec.origins.values())) == len(Origin)  # five colours to tell apart
    for origin, part in parts.items():
        assert colour_of(provenance(view), part.strip()) == hex_colour(spec.origins[origin])


async def test_the_colours_follow_the_theme() -> None:
    view = ReplyView()
    app = WidgetHost(view, theme="fsd-light")
    async with app.run_test(size=SIZE) as pilot:
        view.add_steps([step(("Once", Origin.DRAFT_EXACT), (" upon", Origin.DRAFT_FUZZY))])
        await pilot.pause()
        fuzzy = colour_of(provenance(view), "upon")
        assert fuzzy == hex_colour(app.spec.origins[Origin.DRAFT_FUZZY])
        assert fuzzy != hex_colour(app.specs[DEFAULT_THEME].origins[Origin.DRAFT_FUZZY])


async def test_model_output_and_user_text_are_shown_literally(reply: tuple[ReplyView, Pilot[None]]) -> None:
    view, pilot = reply
    view.add_steps([step((MARKUP, Origin.DRAFT_FUZZY))])
    await pilot.pause()
    assert shown(provenance(view))[0] == MARKUP
    # The whole text keeps its origin's colour: "[bold red]" styles nothing.
    fuzzy = hex_colour(theme_of(pilot).origins[Origin.DRAFT_FUZZY])
    assert colour_of(provenance(view), MARKUP) == fuzzy
    user = UserMessage(MARKUP)
    await pilot.app.mount(user)
    await pilot.pause()
    assert MARKUP in shown(user)[0]


async def test_a_change_of_setting_is_marked_where_it_happened(reply: tuple[ReplyView, Pilot[None]]) -> None:
    view, pilot = reply
    view.add_steps([step(("Once", Origin.DRAFT_EXACT)), step((" upon", Origin.DRAFT_EXACT), threshold=0.3)])
    await pilot.pause()
    assert shown(provenance(view))[0] == "Once⟨T 0.30⟩ upon"  # only T changed


async def test_finished_lines_are_frozen_while_the_tail_streams(reply: tuple[ReplyView, Pilot[None]]) -> None:
    view, pilot = reply
    frozen = view.query_one(".provenance-frozen", Static)
    view.add_steps([step(("One line", Origin.DRAFT_EXACT), ("\nand", Origin.DRAFT_FUZZY))])
    view.add_steps([step((" more", Origin.TARGET_BONUS))])
    await pilot.pause()
    assert frozen.display
    assert shown(frozen)[0] == "One line"
    assert shown(provenance(view))[0] == "and more"
    assert view.live_chars == len("and more")
    # Each piece keeps its origin's colour across the cut.
    origins = theme_of(pilot).origins
    assert colour_of(frozen, "One line") == hex_colour(origins[Origin.DRAFT_EXACT])
    assert colour_of(provenance(view), "and") == hex_colour(origins[Origin.DRAFT_FUZZY])
    # Finished: the whole reply in one widget, then its statistics.
    view.add_steps([step(("!", Origin.TARGET), stop=StopReason.STOPPED)])
    view.finish()
    await pilot.pause()
    assert not frozen.display
    assert shown(provenance(view))[0] == "One line\nand more! ⏹ stopped"
    # (The line wraps at the widget's width.)
    summary = shown(view.query_one(".reply-stats", Static))[0].replace("\n", " ")
    assert summary.startswith("4 tokens · ")
    assert summary.endswith("· under fuzzy js T 0.100 · cost 0 (lossless) · stopped")


async def test_an_error_replaces_the_statistics(reply: tuple[ReplyView, Pilot[None]]) -> None:
    view, pilot = reply
    view.add_steps([step(("Once", Origin.DRAFT_EXACT))])
    view.finish(error=f"device lost {MARKUP}")
    await pilot.pause()
    assert shown(view.query_one(".reply-stats", Static))[0] == f"error: device lost {MARKUP}"


@pytest.fixture
async def strip() -> AsyncIterator[tuple[StatsStrip, Pilot[None]]]:
    """A stats strip with no steps yet, wide enough for its full figures."""
    widget = StatsStrip()
    app = WidgetHost(widget)
    async with app.run_test(size=(FULL_WIDTH, 24)) as pilot:
        yield widget, pilot


def figures(widget: StatsStrip) -> Static:
    """The strip's figures."""
    return widget.query_one("#figures", Static)


async def test_the_strip_shows_dashes_before_any_step(strip: tuple[StatsStrip, Pilot[None]]) -> None:
    widget, _ = strip
    assert shown(figures(widget))[0] == "tok/s –   cost –   acc –   τ –   fuzzy –"


async def test_the_strip_shows_the_window_figures(strip: tuple[StatsStrip, Pilot[None]]) -> None:
    widget, pilot = strip
    # 2 steps: 6 tokens in 0.02 s = 300 tok/s; 6 of 8 drafted accepted = 75 %; τ = 6/2 = 3;
    # 2 of 6 tokens fuzzy = 33 %.
    widget.add(
        [
            Step((), stats(emitted=4, drafted=4, exact=3, fuzzy=0)),
            Step((), stats(emitted=2, drafted=4, exact=1, fuzzy=2)),
        ]
    )
    await pilot.pause()
    assert shown(figures(widget))[0] == "  300 tok/s  cost 0  acc  75%  τ 3.00  fuzzy  33%"
    assert widget.query_one("#spark", Sparkline).data == [4, 2]


async def test_the_strip_counts_the_last_window_of_steps_only(strip: tuple[StatsStrip, Pilot[None]]) -> None:
    widget, pilot = strip
    slow = [Step((), stats(emitted=1, seconds=1.0)) for _ in range(4)]
    fast = [Step((), stats(emitted=5, drafted=4, exact=4)) for _ in range(WINDOW)]
    widget.add(slow)
    widget.add(fast)
    await pilot.pause()
    # The window holds the WINDOW fast steps: 5 tokens per 0.01 s, all drafts accepted.
    assert shown(figures(widget))[0].startswith("  500 tok/s  cost 0  acc 100%  τ 5.00")
    assert widget.query_one("#spark", Sparkline).data == [1] * 4 + [5] * WINDOW
    widget.clear()
    await pilot.pause()
    assert shown(figures(widget))[0].startswith("tok/s –")
    assert widget.query_one("#spark", Sparkline).data == []


@pytest.mark.parametrize(
    ("cost", "figure", "colour"),
    [
        (0.0, "cost 0", "success"),
        (0.019 * 4, "cost 0.019/tok", "foreground"),
        (0.02 * 4, "cost 0.020/tok", "warning"),
        (0.5 * 4, "cost 0.500/tok", "warning"),
    ],
)
async def test_the_cost_takes_the_theme_colour_of_its_size(
    strip: tuple[StatsStrip, Pilot[None]], cost: float, figure: str, colour: str
) -> None:
    widget, pilot = strip
    widget.add([Step((), stats(emitted=4, drafted=4, fuzzy=4, cost=cost))])
    await pilot.pause()
    # The theme's colours as Textual resolved them (it adjusts the warning colour slightly).
    assert colour_of(figures(widget), figure) == hex_colour(pilot.app.theme_variables[colour])


async def test_the_cost_and_fuzzy_share_count_from_the_replys_first_token(
    strip: tuple[StatsStrip, Pilot[None]],
) -> None:
    widget, pilot = strip
    # A fuzzy start, then more than a window of exact steps: the reply's cost is still shown.
    widget.add([Step((), stats(emitted=4, drafted=4, fuzzy=4, cost=0.8))])
    widget.add([Step((), stats(emitted=4, drafted=4, exact=4)) for _ in range(WINDOW)])
    await pilot.pause()
    tokens = 4 * (WINDOW + 1)
    line = shown(figures(widget))[0]
    assert f"cost {0.8 / tokens:.3f}/tok" in line and f"fuzzy {4 / tokens:4.0%}" in line
    widget.begin_reply()  # the next reply counts afresh
    widget.add([Step((), stats(emitted=4, drafted=4, exact=4))])
    await pilot.pause()
    assert "cost 0 " in shown(figures(widget))[0]


async def test_at_80_columns_the_strip_abbreviates_but_keeps_tau_fuzzy_and_the_pause() -> None:
    widget = StatsStrip()
    async with WidgetHost(widget).run_test(size=(80, 24)) as pilot:
        widget.add([Step((), stats(emitted=4, drafted=4, exact=3, fuzzy=1, cost=0.4))])
        widget.add([Step((), replace(stats(emitted=1), paused="mapped draft 0.87× target"))])
        await pilot.pause()
        line = shown(figures(widget))[0]
        assert line == "250 tok/s cost 0.080/tok τ 2.50 fuzzy 20% ⏸ mapped draft 0.87× target"
        assert len(line) <= 80 - 10  # beside the sparkline


async def test_the_strip_says_why_speculation_is_paused(strip: tuple[StatsStrip, Pilot[None]]) -> None:
    widget, pilot = strip
    why = "draft 0.87× [b]target[/b]"  # not markup: shown literally
    widget.add([Step((), replace(stats(emitted=1), paused=why))])
    await pilot.pause()
    # τ and the fuzzy share stay; nothing was drafted, so no acceptance.
    assert shown(figures(widget))[0] == f"  100 tok/s  cost 0  acc    –  τ 1.00  fuzzy   0%  paused: {why}"
    assert colour_of(figures(widget), f"paused: {why}") == hex_colour(pilot.app.theme_variables["warning"])
    widget.add([Step((), stats(emitted=4, drafted=4, exact=3))])  # a probe that paid: drafting again
    await pilot.pause()
    assert "paused" not in shown(figures(widget))[0]


@pytest.fixture
async def dial() -> AsyncIterator[tuple[ThresholdDial, Pilot[None]]]:
    """A threshold dial with the default settings."""
    widget = ThresholdDial()
    app = WidgetHost(widget)
    async with app.run_test(size=SIZE) as pilot:
        yield widget, pilot


@pytest.mark.parametrize(
    ("settings", "top", "step_size"),
    [
        (DecodingSettings(divergence="js"), math.log(2.0), 0.02),
        (DecodingSettings(divergence="kl"), 2.0, 0.05),
        (DecodingSettings(divergence="reverse-kl"), 2.0, 0.05),
        (DecodingSettings(divergence="tv"), 1.0, 0.05),
        # The mixture rule's T is a budget in nats per token, whatever the divergence.
        (DecodingSettings(rule="mixture", divergence="tv"), 0.5, 0.01),
    ],
)
def test_the_dial_range_and_step_of_each_rule(
    settings: DecodingSettings, top: float, step_size: float
) -> None:
    assert dial_scale(settings) == pytest.approx((top, step_size))
    # Greedy: a regret bound in nats per token under every rule and divergence.
    assert dial_scale(settings, greedy=True) == (REGRET_RANGE, REGRET_STEP)


async def test_the_dial_names_the_regret_scale_when_greedy(dial: tuple[ThresholdDial, Pilot[None]]) -> None:
    widget, _ = dial
    widget.greedy = True
    line = await dial_line(dial, DecodingSettings(threshold=REGRET_RANGE / 2, draft_policy="goodput"))
    assert line == f"T {REGRET_RANGE / 2:.2f} ▕████    ▏ regret nats/tok fuzzy · k ≤ 5 goodput"


async def dial_line(dial: tuple[ThresholdDial, Pilot[None]], settings: DecodingSettings) -> str:
    """The line the dial draws for `settings` (the visible part may be cropped: see the last test)."""
    widget, pilot = dial
    widget.settings = settings
    await pilot.pause()
    return widget.render().plain


@pytest.mark.parametrize(
    ("rule", "policy", "line"),
    [
        ("fuzzy", "fixed", "T 0.35 ▕████    ▏ js nats fuzzy · k 5"),
        ("pure", "heuristic", "T 0.35 ▕████    ▏ js nats pure · k 5 heuristic"),
        ("exact", "latency", "T 0.35 ▕████    ▏ js nats exact · k ≤ 5 latency"),
        ("exact", "goodput", "T 0.35 ▕████    ▏ js nats exact · k ≤ 5 goodput"),
    ],
)
async def test_the_dial_shows_the_settings_in_force(
    dial: tuple[ThresholdDial, Pilot[None]], rule: Rule, policy: DraftPolicyName, line: str
) -> None:
    # T = 0.35 is half of js's range (ln 2 ≈ 0.693): four of eight cells.
    settings = DecodingSettings(rule=rule, divergence="js", threshold=0.35, draft_policy=policy)
    assert await dial_line(dial, settings) == line
    widget, _ = dial
    assert shown(widget)[0].strip() == line


async def test_the_dial_bar_spans_the_range_in_eighths(dial: tuple[ThresholdDial, Pilot[None]]) -> None:
    full = await dial_line(dial, DecodingSettings(divergence="tv", threshold=1.0))
    assert full == f"T 1.00 ▕{'█' * BAR_CELLS}▏ tv fuzzy · k 5"
    # 0.0625 of tv's range is 4 eighths of a cell: half a cell; 0.07 is 4.48, rounded to 4 eighths,
    # and 0.08 is 5.12, rounded to 5.
    assert (await dial_line(dial, DecodingSettings(divergence="tv", threshold=0.0625))).startswith(
        "T 0.06 ▕▌ "
    )
    assert (await dial_line(dial, DecodingSettings(divergence="tv", threshold=0.07))).startswith("T 0.07 ▕▌ ")
    assert (await dial_line(dial, DecodingSettings(divergence="tv", threshold=0.08))).startswith("T 0.08 ▕▋ ")
    assert (await dial_line(dial, DecodingSettings(divergence="tv", threshold=0.0))).startswith(
        f"T 0.00 ▕{' ' * BAR_CELLS}▏"
    )


async def test_the_dial_under_the_mixture_rule_and_autoregressive(
    dial: tuple[ThresholdDial, Pilot[None]],
) -> None:
    line = await dial_line(dial, DecodingSettings(rule="mixture", threshold=0.25, draft_tokens=3))
    assert line == "T 0.25 ▕████    ▏ KL nats/tok mixture · k 3"
    widget, pilot = dial
    widget.paused = "draft 0.80× target"
    await pilot.pause()
    assert shown(widget)[0].strip() == "T 0.25 ▕████    ▏ KL nats/tok mixture · k 0 paused"
    widget.autoregressive = True
    await pilot.pause()
    assert shown(widget)[0].strip() == "T  —  autoregressive: no drafting"


# The longest lines app.tcss must leave room for: a line that does not fit wraps and loses its end.
@pytest.mark.parametrize(
    "settings",
    [
        DecodingSettings(
            rule="mixture", threshold=0.25, draft_tokens=MAX_DRAFT_TOKENS, draft_policy="heuristic"
        ),
        DecodingSettings(divergence="reverse-kl", draft_tokens=MAX_DRAFT_TOKENS, draft_policy="heuristic"),
        DecodingSettings(divergence="reverse-kl", draft_tokens=MAX_DRAFT_TOKENS, draft_policy="latency"),
        DecodingSettings(divergence="reverse-kl", draft_tokens=MAX_DRAFT_TOKENS, draft_policy="goodput"),
    ],
)
async def test_the_dial_line_fits_the_dial(
    dial: tuple[ThresholdDial, Pilot[None]], settings: DecodingSettings
) -> None:
    line = await dial_line(dial, settings)
    widget, _ = dial
    assert shown(widget)[0].strip() == line
