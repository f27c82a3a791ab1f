"""llama.cpp's own decoding as bench baselines, on a `llama_cpp.Llama` of their own (its own KV cache
and prefix cache), opened on the target's GGUF file:

- `llama.cpp`: `Llama.generate`, the token loop under `create_completion` (its sampler chain:
  greedy at temperature 0, else top-k, top-p, min-p and temperature; no repetition penalty), without
  `create_completion`'s text assembly, so at least as fast as what a user of `create_completion`
  gets;
- `llama.cpp-lookup`: the same loop with llama-cpp-python's prompt lookup decoding
  (`LlamaPromptLookupDecoding(max_ngram_size=n, num_pred_tokens=k)`, n = fsd-chat's lookup n-gram),
  which evaluates the copied tokens in one batch and keeps those its sampler draws alike.

llama-cpp-python offers no speculation with a draft model (its `LlamaDraftModel` interface has only
prompt lookup; llama.cpp's draft-model speculation lives in its C++ `common` library and examples,
which the binding does not wrap), so there is no such baseline.

Both read a prompt as fsd-chat's decoders do (`fsd_chat.decoding.reply.begin`): all its tokens but
the last in one `Llama.eval` (the prefill), the last in the first step. llama.cpp's logits for a token
read alone differ slightly from those of the same token read in a batch, so a prompt read whole made
a different greedy reply at a near tie: on 8 of 8 summaries (`tinystories-summarise-chat`, the
default model, 128 new tokens) the replies parted after 7 to 97 tokens, and their lengths differed by
up to 74 tokens, so the decode clock compared different texts at different context lengths.
Read alike, the greedy replies are the same tokens, so a ratio of the two is one of speed alone; the
price is one more one-token forward before the first token, which fsd-chat pays too.

A reply ends at any of the pair's end-of-sequence ids (not emitted), at `max_new_tokens`, at a stop
string (the token completing it is emitted, as fsd-chat's decoders do) or at the deadline. Each
`Llama.eval` is one forward pass on the tally (the first the prompt's prefill).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from fsd_chat.bench.meter import ForwardMeter
from fsd_chat.bench.records import ForwardTally
from fsd_chat.decoding.settings import DEFAULT_LOOKUP_NGRAM, SamplingConfig
from fsd_chat.engines.llama_cpp import LlamaCppModel, llama_cpp_module, open_gguf, prints_to_log


def baseline_llama(target: LlamaCppModel, lookup_tokens: int | None) -> Any:
    """A `Llama` of its own over the target's file, threads (for one token and for several) and
    placement; with prompt lookup of
    up to `lookup_tokens` tokens a step when given."""
    draft = None
    if lookup_tokens is not None:
        speculative = llama_cpp_module().llama_speculative
        draft = speculative.LlamaPromptLookupDecoding(
            max_ngram_size=DEFAULT_LOOKUP_NGRAM, num_pred_tokens=lookup_tokens
        )
    return open_gguf(
        target.path,
        threads=target.threads,
        batch_threads=target.batch_threads,
        gpu=target.gpu,
        context=target.n_ctx,
        draft_model=draft,
    )


def llama_generate(
    llama: Any,
    prompt_ids: list[int],
    sampling: SamplingConfig,
    *,
    max_new_tokens: int,
    eos: frozenset[int],
    stop_strings: tuple[str, ...],
    tally: ForwardTally,
    stop: Callable[[], bool],
) -> Iterator[int]:
    """The reply llama.cpp decodes for `prompt_ids`, token by token as it decodes them (see the
    module docstring; so that its time to first token is seen); `stop` is asked after each token
    (a deadline). The tokens `llama`'s cache holds that start the prompt are kept, as
    `Llama.generate` keeps them."""
    if not sampling.greedy:
        llama.set_seed(sampling.seed or 0)
    temp = 0.0 if sampling.greedy else sampling.temperature
    emitted = 0
    text = b""
    longest = max((len(s.encode()) for s in stop_strings), default=0)
    stops = [s.encode() for s in stop_strings]
    evaluate = llama.eval

    def metered(tokens: Any) -> None:
        began = time.perf_counter()
        evaluate(tokens)
        ForwardMeter._add(tally, time.perf_counter() - began)

    llama.eval = metered
    try:
        # All but the last token read first, as fsd-chat's decoders read a prompt (module docstring):
        # `Llama.generate` then finds them cached and reads the last alone.
        head = prompt_ids[:-1]
        llama.n_tokens = llama.longest_token_prefix(llama.input_ids[: llama.n_tokens], head)
        if len(head) > llama.n_tokens:
            llama.eval(head[llama.n_tokens :])
        with prints_to_log():  # `Llama.generate`'s notes on the prefix it reuses (`open_gguf`: verbose)
            for token in llama.generate(
                prompt_ids,
                top_k=sampling.top_k or 0,
                top_p=sampling.top_p,
                min_p=sampling.min_p,
                temp=temp,
                repeat_penalty=1.0,
            ):
                if token in eos:
                    break
                yield token
                emitted += 1
                if stops:
                    text = (text + llama.detokenize([token]))[-(longest + 16) :]
                    if any(s in text for s in stops):
                        break
                if emitted >= max_new_tokens or stop():
                    break
    finally:
        del llama.eval  # the class's method again
