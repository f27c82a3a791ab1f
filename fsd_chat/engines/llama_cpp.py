"""The llama.cpp engine: a GGUF file run natively quantized by llama.cpp (through llama-cpp-python),
bound to its KV cache as a `ModelRunner`, so that the decoding loop, the acceptance rules, the
sampling, the costs, the draft policy and prompt lookup are the same code as over transformers.

What the seam maps to (llama.h):
- `forward` / `prefill`: one `llama_decode` a chunk of up to `BATCH` tokens, from a `llama_batch`
  this model owns and fills through numpy views of its arrays (tokens, positions, output flags: no
  per-token Python). Only the positions asked for are flagged for output, so llama.cpp computes
  and keeps `keep` rows of logits, not a row per token.
- the logits: `llama_get_logits` points at llama.cpp's output buffer, whose rows are the flagged
  positions in batch order; they are returned as a torch view of that buffer
  (`np.ctypeslib.as_array` then `torch.from_numpy`: no copy), valid until the next decode, and
  kept from call to call while llama.cpp keeps the buffer where it is.
- `rollback`: `llama_memory_seq_rm(memory, 0, length, -1)` drops the positions from `length` on.
- `keep_prefix`: the ids the cache holds are kept on the host; the longest common prefix with the
  new sequence stays, the rest is removed (llama.cpp's own prefix cache is this same KV cache).

Sliding-window models keep every token's keys and values (`swa_full`), so that a rollback to any
earlier position is exact; recurrent and hybrid models (whose state cannot be cut back to a
position) are refused.

llama.cpp's output never reaches the terminal, and no file descriptor is redirected: its C log goes
through a callback of ours to the `LLAMA_CPP_LOG` logger (`fsd_chat.support.log` keeps the warnings
and errors in the error log), and llama-cpp-python's own prints to `sys.stderr` go there too
(`prints_to_log`). Its `verbose=False` would instead point fds 1 and 2 at /dev/null while a model
loads, losing whatever another thread writes meanwhile: the chat's screen, drawn on fd 2.

The module imports no llama_cpp until an engine is made (`llama_cpp_module`): fsd-chat runs without
llama-cpp-python (the GPU image has none).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import importlib.util
import io
import itertools
import logging
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from gguf import LlamaFileType

from fsd_chat.decoding.forward_timings import ForwardTimings, timings_of
from fsd_chat.decoding.settings import MAX_DRAFT_TOKENS
from fsd_chat.support.errors import ContextLengthError, ModelLoadError, UnsupportedCacheError
from fsd_chat.support.log import LLAMA_CPP_LOG

log = logging.getLogger(LLAMA_CPP_LOG)
log.addHandler(logging.NullHandler())  # no handler set up (a library use): dropped, not on stderr

BATCH = 512
"""Tokens a `llama_decode` reads at most (llama.cpp's n_batch and n_ubatch; llama-cpp-python's
default): a longer prompt is fed in chunks of this size."""
CONTEXT = 8192
"""Most tokens the KV cache holds (llama.cpp's n_ctx), below the model's trained context: the cache
is allocated whole when the model loads (SmolLM2-135M: 23 KiB a token in f16, 184 MiB at 8192)."""
INSTALL = "pip install llama-cpp-python (make setup builds it from source: it needs cmake and a C++ compiler)"
"""How to get the engine, for the one-line error when it is missing."""


def unavailable() -> str | None:
    """Why the llama.cpp engine cannot run here, in one line (None: it can): llama-cpp-python is
    not installed, or its native library does not load."""
    try:
        llama_cpp_module()
    except ModelLoadError as exc:
        return str(exc)
    return None


@functools.cache
def llama_cpp_module() -> Any:
    """The `llama_cpp` module, imported on first use (typed Any: it is optional, and its ctypes
    declarations are all the typing it has).

    Raises:
        ModelLoadError: llama-cpp-python is not installed, or its native library fails to load.
    """
    if importlib.util.find_spec("llama_cpp") is None:
        raise ModelLoadError(
            f"the llama.cpp engine needs llama-cpp-python, which is not installed: {INSTALL}"
        )
    try:
        module = importlib.import_module("llama_cpp")
    except (ImportError, OSError, RuntimeError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelLoadError(
            f"llama-cpp-python is installed but does not load ({reason}): {INSTALL}"
        ) from None
    # Ours replaces llama-cpp-python's callback (set when it is imported, which prints to stderr).
    module.llama_log_set(_log_callback(module), None)
    return module


GGML_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
"""ggml's log levels (`enum ggml_log_level`, ggml.h) as `logging`'s; 5 (GGML_LOG_LEVEL_CONT) goes
on at the level before it, and 0 (NONE) is taken as info."""
GGML_CONT = 5


@functools.cache
def _log_callback(module: Any) -> Any:
    """The ctypes callback that hands llama.cpp's log lines (llama.cpp's and ggml's) to `log`.

    Cached: the reference kept here is what keeps the callback alive, since llama.cpp holds only
    its address. A line below the logger's level costs a call and a dict lookup (llama.cpp logs
    a line per tensor as a model loads); it is decoded only when kept."""
    last = [logging.INFO]  # a CONT line's level: the line's it continues

    def forward(level: int, text: bytes | None, _user_data: Any) -> None:
        python_level = last[0] if level == GGML_CONT else GGML_LEVELS.get(level, logging.INFO)
        last[0] = python_level
        if text and log.isEnabledFor(python_level):
            line = text.decode("utf-8", errors="replace").rstrip()
            if line:
                log.log(python_level, "%s", line)

    return module.llama_log_callback(forward)


class _PrintsToLog(io.TextIOBase):
    """`sys.stderr` while `prints_to_log` runs: the lines its thread writes go to `log` at debug
    level; any other thread's go on to the stream it replaced (the chat's screen runs beside a
    model loading in a worker thread)."""

    def __init__(self, others: TextIO) -> None:
        self.others = others
        self._thread = threading.get_ident()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if threading.get_ident() != self._thread:
            return self.others.write(text)
        if text.strip():
            log.debug("%s", text.rstrip())
        return len(text)

    def flush(self) -> None:
        if threading.get_ident() != self._thread:
            self.others.flush()


@contextlib.contextmanager
def prints_to_log() -> Iterator[None]:
    """While in it, what this thread prints to `sys.stderr` goes to `log` at debug level: llama-cpp-
    python's prints with `verbose` (which `open_gguf` sets: its system info and model metadata at
    load, its notes on the prefix it reuses in `Llama.generate`). It swaps the `sys.stderr` object,
    never fd 2, so what C code writes to fd 2 is untouched, and other threads' prints go where they
    went. Unlike `contextlib.redirect_stderr`, it puts the old stream back only if `sys.stderr` is
    still its own: the chat's app may have ended meanwhile and put back the terminal's."""
    sink = _PrintsToLog(sys.stderr)
    sys.stderr = sink
    try:
        yield
    finally:
        if sys.stderr is sink:
            sys.stderr = sink.others


def open_gguf(
    path: Path,
    *,
    threads: int,
    gpu: bool,
    batch_threads: int | None = None,
    context: int = CONTEXT,
    draft_model: Any = None,
) -> Any:
    """A `llama_cpp.Llama` over the GGUF file `path`, with no output of its own on stderr and no
    file descriptor redirected meanwhile (see the module docstring).

    Args:
        path: The GGUF file.
        threads: llama.cpp's threads for forwards of one token.
        batch_threads: Its threads for forwards of several (the prefill, a verify); None: `threads`
            (`fsd_chat.support.threads` says why they differ).
        gpu: Offload every layer to the GPU (a CUDA or Metal build); False: the CPU.
        context: Most tokens the KV cache holds (capped to the model's trained context).
        draft_model: llama-cpp-python's own drafting (`LlamaPromptLookupDecoding`: the bench's
            llama.cpp-lookup baseline); None for fsd-chat's engine.

    Raises:
        ModelLoadError: llama-cpp-python is missing, or llama.cpp cannot load the file.
    """
    llama_cpp = llama_cpp_module()
    try:
        with prints_to_log():
            return llama_cpp.Llama(
                model_path=str(path),
                n_ctx=context,
                n_batch=BATCH,
                n_ubatch=BATCH,
                n_threads=threads,
                n_threads_batch=batch_threads or threads,
                n_gpu_layers=-1 if gpu else 0,
                logits_all=False,
                swa_full=True,
                # Flash attention, as llama.cpp's own tools run by default (`-fa auto`; llama-cpp-python
                # defaults to off): without it, a verify's few tokens after a cached prefix attend
                # other than the same tokens fed one by one on some CPUs (logits up to 1.0 apart on an
                # AVX-512 EPYC), so greedy speculative decoding left the target alone's text at near
                # ties of that size; with it they are the same to the bit, and decoding is no slower
                # (docs/engines.md, "Numerics").
                flash_attn=True,
                draft_model=draft_model,
                # True: with False, llama-cpp-python points fds 1 and 2 at /dev/null while the model
                # loads; what it then prints goes to the log (`prints_to_log`, the log callback).
                verbose=True,
            )
    except (ValueError, RuntimeError, OSError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelLoadError(f"llama.cpp could not load {path}: {reason}") from None


class LlamaCppModel:
    """A GGUF model on llama.cpp and the KV cache of the sequence it has seen (a `ModelRunner`).

    Invariant: the cache holds the first `seen` tokens of the last sequence fed, whose ids are
    kept in `_ids`.

    Args:
        llama: The `llama_cpp.Llama` (`open_gguf`); this model decodes through its context with a
            batch of its own, and owns its KV cache from now on.
        vocab_size: Logits beyond this index are dropped (llama.cpp's vocabulary may hold more ids
            than the tokenizer).

    Raises:
        UnsupportedCacheError: the model keeps recurrent state (Mamba, RWKV, hybrid layers), which
            cannot be rolled back to a position.
    """

    compile_error: str | None = None
    """Nothing compiles on this engine."""

    def __init__(self, llama: Any, vocab_size: int) -> None:
        self._llama_cpp = llama_cpp_module()
        lib = self._llama_cpp
        self.llama = llama
        self.path = Path(llama.model_path)
        self.threads = int(llama.n_threads)
        self.batch_threads = int(llama.n_threads_batch)
        self.gpu = llama.model_params.n_gpu_layers != 0
        self._ctx = llama.ctx
        model = llama.model
        if lib.llama_model_is_recurrent(model) or lib.llama_model_is_hybrid(model):
            raise UnsupportedCacheError(
                f"{self.path.name} keeps recurrent state that cannot be rolled back to an "
                "accepted prefix; speculative decoding needs a KV cache that can"
            )
        self._memory = lib.llama_get_memory(self._ctx)
        self._n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model)))
        self.vocab_size = min(vocab_size, self._n_vocab)
        self.device = torch.device("cpu")  # llama.cpp hands its logits to the host, GPU or not
        self.n_ctx = int(lib.llama_n_ctx(self._ctx))
        self.seen = 0
        self._ids = np.zeros(self.n_ctx, dtype=np.int64)
        # The batch and numpy views of its arrays: a decode fills them with vectorised writes.
        self._batch = lib.llama_batch_init(BATCH, 0, 1)
        batch = self._batch
        self._tokens = np.ctypeslib.as_array(batch.token, shape=(BATCH,))
        self._positions = np.ctypeslib.as_array(batch.pos, shape=(BATCH,))
        self._outputs = np.ctypeslib.as_array(batch.logits, shape=(BATCH,))
        np.ctypeslib.as_array(batch.n_seq_id, shape=(BATCH,))[:] = 1
        for i in range(BATCH):
            batch.seq_id[i][0] = 0  # one sequence, id 0
        # Every position the cache holds, and BATCH 0s then BATCH 1s (a chunk's output flags are a
        # slice of it): a chunk's positions and flags are one copy each.
        self._all_positions = np.arange(self.n_ctx, dtype=np.int32)
        self._flags = np.repeat(np.array([0, 1], dtype=np.int8), BATCH)
        # Views of llama.cpp's logits buffer by row count, and the address they are of: it moves
        # only when llama.cpp needs more rows than it has, and the views are made anew then.
        self._logits_address = 0
        self._logits: dict[int, torch.Tensor] = {}
        vocab = lib.llama_model_get_vocab(model)  # asked once: 49,152 calls a token apart cost 16 ms
        self._eos = frozenset(i for i in range(self._n_vocab) if lib.llama_vocab_is_eog(vocab, i))

    def __del__(self) -> None:
        batch = getattr(self, "_batch", None)
        if batch is not None:
            self._llama_cpp.llama_batch_free(batch)
            self._batch = None

    def set_threads(self, threads: int, batch_threads: int) -> None:
        """Decode one token on `threads` CPU threads from now on, several (a prefill, a verify) on
        `batch_threads` (`llama_set_n_threads`)."""
        self._llama_cpp.llama_set_n_threads(self._ctx, threads, batch_threads)
        self.threads, self.batch_threads = threads, batch_threads

    @property
    def context(self) -> int | None:
        """See `ModelRunner.context`: the KV cache's size (n_ctx)."""
        return self.n_ctx

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """See `ModelRunner.eos_token_ids`: the ids llama.cpp ends generation at
        (`llama_vocab_is_eog`: the end-of-sequence, end-of-turn and end-of-message tokens)."""
        return self._eos

    @property
    def file_type(self) -> str | None:
        """The GGUF file's quantization as llama.cpp's tools name it, from its `general.file_type`
        key: "Q4_1", "Q4_K_M", "F16", "F32"...; None where the file does not say, or says a type
        the gguf package does not know."""
        value = self.llama.metadata.get("general.file_type")
        try:
            kind = LlamaFileType(int(value) & ~LlamaFileType.GUESSED)
        except (TypeError, ValueError):
            return None
        return kind.name.removeprefix("MOSTLY_").removeprefix("ALL_")

    @property
    def file_bytes(self) -> int:
        """The weights' size in bytes as llama.cpp holds them (`llama_model_size`)."""
        return int(self._llama_cpp.llama_model_size(self.llama.model))

    def forward(self, seq: torch.Tensor, upto: int, keep: int) -> torch.Tensor:
        """See `ModelRunner.forward`: the returned logits are a view of llama.cpp's output buffer
        (shape [keep, vocab_size] float32 on the CPU), valid until the next decode.

        Raises:
            ContextLengthError: `upto` exceeds the KV cache (n_ctx), or llama.cpp found no room.
        """
        self._decode(seq, upto, keep)
        # Each call after llama_decode runs from cold caches (the weights have just passed through
        # them): the views are made anew only when llama.cpp moved its buffer.
        pointer = self._llama_cpp.llama_get_logits(self._ctx)
        address = ctypes.addressof(pointer.contents)
        if address != self._logits_address:
            self._logits_address, self._logits = address, {}
        view = self._logits.get(keep)
        if view is None:
            rows = np.ctypeslib.as_array(pointer, shape=(keep, self._n_vocab))
            view = self._logits[keep] = torch.from_numpy(rows)[:, : self.vocab_size]
        return view

    def prefill(self, seq: torch.Tensor, upto: int) -> None:
        """See `ModelRunner.prefill`: the last position's logits only (llama.cpp computes none
        for the others)."""
        self._decode(seq, upto, 1)

    def _decode(self, seq: torch.Tensor, upto: int, keep: int) -> None:
        """Feed seq[0, seen:upto] in chunks of up to BATCH tokens, the first chunk the short one, so
        that the last `keep` (≤ BATCH) positions are all in the last chunk."""
        if keep > BATCH:
            raise ValueError(f"at most {BATCH} positions' logits a forward on llama.cpp, asked for {keep}")
        if upto > self.n_ctx:
            raise ContextLengthError(
                f"the sequence reached {upto} tokens but llama.cpp's KV cache holds {self.n_ctx}"
            )
        ids = seq.numpy()[0, self.seen : upto]
        start = self.seen
        first = (len(ids) - 1) % BATCH + 1
        for begin, end in itertools.pairwise([0, *range(first, len(ids) + 1, BATCH)]):
            n = end - begin
            self._tokens[:n] = ids[begin:end]
            self._positions[:n] = self._all_positions[start + begin : start + end]
            # Flags 1 for the last `keep` positions of the last chunk (`_flags`: 0s, then 1s).
            zeros = BATCH - n + (keep if end == len(ids) else 0)
            self._outputs[:n] = self._flags[zeros : zeros + n]
            self._batch.n_tokens = n
            code = self._llama_cpp.llama_decode(self._ctx, self._batch)
            if code != 0:
                self.rollback(start + begin)  # what a failed decode may have written is dropped
                if code == 1:
                    raise ContextLengthError(f"llama.cpp found no room in its KV cache ({self.n_ctx} tokens)")
                raise RuntimeError(f"llama_decode returned {code}")
            self._ids[start + begin : start + end] = ids[begin:end]
            self.seen = start + end

    def rollback(self, length: int) -> None:
        """See `ModelRunner.rollback`: `llama_memory_seq_rm` of the positions from `length` on.

        Raises:
            UnsupportedCacheError: llama.cpp could not remove them (a cache that cannot be cut).
        """
        if self.seen > length:
            if not self._llama_cpp.llama_memory_seq_rm(self._memory, 0, length, -1):
                raise UnsupportedCacheError(
                    "llama.cpp could not roll its KV cache back to an accepted prefix"
                )
            self.seen = length

    def reset(self) -> None:
        """See `ModelRunner.reset`: the KV cache emptied (`llama_memory_clear`)."""
        self._llama_cpp.llama_memory_clear(self._memory, True)
        self.seen = 0

    def keep_prefix(self, seq: torch.Tensor, length: int) -> int:
        """See `ModelRunner.keep_prefix`: the cached ids are compared on the host."""
        n = min(self.seen, length)
        differ = np.flatnonzero(self._ids[:n] != seq[0, :n].numpy())
        common = int(differ[0]) if len(differ) else n
        if common == 0 and self.seen:
            self.reset()
        else:
            # An empty cache stays as it is: clearing it again writes the whole KV buffer (5 ms of
            # CPU for the default model's 184 MiB), which the bench paid on every reply.
            self.rollback(common)
        return self.seen


