"""A causal LM bound to its KV cache: feed only unseen tokens, roll back to an accepted prefix, and
keep what a new sequence shares with the last one (prefix reuse: a chat's next prompt starts with
its previous one).

Uses transformers' `DynamicCache`. Rollback is `DynamicCache.crop(-n)` (drop the last n tokens). A
model is admitted only when transformers says its cache can be cropped without a trace
(`Cache.is_croppable`, which transformers' own assisted generation asks): recurrent state (Mamba,
the hybrid layers of Falcon-H1 or Qwen3-Next) is refused, KV-sharing layers (Gemma 3n, Gemma 4)
are admitted. Some layers know only once they hold state, so it is asked after a one-token probe.
Sliding-window layers (Gemma 2/3, gpt-oss, Mistral-style models) get a plain `DynamicLayer` that keeps
every token's keys and values, not transformers' `DynamicSlidingWindowLayer`, which trims itself to
the window and so cannot go back to an older prefix (its `activate_past_recording` only keeps the
past until the next crop). The window is still applied: transformers' masking
(`masking_utils.create_sliding_window_causal_mask`) builds the sliding mask from
`config.sliding_window` whatever the cache layer, over the full length a `DynamicLayer` reports, so
the attention reads the same keys as with a trimmed cache. Rollback and prefix reuse are then the
full-attention ones, exact at any length, at the memory of a full cache for those layers.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from fsd_chat.decoding.acceptance import compile_failure
from fsd_chat.decoding.runner import ModelRunner, id_set
from fsd_chat.decoding.settings import MAX_DRAFT_TOKENS
from fsd_chat.engines.torch_engine.packed_linear import unpack_linear_layers
from fsd_chat.support.errors import UnsupportedCacheError

if TYPE_CHECKING:  # the modeling stack (torch._dynamo with it): imported by the torch engine alone
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache

    from fsd_chat.engines.torch_engine.positioned_cache import PositionedCache

DRAFT_WIDTHS = (1, 2)
"""The forward passes a compiled draft runs compiled, in tokens: one per draft step, two for a
catch-up after a fully accepted block (`CompiledModel`)."""
VERIFY_WIDTHS = (1, 2, 4, 8, 16, MAX_DRAFT_TOKENS + 1)
"""The widths a compiled target's forward passes are padded to, in tokens: 1 for a target-only
step, k + 1 for a verify (`CompiledModel`)."""
COMPILED_CONTEXT = 8192
"""Most tokens a compiled model's static KV cache holds besides the padding (it is allocated whole,
up front); a decoder's context is capped to it."""
RECOMPILE_LIMIT = 64
"""torch.compile's graphs per forward function (`torch._dynamo.config.recompile_limit`, 8 by
default): a target and a draft of one class share `forward`'s code, each with a graph a width."""


def context_length(model: PreTrainedModel | ModelRunner) -> int | None:
    """The model's context window in tokens (None when its config does not say); a runner of
    another engine says its own."""
    if isinstance(model, ModelRunner):
        return model.context
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def input_device(model: PreTrainedModel) -> torch.device:
    """Where `model`'s input ids go: the device of its input embeddings (with `device_map="auto"`
    its other layers may sit on other devices)."""
    weight = model.get_input_embeddings().weight
    assert isinstance(weight, torch.Tensor)  # typed as a Module attribute, which may be a Module
    return weight.device


