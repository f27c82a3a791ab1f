"""Regional compilation: each decoder layer of a model is one nested compile region, compiled once
and reused for every layer (`step_graph.compiled_step_functions`), so that a deeper model costs
only the tracing of its calls: on this CPU a target-only step of 5, 10 and 20 layers compiled in
15.5, 17.9 and 25.1 s, where unrolled layers took 26.9, 29.2 and 54.1 s (docs/benchmarks.md,
"Compile seconds against depth").

torch.compile traces a model's forward pass unrolled: every layer's operators are traced, lowered
and scheduled again, and compile time grows with the depth. `torch.compiler.nested_compile_region`
(hierarchical compilation, torch ≥ 2.8; the successor of the "regional compilation" recipe's
per-layer `torch.compile`, which would leave the step between layers uncompiled) marks a function
whose compiled code the compiler emits once and calls at each use with the same input conditions
(shapes, dtypes, strides). A decoder layer's forward is the region: its parameters and cache
tensors are its inputs, so the layers of one model share one compiled region per width. Inductor
fuses within the region (a layer's norms, rotary embedding, cache write and activation) and, around
it, the step's own work (the laws, the rule, the draw); it does not fuse across its boundary.

Outside torch.compile a region is a plain call (the eager steps run the layers unchanged).

The layers are found by the model's own declaration of its repeated block, transformers'
`_no_split_modules` (the classes that `device_map` never splits: `LlamaDecoderLayer`,
`Qwen2DecoderLayer`, `GPT2Block`, ...).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_REGIONS: dict[type, Callable[..., Any]] = {}
"""One region per layer class, shared by every layer (and model) of that class: the compiler
reuses a region's code when the same function is called again."""


def mark_layer_regions(model: nn.Module) -> int:
    """Make each decoder layer of `model` (its `_no_split_modules` classes) call its forward as a
    nested compile region, in place; returns how many layers (0: the model declares none).
    Idempotent."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    marked = 0
    for module in model.modules():
        cls = type(module)
        if cls.__name__ not in classes:
            continue
        region = _REGIONS.get(cls)
        if region is None:
            region = _REGIONS[cls] = torch.compiler.nested_compile_region(cls.forward)
        if module.__dict__.get("forward") is None:
            # An instance attribute: nn.Module.__call__ looks `forward` up on the instance first.
            module.forward = types.MethodType(region, module)
        marked += 1
    return marked
