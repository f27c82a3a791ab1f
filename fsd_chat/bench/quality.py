"""Quality of a generated reply, relative to the target model.

- Target negative log-likelihood (nats per generated token): one forward pass of the scoring
  target over prompt + reply, `log_softmax` and `gather` at the generated tokens, under the target's
  raw distribution (temperature 1, full vocabulary). Lower is better; exact speculative decoding
  matches autoregressive decoding in distribution, so a rise measures what FSD's fuzzy acceptances
  cost.
- Greedy agreement: the share of the reply that matches the target's greedy reply before the first
  differing token (after one differing token the two continue different contexts, so later
  coincidences say nothing): common prefix length / the longer reply's length.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


@torch.inference_mode()
def target_nll(model: PreTrainedModel, vocab_size: int, prompt_ids: list[int], reply_ids: list[int]) -> float:
    """Summed negative log-likelihood (nats) of `reply_ids` after `prompt_ids` under `model`.

    Returns 0.0 for an empty reply. Divide by len(reply_ids) for the per-token mean.
    """
    if not reply_ids:
        return 0.0
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([prompt_ids + reply_ids], device=device)
    n = len(reply_ids)
    # Positions len(prompt)-1 .. end-1 predict the reply tokens: keep only those logits.
    logits = model(input_ids=ids[:, :-1], logits_to_keep=n, use_cache=False).logits[0, -n:, :vocab_size]
    log_probs = logits.float().log_softmax(-1)
    return float(-log_probs.gather(-1, ids[0, -n:, None]).sum())


def greedy_agreement(reply_ids: list[int], reference_ids: list[int]) -> float:
    """Common prefix length of the two replies / the longer one's length (1.0 when both are empty)."""
    longest = max(len(reply_ids), len(reference_ids))
    if longest == 0:
        return 1.0
    prefix = next(
        (i for i, (a, b) in enumerate(zip(reply_ids, reference_ids, strict=False)) if a != b),
        min(len(reply_ids), len(reference_ids)),
    )
    return prefix / longest
