"""Logits -> next-token probabilities, and token draws from them.

Both models' logits go through the same processing (temperature, then top-k, top-p and min-p, in
the order of transformers' `GenerationMixin._get_logits_processor`), as speculative sampling
requires (Leviathan et al. 2023, §2.3: p and q must be the distributions the tokens are actually
drawn from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from fsd_chat.decoding.settings import SamplingConfig
from fsd_chat.support.errors import NonFiniteError


def seeded_generator(config: SamplingConfig, device: torch.device | str) -> torch.Generator:
    """A torch generator on `device`, seeded from `config.seed` (or from torch's RNG when None)."""
    gen = torch.Generator(device=device)
    if config.seed is None:
        gen.seed()
    else:
        gen.manual_seed(config.seed)
    return gen


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """A `SamplingConfig`'s values as 0-dim device tensors, the inputs of a captured step
    (`fsd_chat.engines.torch_engine.step_graph`): new values are written into them between
    replays, so a new reply's settings never capture again. `probabilities` applies every
    truncation to them, each one a no-op at its neutral value (top_k 0, top_p 1, min_p 0).

    Attributes:
        temperature: float32, > 0 (1 for greedy decoding, whose laws are taken at temperature 1).
        top_k: int64, 0 for none.
        top_p: float32, in (0, 1].
        min_p: float32, in [0, 1).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor

    @classmethod
    def allocate(cls, device: torch.device) -> SamplingTensors:
        """Buffers on `device` holding the neutral values (untruncated, temperature 1)."""
        ones = torch.ones((), device=device)
        return cls(
            ones.clone(), torch.zeros((), dtype=torch.long, device=device), ones.clone(), ones.new_zeros(())
        )

    def write(self, config: SamplingConfig) -> None:
        """Put `config`'s values in the buffers, in place (their addresses are captured)."""
        self.temperature.fill_(1.0 if config.greedy else config.temperature)
        self.top_k.fill_(config.top_k or 0)
        self.top_p.fill_(config.top_p)
        self.min_p.fill_(config.min_p)

    def untruncated(self) -> SamplingTensors:
        """The same temperature, no truncation: the laws the divergences compare (`acceptance`)."""
        return replace(
            self,
            top_k=torch.zeros_like(self.top_k),
            top_p=torch.ones_like(self.top_p),
            min_p=torch.zeros_like(self.min_p),
        )


def probabilities(logits: torch.Tensor, config: SamplingConfig | SamplingTensors) -> torch.Tensor:
    """Next-token probabilities from logits, [..., vocab] -> [..., vocab] float32.

    Greedy decoding uses temperature 1 here: the divergence test of FSD compares the models' own
    distributions, while the token choice itself is an argmax (see `draw`).

    A `SamplingConfig` applies the truncations it asks for; `SamplingTensors` (a captured step's
    inputs) applies all three with the same formulas, each a no-op at its neutral value, so that
    nothing depends on a value the host would have to read.
    """
    logits = logits.float()
    if isinstance(config, SamplingTensors):
        logits = logits / config.temperature
        vocab = logits.shape[-1]
        # top-k by rank, so that k can be a device value: the k-th largest logit is the floor.
        ranks = torch.where(config.top_k > 0, config.top_k, vocab).clamp(1, vocab) - 1
        sorted_logits = torch.sort(logits, dim=-1, descending=True).values
        kth = sorted_logits.gather(-1, ranks.expand(*logits.shape[:-1], 1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
        logits = _top_p(logits, config.top_p, enabled=config.top_p < 1.0)
        # log(0) = -inf: min_p 0 drops nothing.
        return _min_p(logits, config.min_p.log()).softmax(-1)
    if not config.greedy:
        logits = logits / config.temperature
    if config.top_k and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        logits = _top_p(logits, config.top_p)
    if config.min_p > 0.0:
        logits = _min_p(logits, math.log(config.min_p))
    return logits.softmax(-1)


TOP_P_CANDIDATES = 256
"""`_top_p` on the CPU: the most likely tokens it looks at first (`torch.topk`); a row whose
candidates hold less than top_p of the mass is sorted whole. SmolLM2's 49,152 entries, one thread:
a row's top-256 takes 0.2 ms, its sort 6.5 ms."""
TOP_P_SORT_BELOW = 8 * TOP_P_CANDIDATES
"""`_top_p` sorts a vocabulary this small whole (as cheap as its candidates)."""


def _top_p(
    logits: torch.Tensor, top_p: float | torch.Tensor, enabled: bool | torch.Tensor = True
) -> torch.Tensor:
    """Drop a token when the tokens ranked above it already reach top_p; the top token always
    stays. `enabled` False (a device flag in a captured step) drops nothing: at top_p = 1 the
    cumulative sums' rounding could still reach 1 before the last tokens.

    On the CPU, over a large vocabulary, the rows are ranked by `torch.topk` of
    `TOP_P_CANDIDATES` + 1 tokens, and only a row whose candidates leave the next token kept is
    sorted whole (`_kept_among_candidates`): the same kept set as the full sort, from the same
    probabilities and cumulative sums. That takes one read on the host, which on the CPU waits for
    nothing; elsewhere (a GPU sorts fast, and a read would wait for its queue) and for a device
    top_p every row is sorted."""
    probs = logits.softmax(-1)
    if isinstance(top_p, float) and logits.device.type == "cpu" and logits.shape[-1] > TOP_P_SORT_BELOW:
        keep = _kept_among_candidates(probs, top_p)
    else:
        keep = ~(_dropped_sorted(probs, top_p) & enabled)
    return logits.masked_fill(~keep, float("-inf"))


def _dropped_sorted(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Which tokens top-p drops, [..., vocab] bool: the whole row sorted. A token is dropped when
    the probabilities ranked above it sum to top_p or more (the exclusive cumulative sum)."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    return drop_sorted.scatter(-1, order, drop_sorted)


def _kept_among_candidates(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens top-p keeps, [..., vocab] bool, from each row's TOP_P_CANDIDATES + 1 most likely
    tokens (`torch.topk`, in the order `torch.sort` gives them), the rows where the last of those is
    kept sorted whole (`_dropped_sorted`).

    Exact: the candidates' exclusive cumulative sums are the full sort's first ones (the same
    probabilities summed in the same order), and they do not decrease along the ranking (for r > n,
    fl(S_r) ≥ fl(S_n) and p_r ≤ p_n, so fl(fl(S_r) − p_r) ≥ fl(fl(S_n) − p_n)): once a rank is
    dropped every later one is. Tied probabilities at the cut may be ranked in another order by
    topk than by sort, as by two sorts."""
    top, ids = probs.topk(TOP_P_CANDIDATES + 1, dim=-1)
    dropped = (top.cumsum(-1) - top) >= top_p
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, ids, ~dropped)
    # A row whose last candidate is kept may keep more: sorted whole (the one host read).
    longer = (~dropped[..., -1]).reshape(-1).nonzero().flatten()
    if longer.numel():
        rows = probs.reshape(-1, probs.shape[-1])
        keep.view(-1, probs.shape[-1])[longer] = ~_dropped_sorted(rows[longer], top_p)
    return keep


def _min_p(logits: torch.Tensor, log_min_p: float | torch.Tensor) -> torch.Tensor:
    """min-p (Nguyen et al. 2024; transformers' MinPLogitsWarper): drop tokens less likely than
    min_p times the most likely one. Log space: the ratio of probabilities is a logit difference."""
    floor = logits.max(-1, keepdim=True).values + log_min_p
    return logits.masked_fill(logits < floor, float("-inf"))


def draw(
    probs: torch.Tensor,
    config: SamplingConfig,
    generator: torch.Generator | None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row: argmax when greedy, else a draw. [..., vocab] -> [...] int64.

    The draw is an exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) independent, which picks
    i with probability p_i (the first of independent exponential clocks of rates p_i to ring; the
    Gumbel-max trick in another form). gpt-fast samples this way (`multinomial_sample_one_no_sync`)
    because, unlike `torch.multinomial`, it checks nothing on the device: a row of NaNs gives some
    index instead of a device-side assert that leaves the CUDA context unusable (the decoders
    detect such rows with `non_finite` and end the reply). The noise is clamped away from 0, so a
    token with p_i = 0 never wins (0 / 0 would be NaN, which argmax picks).

    `noise`: the E_i, shape of `probs` (`exponential_noise`), drawn beforehand by a caller that
    runs this inside a compiled function, where a generator cannot go; default drawn here.
    """
    if config.greedy:
        return argmax(probs)
    if noise is None:
        noise = exponential_noise(probs, generator)
    return argmax(probs / noise)


READ_CPU_ON_HOST = True
"""Whether `argmax` and `greedy_on_host` read float32 tensors on the CPU with numpy, where a read
waits for no queue: numpy's argmax is vectorised and torch's CPU argmax is not (a row of SmolLM2's
49,152 entries, one thread: 6 µs against 80). False: every device's path, which reads nothing but
a step's one transfer (what `tests/test_host_syncs.py` checks on the CPU for a GPU's sake)."""


def _on_host(values: torch.Tensor) -> bool:
    """Whether `values` is read with numpy (`READ_CPU_ON_HOST`): float32 on the CPU, no gradient,
    outside a compiled function (which traces torch's operators)."""
    return (
        READ_CPU_ON_HOST
        and values.is_cpu
        and values.dtype == torch.float32
        and not values.requires_grad
        and not torch.compiler.is_compiling()
    )


def argmax(values: torch.Tensor) -> torch.Tensor:
    """`values.argmax(-1)`, [..., n] -> [...] int64 on `values`' device: each row's first largest
    entry (its first NaN, in a row that has one). On the CPU numpy's, the same index
    (`READ_CPU_ON_HOST`)."""
    if _on_host(values):
        return torch.from_numpy(np.asarray(values.numpy().argmax(-1)))
    return values.argmax(-1)


GREEDY_MARGIN = 2.0**-10
"""`greedy_on_host`: logits within this much of the largest (or within 2^-12 of its magnitude, if
more) make a near tie, which the shortcut leaves to `probabilities` and `draw`."""


def greedy_on_host(logits: torch.Tensor) -> int | None:
    """The greedy token of one row of logits, [vocab], read from the logits with numpy where a
    read costs nothing (float32 on the CPU: `READ_CPU_ON_HOST`), without their law:
    `draw(probabilities(logits), greedy)` gives the same token, for a fraction of its time. None
    where that is not sure, for the caller to take the law's way: another device, a row that is
    not finite (NaN, +inf, or all -inf: the rows whose law is NaN, `non_finite`), or a near tie.

    Why the same token: both argmaxes return the first largest entry, and the softmax keeps the
    order of logits that differ by more than GREEDY_MARGIN. Its largest entry is exp(0) / s and a
    logit at least d below gives at most exp(-d) / s: for d ≥ 2^-11 the two exps are thousands of
    float32 ulps apart, more than the exp's error (1 ulp) and than rounding the division by the
    same s can close. Logits closer than the margin (ties included) are counted and refused.
    """
    if not _on_host(logits):
        return None
    row = logits.numpy()
    token = int(row.argmax())
    top = float(row[token])
    if not math.isfinite(top):
        return None
    # Compared in float32: the margin is twice what the argument above needs, so that the rounding
    # of the floor (at most half an ulp of `top`, which the relative part bounds) cannot matter.
    floor = top - max(GREEDY_MARGIN, abs(top) * 2.0**-12)
    return token if np.count_nonzero(row >= floor) == 1 else None


def exponential_noise(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Independent Exp(1) draws clamped away from 0, shape and device of `probs`: `draw`'s race."""
    return torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)


def non_finite(law: torch.Tensor) -> torch.Tensor:
    """Whether each row of a law ([..., vocab] probabilities) holds a NaN, shape [...] bool, on its
    device (no host read).

    Logits with +inf or NaN (a float16 overflow) give NaN rows after the softmax, as does a row
    whose logits are all -inf; the decoders read this flag with the step's single transfer. A row
    holds a NaN exactly when its sum is NaN (probabilities are finite otherwise): one pass.
    """
    return law.sum(-1).isnan()


def non_finite_error(model: str) -> NonFiniteError:
    """The one line that ends a reply whose `model` ("target" or "draft") gave a non-finite law."""
    return NonFiniteError(
        f"the {model} model's logits are not finite (NaN or inf), most likely a float16 overflow: "
        "load it with --dtype bfloat16 (or float32); the reply ends here"
    )