def gpu_offload() -> bool:
    """Whether this llama-cpp-python build can offload layers to a GPU (CUDA, Metal, Vulkan...)."""
    return bool(llama_cpp_module().llama_supports_gpu_offload())


LAYER_SECONDS = 1.37e-4
"""`forward_seconds`: seconds a forward's graph takes per layer whatever the threads (building and
scheduling its operators, the threads' barriers). Fitted with the three below, weighted by relative
error, to `LlamaCppModel.forward` on SmolLM2-135M Q4_1 (96.6 MB, 134.5 M parameters, 30 layers), 100
tokens of context, medians of 10 on a quiet 2-core CPU (load 0.4, 2026-11-27), in ms:

| threads | V(1) | V(2) | V(4) | V(8) | V(16) | V(32) |
|---|---|---|---|---|---|---|
| 1 | 18.2 | 31.8 | 54.1 | 97.4 | 177 | 352 |
| 2 | 11.3 | 19.0 | 27.5 | 45.3 | 91.5 | 183 |

The model gives 18.3, 32.1, 53.0, 94.8, 178, 345 and 11.2, 18.1, 28.6, 49.4, 91.2, 175 (within 5%
but V(8) on two threads, +9%). A token of a batch costs about 0.6 of a lone token on one thread and
0.5 on two: a verify of w tokens is far from w single forwards, and its price against V(1) depends on
the threads."""
BYTE_SECONDS = 4.1e-11
"""`forward_seconds`: seconds per byte of weights (`llama_model_size`) a 1-token forward reads,
divided among the threads."""
WIDE_BYTE_SECONDS = 7.6e-11
"""`forward_seconds`: `BYTE_SECONDS` for a forward over 2 or more tokens (llama.cpp's matrix-matrix
path quantizes the activations and tiles the weights: its fixed part is dearer than the
matrix-vector path's), divided among the threads."""
TOKEN_PARAMETER_SECONDS = 7.45e-11
"""`forward_seconds`: seconds per token of a forward's width and per parameter (the quantized
multiply-adds), divided among the threads."""
ATTENTION_SECONDS = 4.1e-10
"""`priced_timings`: seconds a 1-token forward adds per token of context, per layer and unit of
hidden width, on one thread (SmolLM2-135M Q4_1: V(1) 18.1 ms over 64 tokens of context, 24.7 over
1,000); divided among the threads as the products are (not measured on two)."""
ATTENTION_WIDTH_SECONDS = 6.8e-10
"""`priced_timings`: what each further token of a forward's width adds to ATTENTION_SECONDS (same
measurement: V(8) 85.9 ms over 64 tokens, 169.5 over 1,000); divided among the threads likewise."""


