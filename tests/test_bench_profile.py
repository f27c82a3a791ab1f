"""`bench --profile` on the CPU: torch.profiler over one reply, its columns (kernel counts 0 here,
and the table says so), the weights a reply reads and the copy bandwidth it is measured against."""

from __future__ import annotations

import functools
import math

import torch
from rich.console import Console

from fsd_chat.bench.methods import PairRunner
from fsd_chat.bench.profile import copy_bandwidth, profile_reply, profile_table, weight_bytes
from fsd_chat.bench.records import Configuration, ReplyProfile, Setup
from fsd_chat.models.pair import ModelPair

SETUP = Setup("float32", "none", "none")
PROMPT = [1, 403, 200, 263, 100]


def profiled(pair: ModelPair, config: Configuration, bandwidth: float | None) -> ReplyProfile:
    runner = PairRunner(pair)
    try:
        run = functools.partial(runner.run, config, PROMPT, max_new_tokens=12, seed=0, stop_strings=())
        return profile_reply(run, pair.device, pair.target, pair.draft, bandwidth)
    finally:
        runner.close()


def test_a_profiled_reply_on_the_cpu_has_no_kernels_and_reads_its_weights(pair: ModelPair) -> None:
    bandwidth = copy_bandwidth(torch.device("cpu"))
    assert 1e8 < bandwidth < 1e13  # bytes/s, read + written: between 0.1 GB/s and 10 TB/s
    target_only = profiled(pair, Configuration(SETUP, 0.0, "autoregressive"), bandwidth)
    exact = profiled(pair, Configuration(SETUP, 0.0, "exact", 4), bandwidth)
    for profile in (target_only, exact):
        assert profile.tokens == 12 and profile.wall_ms > 0
        assert not profile.on_device and profile.top_kernels == []
        assert profile.kernels == profile.busy_ms == profile.graph_launch_us == profile.host_wait_us == 0
        assert profile.kernels_per_layer == 0
        assert profile.bandwidth_use is not None and 0 < profile.bandwidth_use < 1
    # Target-only reads the target once a token (and once for the prompt's prefill).
    target = weight_bytes(pair.target)
    assert target <= target_only.weight_bytes_per_token <= target * 13 / 12
    # A speculative reply reads the target once a step and the draft once a drafted token: fewer
    # target reads a token than target-only, some draft reads.
    assert exact.weight_bytes_per_token != target_only.weight_bytes_per_token
    # Bandwidth use: the weight bytes read a wall second over the copy bandwidth.
    expected = target_only.weight_bytes_per_token * 1000 / target_only.wall_ms / bandwidth
    assert math.isclose(target_only.bandwidth_use or 0, expected, rel_tol=1e-9)
    console = Console(width=250, record=True)
    console.print(profile_table([("autoregressive", target_only), ("exact k=4", exact)], bandwidth))
    text = console.export_text()
    assert "on the CPU there are no kernels: kernel, busy, launch and wait columns are 0" in text
    assert "exact k=4" in text and "GB/s (read + written), measured in this run" in text


def test_the_input_embeddings_table_is_not_read_unless_the_head_shares_it(pair: ModelPair) -> None:
    model = pair.target
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is table
    assert weight_bytes(model) == (total if tied else total - table.numel() * table.element_size())