class CachedModel:
    """One model and the KV cache of the sequence it has seen.

    Invariant: the cache holds the first `seen` tokens of the last sequence buffer fed (`fed`).

    Args:
        model: A causal LM (transformers `PreTrainedModel`).
        vocab_size: Logits beyond this index are dropped (a padded lm_head is larger than the
            tokenizer's vocabulary).

    Raises:
        UnsupportedCacheError: the model's cache cannot be rolled back (`Cache.is_croppable` is
            false after a one-token forward pass: recurrent / linear-attention state, as in Mamba
            or Falcon-H1), or the model keeps its state elsewhere than in the cache it is given.
    """

    compile_error: str | None = None
    """Why compiled forward passes fell back to eager ones (only `CompiledModel` compiles)."""

    def __init__(self, model: PreTrainedModel, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.device = input_device(model)
        self.cache: Cache = self._new_cache()
        self.seen = 0
        self.fed: torch.Tensor | None = None
        """The buffer of the last forward pass (shape [1, capacity]): the cache holds its first `seen` tokens."""
        self._check_rollback()

    @property
    def context(self) -> int | None:
        """See `ModelRunner.context`: the model config's."""
        return context_length(self.model)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """See `ModelRunner.eos_token_ids`: the model's generation config's."""
        return id_set(getattr(self.model.generation_config, "eos_token_id", None))

    def _new_cache(self) -> Cache:
        from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

        cache = DynamicCache(config=self.model.config)
        # Whole KV for sliding-window (and chunked) layers: the mask applies the window (module docstring).
        cache.layers = [
            DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers
        ]
        return cache

    def reset(self) -> None:
        """Start a new sequence with an empty cache."""
        self.cache = self._new_cache()
        self.seen = 0

    def _prefix_reusable(self) -> bool:
        # A layer that trims what it holds cannot go back to an arbitrary earlier prefix. Exactly
        # DynamicLayer: the trimming layers subclass it.
        from transformers.cache_utils import DynamicLayer

        return all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def keep_prefix(self, seq: torch.Tensor, length: int) -> int:
        """Start the sequence `seq[0, :length]`, keeping the cached tokens it begins with: the cache
        is rolled back to the longest common prefix of the cached sequence and the new one (emptied
        when the model's layers cannot be rolled back that far).

        Args:
            seq: The new token buffer, shape [1, capacity] int64 on the model's device.
            length: Its tokens to compare (those the caller will feed).

        Returns:
            The tokens kept (the new `seen`).
        """
        common = 0
        if self.fed is not None and self.seen and self._prefix_reusable():
            n = min(self.seen, length)
            differ = torch.nonzero(self.fed[0, :n] != seq[0, :n])
            common = int(differ[0, 0]) if len(differ) else n
        if common == 0:
            self.reset()
        else:
            self.rollback(common)
        return self.seen

    @torch.inference_mode()
    def forward(self, seq: torch.Tensor, upto: int, keep: int) -> torch.Tensor:
        """Feed seq[0, seen:upto] and return the logits of the last `keep` fed positions.

        Args:
            seq: Token buffer, shape [1, capacity] int64 on the model's device.
            upto: Feed the tokens before this index (upto > seen).
            keep: Number of trailing positions whose logits are returned.

        Returns:
            Logits, shape [keep, vocab_size], float32.

        Raises:
            UnsupportedCacheError: the model does not keep its state in the cache it is given.
        """
        out = self.model(
            input_ids=seq[:, self.seen : upto],
            cache=self.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        if getattr(out, "cache", None) is not self.cache:
            raise UnsupportedCacheError(
                f"{type(self.model).__name__} does not use a transformers DynamicCache, "
                "which speculative decoding needs to roll back rejected tokens"
            )
        self.seen = upto
        self.fed = seq
        return out.logits[0, -keep:, : self.vocab_size].float()

    def prefill(self, seq: torch.Tensor, upto: int) -> None:
        """Feed seq[0, seen:upto], prompt tokens whose logits nobody reads (`reply.read_prompt`, a
        mapped draft's spelling of the prompt): a forward pass like `forward`'s, which
        `CompiledModel` runs eagerly."""
        self.forward(seq, upto, keep=1)

    def rollback(self, length: int) -> None:
        """Drop cached tokens beyond `length` (no-op when the cache holds fewer)."""
        drop = self.seen - length
        if drop > 0:
            self.cache.crop(-drop)
            self.seen = length

    @torch.inference_mode()
    def _check_rollback(self) -> None:
        cache = self._new_cache()
        probe = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        out = self.model(input_ids=probe, cache=cache, use_cache=True, logits_to_keep=1)
        if getattr(out, "cache", None) is not cache or not cache.is_croppable:
            kinds = sorted({type(layer).__name__ for layer in cache.layers})
            raise UnsupportedCacheError(
                f"{type(self.model).__name__} keeps state ({', '.join(kinds)}) that cannot be "
                "rolled back to an accepted prefix; speculative decoding needs a KV cache that can"
            )


class StaticModel(CachedModel):
    """A model over a static KV cache written at given positions (`PositionedCache`), every
    forward pass eager.

    The cache keeps tensor shapes and addresses fixed: a pass writes its keys and values at its
    positions, so rolling back is only `seen` going back, and the slots beyond the sequence are
    masked out (`attention_mask`) until they are overwritten. A forward pass attends over the
    whole capacity, so a capacity far beyond what a reply needs costs attention time on a CPU:
    `resize` fits it between replies. Its forward passes are what `CompiledModel` compiles, and
    what `fsd_chat.engines.torch_engine.step_graph` runs as one function a step (captured as a graph on
    CUDA), its positions given on the device (`run`).

    Args:
        model: A causal LM that `compile_refusal` admits (full-attention layers only).
        vocab_size: See `CachedModel`.
        capacity: Tokens the static cache holds (the decoder's context is capped to it).

    Raises:
        UnsupportedCacheError: the model has sliding-window or recurrent layers.
    """

    cache: PositionedCache
    flag = "--whole-step"
    """The option that asks for this model (its errors name it)."""

    def __init__(self, model: PreTrainedModel, vocab_size: int, capacity: int) -> None:
        # Deferred with the modeling stack (`AttentionInterface`), which only the torch engine imports.
        from fsd_chat.engines.torch_engine.static_attention import use

        use(model)
        # Read once: `PreTrainedModel.dtype` walks the parameters (~60 µs, at every mask).
        self.dtype = model.dtype
        self.capacity = capacity
        super().__init__(model, vocab_size)

    def reset(self) -> None:
        """Start a new sequence (the cache is reused: the next pass writes from slot 0)."""
        self.seen = 0

    def resize(self, capacity: int) -> None:
        """Hold `capacity` tokens from now on: a new cache, empty (what the old one held is
        dropped, `fed` too). Never while graphs captured the old cache's addresses."""
        if capacity != self.capacity:
            self.capacity = capacity
            self.cache = self._new_cache()
            self.seen = 0
            self.fed = None
            self._check_rollback()

    @torch.inference_mode()
    def clear(self) -> None:
        """Empty the cache and zero every slot, in place. After non-finite logits: a NaN key or
        value left in a slot beyond the sequence is masked out of the attention, but its weight
        0 times NaN is still NaN, so the next sequence would read it."""
        for layer in self.layers:
            if layer.keys is not None and layer.values is not None:
                layer.keys.zero_()
                layer.values.zero_()
        self.seen = 0
        self.fed = None

    def _new_cache(self) -> PositionedCache:
        from fsd_chat.engines.torch_engine.positioned_cache import PositionedCache

        cache = PositionedCache(self.model.config, self.capacity)
        # The slots' indices, which `attention_mask` compares with the positions of a pass.
        self._slots = torch.arange(self.capacity, device=self.device)
        # An unmasked pass's mask (`attending`), all zeros: a view of it costs one operator, not
        # the comparison's five (~35 µs a pass on the CPU).
        self._open = torch.zeros((1, 1, 1, self.capacity), dtype=self.dtype, device=self.device)
        return cache

    def attention_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """The causal mask of queries at `positions` ([w] int64) over the cache (its first
        `window` slots when `attending` set one), additive: [1, 1, w, capacity or window] in the
        model's dtype, 0 where a query attends (slots up to its position), the dtype's lowest
        value elsewhere.

        Given to the model as a 4D mask, which transformers uses as it is: its own mask builder
        asks whether the first position is 0 (`masking_utils._ignore_causal_mask_sdpa` reads
        `q_offset == 0` unless torch.compile traces it), a host read that a CUDA graph's capture
        refuses. Additive rather than boolean: SDPA would turn a boolean mask into this one in
        every layer's call (`convert_boolean_attn_mask`, a kernel a layer on a GPU), so it is
        built once a pass, or once a step for all its passes (`step_graph`), in 2 operators.
        """
        dtype = self.dtype
        window = self.cache.window
        if self.cache.unmasked:  # one query at the window's last slot: it attends to every slot
            return self._open[..., :window]
        slots = self._slots if window is None else self._slots[:window]
        allowed = slots <= positions.unsqueeze(-1)
        return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype).view(1, 1, *allowed.shape)

    def run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
        keep: int = 0,
        forward: Callable[..., Any] | None = None,
    ) -> torch.Tensor:
        """One forward pass over `ids` at device `positions`: its keys and values written at those
        positions, its logits.

        Args:
            ids: [1, w] int64.
            positions: [w] int64, consecutive (or the first one repeated: the same token written
                twice at one slot, `step_graph`'s draft at position 0).
            mask: `attention_mask(positions)`, when the caller built it already.
            keep: The last `keep` positions' logits only (0: all w): a prompt's prefill needs one
                row, and the LM head over every position of a long prompt is a vocabulary-wide GEMM
                a token (transformers' `logits_to_keep`).
            forward: What runs the pass in the model's place (`CompiledModel`'s compiled forward).

        Returns:
            Logits [w or keep, padded vocabulary] in the model's dtype.
        """
        self.cache.positions = positions
        out = (self.model if forward is None else forward)(
            input_ids=ids,
            cache=self.cache,
            position_ids=positions.unsqueeze(0),
            attention_mask=self.attention_mask(positions) if mask is None else mask,
            use_cache=True,
            logits_to_keep=keep,
            static_cache=True,  # to the attention (`static_attention`)
            unmasked=self.cache.unmasked,
        )
        return out.logits[0]

    @contextmanager
    def attending(self, window: int | None, last: bool = False) -> Iterator[None]:
        """The passes inside the block attend over the cache's first `window` slots only (None,
        or at least `capacity`: all of them), set back to all on leaving. `last` (with a
        window): each pass is one query at position window − 1 (a target-only step), which
        attends to every slot of the window, so its attention runs without a mask
        (`static_attention`): a masked SDPA costs nearly twice an unmasked one on the CPU
        (~100 µs a layer against ~60 on the story pair's one-token passes).

        For eager passes whose positions the host knows lie below `window`: a pass's cost on a CPU
        grows with the slots it attends over, and a static cache is sized for a whole reply (up
        to twice it, `step_graph.EagerSteps.fit`), so the written prefix is usually shorter. The
        result is the same: the slots cut are those the mask gives no weight (exp of the dtype's
        lowest value is 0). Never inside a compiled or captured function, whose shapes are fixed
        (the window would be guarded on: a graph a length).
        """
        self.cache.window = None if window is None or window >= self.capacity else window
        self.cache.unmasked = last and window is not None
        try:
            yield
        finally:
            self.cache.window = None
            self.cache.unmasked = False

    @torch.inference_mode()
    def forward(self, seq: torch.Tensor, upto: int, keep: int) -> torch.Tensor:
        """See `CachedModel.forward`; `upto` must not exceed `capacity`. Attends over the first
        `upto` slots (`attending`)."""
        with self.attending(upto):
            logits = self.run(
                seq[:, self.seen : upto], torch.arange(self.seen, upto, device=self.device), keep=keep
            )
        self.seen = upto
        self.fed = seq
        return logits[:, : self.vocab_size].float()

    def rollback(self, length: int) -> None:
        """Go back to `length` tokens (no-op when the cache holds fewer): the next pass writes over
        what lies beyond."""
        self.seen = min(self.seen, length)

    def _prefix_reusable(self) -> bool:
        return True  # rolling back only moves `seen`

    @torch.inference_mode()
    def _check_rollback(self) -> None:
        from fsd_chat.engines.torch_engine.positioned_cache import PositionedLayer

        # Exactly ours: the sliding-window static layers subclass StaticLayer, and are left as they are.
        self.layers = [layer for layer in self.cache.layers if type(layer) is PositionedLayer]
        if len(self.layers) < len(self.cache.layers):
            kinds = sorted({type(layer).__name__ for layer in self.cache.layers})
            raise UnsupportedCacheError(
                f"{self.flag} needs full-attention layers only; {type(self.model).__name__} has {', '.join(kinds)}"
            )
        # One eager pass allocates the layers (`StaticLayer.lazy_initialization`), outside any
        # compiled graph: their addresses are then marked static, which CUDA graphs need.
        probe = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.run(probe, torch.zeros(1, dtype=torch.long, device=self.device))


