"""CPU instruments that predict a GPU's kernel launches: the operators a decoding step runs eagerly,
and the kernels inductor generates for it compiled, each counted a step and a decoder layer.

On a GPU at batch 1 a small model's step costs about a microsecond and a half per kernel launched
(a CUDA graph included), whatever the kernel does: the profile of the whole step (DESIGN.md, "On a
GPU") counted 52 kernels a layer, 1,247 a token. Neither count needs a GPU to be known:

- **Eager**: every aten operator a step dispatches, less views (which launch nothing) and
  allocations, is one kernel on CUDA (`TorchDispatchMode` sees each, as a CUDA graph's capture
  records each; `eager_ops`).
- **Compiled**: inductor's output code for the step (`torch._inductor.utils.run_and_get_code`)
  calls its generated kernels (`cpp_fused_*` on a CPU, Triton kernels on a GPU: one fused loop
  each), extern kernels (`extern_kernels.mm`: a GEMM) and the aten operators it does not lower
  (attention); a nested compile region (`torch_engine.regions`) is a function of that code, called
  once a layer (`launches`).

A layer's count is the slope between two depths of one model (`per_layer`), so that the work
outside the layers (embedding, head, laws, rule) is not spread over them. A decoder's count a
token (`reply_ops`) compares two step paths over the same reply: the whole step against the
per-forward steps it replaces.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from fsd_chat.decoding.protocol import Decoder
from fsd_chat.engines.torch_engine.fused_linear import fuse_projections
from fsd_chat.engines.torch_engine.kv_cache import StaticModel
from fsd_chat.engines.torch_engine.step_graph import StepInputs, target_step


class _OpCounter(TorchDispatchMode):
    """Counts the operators that write memory: in place, or into a new tensor. A view, an alias or
    a conversion to what a tensor already is (`to` its own dtype) returns its input's storage and
    launches nothing; an allocation writes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if name.startswith(("aten.empty", "aten.new_empty")):
            return out
        inputs = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func._schema.is_mutable or any(_storage(t) not in inputs for t in outputs):
            self.ops[name] += 1
        return out


def _storage(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except NotImplementedError:  # an opaque tensor: oneDNN's prepacked weights (`packed_linear`)
        return id(tensor)


def eager_ops(step: Callable[..., Any], *args: Any) -> Counter[str]:
    """The kernel-launching aten operators of one eager call of `step(*args)`, by name."""
    with _OpCounter() as counter:
        step(*args)
    return counter.ops


def reply_ops(decoder: Decoder, prompt: list[int], tokens: int) -> float:
    """Kernel-launching aten operators a token of a greedy reply of `tokens` tokens to `prompt`
    (`eager_ops`' count), from its second step on: the prompt's prefill and the first step are
    left out, so that the count is the decoding steps'.

    Raises:
        ValueError: the reply ended at its first step (no step to count).
    """
    steps = decoder.generate(prompt, max_new_tokens=tokens)
    next(steps)
    emitted = 0
    with _OpCounter() as counter:
        for step in steps:
            emitted += len(step.tokens)
    if not emitted:
        raise ValueError("the reply ended at its first step: no decoding step to count")
    return sum(counter.ops.values()) / emitted


_FUNCTION = re.compile(r"^(?:    )?def (\w+)\(", re.MULTILINE)
_LAUNCH = re.compile(
    r"^\s+(?:\w+ = )?(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|torch\.ops\.\w+\.\w+\.\w+)\("
)
_SUBGRAPH_CALL = re.compile(r"^\s+\w+ = (\w+)\(\w+_args\)", re.MULTILINE)


def launches(code: str) -> int:
    """Kernel launches of one run of inductor's output code (the wrapper's `call`), each nested
    region's launches counted at every call of it."""
    bodies: dict[str, str] = {}
    matches = list(_FUNCTION.finditer(code))
    for match, after in zip(matches, [*matches[1:], None], strict=True):
        bodies[match.group(1)] = code[match.end() : after.start() if after else len(code)]

    def count(name: str) -> int:
        body = bodies[name]
        own = sum(1 for line in body.splitlines() if _LAUNCH.match(line))
        return own + sum(count(sub) for sub in _SUBGRAPH_CALL.findall(body) if sub in bodies)

    return count("call")


def compiled_launches(step: Callable[..., Any], *args: Any) -> tuple[int, float]:
    """(kernel launches, compile seconds) of `step(*args)` compiled by inductor (whole, static
    shapes), from the output code of its first call."""
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    start = time.perf_counter()
    _, codes = run_and_get_code(compiled, *args)
    seconds = time.perf_counter() - start
    return sum(launches(code) for code in codes), seconds


def per_layer(counts: dict[int, float]) -> float:
    """A layer's share of a count measured at several depths (layers → count): the slope between
    the shallowest and the deepest."""
    low, high = min(counts), max(counts)
    return (counts[high] - counts[low]) / (high - low)


def deeper(
    source: str, layers: int, *, fused: bool = True, dtype: torch.dtype = torch.bfloat16
) -> PreTrainedModel:
    """A random-weight copy of the model at `source` (a folder) with `layers` decoder layers, in
    float32 on the CPU, its projections fused as the loader fuses them (`fused`): the counts
    depend on the shapes, not the weights."""
    config = AutoConfig.from_pretrained(source)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    if fused:
        fuse_projections(model)
    return model


def target_only_step(
    model: PreTrainedModel, *, sorts: bool = False
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A greedy target-only whole step over `model` (`step_graph.target_step`, the settings as
    device values, as the captured graphs read them), ready to call: (function, arguments).
    `sorts`: with the laws every truncation applies (the greedy graphs before `StepInputs.for_step`
    dropped them)."""
    vocab = model.config.get_text_config().vocab_size
    static = StaticModel(model, vocab, capacity=CAPACITY)
    inputs = StepInputs.allocate(CAPACITY, static.device, on_device=True)
    inputs.position.fill_(3)
    return target_step, (static, inputs.for_step(True, sorts), True, None)


CAPACITY = 64
"""The static caches' tokens in the counted steps (the counts do not depend on it)."""
