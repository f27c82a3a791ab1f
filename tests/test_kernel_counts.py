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
    target_only_step,
)
from fsd_chat.decoding.regions import mark_layer_regions

EAGER_OPS_A_LAYER = 40
"""bfloat16, fused projections: 4 GEMMs, attention, 35 elementwise, reduction, cat and copy
operators (43 with q, k, v and gate, up as separate GEMMs; 44 when each layer's write position was
set by a copy of its own)."""
EAGER_OPS_OUTSIDE_LAYERS = 36
"""The step's own operators at 0 layers (embedding, rotary tables, mask, final norm, head, greedy
draw): 56 when a greedy step still truncated its laws (sorts); 34 when the mask was boolean, which
SDPA then turned into an additive one inside every layer's call, below what this instrument counts
(torch.profiler sees it: a `where` and its scalars a layer)."""
COMPILED_LAUNCHES_A_LAYER = 11
"""Inductor, each layer a nested compile region: 4 GEMMs, attention and 5 fused kernels (norm;
rotary embedding and cache write; residual and norm; SiLU gate; residual), and the layer's write
position: the step sets every layer's with one multi-tensor copy, which inductor's CPU code runs as
a kernel per layer."""


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
