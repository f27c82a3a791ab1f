"""Logits -> next-token probabilities, and token draws from them.

Both models' logits go through the same processing (temperature, then top-k, then top-p), as
speculative sampling requires (Leviathan et al. 2023, §2.3: p and q must be the distributions the
tokens are actually drawn from).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsd_chat.errors import SettingsError


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """How tokens are drawn.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_k: Keep the k most likely tokens (0 = all).
        top_p: Keep the smallest set of tokens whose probability reaches top_p (1.0 = all).
        seed: Seed of the generator used for draws and acceptance tests (None = random).

    Raises:
        SettingsError: on a negative temperature or top-k, or top-p outside (0, 1].
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise SettingsError(f"temperature must be ≥ 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise SettingsError(f"top-k must be ≥ 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SettingsError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax."""
        return self.temperature == 0.0

    def generator(self, device: torch.device | str) -> torch.Generator:
        """A torch generator on `device`, seeded from `seed` (or from torch's RNG when None)."""
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def probabilities(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Next-token probabilities from logits, [..., vocab] -> [..., vocab] float32.

    Greedy decoding uses temperature 1 here: the divergence test of FSD compares the models' own
    distributions, while the token choice itself is an argmax (see `draw`).
    """
    logits = logits.float()
    if not config.greedy:
        logits = logits / config.temperature
    if config.top_k and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p; the top token always stays.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= config.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def draw(probs: torch.Tensor, config: SamplingConfig, generator: torch.Generator) -> torch.Tensor:
    """One token per row: argmax when greedy, else a draw. [..., vocab] -> [...] int64."""
    if config.greedy:
        return probs.argmax(-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
