"""The commands over the llama.cpp engine, on a real llama.cpp: `generate` names its engine and
decodes a GGUF file on it, `--engine llama.cpp` with a model that is not a GGUF file is one line and
exit status 2, the chat's loading screen names the engine and the chat opens on it, `serve` answers
and reuses the cached prefix of a resent history, and `bench` runs llama.cpp's own baselines beside
fsd-chat's rows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from textual.widgets import Static

from fsd_chat.conversation.controller import ChatOptions
from fsd_chat.conversation.store import SessionStore
from fsd_chat.decoding.settings import LOOKUP
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.tui.app import FsdChatApp
from tests.conftest import LLAMA_CPP_MISSING
from tests.test_bench_cli import DATA_DIR
from tests.test_bench_table import _check_tables
from tests.test_cli_generate import run_cli
from tests.test_server import MODEL, extra, serving, user
from tests.tui.helpers import SIZE, recording_loader, wait_for_chat

pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)

LLAMA_CPP_LINE = re.compile(r"(llama_|ggml_|load_tensors|print_info|Llama\.|Model metadata|Guessed chat)")
"""The start of a line of llama.cpp's log (its functions' names) or of llama-cpp-python's prints."""


def test_generate_runs_a_gguf_file_on_llama_cpp_and_says_so(
    stories_gguf_files: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("FSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    target, draft = stories_gguf_files
    args = [
        "generate",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--draft-policy",
        "fixed",
        "--threads",
        "1",
    ]
    code, out, err = run_cli([*args, "--json", "--max-new-tokens", "12", "Once upon a time"], capsys)
    assert code == 0, err
    assert "fsd-chat: engine llama.cpp (a GGUF file, llama-cpp-python installed)" in err.splitlines()
    final = json.loads(out.splitlines()[-1])
    assert len(final["token_ids"]) == 12 and final["text"]
    assert final["stats"]["draft_forwards"] > 0  # the GGUF draft drafted, on llama.cpp


def test_llama_cpp_with_a_model_folder_is_one_line_and_status_2(
    target_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(
        ["generate", "--target", str(target_dir), "--engine", "llama.cpp", "--max-new-tokens", "4", "Hi"],
        capsys,
    )
    assert code == 2 and out == ""
    assert err.strip() == (
        "fsd-chat: error: --engine llama.cpp runs GGUF files, and stories260K is not one: name a .gguf file, "
        "or use --engine transformers"
    )


def test_serve_on_llama_cpp_answers_and_reuses_the_cached_prefix(llama_pair: ModelPair) -> None:
    with serving(llama_pair) as served:
        client = served.client()
        first = client.chat.completions.create(model=MODEL, messages=user(), max_tokens=8)  # type: ignore[arg-type]
        text = first.choices[0].message.content
        assert text and extra(first, "timings")["predicted_n"] == 8
        history = [*user(), {"role": "assistant", "content": text}, *user("And then?")]
        second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4)  # type: ignore[arg-type]
        assert extra(second, "timings")["cache_n"] > 0  # the first turn's tokens were not read again


@pytest.mark.slow  # a sweep
def test_bench_runs_llama_cpps_own_baselines(
    stories_gguf_files: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    from fsd_chat.cli import main

    monkeypatch.setenv("FSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    args = [
        "bench",
        "--target", str(stories_gguf_files[0]),
        "--prompts", "tinystories", "--data-dir", str(DATA_DIR),
        "--limit", "2", "--max-new-tokens", "16",
        "--rules", "fuzzy", "--divergences", "js", "--thresholds", "0.2", "--draft-tokens", "3",
        "--threads", "1", "--threads-batch", "2", "--output", str(out),
    ]  # fmt: skip
    main(args)  # returns: a sweep that ran to its end
    # It says the engine it chose and why, then what loaded, as it runs (the file's type, not the
    # transformers dtype asked for), and llama.cpp's baselines print nothing of llama.cpp's or
    # llama-cpp-python's.
    printed = capfd.readouterr()
    err = printed.err.splitlines()
    assert "engine llama.cpp (a GGUF file, llama-cpp-python installed)" in err
    assert "loaded llama.cpp F32" in err and not [line for line in err if "float32" in line]
    assert not [line for line in err if LLAMA_CPP_LINE.match(line)], err
    report = json.loads((out / "report.json").read_text())
    configs = report["configs"]
    assert report["environment"]["scorer"].endswith("llama.cpp cpu, 1 thread, 2 a batch")
    by_method = {c["method"]: c for c in configs}
    # The default baselines on the llama.cpp engine.
    assert {"autoregressive", "exact", "llama.cpp", "llama.cpp-lookup", "fuzzy"} <= set(by_method)
    for method in ("llama.cpp", "llama.cpp-lookup"):
        assert by_method[method]["tokens"] > 0
        assert by_method[method]["target_forwards_per_token"] > 0
    assert "llama.cpp" in by_method["fuzzy"]["speedup"]
    assert "llama.cpp-lookup" in by_method["fuzzy"]["speedup"]
    # Every row ran on llama.cpp, over the file as it is (float32 GGUF files): the rows say so, not
    # the transformers engine's dtype.
    assert {c["setup"] for c in configs} == {"llama.cpp F32"}
    # Both tables, cell by cell: the columns against llama.cpp (a baseline whose name holds a dot)
    # show their figures, on the wall clock and the decode clock.
    _check_tables(printed.out, out)
    assert by_method["fuzzy"]["decode_speedup"]["llama.cpp"] > 0
    assert by_method["llama.cpp"]["time_to_first_token"] > 0


async def test_the_chat_names_the_engine_while_loading_and_opens_on_llama_cpp(
    stories_gguf_files: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    options = ChatOptions(
        target=ModelSpec(str(stories_gguf_files[0])),
        draft=ModelSpec(LOOKUP),
        load=LoadOptions(device="cpu"),
        store=SessionStore(tmp_path / "s.sqlite3"),
    )
    seen: list[str] = []
    app = FsdChatApp(options, loader=recording_loader(options, seen))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        assert seen[0] == "engine llama.cpp (a GGUF file, llama-cpp-python installed)"
        assert "llama.cpp cpu" in str(app.screen.query_one("#header", Static).content)
