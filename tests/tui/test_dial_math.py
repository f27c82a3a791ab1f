"""The dial keys' arithmetic as pure functions of the settings: steps, bounds, cycling."""

from __future__ import annotations

import math

import pytest

from fsd_chat.decoding.controls import Controls
from fsd_chat.decoding.settings import DIVERGENCE_NAMES, DecodingSettings
from fsd_chat.tui.widgets.dial import (
    EXACT,
    RULE_CYCLE,
    DialChange,
    cycle_divergence,
    cycle_rule,
    dial_scale,
    lower_threshold,
    raise_threshold,
)

JS_TOP = math.log(2.0)


def apply(settings: DecodingSettings, changes: DialChange) -> DecodingSettings:
    """The settings after `changes`, applied as the chat screen applies them (`Controls.update`)."""
    return Controls(settings).update(**changes)


@pytest.mark.parametrize(
    ("settings", "raised", "lowered"),
    [
        (DecodingSettings(divergence="js", threshold=0.1), 0.12, 0.08),
        (DecodingSettings(divergence="kl", threshold=0.1), 0.15, 0.05),
        (DecodingSettings(divergence="tv", threshold=0.3), 0.35, 0.25),
        (DecodingSettings(rule="mixture", divergence="kl", threshold=0.05), 0.06, 0.04),  # nats/token
    ],
)
def test_one_step_up_and_down_in_the_units_of_the_dial_in_use(
    settings: DecodingSettings, raised: float, lowered: float
) -> None:
    assert raise_threshold(settings) == {"threshold": raised}
    assert lower_threshold(settings) == {"threshold": lowered}


def test_steps_do_not_accumulate_float_noise() -> None:
    settings = DecodingSettings(divergence="js", threshold=0.0)
    for _ in range(10):
        settings = apply(settings, raise_threshold(settings))
    assert settings.threshold == 0.2  # exactly: rounded at every step, not 0.20000000000000004
    for _ in range(10):
        settings = apply(settings, lower_threshold(settings))
    assert settings.threshold == 0.0


def test_the_threshold_stays_within_the_dial() -> None:
    near_top = DecodingSettings(divergence="js", threshold=0.68)
    assert raise_threshold(near_top) == {"threshold": round(JS_TOP, 6)}  # capped at the top
    assert raise_threshold(DecodingSettings(divergence="js", threshold=JS_TOP)) == {}  # no change
    assert raise_threshold(DecodingSettings(divergence="kl", threshold=5.0)) == {}  # above: left alone
    assert lower_threshold(DecodingSettings(divergence="kl", threshold=5.0)) == {"threshold": 2.0}
    assert lower_threshold(DecodingSettings(divergence="js", threshold=0.01)) == {"threshold": 0.0}
    assert lower_threshold(DecodingSettings(divergence="js", threshold=0.0)) == {"threshold": 0.0}
    assert EXACT == {"threshold": 0.0}


def test_the_divergences_cycle_and_the_threshold_is_capped_at_the_next_ones_top() -> None:
    settings = DecodingSettings(divergence="kl", threshold=1.5)
    seen = []
    for _ in DIVERGENCE_NAMES:
        settings = apply(settings, cycle_divergence(settings))
        seen.append((settings.divergence, settings.threshold))
    assert seen == [("reverse-kl", 1.5), ("js", JS_TOP), ("tv", JS_TOP), ("kl", JS_TOP)]
    assert dial_scale(settings)[0] == 2.0  # back at kl: T stays where the cap left it


def test_the_rules_cycle_and_the_mixture_caps_the_threshold_at_its_budget() -> None:
    settings = DecodingSettings(rule="fuzzy", divergence="tv", threshold=0.8)
    seen = []
    for _ in RULE_CYCLE:
        settings = apply(settings, cycle_rule(settings))
        seen.append((settings.rule, settings.threshold))
    assert seen == [("mixture", 0.5), ("pure", 0.5), ("exact", 0.5), ("fuzzy", 0.5)]
    assert settings.divergence == "tv"  # the divergence is the divergence cycle's business
