"""Linear layers whose weights are prepacked for oneDNN: how a float32 model decodes on a CPU.

torch's CPU `linear` multiplies through MKL, which repacks the weight matrix on every call of two
or more rows and, on the AMD EPYC this project runs on, reads it at about 14 GB/s.
oneDNN's inner product over a weight reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, the prepacking torch's inductor applies when it
freezes a CPU model) skips both. Measured on SmolLM2-135M in float32, one thread, through
`CachedModel` (best of 4, 64 tokens of context; `scripts/bench_packed_linear.py` measures it from
the chat's decoders):

| forward over | 1 token | 2 | 3 | 4 | 6 |
|---|---|---|---|---|---|
| MKL (`nn.Linear`) | 38.8 ms | 60.4 | 77.7 | 57.8 | 66.4 |
| oneDNN, packed for 2 rows | 23.3 ms | 25.2 | 26.2 | 26.5 | 29.1 |

So the target alone decodes about 1.6× faster, and a verify of k + 1 tokens costs little more than
a 1-token forward: prompt lookup pays at a far lower acceptance.

A oneDNN call has a fixed cost of about 9 µs against MKL's 2 µs, so a small layer stays as it is:
only weights of at least `PACK_MIN_WEIGHTS` are packed (the story pair, 64 wide, keeps `nn.Linear`
everywhere; packed it decoded 1.5× slower). `torch.compile`'s inductor cannot lower a packed
weight (it packs its own when it freezes a model), so a model about to be compiled is unpacked
first (`unpack_linear_layers`): the reorder is exact both ways.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

PACK_MIN_WEIGHTS = 100_000
"""The fewest weights (out × in) a linear layer needs to be packed: per call, oneDNN's fixed cost
(about 9 µs, one thread) against MKL's (about 2 µs) is repaid from about 192 × 576 (110,592
weights: 21.5 µs MKL, 20.0 µs oneDNN at one row; 27.4 and 21.1 µs at two); at 192 × 192 oneDNN is
2.7× slower."""

PACK_ROWS = 2
"""The rows (tokens) oneDNN's layout is chosen for: packed for 2, SmolLM2-135M's forwards over 1 and
6 tokens took 23.3 and 29.1 ms; packed for 1 (its matrix-vector layout), 30.0 and 44.7 ms; for 4,
23.7 and 29.9 ms."""


def can_pack() -> bool:
    """Whether this torch build has oneDNN and its prepacked linear operators."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """`nn.Linear`'s product over a weight prepacked for oneDNN (`PACK_ROWS`); float32, CPU.

    Args:
        linear: The layer to replace. Its weight is kept only where another module shares it (an
            output head tied to the input embeddings): there the embedding keeps the table and
            this layer a packed copy.

    Input [..., in_features] float32 → output [..., out_features].
    """

    packed: torch.Tensor

    def __init__(self, linear: nn.Linear, *, tied: bool) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer(
            "packed", torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS), persistent=False
        )
        self.bias = linear.bias
        self.tied = linear.weight if tied else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def unpacked(self) -> nn.Linear:
        """The `nn.Linear` this layer replaced, with the same weight (a tied one is the shared
        parameter itself)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = (
            self.tied if self.tied is not None else nn.Parameter(self.packed.to_dense(), requires_grad=False)
        )
        linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def packable(linear: nn.Linear) -> bool:
    """A plain float32 CPU `nn.Linear` (not a quantized subclass) of at least PACK_MIN_WEIGHTS."""
    return (
        type(linear) is nn.Linear
        and linear.weight.device.type == "cpu"
        and linear.weight.dtype == torch.float32
        and linear.weight.numel() >= PACK_MIN_WEIGHTS
    )


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every `packable` linear layer of `model` by a `PackedLinear`, in place; returns how
    many were (0 without oneDNN: `can_pack`)."""
    if not can_pack():
        return 0
    # A weight listed under two names is shared (an output head tied to the input embeddings).
    owners = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return _replace_layers(
        model,
        lambda child: (
            PackedLinear(child, tied=owners[id(child.weight)] > 1)
            if isinstance(child, nn.Linear) and packable(child)
            else None
        ),
    )


def unpack_linear_layers(model: nn.Module) -> int:
    """Put back the `nn.Linear` of every `PackedLinear` in `model`, in place (exact: the reorder
    loses nothing); returns how many."""
    return _replace_layers(model, lambda child: child.unpacked() if isinstance(child, PackedLinear) else None)


def _replace_layers(model: nn.Module, replacement: Callable[[nn.Module], nn.Module | None]) -> int:
    """Put `replacement(child)` in place of each submodule it gives one for; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = replacement(child)
            if new is not None:
                setattr(parent, name, new)
                replaced += 1
    return replaced


def packed_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s packed weights (buffers, which `parameters()` does not list)."""
    return sum(m.packed.numel() * 4 for m in model.modules() if isinstance(m, PackedLinear))
