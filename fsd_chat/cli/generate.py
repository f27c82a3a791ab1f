"""The `fsd-chat generate` command's options; the reply itself is written by `fsd_chat.cli.generate_reply`
(imported when the command runs, since it loads torch)."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from fsd_chat.cli import options as o
from fsd_chat.cli.option import Option, takes
from fsd_chat.decoding.settings import LOOKUP
from fsd_chat.support.log import quiet_libraries

JSON = Option("as_json", ("--json",), bool, False, "JSON Lines: one object per step, then a summary.")


@takes(o.TARGET.replace(required=True), o.DRAFT, *o.REPLY_OPTIONS, JSON)
def generate(
    prompt: Annotated[
        str, typer.Argument(help="The prompt (a user turn for chat models); - reads it from standard input.")
    ],
    **values: Any,
) -> None:
    """Stream one reply to PROMPT, coloured by token origin on a terminal."""
    from fsd_chat.cli.generate_reply import prompt_text, run_generate

    settings = o.decoding_settings(values)
    sampling = o.sampling_request(values)
    specs = o.model_specs(o.TARGET.of(values), o.DRAFT.get(values) or LOOKUP, values)
    text = prompt_text(prompt, sys.stdin.buffer if sys.stdin is not None else None)
    quiet_libraries()
    status = run_generate(
        text,
        *specs,
        settings=settings,
        threshold_given=o.THRESHOLD.get(values) is not None,
        sampling=sampling,
        max_new_tokens=o.MAX_NEW_TOKENS.of(values),
        raw=o.RAW.of(values),
        as_json=JSON.of(values),
        autoregressive=o.AUTOREGRESSIVE.of(values),
        threads=o.THREADS.get(values),
        threads_batch=o.THREADS_BATCH.get(values),
        compiled=o.COMPILE.of(values),
        whole_step=o.WHOLE_STEP.of(values),
    )
    if status:
        raise typer.Exit(status)
