"""`ModelRunner`: the one seam between the decoding loop and an engine.

Everything the decoders, the proposers, `reply.begin` and the acceptance rules ask of a model goes
through these members: feed the unseen tokens of a sequence buffer and return the logits of the
positions asked for (`forward`), feed a prompt whose logits nobody reads (`prefill`), roll the KV
cache back to a position (`rollback`), keep the cached prefix a new sequence shares (`keep_prefix`),
start afresh (`reset`), and say its vocabulary, context window and end-of-sequence ids. It is as
narrow as a vLLM model runner's `execute_model` (tokens at positions in, logits of the sampled
positions out; the cache managed behind it); sampling, acceptance, costs, the draft policy and
prompt lookup stay the decoding loop's, the same code for every engine.

The seam sits here, in the decoding package, which imports no engine (an import-linter contract);
the engines live in `fsd_chat.engines`, above it:
- transformers / torch: `fsd_chat.engines.torch_engine.kv_cache.CachedModel` and its static and
  compiled kinds, bound for a decoder by `fsd_chat.engines.torch_engine.binding`; its whole step
  (`fsd_chat.engines.torch_engine.step_graph`, CUDA graphs on CUDA) is handed to the decoders as
  a `fsd_chat.decoding.whole_step.WholeStep`;
- llama.cpp: `fsd_chat.engines.llama_cpp.LlamaCppModel`, over llama-cpp-python's context, batch
  and logits buffer.

A decoder takes `ModelRunner`s only, bound to their caches by their engine.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ModelRunner(Protocol):
    """A causal LM bound to the KV cache of the one sequence it has seen.

    Invariant: the cache holds the first `seen` tokens of the last sequence buffer fed.

    Attributes:
        vocab_size: Logits are returned over ids [0, vocab_size).
        device: Where the sequence buffer and the returned logits live.
        seen: Tokens the KV cache holds.
        context: The context window in tokens (None: not known).
        eos_token_ids: Ids that end a reply, by the model's own configuration (the tokenizer's EOS
            is added by the decoder).
        compile_error: Why a model asked to run compiled runs eagerly (None: it does not, or nothing
            was asked).
    """

    vocab_size: int
    device: torch.device
    seen: int
    compile_error: str | None

    @property
    def context(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def forward(self, seq: torch.Tensor, upto: int, keep: int) -> torch.Tensor:
        """Feed seq[0, seen:upto] (upto > seen) and return the logits of the last `keep` fed
        positions, shape [keep, vocab_size] float32 on `device`. The tensor may be a view of the
        engine's own buffer, valid until the next call of any method: read it before then.

        Raises:
            UnsupportedCacheError: the model does not keep its state where it can be rolled back.
            ContextLengthError: upto exceeds what the engine's KV cache holds.
        """
        ...

    def prefill(self, seq: torch.Tensor, upto: int) -> None:
        """Feed seq[0, seen:upto], prompt tokens whose logits nobody reads."""
        ...

    def rollback(self, length: int) -> None:
        """Drop cached tokens beyond `length` (no-op when the cache holds fewer)."""
        ...

    def keep_prefix(self, seq: torch.Tensor, length: int) -> int:
        """Start the sequence seq[0, :length], keeping the cached tokens it begins with; returns
        the tokens kept (the new `seen`)."""
        ...

    def reset(self) -> None:
        """Start a new sequence with an empty cache."""
        ...


def id_set(value: object) -> frozenset[int]:
    """Token ids as a config writes them (an int, a list or tuple of ints, or None) as a set."""
    if isinstance(value, int):
        return frozenset((value,))
    if isinstance(value, list | tuple):
        return frozenset(v for v in value if isinstance(v, int))
    return frozenset()