class CompiledModel(StaticModel):
    """A model whose short forward passes are compiled (`torch.compile`, whole graph) over a static
    KV cache (`StaticModel`): the target's verify and target-only steps, the draft's steps.

    A small model's forward pass is mostly framework overhead on a CPU and kernel launches on a
    GPU; compiling it (on CUDA with CUDA graphs, mode "reduce-overhead", as gpt-fast does for both
    its models and transformers' `generate` does over a `StaticCache`) removes most of both.

    **Widths.** A forward pass of w tokens, w ≤ max(widths), is padded to the smallest of `widths`
    that holds it, and each of those widths is one compiled graph. Padding is exact: the padded
    positions come after the real ones, so the causal mask hides them from every real position;
    their cache slots lie beyond the real end, and the next pass writes at its own positions
    (`PositionedLayer`), over them, before any query can see them. Widths of powers of two bound the graphs to a few (1, 2, 4, 8,
    16, 33 for a target verifying up to MAX_DRAFT_TOKENS): one graph per width would compile anew,
    seconds each on a GPU and tens of seconds on a CPU, whenever the draft policy picks a new draft
    length k, while padding costs only the positions it adds: nothing measurable on a GPU, where a
    small model's forward pass costs the same at any of these widths, and under 2× the pass's
    arithmetic on a CPU (where compilation is off by default). Longer passes, and every pass
    over a prompt (`prefill`, whatever its width), run eagerly over the same cache: a prompt's
    length is the user's, so padding it to a compiled width would compile a new graph (3–23 s on a
    GPU) whenever a reply's prompt first has that padded width (issue 36); transformers'
    `generate` likewise prefills eagerly and compiles only its one-token step.

    If compilation fails (no C++ compiler, an operator torch.compile cannot trace), the model runs
    eagerly from then on and `compile_error` says why. A model whose linear layers were prepacked
    for oneDNN (`fsd_chat.engines.torch_engine.packed_linear`) gets them back unpacked, in place, first.

    Args:
        model: A causal LM that `compile_refusal` admits (full-attention layers only).
        vocab_size: See `CachedModel`.
        capacity: Tokens the static cache holds (the decoder's context is capped to it); at least
            max(widths) more than the longest sequence fed, for the padding.
        widths: The compiled widths in tokens, increasing (default: up to MAX_DRAFT_TOKENS + 1).

    Raises:
        UnsupportedCacheError: the model has sliding-window or recurrent layers.
    """

    flag = "--compile"

    def __init__(
        self,
        model: PreTrainedModel,
        vocab_size: int,
        capacity: int,
        widths: tuple[int, ...] = VERIFY_WIDTHS,
    ) -> None:
        self.widths = widths
        super().__init__(model, vocab_size, capacity)
        # inductor cannot lower oneDNN's packed weights (it packs its own when it freezes a model).
        unpack_linear_layers(model)
        self._compiled = compiled_forward(model)
        # The padded inputs: the tokens beyond a pass's own are stale, but valid ids.
        self._ids = torch.zeros((1, widths[-1]), dtype=torch.long, device=self.device)
        # One graph a width for each compiled model, and models of one class share one forward's code.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)

    @torch.inference_mode()
    def forward(self, seq: torch.Tensor, upto: int, keep: int) -> torch.Tensor:
        """See `CachedModel.forward`; `upto` + max(widths) must not exceed `capacity`."""
        width = upto - self.seen
        padded = next((w for w in self.widths if w >= width), None)
        logits = None
        if padded is not None and self.compile_error is None:
            self._ids[0, :width].copy_(seq[0, self.seen : upto])
            positions = torch.arange(self.seen, self.seen + padded, device=self.device)
            try:
                # A view of a buffer of its own: the compiled function is guarded on strides, and
                # each reply's buffer has its own length.
                logits = self.run(self._ids[:, :padded], positions, forward=self._compiled)[
                    width - keep : width
                ]
            except Exception as exc:  # compilation failures come in many types; fall back to eager
                self.compile_error = compile_failure(exc)
        if logits is None:
            return StaticModel.forward(self, seq, upto, keep)
        self.seen = upto
        self.fed = seq
        return logits[:, : self.vocab_size].float()

    @torch.inference_mode()
    def prefill(self, seq: torch.Tensor, upto: int) -> None:
        """Feed a prompt's tokens eagerly, over the same static cache: only decoding steps (verify
        widths, draft steps) run compiled graphs, so no prompt length compiles one."""
        StaticModel.forward(self, seq, upto, keep=1)


