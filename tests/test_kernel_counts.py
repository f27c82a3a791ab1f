"""The CPU's kernel counts of a decoding step (`fsd_chat.bench.kernel_counts`), bounded: a change
that adds kernels to a decoder layer, eager or compiled, fails here before it costs microseconds a
layer on a GPU (DESIGN.md, "On a GPU": 52 kernels a layer in the profile of the whole step).

The bounds are today's counts for stories260K's shape (scripts/count_kernels.py measures them at
1×, 2× and 4× its 5 layers; docs/benchmarks.md gives them beside the GPU's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsd_chat.bench.kernel_counts import (
    compiled_launches,
    deeper,
    eager_ops,
    launches,
    per_layer,
    reply_ops,
    target_only_step,
)
from fsd_chat.decoding import Controls, DecodingSettings
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.engines.torch_engine.regions import mark_layer_regions
from fsd_chat.models.pair import ModelPair

EAGER_OPS_A_LAYER = 37
"""bfloat16, fused projections: 4 GEMMs, attention, the cache's two `index_copy_`
(`kv_cache.PositionedLayer`) and 30 elementwise, reduction and cat operators (40 with q, k, v and
gate, up as separate GEMMs; 40 also when transformers' `StaticLayer.update` wrote the cache, at
its own write position: an `arange`, an `add` and an `add_` more)."""
EAGER_OPS_OUTSIDE_LAYERS = 30
"""The step's own operators at 0 layers (the fed token, the mask's 3 in bfloat16, embedding,
rotary tables, final norm, head, law, greedy draw, the token's write, the position, the block):
36 when every layer's write position was set first and the mask built from a fresh `arange`; 56
when a greedy step still truncated its laws (sorts)."""
COMPILED_LAUNCHES_A_LAYER = 10
"""Inductor, each layer a nested compile region: 4 GEMMs, attention and 5 fused kernels (norm;
rotary embedding and cache write; residual and norm; SiLU gate; residual). 11 when transformers'
`StaticLayer` kept a write position a layer, which the step set with one multi-tensor copy (a
kernel a layer in inductor's CPU code); `kv_cache.PositionedLayer` keeps none."""
REPLY_OPS_A_TOKEN = {"target-only": 186.0, "exact k4": 130.8, "fuzzy js 0.1 k4": 132.9}
"""The whole step's operators a token over a 48-token greedy story reply (`reply_ops`). Today's
per-forward steps (a transformers `DynamicCache`, a forward pass a call) ran 183, 136.2 and 138.3 at
the commit that set these (the target-only step's 3 more: the token's read at its position, its
check's `gather`, its cast for the block; the cache's two writes a layer are `index_copy_` where the
dynamic cache's are `cat`); the whole step ran 211, 155 and 157 over transformers' `StaticCache`, and 189 target-only
while it built an unmasked pass's all-zero mask (issue 45, item 5: the whole step may replace those steps only where it is no dearer)."""


def _eager(target_dir: Path, layers: int, **kwargs: object) -> int:
    step, args = target_only_step(deeper(str(target_dir), layers, **kwargs))  # type: ignore[arg-type]
    with torch.inference_mode():
        return sum(eager_ops(step, *args).values())


def test_eager_operators_a_layer_are_bounded(target_dir: Path) -> None:
    counts = {layers: _eager(target_dir, layers) for layers in (2, 4)}
    assert per_layer(counts) <= EAGER_OPS_A_LAYER
    assert counts[2] - 2 * per_layer(counts) <= EAGER_OPS_OUTSIDE_LAYERS
    # The instrument sees what the fusion and the untruncated greedy laws removed.
    before = {layers: _eager(target_dir, layers, fused=False) for layers in (2, 4)}
    assert per_layer(before) == per_layer(counts) + 3  # q, k, v: 3 GEMMs to 1; gate, up: 2 to 1


@pytest.mark.parametrize("kind", list(REPLY_OPS_A_TOKEN))
def test_the_whole_step_runs_no_more_operators_a_token_than_its_bound(pair: ModelPair, kind: str) -> None:
    settings = {
        "exact k4": DecodingSettings(rule="exact", threshold=0.0, draft_tokens=4, draft_policy="fixed"),
        "fuzzy js 0.1 k4": DecodingSettings(
            rule="fuzzy", divergence="js", threshold=0.1, draft_tokens=4, draft_policy="fixed"
        ),
    }

    def decoder(whole_step: bool) -> Decoder:
        if kind == "target-only":
            return pair.autoregressive(Controls(), whole_step=whole_step)
        return pair.speculative(Controls(settings[kind]), whole_step=whole_step)

    prompt = pair.tokenizer("Once upon a time").input_ids
    decoders = {whole_step: decoder(whole_step) for whole_step in (False, True)}
    replies = {
        whole_step: [t.id for step in d.generate(prompt, max_new_tokens=48) for t in step.tokens]
        for whole_step, d in decoders.items()
    }
    assert replies[True] == replies[False]  # the same reply: the bounds count the same tokens
    assert reply_ops(decoders[True], prompt, 48) <= REPLY_OPS_A_TOKEN[kind]


def test_launches_count_each_region_at_each_call() -> None:
    code = """
def subgraph_0(args):
    cpp_fused_norm_1(a, b)
    extern_kernels.mm(a, b, out=c)
    buf = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)
class Runner:
    def call(self, args):
        cpp_fused_embedding_0(a)
        buf1 = subgraph_0(subgraph_0_args)
        buf2 = subgraph_0(subgraph_0_args)
        extern_kernels.mm(x, w, out=y)
"""
    assert launches(code) == 1 + 2 * 3 + 1


@pytest.mark.slow
def test_compiled_kernels_a_layer_are_bounded(target_dir: Path) -> None:
    counts = {}
    for layers in (2, 4):
        model = deeper(str(target_dir), layers, dtype=torch.float32)
        assert mark_layer_regions(model) == layers
        step, args = target_only_step(model)
        with torch.inference_mode():
            counts[layers], _ = compiled_launches(step, *args)
    assert per_layer(counts) <= COMPILED_LAUNCHES_A_LAYER
