"""Out-of-memory and bitsandbytes failures of a GPU setup end in one line, and a reply that ran out
of memory leaves the decoder usable.

No GPU runs here, so torch's out-of-memory error is raised by a patched call (the model's forward,
or transformers' loader): the one use of a mock in these tests, standing in for CUDA. The
bitsandbytes check runs for real against the installed build, whose CUDA library is absent here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.models.options import ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.models.transformers_loading import check_bitsandbytes_cuda
from fsd_chat.support.errors import DeviceMemoryError, ModelLoadError
from tests.decoding_helpers import collect
from tests.test_cli_generate import pair_args, run_cli

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 7.79 GiB total capacity)"


def test_running_out_of_memory_mid_reply_frees_the_caches(
    pair: ModelPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoder = pair.speculative(Controls(DecodingSettings(threshold=0.0)))
    ids = pair.tokenizer("Once upon a time").input_ids
    expected = collect(decoder.generate(ids, max_new_tokens=40, sampling=SamplingConfig())).ids
    forward = type(pair.target).forward
    calls = 0

    def failing(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 4:
            raise torch.OutOfMemoryError(OOM)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(pair.target), "forward", failing)
    with pytest.raises(DeviceMemoryError) as caught:
        collect(decoder.generate(ids, max_new_tokens=40, sampling=SamplingConfig()))
    message = str(caught.value)
    assert "\n" not in message and "KV cache" in message and "--quantize-target 4bit" in message
    assert [m.seen for m in decoder.cached_models] == [0, 0]
    monkeypatch.undo()
    assert collect(decoder.generate(ids, max_new_tokens=40, sampling=SamplingConfig())).ids == expected


def test_a_model_too_big_to_load_is_one_line(
    target_dir: Path, draft_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def too_big(*args, **kwargs):
        raise torch.OutOfMemoryError(OOM)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", too_big)
    code, out, err = run_cli(["generate", *pair_args(target_dir, draft_dir), "Once upon a time"], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "did not fit in GPU memory" in err and "--quantize-target 4bit" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a bitsandbytes build without CUDA")
def test_bitsandbytes_without_cuda_says_so(target_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="needs a bitsandbytes build with CUDA support"):
        check_bitsandbytes_cuda(ModelSpec(str(target_dir), "4bit"))
