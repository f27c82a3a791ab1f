"""What drafting and verifying cost: the forward times (`ForwardTimings`) by which the draft-length
policies (`fsd_chat.decoding.draft_policy`) price a step of k draft tokens against a target-only step.

The app's are fixed before a reply and never read from a clock during one, so that the draft
lengths chosen, and with them the text a lossy rule writes for a seed, are the same on every run:
for transformers models modelled from the models' shapes and sizes
(`fsd_chat.engines.torch_engine.timings.modelled_timings`), the same under any load; on llama.cpp
timed once on this machine and cached per machine, file and threads
(`fsd_chat.engines.llama_calibration.calibrated_timings`), the same on every later run there (both
through `timings_of`). An experiment's: timed on this machine
(`fsd_chat.engines.torch_engine.timings.time_forwards`), which `goodput` then scales by the
seconds its steps take (`ForwardTimings.follows_clock`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from fsd_chat.decoding.settings import MAX_DRAFT_TOKENS

MEASURED_WIDTHS = (1, 2, 3, 4, 5, 6, 8, 12, 17, MAX_DRAFT_TOKENS + 1)
"""Verify widths (tokens) an engine's timings cover (modelled, calibrated, or timed by
`time_forwards`); other widths are linearly interpolated."""

MEASURE_CONTEXT = 64
"""Tokens of context the timed forwards attend to."""

MEASURE_REPEATS = 3
"""Timed passes over the widths (after one untimed pass); each time is their minimum (timing noise only adds)."""

STEP_SECONDS = 5.5e-4
"""`timings_of`: seconds a drafting step spends beyond its forwards (`ForwardTimings.step`),
against a target-only step. Fitted (2026-11-27, with the transformers engine's forward prices,
`fsd_chat.engines.torch_engine.timings`) to the story pair's
fixed-k steps in the bench, k = 1..5: 1.93, 2.34, 2.77, 3.21, 3.73 ms against a target-only step's
0.82 ms, i.e. T_k / V(1) 2.35, 2.85, 3.37, 3.92, 4.55; the model gives 2.39, 2.93, 3.46, 4.00, 4.53
(3.5e-4 gave 2.03 at k = 1: a k = 1 block looked 15% cheaper than it is)."""

STEP_VOCAB_SECONDS = 1.0e-8
"""`timings_of`: seconds a drafting step spends beyond its forwards per entry of the target's
vocabulary (the laws, the rule and the verdict over it), on top of `STEP_SECONDS`. SmolLM2-135M
packed, prompt lookup, one thread, 2026-11-27 (median step against the same prompts' target-only
steps): k = 1 1.11–1.13 V(1), k = 2 1.17, k = 5 1.35 (at about 450 tokens of context), where the
forwards alone account for 1.08, 1.12 and 1.30: about 0.5 ms more a step over 49,152 entries."""


@dataclass(frozen=True, slots=True)
class ForwardTimings:
    """How long drafting and verifying take on a device.

    Attributes:
        draft: Seconds of one draft position (a 1-token draft forward and its softmax).
        widths: Verify widths in tokens, increasing, from 1 to at least MAX_DRAFT_TOKENS + 1.
        verify: Seconds of a target forward over each of `widths` tokens.
        follows_clock: `goodput` scales these by the seconds its steps take at run time (a clock
            in the loop: the text then follows the load): timings from `time_forwards`, an
            experiment's. False for the app's, modelled or calibrated once (`timings_of`), and for
            those written by hand (tests), which are taken as they are.
        step: Seconds a drafting step spends beyond its forwards, against a target-only step's
            (the acceptance rule, the draft's draws, the rollback): what makes a small pair's
            speculation dearer than its forwards say.
        catch_up: Seconds a draft model's cache takes per token it missed while paused (the
            marginal token of a wide draft forward; 0 for prompt lookup, which keeps no cache).
        attention: Seconds a 1-token target forward adds per token of context beyond
            MEASURE_CONTEXT (the context `verify` was timed over).
        attention_width: Seconds each further token of a forward's width adds per token of
            context beyond MEASURE_CONTEXT: a verify reads the keys and values once per query.
        batch_attention: What the first token of a forward of several tokens adds per token of
            context beyond MEASURE_CONTEXT (None: `attention`): llama.cpp runs such forwards on
            threads of their own (`fsd_chat.support.threads`).
    """

    draft: float
    widths: tuple[int, ...]
    verify: tuple[float, ...]
    follows_clock: bool = False
    step: float = 0.0
    catch_up: float = 0.0
    attention: float = 0.0
    attention_width: float = 0.0
    batch_attention: float | None = None

    def verify_table(self, context: int = MEASURE_CONTEXT) -> list[float]:
        """V(w) for w = 0..MAX_DRAFT_TOKENS + 1 in seconds, indexed by width (w = 0 unused: V(1)),
        over `context` tokens of context."""
        extra = max(context - MEASURE_CONTEXT, 0)
        batch = self.attention if self.batch_attention is None else self.batch_attention
        return [self.verify_seconds(1) + extra * self.attention] * 2 + [
            self.verify_seconds(w) + extra * (batch + (w - 1) * self.attention_width)
            for w in range(2, MAX_DRAFT_TOKENS + 2)
        ]

    def verify_seconds(self, width: int) -> float:
        """Seconds of a target forward over `width` tokens (linear between measured widths)."""
        i = bisect.bisect_left(self.widths, width)
        if i < len(self.widths) and self.widths[i] == width:
            return self.verify[i]
        i = min(max(i, 1), len(self.widths) - 1)
        (w0, w1), (v0, v1) = self.widths[i - 1 : i + 1], self.verify[i - 1 : i + 1]
        return v0 + (v1 - v0) * (width - w0) / (w1 - w0)


M = TypeVar("M")


def timings_of(
    forward_seconds: Callable[[M, int], float],
    target: M,
    draft: M | None,
    *,
    vocab: int,
    attention: float,
    attention_width: float,
    batch_attention: float | None = None,
) -> ForwardTimings:
    """`ForwardTimings` of an engine's models from its `forward_seconds(model, width)`
    (`modelled_timings` for transformers models; `fsd_chat.engines.llama_cpp.priced_timings`):
    the verify widths, a draft position (0 s without a draft model: prompt lookup), the marginal
    token of a draft's catch-up, a step's work over a vocabulary of `vocab` ids, and the attention
    terms (seconds per token of context, see `ForwardTimings`)."""
    verify = tuple(forward_seconds(target, width) for width in MEASURED_WIDTHS)
    draft_seconds = 0.0 if draft is None else forward_seconds(draft, 1)
    # The marginal token of a wide forward (past the 1-token forward's cheaper read).
    catch_up = 0.0 if draft is None else forward_seconds(draft, 3) - forward_seconds(draft, 2)
    return ForwardTimings(
        draft=draft_seconds,
        widths=MEASURED_WIDTHS,
        verify=verify,
        follows_clock=False,
        step=STEP_SECONDS + vocab * STEP_VOCAB_SECONDS,
        catch_up=catch_up,
        attention=attention,
        attention_width=attention_width,
        batch_attention=batch_attention,
    )
