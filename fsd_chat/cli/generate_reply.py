"""`fsd-chat generate`: one reply on stdout (coloured by origin on a terminal, JSON Lines with
`--json`, plain text when piped)."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import BinaryIO

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from fsd_chat.decoding import Controls, DecodingSettings, GenerationStats, Step
from fsd_chat.decoding.settings import SamplingRequest, default_threshold
from fsd_chat.engines.torch_engine import step_graph
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.support.interrupts import exit_status, interrupts
from fsd_chat.support.text import TextError, counted, decode_utf8, require_utf8, to_json, visible
from fsd_chat.tui.theme_files import default_origin_styles

STDIN = "-"
INTERRUPTED = "interrupted"
"""The stop reason of a reply that Ctrl-C or SIGTERM ended."""


def step_record(step: Step) -> dict[str, object]:
    """A step as a JSON-ready dict: its tokens, its stats, and the stop reason (or None)."""
    return {
        "tokens": [
            {"id": t.id, "text": t.text, "origin": str(t.origin), "divergence": t.divergence, "cost": t.cost}
            for t in step.tokens
        ],
        "stats": asdict(step.stats),
        "stop_reason": None if step.stop_reason is None else str(step.stop_reason),
        "flushed": step.flushed,
    }


def _emit_json(obj: object) -> None:
    sys.stdout.write(to_json(obj) + "\n")
    sys.stdout.flush()


def prompt_text(argument: str, stdin: BinaryIO | None) -> str:
    """The prompt: the argument itself, or all of standard input when it is "-" (one trailing
    newline dropped, as `echo` adds it).

    Args:
        argument: The PROMPT argument.
        stdin: Standard input's bytes; None when it is closed (`<&-`: Python then has no
            `sys.stdin`).

    Raises:
        TextError: the prompt is not valid UTF-8, or empty or only whitespace (a base model would
            continue from the start-of-text token alone, which is never what was meant), or it is
            to come from a closed standard input.
    """
    if argument == STDIN:
        if stdin is None:
            raise TextError("the prompt is to come from standard input (-), which is closed")
        text = decode_utf8(stdin.read(), "standard input").removesuffix("\n")
    else:
        text = require_utf8(argument, "the prompt")
    if not text.strip():
        raise TextError("the prompt is empty: give some text (or - to read it from standard input)")
    return text


def run_generate(
    prompt: str,
    target: ModelSpec,
    draft: ModelSpec,
    options: LoadOptions,
    *,
    settings: DecodingSettings,
    sampling: SamplingRequest,
    max_new_tokens: int,
    raw: bool,
    as_json: bool,
    autoregressive: bool,
    threads: int | None = None,
    threads_batch: int | None = None,
    compiled: bool | None = None,
    threshold_given: bool = True,
    whole_step: bool | None = None,
) -> int:
    """Load the pair, decode one reply to `prompt` and write it out; returns the exit status: 0, or
    130 (Ctrl-C) or 143 (SIGTERM) when a signal ended the reply early, which is then written out as
    far as it went, with its stats and stop reason "interrupted".

    `prompt` is text already checked by `prompt_text`.

    Raises:
        FsdChatError: bad models, settings or a prompt that does not fit the context.
        OSError: standard output cannot be written (a full disk).
    """
    pair = load_pair(target, draft, options)
    resolved = sampling.resolve(pair.generation_config, Path(target.source).name)
    if resolved.not_applied and not as_json:
        sys.stderr.write(
            f"fsd-chat: not applied (the model's generation_config): {', '.join(resolved.not_applied)}\n"
        )
    pair.use_threads(threads, requested_batch=threads_batch)
    # T not given: the setup's default (greedy: a regret bound with its own scale).
    settings = default_threshold(settings, threshold_given, resolved.config.greedy)
    controls = Controls(settings)
    decoder = pair.decoder(
        controls,
        autoregressive=autoregressive,
        compiled=compiled,
        whole_step=whole_step,
        capture_progress=step_graph.capture_announcer(sys.stderr.write, compile=compiled),
    )
    ids = prompt_ids(pair.tokenizer, [Message("user", prompt)], raw=raw, vocab_size=pair.vocab_size)
    console = Console(highlight=False, soft_wrap=True)
    styles = default_origin_styles()
    colour = console.is_terminal and not as_json
    totals = GenerationStats()
    token_ids: list[int] = []
    texts: list[str] = []
    stop_reason: str | None = None
    status = 0

    def record(step: Step) -> None:
        """Count the step in the summary and write it out."""
        nonlocal stop_reason
        totals.add(step)
        token_ids.extend(t.id for t in step.tokens)
        texts.append(step.text)
        stop_reason = step.stop_reason
        if as_json:
            _emit_json(step_record(step))
        elif colour:
            # Model text is data: an ESC token must not reach the terminal as an escape sequence.
            spans = [(visible(t.text), styles[t.origin]) for t in step.tokens]
            console.print(Text.assemble(visible(step.flushed), *spans), end="")
        else:
            sys.stdout.write(step.text)
            sys.stdout.flush()

    # Ctrl-C or SIGTERM ends the reply where it is: the tokens so far and their stats are reported.
    # A step decoded is recorded whole, counted and written (`held`), also when the signal came
    # before its recording began (`unrecorded`): a summary listing a token whose step line was never
    # written, or a line for a token it does not list, would lose part of the reply.
    unrecorded: Step | None = None
    with interrupts() as signals:
        try:
            for step in decoder.generate(ids, max_new_tokens=max_new_tokens, sampling=resolved.config):
                unrecorded = step
                with signals.held():
                    record(step)
                    unrecorded = None
        except KeyboardInterrupt as interrupt:
            if unrecorded is not None:
                record(unrecorded)
            status, stop_reason = exit_status(interrupt), INTERRUPTED
    if as_json:
        _emit_json(
            {
                "prompt_ids": ids,
                "token_ids": token_ids,
                "text": "".join(texts),
                "stop_reason": None if stop_reason is None else str(stop_reason),
                "settings": asdict(settings),
                "sampling": asdict(resolved.config),
                "sampling_source": resolved.source,
                "not_applied": list(resolved.not_applied),
                # Target-only decoding drafts nothing: no kind of draft to name.
                "draft": None if autoregressive else {"kind": pair.draft_kind, "coverage": pair.coverage},
                "stats": totals.to_dict(),
            }
        )
    else:
        sys.stdout.write("\n")
        if colour:
            # Target-only decoding has no acceptance or τ to report: it speculated nothing.
            drafting = (
                "target only · "
                if autoregressive
                else f"acceptance {totals.acceptance_rate:.0%} · τ {totals.mean_accepted_length:.2f} · "
                f"fuzzy {totals.fuzzy_share:.0%} · "
            )
            console.print(
                f"[dim]{counted(totals.tokens, 'token')} · {totals.tokens_per_second:.1f} tok/s · {drafting}"
                f"cost {totals.cost_per_token:.4f} nats/token · "
                f"{resolved.config.describe()} ({escape(resolved.source)})"
                + (
                    f" · lookup hits {totals.lookup_hits} of {totals.steps} steps"
                    if totals.lookup_hits
                    else ""
                )
                + "[/dim]",
                highlight=False,
            )
    if status and not as_json:
        # On stderr, so that a piped reply stays the reply alone; on a terminal, after its stats.
        sys.stderr.write(
            f"fsd-chat: interrupted after {counted(totals.tokens, 'token')} ({totals.tokens_per_second:.1f} tok/s)\n"
        )
    if decoder.compile_error:
        sys.stderr.write(
            f"fsd-chat: {'--whole-step' if whole_step else '--compile'} fell back to eager forward passes: "
            f"{visible(decoder.compile_error)}\n"
        )
    return status
