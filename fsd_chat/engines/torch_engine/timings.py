"""The transformers engine's forward times (`ForwardTimings`): modelled from a model's shapes and
sizes (`modelled_timings`, the app's: no clock, so a seed gives the same reply under any load), or
timed on this machine (`time_forwards`, an experiment's). The constants below are the fitted
prices of `modelled_timings`, each with the measurement it was fitted to; the llama.cpp engine's
are timed on the machine once and cached (`fsd_chat.engines.llama_calibration`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fsd_chat.decoding.forward_timings import (
    MEASURE_CONTEXT,
    MEASURE_REPEATS,
    MEASURED_WIDTHS,
    ForwardTimings,
    timings_of,
)
from fsd_chat.decoding.timing import PhaseClock
from fsd_chat.engines.torch_engine.kv_cache import CachedModel
from fsd_chat.engines.torch_engine.packed_linear import PackedLinear, packed_bytes

if TYPE_CHECKING:  # the modeling stack (torch._dynamo with it): imported by the torch engine alone
    from transformers import PreTrainedModel


def time_forwards(target: PreTrainedModel, draft: PreTrainedModel | None, vocab_size: int) -> ForwardTimings:
    """Time the draft's 1-token forward and the target's forward at `MEASURED_WIDTHS` on their
    devices, over a `MEASURE_CONTEXT`-token context, with caches of their own (a decoder's caches
    are not touched). Takes (1 + MEASURE_REPEATS) × (len(MEASURED_WIDTHS) + 1) forward passes,
    all eager (a compiled draft's forward is faster than measured: `latency` then drafts less than
    it could). Without a draft model (prompt lookup) a draft position takes 0 seconds."""
    t_model = CachedModel(target, vocab_size)
    d_model = CachedModel(draft, vocab_size) if draft is not None else None
    longest = MEASURE_CONTEXT + MEASURED_WIDTHS[-1]
    t_seq = torch.arange(longest, device=t_model.device).remainder(vocab_size)[None]
    t_model.forward(t_seq, MEASURE_CONTEXT, keep=1)
    if d_model is not None:
        d_model.forward(t_seq.to(d_model.device), MEASURE_CONTEXT, keep=1)
    clock = PhaseClock(t_model.device)

    def verify(width: int) -> float:
        clock.lap()
        t_model.forward(t_seq, MEASURE_CONTEXT + width, keep=width)
        seconds = clock.lap()
        t_model.rollback(MEASURE_CONTEXT)
        return seconds

    def draft_position() -> float:
        if d_model is None:
            return 0.0
        clock.lap()
        d_model.forward(t_seq.to(d_model.device), MEASURE_CONTEXT + 1, keep=1).softmax(-1).max().item()
        seconds = clock.lap()
        d_model.rollback(MEASURE_CONTEXT)
        return seconds

    samples: list[list[float]] = [[] for _ in range(len(MEASURED_WIDTHS) + 1)]
    for repeat in range(1 + MEASURE_REPEATS):
        times = [verify(width) for width in MEASURED_WIDTHS] + [draft_position()]
        if repeat:  # pass 0 is untimed: first-call allocations and kernel selection
            for sample, seconds in zip(samples, times, strict=True):
                sample.append(seconds)
    fastest = [min(s) for s in samples]
    return ForwardTimings(
        draft=fastest[-1], widths=MEASURED_WIDTHS, verify=tuple(fastest[:-1]), follows_clock=True
    )


FORWARD_SECONDS = 1.4e-4
"""`modelled_timings`: a forward's fixed host cost (seconds): Python, dispatch, the cache's
bookkeeping, the softmax and the read of its result. Fitted, with the six below, to the forwards
and steps of fixed-k decoding on this project's CPU (one thread, float32): SmolLM2-135M (30 layers,
134.5M parameters; before its weights were prepacked, whose rates `PACKED_BYTE_SECONDS` and the two
after it price: V(1) 36 ms, V(33) 140 ms) and the story pair (5 and 2 layers of width 64; its
layers are too small to pack).
Refit 2026-11-27 on the story pair (`time_forwards`, best of 5; one torch thread): target V(1)
0.74 ms, V(2) 0.87, V(6) 0.93, V(33) 1.30; draft (as a target) V(1) 0.38, V(2) 0.43, V(33) 0.62 ms:
0.12 ms a layer and 0.14 ms a forward (the model gives 0.77, 0.89, 0.94, 1.33 and 0.40, 0.45,
0.64 ms). The earlier 4e-4 priced a small model's forwards 1.4× too dear against its steps' own
work and its width too cheap: the story pair's V(6) at 1.14 V(1), measured 1.26. SmolLM2 barely
moves (V(1) 39.3 → 39.0 ms modelled)."""

LAYER_SECONDS = 1.1e-4
"""`modelled_timings`: seconds of one decoder layer's fixed cost per forward (its dozen operators'
dispatch, which dominates a small model)."""

TOKEN_LAYER_SECONDS = 1.6e-6
"""`modelled_timings`: seconds of one decoder layer's work per token beyond its weights (attention,
norms, activations): with the weights' multiply-adds, the slope of a narrow model's V(w) past w = 2
(story pair, 2026-11-27: 14 µs a token over 5 layers, 6 µs over 2)."""

BYTE_SECONDS = 6e-11
"""`modelled_timings`: seconds to read one byte of weights (about 16 GB/s): a forward over a few
tokens is bound by its weight read."""

WIDE_READ = 1.5
"""`modelled_timings`: how much dearer the weight read of a forward over 2 or more tokens is than a
1-token forward's: torch's CPU matrix-vector kernels read the weights faster than its
matrix-matrix ones. Measured with SmolLM2-135M in float32: V(1) 36–37 ms, V(4) 54–63 ms, V(6)
62–67 ms, so a lookup block of k must be accepted about half the time to pay."""

WIDE_LAYER_SECONDS = 1.5e-5
"""`modelled_timings`: seconds one decoder layer adds to a forward over 2 or more tokens (its causal
mask and multi-query attention path): a narrow model's V(2) is 17% dearer than its V(1), where its
per-token work and wider read make 6% (story pair, 2026-11-27: V(1) 0.74 ms, V(2) 0.87 ms; its
2-layer draft 0.38 and 0.43 ms: about 26 µs a layer either way, 15 µs at the fit's fixed cost)."""

TOKEN_SECONDS = 2.4e-11
"""`modelled_timings`: seconds of one weight's multiply-adds for one token (about 80 GFLOP/s): what
each more token of a verify width costs."""


PACKED_BYTE_SECONDS = 3.5e-11
"""`modelled_timings`: `BYTE_SECONDS` for a weight prepacked for oneDNN
(`fsd_chat.engines.torch_engine.packed_linear`; about 28 GB/s). Fitted with the two below to SmolLM2-135M in
float32, packed, one thread (2026-11-27, `CachedModel`, best of 4): V(1) 23.3 ms, V(2) 25.2, V(3)
26.2, V(4) 26.5, V(6) 29.1 (the model gives 23.3, 25.2, 26.2, 27.2, 29.1)."""

PACKED_WIDE_READ = 1.02
"""`modelled_timings`: `WIDE_READ` for packed weights: oneDNN's layout for 2 rows reads the weights
as fast for 2 to 6 rows as for 1."""

PACKED_TOKEN_SECONDS = 6.9e-12
"""`modelled_timings`: `TOKEN_SECONDS` for packed weights: each more token of a verify width adds
about 1 ms to SmolLM2's forward (its multiply-adds overlap the weight read)."""


ATTENTION_SECONDS = 4.3e-10
"""`modelled_timings`: seconds a 1-token forward adds per token of context, per layer and per unit
of hidden width (`ForwardTimings.attention`). SmolLM2-135M (30 layers, 576 wide), packed, one
thread, `CachedModel` best of 5: V(1) 23.9 ms over 64 tokens of context, 26.8 over 400, 30.9 over
1,000 (8.8 and 7.5 µs a token)."""

ATTENTION_WIDTH_SECONDS = 8.7e-11
"""`modelled_timings`: what each further token of a forward's width adds to `ATTENTION_SECONDS`
(`ForwardTimings.attention_width`). Same measurement: over 1,000 tokens against 64, V(2) +11.4 ms,
V(4) +13.3, V(6) +17.0 (7.5 µs a token of context at width 1, 12–18 at widths 2–6), so the
verify of a long conversation is dearer against V(1) than over a short one: V(6)/V(1) 1.20 over
64 tokens, 1.48 over 1,000."""


def model_forward_seconds(model: PreTrainedModel, width: int) -> float:
    """The modelled seconds of `model`'s forward over `width` new tokens (`modelled_timings`): a
    fixed cost, per layer, per byte of weights read (`WIDE_READ` times dearer over 2 or more tokens),
    and per token (per weight and per layer), weights prepacked for oneDNN
    (`fsd_chat.engines.torch_engine.packed_linear`) at their own prices (`PACKED_BYTE_SECONDS`...). The weights
    count every parameter but an input embedding that no output head reads (a gather reads `width`
    rows of it, not the whole table): the head is untied, or holds a packed copy of its own."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    head_weight = head.tied if isinstance(head, PackedLinear) else getattr(head, "weight", None)
    gathered = (
        embedding.weight
        if embedding is not None and (head_weight is not embedding.weight or isinstance(head, PackedLinear))
        else None
    )
    weights = [p for p in model.parameters() if p is not gathered]
    read = sum(p.numel() * p.element_size() for p in weights)
    count = sum(p.numel() for p in weights)
    packed = packed_bytes(model)
    layers = model.config.get_text_config().num_hidden_layers
    wide = width > 1
    per_token = count * TOKEN_SECONDS + packed / 4 * PACKED_TOKEN_SECONDS + layers * TOKEN_LAYER_SECONDS
    read_seconds = read * BYTE_SECONDS * (WIDE_READ if wide else 1.0) + packed * PACKED_BYTE_SECONDS * (
        PACKED_WIDE_READ if wide else 1.0
    )
    layer_seconds = layers * (LAYER_SECONDS + (WIDE_LAYER_SECONDS if wide else 0.0))
    return FORWARD_SECONDS + layer_seconds + read_seconds + width * per_token


def modelled_timings(target: PreTrainedModel, draft: PreTrainedModel | None) -> ForwardTimings:
    """The draft and verify forward times from the models alone (`model_forward_seconds`): the
    same on every run and under any load, so that the draft lengths `goodput` and `latency` choose,
    and with them the text a lossy rule writes, do not depend on a clock (an undrafted position is
    the target's token). Only ratios matter to the policies (they compare E_k / T_k with
    1 / V(1)), and those follow the models' shapes and sizes on any device; a draft position also
    pays its softmax over the vocabulary, included in its forward's head. Prompt lookup: 0 s."""
    config = target.config.get_text_config()
    attended = config.num_hidden_layers * config.hidden_size
    return timings_of(
        model_forward_seconds,
        target,
        draft,
        vocab=config.vocab_size,
        attention=attended * ATTENTION_SECONDS,
        attention_width=attended * ATTENTION_WIDTH_SECONDS,
    )