_COMPILED: weakref.WeakKeyDictionary[PreTrainedModel, Callable[..., Any]] = weakref.WeakKeyDictionary()


def compiled_forward(model: PreTrainedModel) -> Callable[..., Any]:
    """`model.forward` compiled whole (`fullgraph`: a graph break is a failure, not a slow
    half-compiled pass), with CUDA graphs on CUDA ("reduce-overhead"), one graph a shape
    (`dynamic=False`): transformers' `CompileConfig` defaults. One per model, shared by its
    decoders (a benchmark makes one a reply), so that each width compiles once."""
    compiled = _COMPILED.get(model)
    if compiled is None:
        mode = "reduce-overhead" if input_device(model).type == "cuda" else None
        compiled = _COMPILED[model] = torch.compile(model.forward, mode=mode, fullgraph=True, dynamic=False)
    return compiled


def compile_refusal(model: PreTrainedModel, flag: str = "--compile") -> str | None:
    """Why `model` cannot run compiled over a static KV cache, in one line naming the option that
    asked for it (`flag`: "--compile", or "--whole-step" for a `StaticModel`) (None: it can).

    The criteria of transformers' `GenerationMixin._valid_auto_compile_criteria` (a quantization
    that cannot be compiled; layers offloaded to the CPU or the disk), and `CompiledModel`'s own:
    every cache layer a full-attention `StaticLayer` (sliding-window layers trim a static cache to
    the window, and recurrent state has no static cache to roll back).
    """
    name = type(model).__name__
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        return (
            f"{name}'s {type(quantizer).__name__.removesuffix('HfQuantizer')} quantization cannot be compiled"
        )
    devices = set(getattr(model, "hf_device_map", {}).values())
    if "disk" in devices or ("cpu" in devices and len(devices) > 1):
        return f"{name} has layers offloaded to the CPU or the disk, which cannot be compiled"
    from transformers.cache_utils import StaticCache, StaticLayer

    try:
        layers = StaticCache(config=model.config, max_cache_len=1).layers
    except Exception as exc:  # a model whose config a static cache cannot read
        return f"{name} has no static KV cache ({type(exc).__name__})"
    kinds = sorted({type(layer).__name__ for layer in layers if type(layer) is not StaticLayer})
    if kinds:
        return f"{name} has {', '.join(kinds)} layers; {flag} needs full-attention layers only"
    return None


