"""llama.cpp's forward times measured on this machine, once, and kept: the prices the draft-length
policies decide at on the llama.cpp engine (`calibrated_timings`).

A model's verify times V(1)..V(`CALIBRATED_WIDTHS`[-1]) are timed with `LlamaCppModel.forward`
over `MEASURE_CONTEXT` tokens of context at its thread split (`time_widths`, which
`scripts/llama_forward_table.py` runs too), and written to a small JSON file in
`calibration_dir()`, one a model, named by a digest of what the times depend on
(`calibration_key`: the CPU, llama-cpp-python's version, the GGUF file, the threads, GPU offload).
Every later load on the same machine reads that file and times nothing, so the prices, and with
them the draft lengths and the text a lossy rule writes for a seed, are the same on every run and
under any load: no clock during a reply (`fsd_chat.decoding.draft_policy`). A missing, unreadable or
damaged file, or one of another key, is timed again; a folder that cannot be written is no error
(the times are used, and timed again next time).

Why measured: the modelled prices (`fsd_chat.engines.llama_cpp.forward_seconds`, fitted on another
2-core CPU) put a 2-token verify at 0.98 V(1) where this CPU takes 1.32 V(1)
(docs/llama-forward-table.json), and mispriced speculation made lossless decoding slower than the
target alone (docs/engines.md, "Forward prices").
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsd_chat.decoding.forward_timings import MEASURE_CONTEXT, ForwardTimings
from fsd_chat.engines import llama_cpp
from fsd_chat.engines.llama_cpp import LlamaCppModel
from fsd_chat.support.config import calibration_dir
from fsd_chat.support.log import LLAMA_CPP_LOG

log = logging.getLogger(LLAMA_CPP_LOG)

CALIBRATED_WIDTHS = tuple(range(1, 7))
"""Verify widths (tokens) timed: a step of draft length k verifies k + 1 tokens, and the chat's
k is at most 5 (`DEFAULT_DRAFT_TOKENS`, the settings' default). A wider verify (a k the user raises,
up to `MAX_DRAFT_TOKENS`) is priced by the model scaled to V(6) (`llama_cpp.priced_timings`): timing
every width up to 33 would take seconds, where these take 0.9 s on the default model at the
chat's split on a 2-core CPU (median of 10, load 2-3; docs/benchmarks.md), once per file and thread
split, as a command sets its threads."""
INTERLEAVED = tuple(w for width in CALIBRATED_WIDTHS[1:] for w in (1, width))
"""One pass's forwards, in order: V(1) before every wider width (1, 2, 1, 3, ... 1, 6), so that V(1),
the unit every price is a multiple of, has five samples a pass spread over the pass, and a burst of
another process's work that slows part of a pass cannot leave V(1) alone disturbed."""
CALIBRATION_PASSES = 3
"""Timed passes of `INTERLEAVED`: V(1) gets 15 samples, each wider width 3 (4 passes took 1.06 s at
the chat's split, over the ~1 s aimed at). A time is the least of its samples (timing noise, another
process or a cache miss, only adds to a time). Each V(1) follows a batch forward and each batch a
V(1), as in a reply whose verifies and one-token steps alternate: V(1) after a batch came out 7%
dearer than after a V(1), a verify after a V(1) 6% dearer than after its own width, in an
exploratory check (docs/benchmarks.md), so the ratios V(w) / V(1) the policy decides by move little."""
STEADY_SPREAD = 1.25
"""A calibration is kept (written to its file) only where, at every width, the median of its samples
is within this factor of their least (`Calibration.steady`): other work slowing half a width's
samples or more leaves the times unsure, so they are used for this load and timed again at the next.
On a 2-core CPU at the chat's split it kept 9 of 10 calibrations as the machine was (load 2-3) and
none of 10 with one more process keeping a core busy, which stalls the batches' second thread
(docs/benchmarks.md, "llama.cpp's calibration, robust to noise"). A slowdown lasting the whole
calibration leaves its samples agreeing, and is kept."""
FORMAT = 2
"""The cache files' layout and meaning; a file of another is timed again. 2: V(1) interleaved with
the wider widths, least of 15 (1: least of 3 passes over the widths in order)."""
TIMING_NOTE = "timing llama.cpp's forwards of {name} on this CPU (once per file and threads)"
"""What `forward_times` tells its `progress` before it times (the chat's loading screen shows it)."""


