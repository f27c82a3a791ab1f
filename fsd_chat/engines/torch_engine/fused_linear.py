"""Sibling projections fused into one GEMM at load: q, k and v; gate and up.

A decoder layer of Llama, Qwen2, Gemma, Mistral and most of transformers' causal LMs multiplies one
hidden state by three attention projections (`q_proj`, `k_proj`, `v_proj`) and, in its MLP, by two
(`gate_proj`, `up_proj`): five GEMMs (on a GPU at batch 1, five GEMVs, the small k and v ones far
from the memory bandwidth) where two would do. vLLM (`QKVParallelLinear`, `MergedColumnParallelLinear`),
SGLang and gpt-fast (`wqkv`, `w13`... in its `model.py`) define their own models with the
projections fused; transformers has no such switch for its torch models (its `WeightConverter`
renames checkpoint tensors into the model's own modules, and Phi-3, GPT-2 and GPT-NeoX already
define fused ones).

So the fusion here leaves every model's code as it is: the sibling `nn.Linear`s of one module
become views of one `FusedLinear` (their weights concatenated along the output rows), and each
sibling's call returns its slice of the fused product. The first sibling called on an input
computes the product for all of them; the others called on the *same tensor object* take their
slice of it; a call on any other input computes the product again (the architecture fed the
siblings different inputs: still exact, only slower). A module's forward calls its siblings on
one hidden state in every architecture listed, so the product is computed once a layer.

Exactness: each output element is the same dot product of the same input row and weight row; a
GEMM may still order its accumulation differently for another output width (blocking, split-K),
so logits agree to rounding, not bit for bit (tests/test_fused_linear.py bounds it on real
models, and checks greedy decoding gives the same tokens).

Not fused: quantized layers (bitsandbytes' `Linear8bitLt` and `Linear4bit` are subclasses of
`nn.Linear` holding their own quantization state per layer; an 8-bit or 4-bit target keeps its
separate GEMMs), layers on different devices or dtypes, and layers with accelerate's offloading
hooks (`device_map="auto"` over several devices).
"""

from __future__ import annotations

import torch
from torch import nn

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""The names of the projections fused, each tuple into one GEMM: transformers' names in every
Llama-like architecture (Llama, Mistral, Qwen2/3, Gemma 1-3, OLMo, Granite, SmolLM, ...)."""


class FusedLinear(nn.Module):
    """One GEMM for several linear layers of one input, their outputs as slices of it.

    Args:
        layers: The layers, with equal in_features, dtype and device, all with a bias or none.

    Input [..., in_features] → `slice_of(x, i)`: [..., out_features of layer i] (a view of the
    fused product, whose last dimension has stride 1).
    """

    def __init__(self, layers: list[nn.Linear]) -> None:
        super().__init__()
        first = layers[0]
        self.sizes = [layer.out_features for layer in layers]
        self.linear = nn.Linear(
            first.in_features, sum(self.sizes), bias=first.bias is not None, device="meta"
        )
        weight = torch.cat([layer.weight.detach() for layer in layers])
        self.linear.weight = nn.Parameter(weight, requires_grad=False)
        if first.bias is not None:
            bias = torch.cat([layer.bias.detach() for layer in layers if layer.bias is not None])
            self.linear.bias = nn.Parameter(bias, requires_grad=False)
        # Held in a plain object: an assignment to an `nn.Module` attribute goes through
        # `Module.__setattr__`'s parameter, buffer and submodule checks, three times a sibling call,
        # 8% of an eager forward of the tests' 5-layer models (cProfile).
        self._held = _Product()

    def slice_of(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Layer `index`'s output for input `x`: from the product of `x` if one is held, else
        from a new one."""
        held = self._held
        if held.input is not x:
            held.slices = self.linear(x).split(self.sizes, dim=-1)
            held.input, held.taken = x, 0
        out = held.slices[index]
        held.taken += 1
        if held.taken == len(self.sizes):  # every sibling served: hold nothing between layers
            held.input, held.slices = None, ()
        return out


class _Product:
    """A `FusedLinear`'s last input and its product's slices, until every sibling took its own."""

    __slots__ = ("input", "slices", "taken")

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.slices: tuple[torch.Tensor, ...] = ()
        self.taken = 0


class FusedSlice(nn.Module):
    """A sibling layer's place in its module: its slice of a `FusedLinear`'s product.

    The fused module is held outside the module tree (`parts`), so that it is listed once, under
    its own name (`fused_<first sibling>`), not once per sibling.
    """

    def __init__(self, fused: FusedLinear, index: int) -> None:
        super().__init__()
        self.parts = (fused,)
        self.index = index
        self.in_features = fused.linear.in_features
        self.out_features = fused.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parts[0].slice_of(x, self.index)

    def extra_repr(self) -> str:
        return f"slice {self.index} of a fused GEMM, out_features={self.out_features}"


def fusable(layers: list[nn.Module]) -> bool:
    """Plain `nn.Linear`s (not a quantized subclass) of one input width, dtype and device, all with a
    bias or none, none with accelerate's hooks."""
    if not all(type(layer) is nn.Linear and not hasattr(layer, "_hf_hook") for layer in layers):
        return False
    first = layers[0]
    assert isinstance(first, nn.Linear)  # for mypy
    return all(
        isinstance(layer, nn.Linear)
        and layer.in_features == first.in_features
        and layer.weight.dtype == first.weight.dtype
        and layer.weight.device == first.weight.device
        and (layer.bias is None) == (first.bias is None)
        for layer in layers
    )


def fuse_projections(model: nn.Module) -> int:
    """Fuse every module's `SIBLINGS` into one GEMM each, in place (`FusedLinear`); returns how
    many groups were fused. The siblings' weights move into the fused one (no copy is kept)."""
    fused = 0
    for module in list(model.modules()):
        for names in SIBLINGS:
            layers = [getattr(module, name, None) for name in names]
            if any(layer is None for layer in layers) or not fusable(layers):  # type: ignore[arg-type]
                continue
            group = FusedLinear(layers)  # type: ignore[arg-type]
            module.add_module(f"fused_{names[0]}", group)
            for index, name in enumerate(names):
                setattr(module, name, FusedSlice(group, index))
            fused += 1
    return fused