def compiler_refusal(device: torch.device) -> str | None:
    """Why inductor cannot compile for `device`, in one line (None: it can).

    On the CPU, inductor's kernels are C++: without a working C++ compiler, every compiled
    function would trace and lower the whole model before failing (about 25 s each on the story
    pair, three a chat), so the compiler is looked up first, as inductor looks it up
    (`torch._inductor.cpp_builder.get_cpp_compiler`). On CUDA the kernels are Triton's and the
    wrapper is Python: nothing to look up.
    """
    if device.type != "cpu":
        return None
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as exc:  # InvalidCxxCompiler, or whatever the lookup itself raises
        return compile_failure(exc)
    return None


def compiled_capacity(context: int) -> int:
    """The static KV cache's tokens for a context of `context` tokens: a speculative step's block
    (up to MAX_DRAFT_TOKENS + 1 tokens) and the widest pass's padding fit beyond it. The same for
    every decoder of a model, so that they share its compiled graphs (the cache's shape is in them)."""
    return context + MAX_DRAFT_TOKENS + 1


def bind(
    model: PreTrainedModel,
    vocab_size: int,
    *,
    compiled: bool | None,
    capacity: int,
    widths: tuple[int, ...] = VERIFY_WIDTHS,
    static: bool = False,
) -> CachedModel:
    """`model` bound to its KV cache: a `CompiledModel` when `compiled` asks for it (None: on a
    CUDA device, where kernel launches dominate a small model's forward pass; on a CPU compiling
    takes long and gains little) and `compile_refusal` and `compiler_refusal` admit it, a
    `StaticModel` when `static` asks for one (the whole-step path, `fsd_chat.engines.torch_engine.step_graph`,
    which compiles and captures on its own), else a `CachedModel` whose `compile_error` says why
    compiling (or a static cache) was refused (None when neither was asked for).

    Args:
        model: A causal LM.
        vocab_size: See `CachedModel`.
        compiled: Compile (True), do not (False), or on a CUDA device only (None).
        capacity, widths: See `CompiledModel`.
        static: A `StaticModel` (takes precedence over `compiled`).

    Raises:
        UnsupportedCacheError: see `CachedModel`.
    """
    if compiled is None:
        compiled = input_device(model).type == "cuda"
    reason = (
        compile_refusal(model, (StaticModel if static else CompiledModel).flag)
        if compiled or static
        else None
    )
    if compiled and reason is None:
        reason = compiler_refusal(input_device(model))
    if static and reason is None:
        return StaticModel(model, vocab_size, capacity)
    if compiled and not static and reason is None:
        return CompiledModel(model, vocab_size, capacity, widths)
    bound = CachedModel(model, vocab_size)
    bound.compile_error = reason
    return bound