def calibration_ids(model: LlamaCppModel, length: int) -> torch.Tensor:
    """The token ids the forwards are timed over: shape [1, length], ids 1000, 1001... wrapped into
    the model's vocabulary (a forward's time does not depend on which ids it reads)."""
    return ((torch.arange(length) + 1000) % model.vocab_size)[None]


def time_widths(model: LlamaCppModel, widths: tuple[int, ...]) -> list[float]:
    """One pass: the seconds of `model`'s forward over each of `widths` tokens (in that order, a width
    may come again) after `MEASURE_CONTEXT` tokens of context (`calibration_ids`, prefilled first
    where the cache does not hold them), at its threads. Untimed first: a 1-token forward and one of
    the widest, which pay for what a thread change or another process left cold, on the threads for
    one token and on those for a batch (the first batch forwards after a thread change ran up to 1.5
    times their later time). The cache holds the context again after."""
    seq = calibration_ids(model, MEASURE_CONTEXT + max(widths))
    model.keep_prefix(seq, MEASURE_CONTEXT)
    if model.seen < MEASURE_CONTEXT:
        model.prefill(seq, MEASURE_CONTEXT)
    seconds = []
    for width in (1, max(widths), *widths):
        model.rollback(MEASURE_CONTEXT)
        start = time.perf_counter()
        model.forward(seq, MEASURE_CONTEXT + width, width)
        seconds.append(time.perf_counter() - start)
    model.rollback(MEASURE_CONTEXT)
    return seconds[2:]


@dataclass(frozen=True, slots=True)
class Calibration:
    """One calibration's outcome.

    Attributes:
        seconds: V(w) in seconds for w in `CALIBRATED_WIDTHS` (index w − 1).
        samples: Each width's samples in seconds, in the order timed (index w − 1; V(1) has
            `CALIBRATION_PASSES` × 5, a wider width `CALIBRATION_PASSES`).
    """

    seconds: list[float]
    samples: list[list[float]]

    @property
    def spread(self) -> float:
        """The widest, over the widths, of the median of a width's samples over their least (1.0:
        every sample alike)."""
        return max(statistics.median(times) / min(times) for times in self.samples)

    @property
    def steady(self) -> bool:
        """Whether the times are sure enough to keep: `spread` ≤ `STEADY_SPREAD`."""
        return self.spread <= STEADY_SPREAD


def calibrate(model: LlamaCppModel) -> Calibration:
    """V(w) in seconds for w in `CALIBRATED_WIDTHS`: `CALIBRATION_PASSES` passes of `INTERLEAVED`
    (`time_widths`), each width's least sample, then made non-decreasing from the right (a wider
    forward does all a narrower one does, so a narrower width measured dearer than a wider one
    was disturbed: it takes the wider one's time), and at most w·V(1) (llama.cpp could run the w
    tokens one by one: a dearer verify was disturbed, as by another process holding one of the
    batch's threads' cores, which stalls the others at each barrier: 251 ms for V(5) against
    12.4 ms for V(1), on this 2-core CPU under load 2). The model's KV cache is emptied after.
    The least of V(1)'s 15 samples against the least of a wider width's 3 leans, if anything,
    towards verifies priced dear (the policy drafts a little less), not cheap.

    Raises:
        ContextLengthError: the model's KV cache holds fewer than `MEASURE_CONTEXT` + 6 tokens.
    """
    passes = [time_widths(model, INTERLEAVED) for _ in range(CALIBRATION_PASSES)]
    model.reset()
    samples: dict[int, list[float]] = {}
    for width, seconds in zip(INTERLEAVED * CALIBRATION_PASSES, itertools.chain(*passes), strict=True):
        samples.setdefault(width, []).append(seconds)
    least = [min(samples[width]) for width in CALIBRATED_WIDTHS]
    for i in range(len(least) - 2, -1, -1):
        least[i] = min(least[i], least[i + 1])
    capped = [min(seconds, width * least[0]) for width, seconds in zip(CALIBRATED_WIDTHS, least, strict=True)]
    return Calibration(capped, [samples[width] for width in CALIBRATED_WIDTHS])


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo's "model name", else `platform.processor()`, else the
    architecture)."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and value.strip():
                return value.strip()
    return platform.processor() or platform.machine()


