"""The quality score that needs the target model: a reply's target negative log-likelihood.

One forward pass of the scoring target over prompt + reply, `log_softmax` and `gather` at the
generated tokens, under the target's raw distribution (temperature 1, full vocabulary). Lower is
better; exact speculative decoding matches autoregressive decoding in distribution, so a rise
measures what FSD's fuzzy acceptances cost. Scores computed from token ids alone (greedy
agreement) are in `metrics`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fsd_chat.decoding.runner import ModelRunner
from fsd_chat.engines.torch_engine.kv_cache import input_device

if TYPE_CHECKING:  # the modeling stack (torch._dynamo with it): imported by the torch engine alone
    from transformers import PreTrainedModel


def reply_logits(
    model: PreTrainedModel | ModelRunner, vocab_size: int, prompt_ids: list[int], reply_ids: list[int]
) -> torch.Tensor:
    """The logits that predicted each reply token, teacher-forced over prompt + reply, shape
    [len(reply_ids), vocab_size] float32: one forward pass of a transformers model (no cache), or
    a runner's passes over its KV cache (llama.cpp's: the prompt's cached prefix kept, the reply fed
    in chunks of at most `fsd_chat.engines.llama_cpp.BATCH` positions' logits).

    Args:
        reply_ids: Non-empty.
    """
    n = len(reply_ids)
    if not isinstance(model, ModelRunner):
        ids = torch.tensor([prompt_ids + reply_ids], device=input_device(model))
        # Positions len(prompt)-1 .. end-1 predict the reply tokens: keep only those logits.
        out = model(input_ids=ids[:, :-1], logits_to_keep=n, use_cache=False).logits[0, -n:, :vocab_size]
        return out.float()
    ids = torch.tensor([prompt_ids + reply_ids], device=model.device)
    end = ids.shape[1] - 1
    model.keep_prefix(ids, len(prompt_ids) - 1)
    if model.seen < len(prompt_ids) - 1:
        model.prefill(ids, len(prompt_ids) - 1)
    rows = []
    for upto in range(len(prompt_ids) - 1 + SCORE_CHUNK, end + SCORE_CHUNK, SCORE_CHUNK):
        width = min(upto, end) - model.seen
        rows.append(model.forward(ids, model.seen + width, keep=width)[:, :vocab_size].clone())
    return torch.cat(rows)


SCORE_CHUNK = 256
"""Positions whose logits a runner's scoring pass returns at once (`reply_logits`)."""


@torch.inference_mode()
def target_nll(
    model: PreTrainedModel | ModelRunner, vocab_size: int, prompt_ids: list[int], reply_ids: list[int]
) -> float:
    """Summed negative log-likelihood (nats) of `reply_ids` after `prompt_ids` under `model`.

    Returns 0.0 for an empty reply. Divide by len(reply_ids) for the per-token mean.
    """
    if not reply_ids:
        return 0.0
    log_probs = reply_logits(model, vocab_size, prompt_ids, reply_ids).log_softmax(-1)
    chosen = torch.tensor(reply_ids, device=log_probs.device)[:, None]
    return float(-log_probs.gather(-1, chosen).sum())
