"""What CUDA graphs do to a compiled function's outputs, emulated on the CPU (which cannot run them):
the decoders keep nothing a compiled call returned past the next compiled call.

On CUDA, `--compile` runs the models' forward passes and the acceptance rule under torch.compile's
mode "reduce-overhead" (CUDA graph trees). A graph's outputs live in memory the graphs share, and
in inference every compiled call starts a new generation that frees the outputs of the calls
before it: reading one afterwards raises torch's "accessing tensor output of CUDAGraphs that has
been overwritten by a subsequent run" (`torch/_inductor/cudagraph_trees.py`). A decoder that kept
a float32 target's logits (a view of the output: `Tensor.float` does not copy float32), or a draft
step's, across the next pass would crash there, and only there.

`GraphPool` stands in for torch.compile (a mock, because CUDA cannot run here): the wrapped
function runs eagerly, its tensor outputs are handed back in buffers the pool owns, and each call
of any wrapped function first fills the previous call's buffers with NaN (floats) or -1 (integers).
A decoder that kept one would then read garbage, and its reply would differ from the eager
decoder's, or end in a non-finite error.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.decoding.lookup import PromptLookup
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.decoding.settings import Rule
from fsd_chat.engines.torch_engine import kv_cache
from fsd_chat.engines.torch_engine.binding import speculative_decoder
from fsd_chat.engines.torch_engine.kv_cache import CompiledModel
from fsd_chat.models.pair import ModelPair
from tests.decoding_helpers import collect, modelled


class GraphPool:
    """Outputs of "compiled" calls that the next call of any of them overwrites (module docstring)."""

    def __init__(self) -> None:
        self.live: list[torch.Tensor] = []
        self.calls = 0

    def _own(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            owned = value.clone()
            self.live.append(owned)
            return owned
        if isinstance(value, tuple):
            return tuple(self._own(v) for v in value)
        if hasattr(value, "logits"):  # a transformers ModelOutput; its cache is an input, not an output
            value.logits = self._own(value.logits)
        return value

    def compile(self, function: Callable[..., Any], **_: Any) -> Callable[..., Any]:
        """torch.compile's stand-in: `function` run eagerly, its outputs in the pool."""

        def replay(*args: Any, **kwargs: Any) -> Any:
            for tensor in self.live:
                tensor.fill_(float("nan") if tensor.is_floating_point() else -1)
            self.live.clear()
            self.calls += 1
            return self._own(function(*args, **kwargs))

        return replay


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> GraphPool:
    """torch.compile replaced by a `GraphPool`, and no compiled forward kept from other tests."""
    graphs = GraphPool()
    monkeypatch.setattr(torch, "compile", graphs.compile)
    monkeypatch.setattr(kv_cache, "_COMPILED", weakref.WeakKeyDictionary())
    return graphs


def speculative(pair: ModelPair, draft: str, rule: Rule, compiled: bool) -> Decoder:
    settings = DecodingSettings(
        rule=rule, threshold=0.0 if rule == "exact" else 0.1, draft_tokens=4, draft_policy="fixed"
    )
    if draft == "lookup":
        return speculative_decoder(
            pair.target,
            PromptLookup(3),
            pair.tokenizer,
            controls=Controls(settings),
            vocab_size=pair.vocab_size,
            compiled=compiled,
            timings=modelled(pair.target),
        )
    return pair.speculative(Controls(settings), compiled=compiled)


CASES: list[tuple[str, str, Rule]] = [
    ("target-only", "model", "exact"),
    ("speculative", "model", "exact"),
    ("speculative", "model", "fuzzy"),
    ("speculative", "model", "mixture"),
    ("speculative", "lookup", "exact"),
    ("speculative", "mapped", "fuzzy"),
]


@pytest.mark.parametrize(("kind", "draft", "rule"), CASES)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_replies_equal_eager_ones_when_outputs_are_overwritten(
    pool: GraphPool,
    pair: ModelPair,
    shuffled: ModelPair,
    kind: str,
    draft: str,
    rule: Rule,
    temperature: float,
) -> None:
    models = shuffled if draft == "mapped" else pair
    sampling = SamplingConfig(temperature=temperature, top_p=0.95, seed=5)
    prompt = models.tokenizer("Once upon a time, Tom and Sue went to the park. Tom and Sue").input_ids

    def reply(compiled: bool) -> list[int]:
        decoder = (
            models.autoregressive(Controls(), compiled=compiled)
            if kind == "target-only"
            else speculative(models, draft, rule, compiled)
        )
        if compiled:
            assert all(isinstance(m, CompiledModel) for m in decoder.owned_models)  # type: ignore[attr-defined]
        return collect(decoder.generate(prompt, max_new_tokens=48, sampling=sampling)).ids

    want = reply(False)
    calls = pool.calls
    got = reply(True)
    assert pool.calls - calls >= 10  # the steps went through the pool
    assert got == want
