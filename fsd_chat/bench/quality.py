"""The quality score that needs the target model: a reply's target negative log-likelihood.

One forward pass of the scoring target over prompt + reply, `log_softmax` and `gather` at the
generated tokens, under the target's raw distribution (temperature 1, full vocabulary). Lower is
better; exact speculative decoding matches autoregressive decoding in distribution, so a rise
measures what FSD's fuzzy acceptances cost. Scores computed from token ids alone (greedy
agreement) are in `metrics`.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from fsd_chat.decoding.kv_cache import input_device


@torch.inference_mode()
def target_nll(model: PreTrainedModel, vocab_size: int, prompt_ids: list[int], reply_ids: list[int]) -> float:
    """Summed negative log-likelihood (nats) of `reply_ids` after `prompt_ids` under `model`.

    Returns 0.0 for an empty reply. Divide by len(reply_ids) for the per-token mean.
    """
    if not reply_ids:
        return 0.0
    ids = torch.tensor([prompt_ids + reply_ids], device=input_device(model))
    n = len(reply_ids)
    # Positions len(prompt)-1 .. end-1 predict the reply tokens: keep only those logits.
    logits = model(input_ids=ids[:, :-1], logits_to_keep=n, use_cache=False).logits[0, -n:, :vocab_size]
    log_probs = logits.float().log_softmax(-1)
    return float(-log_probs.gather(-1, ids[0, -n:, None]).sum())
