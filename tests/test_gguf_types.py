"""GGUF files holding the ggml types llama.cpp's quantizer mixes: a Q4_K_M file keeps Q4_K and Q6_K
where a row is a multiple of 256 values and falls back to Q5_0, Q5_1 or Q8_0 elsewhere (most of a
small model's tensors), with float16 or float32 beside them. Written by the tests (`write_gguf`, the
K-quants by `k_quantize`), loaded through fsd-chat's loader, every weight must be the file's tensor as
`gguf.quants.dequantize` reads it, exactly, and the logits those of the folder so dequantized; a type
no dequantizer reads is refused by name, id and the tensors that hold it."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.integrations.gguf import GgufHeader

from fsd_chat.decoding.settings import LOOKUP
from fsd_chat.engines.torch_engine.fused_linear import fuse_projections
from fsd_chat.models.gguf_table import read_table, with_values
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.errors import ModelLoadError
from tests.gguf_models import dequantized_state, file_names, k_quantize, set_tensor_type, write_gguf
from tests.tiny_models import save_gemma3, save_tiny_model

CPU = LoadOptions(device="cpu", dtype="float32", engine="transformers")
T = gguf.GGMLQuantizationType
TEXT = "Once upon a time, there was a little girl named Lily. She had 3 red balls!"
WRITTEN = (T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.TQ1_0, T.TQ2_0, T.MXFP4, T.Q4_K, T.Q6_K)
"""Every type the tests write: the gguf package's quantizer's and `k_quantize`'s."""
Types = Callable[[str, int], T | None]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, target_dir: Path) -> dict[str, Path]:
    """A tiny Llama, Gemma 3 and LFM2 whose MLPs are 256 wide: their down projections' rows fit a
    K-quant block, their other rows (64 wide) do not, as in a small real model. transformers reads
    the first two through its older GGUF loader, LFM2 through its newer one."""
    root = tmp_path_factory.mktemp("typed-folders")
    return {
        "llama": save_tiny_model(
            root / "llama", "llama", seed=0, tokenizer_dir=target_dir, intermediate_size=256
        ),
        "gemma3": save_gemma3(root / "gemma3", target_dir, norm_spread=0.5, intermediate_size=256),
        "lfm2": save_tiny_model(
            root / "lfm2", "lfm2", seed=0, tokenizer_dir=target_dir, layers=4, intermediate_size=256
        ),
    }


def typed(folder: Path, choose: Types) -> dict[str, T]:
    """`write_gguf`'s `tensor_types`: `choose(name in the file, row width)` for each 2-D tensor of the
    folder's, where it names a type (the 1-D norms stay float32, as llama.cpp keeps them)."""
    types = {}
    shapes = {name: tensor.shape for name, tensor in load_file(folder / "model.safetensors").items()}
    for name, file_name in file_names(folder).items():
        if len(shapes[name]) == 2 and (qtype := choose(file_name, shapes[name][-1])) is not None:
            types[file_name] = qtype
    return types


def q4_k_m(name: str, width: int) -> T:
    """A Q4_K_M-like mix: K-quants where the rows allow (Q4_K in layer 0, Q6_K after), else the
    legacy types llama.cpp falls back to, and float16."""
    if width % 256 == 0:
        return T.Q4_K if ".0." in name else T.Q6_K
    for part, qtype in (("attn_q", T.Q5_0), ("attn_k", T.Q5_0), ("attn_v", T.Q5_1), ("attn_output", T.Q5_1)):
        if part in name:
            return qtype
    return T.F16 if "ffn_up" in name else T.Q8_0


def load(path: Path, seen: list[str] | None = None) -> ModelPair:
    return load_pair(ModelSpec(str(path)), ModelSpec(LOOKUP), CPU, None if seen is None else seen.append)


def assert_dequantized_exactly(folder: Path, path: Path, loaded: ModelPair) -> None:
    """Each weight of the loaded model is the file's, dequantized by gguf.quants, bit for bit, and
    its logits are those of the folder holding these weights."""
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    reference.load_state_dict(dequantized_state(folder, path), strict=True)
    fuse_projections(reference)  # as the loader fuses q, k, v and gate, up
    state = loaded.target.state_dict()
    unequal = [
        name for name, tensor in reference.state_dict().items() if not torch.equal(state[name], tensor)
    ]
    assert unequal == []
    ids = loaded.tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.inference_mode():
        assert torch.equal(loaded.target(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "lfm2"])
