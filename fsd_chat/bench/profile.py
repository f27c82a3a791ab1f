"""Where a reply's time goes: torch.profiler over one reply of a configuration (`bench --profile`).

Per generated token: the wall time, the device's busy time (the sum of its kernels' times), the
number of kernels, the host's time in `cudaGraphLaunch` (launching captured graphs) and its time
waiting for the device (`cudaEventSynchronize`, `cudaStreamSynchronize`, `cudaDeviceSynchronize`);
kernels a layer (the reply's kernels over its layer passes: target forwards × target layers + draft
forwards × draft layers); the top kernels by device time; and the bandwidth use: the bytes of
weights the reply's forward passes read, per second of wall time, over the device's copy bandwidth
(`copy_bandwidth`, measured in the same run: a ratio that holds across cards). A forward pass reads
every weight once, the input embedding's table aside (a row a token), unless it is tied to the output
head.

On the CPU there are no kernels: kernel counts, busy time, launches and waits are 0, and the table
says so. The profiler's own cost inflates the profiled reply's wall time somewhat (measured: about
10% on an H200, 2026-11-27); the tokens/s columns come from the unprofiled replies.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch
from rich.table import Table
from rich.text import Text
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from fsd_chat.bench.records import Generation, Kernel, ReplyProfile

TOP_KERNELS = 5
LAUNCH = "cudaGraphLaunch"
WAITS = frozenset({"cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize"})
COPY_BYTES = {"cuda": 2 * 2**30, "cpu": 256 * 2**20}
"""Bytes the copy-bandwidth measurement copies: a few GB on a GPU (far beyond its L2), less on a
CPU (the CPU suite's tiny runs)."""


def copy_bandwidth(device: torch.device) -> float:
    """The device's copy bandwidth in bytes per second, bytes read and written counted (a
    device-to-device copy of `COPY_BYTES`, best of three after a warm-up)."""
    size = COPY_BYTES["cuda" if device.type == "cuda" else "cpu"]
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for trial in range(4):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(source)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            began = time.perf_counter()
            target.copy_(source)
            seconds = time.perf_counter() - began
        if trial:  # the first is the warm-up
            best = min(best, seconds)
    return 2 * size / best


def weight_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s weights a forward pass reads: every parameter (packed quantized weights at
    their stored size), less the input embedding's table unless the output head shares it."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if isinstance(embeddings, nn.Embedding) and (head is None or head.weight is not embeddings.weight):
        total -= embeddings.weight.numel() * embeddings.weight.element_size()
    return total


def _layers(model: nn.Module | None) -> int:
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None else None
    return int(getattr(text, "num_hidden_layers", 0) or 0)


def profile_reply(
    run: Callable[[], Generation],
    device: torch.device,
    target: nn.Module,
    draft: nn.Module | None,
    bandwidth: float | None,
) -> ReplyProfile:
    """Profile the reply `run` generates (fsd-chat's decoders: its stats give the forward passes)
    on `device`, for the pair `target` / `draft` (None: no draft model)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        generation = run()
    tokens = max(len(generation.token_ids), 1)
    busy_us = 0.0
    kernels = 0
    launch_us = wait_us = 0.0
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in profiler.events():
        if event.device_type == DeviceType.CUDA:
            kernels += 1
            busy_us += event.device_time
            entry = by_name[event.name]
            entry[0] += event.device_time
            entry[1] += 1
        elif event.name == LAUNCH:
            launch_us += event.cpu_time
        elif event.name in WAITS:
            wait_us += event.cpu_time
    stats = generation.stats
    target_passes = stats.target_forwards if stats is not None else generation.target.calls
    draft_passes = stats.draft_forwards if stats is not None else generation.draft.calls
    layer_passes = target_passes * _layers(target) + draft_passes * _layers(draft)
    read = target_passes * weight_bytes(target) + (draft_passes * weight_bytes(draft) if draft else 0)
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    return ReplyProfile(
        tokens=len(generation.token_ids),
        wall_ms=1000 * generation.seconds / tokens,
        busy_ms=busy_us / 1000 / tokens,
        kernels=kernels / tokens,
        graph_launch_us=launch_us / tokens,
        host_wait_us=wait_us / tokens,
        kernels_per_layer=kernels / layer_passes if layer_passes else 0.0,
        weight_bytes_per_token=read / tokens,
        bandwidth_use=read / generation.seconds / bandwidth if bandwidth and generation.seconds > 0 else None,
        on_device=device.type == "cuda",
        top_kernels=[Kernel(name[:80], us / 1000, int(calls)) for name, (us, calls) in top],
    )


def profile_table(rows: list[tuple[str, ReplyProfile]], bandwidth: float | None) -> Table:
    """The profiles of `rows` (a label and its profile each): one line a configuration, then its
    top kernels (see docs/benchmarks.md, "Reading the profile")."""
    on_device = any(p.on_device for _, p in rows)
    caption = (
        f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written), measured in this run"
        if bandwidth
        else "no copy bandwidth measured"
    )
    if not on_device:
        caption += "; on the CPU there are no kernels: kernel, busy, launch and wait columns are 0"
    table = Table(
        "configuration",
        "wall ms/tok",
        "busy ms/tok",
        "kernels/tok",
        "graph launch µs/tok",
        "host wait µs/tok",
        "kernels/layer",
        "weights MB/tok",
        "bandwidth use",
        title="profile: one reply under torch.profiler, per generated token",
        caption=caption,
    )
    for label, p in rows:
        use = f"{p.bandwidth_use:.0%}" if p.bandwidth_use is not None else "-"
        table.add_row(
            Text(label),
            f"{p.wall_ms:.2f}",
            f"{p.busy_ms:.2f}",
            f"{p.kernels:.0f}",
            f"{p.graph_launch_us:.0f}",
            f"{p.host_wait_us:.0f}",
            f"{p.kernels_per_layer:.1f}",
            f"{p.weight_bytes_per_token / 1e6:.0f}",
            use,
        )
        for kernel in p.top_kernels:
            table.add_row(
                Text(f"  {kernel.name}", style="dim"),
                "",
                Text(f"{kernel.milliseconds / max(p.tokens, 1):.3f}", style="dim"),
                Text(f"{kernel.calls / max(p.tokens, 1):.1f}", style="dim"),
            )
    return table