def priced_timings(
    target: LlamaCppModel,
    draft: LlamaCppModel | None,
    measured: Mapping[LlamaCppModel, Sequence[float]],
) -> ForwardTimings:
    """The draft and verify forward times of models on llama.cpp at their thread counts
    (`LlamaCppModel.threads` for one token, `batch_threads` for several).

    A model in `measured` is priced at its times V(1), V(2)... (seconds, index w − 1 for width w;
    `fsd_chat.engines.llama_calibration` times them on this machine), a wider forward at
    `forward_seconds` scaled to the widest measured one, and the target's context terms (seconds
    per token of context, see `ForwardTimings`) at the model's scaled alike: a 1-token forward's by
    V(1), a batch's by the widest measured V(w). A model not in `measured` is priced by
    `forward_seconds` alone (modelled from its size, no clock: `scripts/lookup_ceiling.py` compares
    the policy deciding at those). Prompt lookup's positions cost nothing."""
    lib = target._llama_cpp
    model = target.llama.model
    attended = int(lib.llama_model_n_layer(model)) * int(lib.llama_model_n_embd(model))

    def scale(runner: LlamaCppModel, width: int) -> float:
        """Measured over modelled seconds of `runner`'s forward of `width`, or of its widest
        measured forward for a wider one (1 where none is measured)."""
        times = measured.get(runner, ())
        if not times:
            return 1.0
        width = min(width, len(times))
        return times[width - 1] / forward_seconds(runner, width)

    def seconds(runner: LlamaCppModel, width: int) -> float:
        return forward_seconds(runner, width) * scale(runner, width)

    wide = scale(target, MAX_DRAFT_TOKENS + 1)
    return timings_of(
        seconds,
        target,
        draft,
        vocab=target.vocab_size,
        attention=attended * ATTENTION_SECONDS / target.threads * scale(target, 1),
        attention_width=attended * ATTENTION_WIDTH_SECONDS / target.batch_threads * wide,
        batch_attention=attended * ATTENTION_SECONDS / target.batch_threads * wide,
    )


def forward_seconds(model: LlamaCppModel, width: int) -> float:
    """The modelled seconds of a forward of `width` tokens on llama.cpp over
    `fsd_chat.decoding.forward_timings.MEASURE_CONTEXT` tokens of context, at the model's threads for
    its width (`priced_timings` scales it to the widths measured; the constants say how they were
    fitted). A forward costs a part per layer, the read of its weights (`llama_model_size`) and a
    part per token and parameter, the last two divided among the threads."""
    lib = model._llama_cpp
    layers = int(lib.llama_model_n_layer(model.llama.model))
    params = int(lib.llama_model_n_params(model.llama.model))
    read, threads = (BYTE_SECONDS, model.threads) if width == 1 else (WIDE_BYTE_SECONDS, model.batch_threads)
    return (
        layers * LAYER_SECONDS
        + (model.file_bytes * read + width * params * TOKEN_PARAMETER_SECONDS) / threads
    )