def test_a_q4_k_m_mix_loads_as_gguf_dequantizes_it(
    tmp_path: Path, folders: dict[str, Path], arch: str, cache: Path
) -> None:
    folder = folders[arch]
    types = typed(folder, q4_k_m)
    assert {T.Q4_K, T.Q6_K, T.Q5_0, T.Q5_1, T.Q8_0, T.F16} == set(types.values())
    path = write_gguf(folder, tmp_path / f"{arch}-Q4_K_M.gguf", tensor_types=types)
    held = {entry.name: entry.type_id for entry in read_table(path).tensors}
    assert all(held[name] == qtype for name, qtype in types.items())
    seen: list[str] = []
    assert_dequantized_exactly(folder, path, load(path, seen))
    assert f"converting {path.name} (first start only)" in seen


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
@pytest.mark.parametrize("qtype", WRITTEN, ids=lambda t: t.name)
def test_each_type_alone_loads_as_gguf_dequantizes_it(
    tmp_path: Path, folders: dict[str, Path], qtype: T, arch: str
) -> None:
    """Each type wherever its block fits the rows (K-quants and ternary types: the MLP's down
    projection only), the rest float32; through transformers' older loader (llama) and its newer
    one (lfm2), which dequantizes the types it has with its own code."""
    folder = folders[arch]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    types = typed(folder, lambda name, width: qtype if width % block == 0 else None)
    assert types
    path = write_gguf(folder, tmp_path / f"{arch}-{qtype.name}.gguf", tensor_types=types)
    assert_dequantized_exactly(folder, path, load(path))


def test_the_k_quant_writer_quantizes() -> None:
    """`k_quantize` writes blocks gguf reads back as the values, within half a step of the
    quantization grid (the steps: 1/31 of a 16-value group's largest magnitude in Q6_K, 1/15 of a
    32-value group's range in Q4_K, each scale itself rounded to 63 or 127 steps)."""
    values = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    for qtype, error in ((T.Q6_K, 0.07), (T.Q4_K, 0.2)):
        back = gguf.quants.dequantize(k_quantize(values, qtype), qtype)
        assert np.abs(back - values).max() < error
        assert np.abs(back - values).mean() < error / 3


@pytest.mark.parametrize(
    ("type_id", "named"),
    [(41, "Q1_0 (id 41)"), (15, "Q8_K (id 15)"), (99, "an unknown type (id 99)")],
)
def test_a_type_no_dequantizer_reads_is_refused_by_name(
    tmp_path: Path, folders: dict[str, Path], type_id: int, named: str, cache: Path
) -> None:
    folder = folders["llama"]
    path = write_gguf(folder, tmp_path / "odd.gguf", tensor_types=typed(folder, q4_k_m))
    set_tensor_type(path, "blk.0.attn_q.weight", type_id)
    set_tensor_type(path, "blk.1.attn_q.weight", type_id)
    with pytest.raises(ModelLoadError) as error:
        load(path)
    assert str(error.value).startswith(
        f"{path} holds tensors of a ggml type that no dequantizer reads: {named} in 2 tensors "
        "(blk.0.attn_q.weight, blk.1.attn_q.weight) (fsd-chat reads F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
    )
    assert "damaged" not in str(error.value) and "\n" not in str(error.value)
    assert not (cache / "gguf").exists() or not any((cache / "gguf").iterdir())  # nothing converted


def test_a_copy_for_transformers_newer_loader_holds_gguf_values(
    tmp_path: Path, folders: dict[str, Path]
) -> None:
    """transformers' newer GGUF loader (lfm2, qwen35) lacks Q5_0, Q5_1 and the ternary and FP4
    types: it is handed a copy with those tensors as float32, the gguf package's values, and the
    rest byte for byte."""
    folder = folders["llama"]
    path = write_gguf(folder, tmp_path / "mixed.gguf", tensor_types=typed(folder, q4_k_m))
    table = read_table(path)
    lacking = frozenset({int(T.Q5_0), int(T.Q5_1)})
    copy = with_values(table, lacking, tmp_path / "copy.gguf")
    again = read_table(copy)
    assert again.metadata == table.metadata and again.data_start == table.data_start
    for before, after in zip(table.tensors, again.tensors, strict=True):
        assert (after.name, after.shape) == (before.name, before.shape)
        if before.type_id in lacking:
            assert after.type_id == T.F32
            assert np.array_equal(again.values(after), table.values(before))
        else:
            assert after.type_id == before.type_id
            assert np.array_equal(again.raw(after), table.raw(before))
    # transformers' newer reader, which refuses the original, reads the copy's table.
    with pytest.raises(ValueError, match="ggml type 6, which is not supported yet"):
        GgufHeader.from_file(str(path))
    assert len(GgufHeader.from_file(str(copy)).tensors) == len(table.tensors)


def test_the_q4_k_m_file_copied_elsewhere_is_not_converted_again(
    tmp_path: Path, folders: dict[str, Path], cache: Path
) -> None:
    folder = folders["gemma3"]
    path = write_gguf(folder, tmp_path / "gemma.gguf", tensor_types=typed(folder, q4_k_m))
    load(path)
    (tmp_path / "elsewhere").mkdir()
    copy = Path(shutil.copy(path, tmp_path / "elsewhere" / "gemma-3-270m-it-Q4_K_M.gguf"))
    seen: list[str] = []
    load(copy, seen)
    assert "loading the converted copy of gemma-3-270m-it-Q4_K_M.gguf (converted on an earlier start)" in seen
    assert not any("converting" in message for message in seen)
    assert len(list((cache / "gguf").iterdir())) == 1
