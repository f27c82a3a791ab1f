"""Python's cyclic garbage collector paused while a command starts: from its first line until its
models are loaded (`paused` around the command, `resume` once the pair is in memory).

Starting imports torch and transformers and builds a tokenizer: millions of objects that live as
long as the process. While they are made, the collector walks them again and again, finding almost
nothing: 638 collections, 4 of them full ones, 0.46-0.60 s of CPU before a new GGUF file's first
token (a 5.5-6 s start on the 2-core CPU; docs/engines.md), for about 1 MB of garbage it would
have freed (`scripts/bench_llama_memory.py`). The objects that exist when the start ends are frozen
(`gc.freeze`: the collector never walks them again) and collection resumes for what the replies
make. A transformers model resumes it before its weights load (`resume` there too), so that a
long conversion collects as it goes.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_paused = False


@contextmanager
def paused() -> Iterator[None]:
    """Collection paused in the block until `resume` is called, and enabled again at its end
    whatever happened (a command that failed, or that loaded no model: nothing frozen then)."""
    global _paused
    if not gc.isenabled():  # paused by the caller: left to it
        yield
        return
    gc.disable()
    _paused = True
    try:
        yield
    finally:
        if _paused:
            _paused = False
            gc.enable()


def resume() -> None:
    """End the start: the objects tracked now are frozen and collection resumes, if `paused`
    paused it (else nothing)."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