def calibration_key(model: LlamaCppModel) -> dict[str, Any]:
    """What a model's forward times depend on: the CPU (model name, core count), llama-cpp-python's
    version, the GGUF file (resolved path, size in bytes, modification time in ns), the threads for
    one token and for a batch, and whether layers are offloaded to a GPU."""
    stat = model.path.stat()
    return {
        "format": FORMAT,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "llama_cpp_python": str(getattr(model._llama_cpp, "__version__", "unknown")),
        "file": str(model.path.resolve()),
        "file_bytes": stat.st_size,
        "file_mtime_ns": stat.st_mtime_ns,
        "threads": model.threads,
        "batch_threads": model.batch_threads,
        "gpu": model.gpu,
        "widths": list(CALIBRATED_WIDTHS),
    }


def cache_path(key: dict[str, Any]) -> Path:
    """The file the times of `key` are kept in: `calibration_dir()`/<digest of the key>.json."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return calibration_dir() / f"{digest}.json"


def read_times(path: Path, key: dict[str, Any]) -> list[float] | None:
    """The times kept at `path` for `key`; None where the file is missing, unreadable, damaged, of
    another key, or holds a time that is not a positive finite number for each width."""
    try:
        data = json.loads(path.read_text())
        times = [float(v) for v in data["seconds"]]
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError):
        return None
    valid = len(times) == len(CALIBRATED_WIDTHS) and all(math.isfinite(v) and v > 0 for v in times)
    return times if valid and data.get("key") == key else None


def write_times(path: Path, key: dict[str, Any], times: list[float]) -> None:
    """Keep `times` at `path`, replaced whole (a temporary file renamed: a reader never sees half a
    file), private to the user (folder 0700, file 0600). A folder that cannot be written is no
    error: logged, and the next load times again."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    record = {"key": key, "seconds": times, "load": os.getloadavg(), "timed_at": time.time()}
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(partial, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "w") as file:
            json.dump(record, file, indent=1)
        partial.replace(path)
    except OSError as exc:
        log.warning("could not keep llama.cpp's forward times at %s: %s", path, exc)
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)


def forward_times(model: LlamaCppModel, progress: Callable[[str], object] | None = None) -> list[float]:
    """`model`'s V(w) for w in `CALIBRATED_WIDTHS` at its threads: read from its cache file, or timed
    (`calibrate`, which empties its KV cache; `progress` is told `TIMING_NOTE` first) and written
    there where the timing was steady (`Calibration.steady`; else used now, timed again next load)."""
    key = calibration_key(model)
    path = cache_path(key)
    times = read_times(path, key)
    if times is None:
        if progress is not None:
            progress(TIMING_NOTE.format(name=model.path.name))
        calibration = calibrate(model)
        times = calibration.seconds
        if calibration.steady:
            write_times(path, key, times)
        else:
            log.info(
                "llama.cpp's forward times of %s not kept (a width's median %.2f times its least: "
                "other work on the CPU); timed again next load",
                model.path.name,
                calibration.spread,
            )
    return times


def calibrated_timings(
    target: LlamaCppModel, draft: LlamaCppModel | None, progress: Callable[[str], object] | None = None
) -> ForwardTimings:
    """The pair's forward times for the draft policies: each model's widths as measured on this
    machine (`forward_times`, cached; `progress` told before a model is timed), wider ones and the
    context's terms by the model scaled to them (`llama_cpp.priced_timings`)."""
    models = [m for m in (target, draft) if m is not None]
    return llama_cpp.priced_timings(target, draft, {m: forward_times(m, progress) for m in models})
