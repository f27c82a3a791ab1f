"""The `fsd-chat generate` command's options; the reply itself is written by `fsd_chat.generate`
(imported when the command runs, since it loads torch)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from fsd_chat import cli_options as o
from fsd_chat.log import quiet_libraries


def generate(
    prompt: Annotated[
        str, typer.Argument(help="The prompt (a user turn for chat models); - reads it from standard input.")
    ],
    target: o.TargetOpt,
    draft: o.DraftOpt,
    threshold: o.ThresholdOpt = o.DEFAULT_THRESHOLD,
    divergence: o.DivergenceOpt = o.DEFAULT_DIVERGENCE,
    rule: o.RuleOpt = o.DEFAULT_RULE,
    draft_tokens: o.DraftTokensOpt = o.DEFAULT_K,
    draft_policy: o.DraftPolicyOpt = o.DEFAULT_DRAFT_POLICY,
    compile_draft: o.CompileOpt = False,
    temperature: o.TemperatureOpt = 0.0,
    top_p: o.TopPOpt = 1.0,
    top_k: o.TopKOpt = 0,
    seed: o.SeedOpt = None,
    max_new_tokens: o.MaxNewTokensOpt = 256,
    quantize_target: o.QuantizeTargetOpt = "none",
    quantize_draft: o.QuantizeDraftOpt = "none",
    device: o.DeviceOpt = "auto",
    dtype: o.DtypeOpt = "auto",
    trust_remote_code: o.TrustRemoteCodeOpt = False,
    threads: o.ThreadsOpt = None,
    raw: Annotated[bool, typer.Option("--raw", help="Plain text prompt, no chat template.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="JSON Lines: one object per step, then a summary.")
    ] = False,
    autoregressive: Annotated[
        bool, typer.Option("--autoregressive", help="Target-only decoding (the baseline).")
    ] = False,
) -> None:
    """Stream one reply to PROMPT, coloured by token origin on a terminal."""
    from fsd_chat.generate import prompt_text, run_generate

    o.check_max_new_tokens(max_new_tokens)
    settings = o.decoding_settings(rule, divergence, threshold, draft_tokens, draft_policy)
    sampling = o.sampling_config(temperature, top_k, top_p, seed)
    specs = o.pair_specs(target, draft, quantize_target, quantize_draft, device, dtype, trust_remote_code)
    text = prompt_text(prompt, sys.stdin.buffer)
    quiet_libraries()
    run_generate(
        text,
        *specs,
        settings=settings,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        raw=raw,
        as_json=as_json,
        autoregressive=autoregressive,
        threads=threads,
        compile_draft=compile_draft,
    )
