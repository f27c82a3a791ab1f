"""This CPU's forward times of the default model on the llama.cpp engine, beside what the model
prices them at (`fsd_chat.engines.llama_cpp.forward_seconds`, whose constants were fitted on
another 2-core CPU; the chat prices at times calibrated on the machine,
`fsd_chat.engines.llama_calibration`, whose timing pass this is): V(w), a target forward over w tokens after `MEASURE_CONTEXT` tokens of
context, and a prompt's prefill per token (over `PREFILL` tokens), at one thread, two, and one for a token with two for a batch (the chat's split).

Each width is timed `--repeats` times (`llama_calibration.time_widths`), the widths and splits
interleaved in every round (so a load that comes and goes touches each alike); each time is the
median of its samples (the calibration takes the least of its samples: here, the typical time of many). The goodput
policy's decisions follow the ratios V(w) / V(1) alone, so those are written too; the JSON feeds
`scripts/lookup_ceiling.py --forward-table`, which prices the policy's steps at these times.

    flock /work/bench.lock env PYTHONPATH=. .venv/bin/python scripts/llama_forward_table.py \
        --output docs/llama-forward-table.json

`--file-type Q4_0` (or Q8_0, Q4_K_M, ... as llama.cpp's quantize tool names them) times a copy of
the default model requantized to that type by llama.cpp itself (`llama_model_quantize`, written to a
temporary folder): the same model at another file's kernels. Requantizing from Q4_1 loses a little
of the model, which prices do not mind; the text it writes is not the default model's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from gguf import LlamaFileType

from fsd_chat.decoding.forward_timings import MEASURE_CONTEXT
from fsd_chat.engines import llama_cpp
from fsd_chat.engines.llama_calibration import calibration_ids, time_widths
from fsd_chat.models.default_model import default_model_path
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair

SPLITS = {"1": (1, 1), "2": (2, 2), "1, batches 2": (1, 2)}
"""llama.cpp's threads for one token and for several, as `scripts/lookup_ceiling.py` names them."""
WIDTHS = tuple(range(1, 9))
"""The verify widths timed: a step of draft length k runs k + 1 tokens (the chat's k ≤ 5)."""
PREFILL = 256
"""Tokens of the prompt-like forward timed for the prefill's seconds per token."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--file-type", help="time the default model requantized to this type (Q4_0, Q8_0...)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = default_model_path()
        if args.file_type:
            model = requantized(model, args.file_type, Path(folder))
        pair = load_pair(
            ModelSpec(str(model)), ModelSpec("lookup"), LoadOptions(engine="llama.cpp", threads=1)
        )
        report = table(pair, args.repeats)
    args.output.write_text(json.dumps(report, indent=1))


def requantized(model: Path, file_type: str, folder: Path) -> Path:
    """`model` requantized to `file_type` by llama.cpp (`llama_model_quantize`), in `folder`.

    Raises:
        KeyError: llama.cpp knows no such type.
        RuntimeError: llama.cpp could not quantize the file.
    """
    lib = llama_cpp.llama_cpp_module()
    params = lib.llama_model_quantize_default_params()
    params.ftype = int(LlamaFileType[f"MOSTLY_{file_type}"])
    params.allow_requantize = True
    out = folder / f"{model.stem}.{file_type}.gguf"
    if lib.llama_model_quantize(str(model).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not requantize {model.name} to {file_type}")
    return out


def table(pair: ModelPair, repeats: int) -> dict[str, object]:
    """V(w) for each width and thread split, and the prefill's seconds per token, over `repeats`
    interleaved rounds (printed as they are written), and the file's type as llama.cpp names it."""
    target = pair.target
    assert isinstance(target, llama_cpp.LlamaCppModel)
    seq = calibration_ids(target, PREFILL)
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):
        for label, threads in SPLITS.items():
            target.set_threads(*threads)
            target.reset()
            start = time.perf_counter()
            target.prefill(seq, PREFILL)
            samples.setdefault((label, 0), []).append((time.perf_counter() - start) / PREFILL)
            for width, seconds in zip(WIDTHS, time_widths(target, WIDTHS), strict=True):
                samples.setdefault((label, width), []).append(seconds)
    report: dict[str, object] = {
        "file_type": target.file_type,
        "repeats": repeats,
        "load": os.getloadavg(),
        "context": MEASURE_CONTEXT,
    }
    for label, threads in SPLITS.items():
        target.set_threads(*threads)
        measured = [statistics.median(samples[label, width]) for width in WIDTHS]
        modelled = [llama_cpp.forward_seconds(target, width) for width in WIDTHS]
        report[label] = {
            "prefill_seconds_per_token": statistics.median(samples[label, 0]),
            "modelled_prefill_seconds_per_token": llama_cpp.forward_seconds(target, PREFILL) / PREFILL,
            "measured_seconds": measured,
            "modelled_seconds": modelled,
            "measured_over_v1": [v / measured[0] for v in measured],
            "modelled_over_v1": [v / modelled[0] for v in modelled],
        }
        print(
            label,
            "measured",
            [round(v * 1e3, 1) for v in measured],
            "modelled",
            [round(v * 1e3, 1) for v in modelled],
        )
    return report


if __name__ == "__main__":
    main()
