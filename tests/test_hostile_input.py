"""Hostile input, damaged files and odd environments, through the real command line.

Every case of the table runs `fsd-chat` in-process through its entry point (`fsd_chat.cli.main`,
what the console script calls) and must end with the expected exit code, exactly one line on
stderr naming the problem, no traceback, nothing on stdout, and no file created or changed in the
user's folders (working directory, config and data folders). Cases that need a real stdout that
fails (a full disk) or the terminal run the console script in a subprocess.
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from fsd_chat.cli import main
from fsd_chat.conversation.store import SessionStore
from fsd_chat.models.chat_template import Message, fit_to_context, prompt_ids
from fsd_chat.models.pair import ModelPair
from fsd_chat.models.vocabulary import check_compatible
from fsd_chat.support.errors import ContextLengthError, IncompatibleModelsError
from fsd_chat.support.text import to_json, visible
from tests.test_cli_generate import run_cli as run
from tests.test_transcript import session as saved_session

CONSOLE_SCRIPT = str(Path(sys.executable).with_name("fsd-chat"))
ESC_TOKEN = "<0x1B>"  # the byte-fallback token of the escape character, in the offline vocabulary


class Evil:
    """Unpickling this runs `print`: what a malicious pytorch_model.bin would do with os.system."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("pickled code ran",))


def _copy(source: Path, root: Path, name: str) -> Path:
    destination = root / name
    shutil.copytree(source, destination)
    return destination


Tensors = dict[str, torch.Tensor]


def _rewrite_weights(folder: Path, change: Callable[[Tensors], Tensors]) -> None:
    tensors = load_file(folder / "model.safetensors")
    save_file(change(tensors), folder / "model.safetensors", metadata={"format": "pt"})


def _swap_tokens(folder: Path, a: str, b: str) -> None:
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))


TEMPLATES = {
    "template-raises": "{{ raise_exception('roles must alternate') }}",
    "template-syntax": "{% for m in messages %}{{ m.content }}",
    "template-unsafe": "{{ ''.__class__.__mro__ }}",
    "template-recursive": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "template-range": "{% for i in range(1000000) %}{% endfor %}",
    "template-lipsum": "{{ lipsum(1, html=False, min=1, max=1) }}",
}
"""Chat templates that fail as a careless or hostile model folder's can: their own exception, a
syntax error, the sandbox's SecurityError, runaway recursion, a range over the sandbox's limit,
and lipsum's own error."""


def _with_template(folder: Path, template: str) -> Path:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _add_token(folder: Path, content: str) -> None:
    """A token added to tokenizer.json after the last id: one past the models' 512-row embedding."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    ids = [*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer["added_tokens"])]
    tokenizer["added_tokens"].append(
        {
            "id": max(ids) + 1,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": False,
        }
    )
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, target_dir: Path, draft_dir: Path) -> dict[str, Path]:
    """The real pair, and damaged copies of its target."""
    root = tmp_path_factory.mktemp("hostile-models")
    truncated = _copy(target_dir, root, "truncated")
    weights = truncated / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    missing = _copy(target_dir, root, "missing")
    _rewrite_weights(missing, lambda t: {k: v for k, v in t.items() if ".layers.0." not in k})
    misshapen = _copy(target_dir, root, "misshapen")
    _rewrite_weights(misshapen, lambda t: {**t, "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)})
    pickled = _copy(target_dir, root, "pickled")
    tensors = load_file(pickled / "model.safetensors")
    (pickled / "model.safetensors").unlink()
    torch.save({**tensors, "payload": Evil()}, pickled / "pytorch_model.bin")
    templated = {
        name: _with_template(_copy(target_dir, root, name), text) for name, text in TEMPLATES.items()
    }
    no_tokenizer = _copy(target_dir, root, "no-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink()
    larger = {
        name: _copy(folder, root, f"larger-{name}")
        for name, folder in (("target", target_dir), ("draft", draft_dir))
    }
    for folder in larger.values():
        _add_token(folder, "zzqq")
    return {
        "target": target_dir,
        "draft": draft_dir,
        "truncated": truncated,
        "missing": missing,
        "misshapen": misshapen,
        "pickled": pickled,
        "no-tokenizer": no_tokenizer,
        "larger-target": larger["target"],
        "larger-draft": larger["draft"],
        **templated,
    }


@dataclass(frozen=True)
class Case:
    """One hostile command line: args (with {placeholders} for model folders and the user's
    folders), the text the one stderr line must hold, the exit code, and optionally a config.toml,
    standard input, and files to create first (relative to the user's folder)."""

    id: str
    args: list[str]
    message: str
    code: int = 2
    config: str | None = None
    stdin: bytes | None = None
    files: dict[str, bytes | None] = field(default_factory=dict)  # None: a folder
    stdin_closed: bool = False
    prepare: str | Callable[[Path], object] | None = None
    """Makes the hostile condition in the user's folder first: SQL run on the saved sessions (an
    edited row), or a function of the folder (a link, a FIFO)."""


PAIR = ["--target", "{target}", "--draft", "{draft}", "--device", "cpu"]
GEN = ["generate", *PAIR, "--max-new-tokens", "4"]
DATA = str(Path(__file__).resolve().parents[1] / ".." / "shared" / "data")


def bench(prompts: str = "tinystories") -> list[str]:
    return [
        "bench",
        *PAIR,
        "--prompts",
        prompts,
        "--data-dir",
        DATA,
        "--limit",
        "1",
        "--output",
        "{home}/out",
    ]


BENCH = bench()


def damaged(name: str) -> list[str]:
    return ["generate", "--target", "{" + name + "}", "--draft", "{draft}", "--device", "cpu", "Once"]


CASES = [
    # 1. damaged weights
    Case(
        "truncated-safetensors", damaged("truncated"), "truncated/model.safetensors is damaged or truncated"
    ),
    Case("missing-tensors", damaged("missing"), "9 missing tensors (model.layers.0."),
    Case("wrong-shapes", damaged("misshapen"), "1 tensors of the wrong shape (model.layers.0.mlp.up_proj"),
    Case("malicious-pickle", damaged("pickled"), "refused to load its pickled weights (pytorch_model.bin)"),
    # 2. text that is not UTF-8, and prompts from standard input
    Case("prompt-not-utf8", [*GEN, "Once \udcff"], "is not valid UTF-8 (byte 0xff at character 6)"),
    Case("system-not-utf8", ["chat", *PAIR, "--system", "\udcfe"], "is not valid UTF-8 (byte 0xfe"),
    Case(
        "stdin-not-utf8", [*GEN, "-"], "standard input:2: not valid UTF-8 (byte 0xff)", stdin=b"Once\nup\xff"
    ),
    Case("stdin-empty", [*GEN, "-"], "the prompt is empty", stdin=b"\n"),
    Case("empty-prompt", [*GEN, ""], "the prompt is empty"),
    Case("blank-prompt", [*GEN, " \t\n"], "the prompt is empty"),
    Case(
        "bench-jsonl-not-utf8",
        bench("{home}/p.jsonl"),
        "p.jsonl:2: not valid UTF-8 (byte 0xfe)",
        files={"p.jsonl": b'{"prompt": "fine"}\n{"prompt": "\xfe"}\n'},
    ),
    Case(
        "bench-jsonl-lone-surrogate",
        bench("{home}/p.jsonl"),
        "the prompt of row 1 is not valid UTF-8 (byte 0xff",
        files={"p.jsonl": b'{"prompt": "\\udcff"}\n'},
    ),
    # 8. huge or extreme numbers: one rule for generate, chat and bench
    Case(
        "huge-max-new-tokens", [*GEN, "--max-new-tokens", "1000000000000", "x"], "--max-new-tokens must be in"
    ),
    Case("seed-over-64-bits", [*GEN, "--seed", str(2**64), "x"], "seed must be in 0..2^64 − 1"),
    Case(
        "tiny-temperature",
        [*GEN, "--temperature", "1e-40", "x"],
        "temperature must be 0 (greedy) or a finite",
    ),
    Case(
        "infinite-temperature",
        [*GEN, "--temperature", "inf", "x"],
        "temperature must be 0 (greedy) or a finite",
    ),
    Case("tiny-top-p", [*GEN, "--temperature", "1", "--top-p", "1e-300", "x"], "top-p must be in [1e-06, 1]"),
    Case(
        "infinite-threshold", [*GEN, "--threshold", "inf", "--json", "x"], "threshold must be a finite number"
    ),
    Case(
        "bench-infinite-temperature",
        [*BENCH, "--temperature", "0,inf"],
        "temperature must be 0 (greedy) or a",
    ),
    Case("bench-infinite-threshold", [*BENCH, "--thresholds", "inf"], "threshold must be a finite number"),
    Case(
        "bench-seed-over-64-bits",
        [*BENCH, "--limit", "2", "--seed", str(2**64 - 1)],
        "seed must be in 0..2^64 − 1",
    ),
    Case("bench-zero-tokens", [*BENCH, "--max-new-tokens", "0"], "--max-new-tokens must be in"),
    # 9. the chat checks flags and config.toml before its screen opens
    Case("chat-zero-tokens", ["chat", *PAIR, "--max-new-tokens", "0"], "--max-new-tokens must be in"),
    Case("chat-mps", ["chat", *PAIR[:4], "--device", "mps"], "unsupported device 'mps'"),
    Case("chat-int8", ["chat", *PAIR, "--dtype", "int8"], "unknown dtype 'int8'"),
    Case(
        "chat-config-3bit",
        ["chat", *PAIR],
        "unknown quantization '3bit'",
        config='quantize_target = "3bit"\n',
    ),
    Case(
        "chat-config-huge",
        ["chat", *PAIR],
        "--max-new-tokens must be in",
        config="max_new_tokens = 10000000000\n",
    ),
    Case("chat-config-infinite-T", ["chat", *PAIR], "threshold must be a finite", config="threshold = inf\n"),
    Case("chat-config-float64", ["chat", *PAIR], "unknown dtype 'float64'", config='dtype = "float64"\n'),
    Case("chat-config-bad-rule", ["chat", *PAIR], "unknown rule 'lossy'", config='rule = "lossy"\n'),
    Case("chat-config-wrong-type", ["chat", *PAIR], "raw = 'yes' has the wrong type", config='raw = "yes"\n'),
    # a draft policy's former name, from a flag, config.toml or bench's list, names the new one
    Case("former-policy", [*GEN, "--draft-policy", "cost", "x"], "policy 'cost' (now called 'latency'); use"),
    Case(
        "chat-config-former-policy",
        ["chat", *PAIR],
        "config.toml: draft_policy: unknown draft policy 'adaptive' (now called 'heuristic'); use goodput, fixed, heuristic, latency",
        config='draft_policy = "adaptive"\n',
    ),
    Case(
        "bench-former-policy",
        [*BENCH, "--draft-policies", "fixed,cost"],
        "--draft-policies: unknown value 'cost' (now called 'latency')",
    ),
    # 7. bench checks its output before measuring
    Case(
        "bench-report-is-a-folder",
        BENCH,
        "out/report.json: it is a folder",
        files={"out": None, "out/report.json": None},
    ),
    Case(
        "bench-output-under-a-file",
        BENCH,
        "cannot write into the output folder",
        files={"out": b"a file"},
    ),
    # 6. export onto a device that cannot take it
    Case(
        "export-to-full-device",
        ["export", "feed0001", "-o", "/dev/full"],
        "/dev/full: No space left on device",
    ),
    # round 2, 1. chat templates that fail: one line naming the template's file
    *(
        Case(name, damaged(name), f"the chat template in {{{name}}}/tokenizer_config.json failed: {reason}")
        for name, reason in (
            ("template-raises", "TemplateError: roles must alternate"),
            ("template-syntax", "TemplateSyntaxError: Unexpected end of template"),
            ("template-unsafe", "SecurityError: access to attribute '__class__' of 'str' object is unsafe"),
            ("template-recursive", "RecursionError: maximum recursion depth exceeded"),
            ("template-range", "OverflowError: Range too big"),
            ("template-lipsum", "ValueError: empty range for randrange()"),
        )
    ),
    # 2. a tokenizer larger than the models' vocabulary: the token is named, before any forward pass
    Case(
        "token-beyond-the-vocabulary",
        [
            "generate",
            "--target",
            "{larger-target}",
            "--draft",
            "{larger-draft}",
            "--device",
            "cpu",
            "Once zzqq",
        ],
        "the prompt holds the token 'zzqq' (id 512), which the tokenizer has but the models do not",
    ),
    # 3. nesting deeper than the TOML parser recurses
    Case(
        "config-nested-100000-deep",
        ["chat", *PAIR],
        "config.toml: invalid TOML (nested too deeply)",
        config="a = " + "[" * 100_000 + "]" * 100_000 + "\n",
    ),
    # 4. rows edited or damaged behind fsd-chat's back: one line for the session asked for
    *(
        Case(
            f"export-{name}",
            ["export", "feed0001"],
            f"session feed0001 cannot be read: {message}",
            prepare=edit,
        )
        for name, edit, message in (
            (
                "models-list",
                "UPDATE sessions SET models = '[]'",
                "its models field is not a JSON object (list)",
            ),
            ("models-null", "UPDATE sessions SET models = 'null'", "its models field is not a JSON object"),
            ("settings-invalid-json", "UPDATE sessions SET settings = '{'", "Expecting property name"),
            (
                "threshold-text",
                "UPDATE sessions SET settings = json_set(settings, '$.threshold', 'x')",
                "threshold = 'x' in its settings is not a number",
            ),
            (
                "stats-key-missing",
                "UPDATE turns SET reply = json_remove(reply, '$.stats.tokens')",
                "tokens missing from its reply statistics",
            ),
            (
                "run-origin-unknown",
                "UPDATE turns SET reply = json_set(reply, '$.runs[0].origin', 'oracle')",
                "a reply run has the unknown origin 'oracle'",
            ),
            (
                "content-number",
                "UPDATE turns SET content = x'ff' WHERE position = 0",
                "a turn's content or time is not text",
            ),
        )
    ),
    Case(
        "resume-models-null",
        ["chat", "--resume", "feed0001"],
        "session feed0001 cannot be read: its models field is not a JSON object",
        prepare="UPDATE sessions SET models = 'null'",
    ),
    # 5. a prompt from a closed standard input
    Case("stdin-closed", [*GEN, "-"], "standard input (-), which is closed", stdin_closed=True),
    # 10. reading refuses what is not a regular file, and follows no link
    Case(
        "store-symlink-loop",
        ["history"],
        "sessions.sqlite3 is a symbolic link",
        prepare=lambda home: _replace(home / "data" / "sessions.sqlite3", lambda p: p.symlink_to(p)),
    ),
    Case(
        "store-is-a-folder",
        ["export", "feed0001"],
        "sessions.sqlite3 is not a regular file",
        prepare=lambda home: _replace(home / "data" / "sessions.sqlite3", Path.mkdir),
    ),
    # 7. export writes through no link: its target keeps its content and owner
    Case(
        "export-onto-a-symlink",
        ["export", "feed0001", "-o", "{home}/out.md"],
        "{home}/out.md is a symbolic link (to mine.md): fsd-chat does not write through links",
        files={"mine.md": b"kept"},
        prepare=lambda home: (home / "out.md").symlink_to("mine.md"),
    ),
    # 13. errors that quote a long list of the user's: how many, and a few
    Case(
        "config-100000-unknown-keys",
        ["chat", *PAIR],
        "unknown setting(s) k0, k1, k10, … 99,997 more; known:",
        config="".join(f"k{i} = 1\n" for i in range(100_000)),
    ),
    Case(
        "ambiguous-prefix-of-10000",
        ["export", "f"],
        "session 'f' is ambiguous: 10,001 sessions start with it (f0000000, f0000001, f0000002, … 9,998 more)",
        prepare="WITH RECURSIVE n(v) AS (SELECT 0 UNION ALL SELECT v + 1 FROM n WHERE v < 9999) "
        "INSERT INTO sessions SELECT printf('f%07d', v), created, updated, title, models, settings, system "
        "FROM sessions, n",
    ),
    # 14. a config.toml that is a FIFO, a model folder without a tokenizer
    Case(
        "config-is-a-fifo",
        ["chat", *PAIR],
        "config/config.toml: not a regular file",
        prepare=lambda home: os.mkfifo(home / "config" / "config.toml"),
    ),
    Case("no-tokenizer", damaged("no-tokenizer"), "no-tokenizer has no tokenizer (none of tokenizer.json"),
    # error text is data: one visible line, whatever the path holds
    Case(
        "escape-in-model-path",
        ["generate", "--target", "{home}/\x1b]0;pwned\x07\n[red]x[/]", "--draft", "{draft}", "x"],
        "model path not found: {home}/␛]0;pwned␇ [red]x[/]",
    ),
]


def _replace(path: Path, make: Callable[[Path], object]) -> None:
    path.unlink()
    make(path)


def _prepare(case: Case, home: Path) -> None:
    if isinstance(case.prepare, str):
        with sqlite3.connect(home / "data" / "sessions.sqlite3") as conn:
            conn.execute(case.prepare)
        conn.close()
    elif case.prepare is not None:
        case.prepare(home)


def _snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    # lstat: a link is what is there, and may lead nowhere (a loop).
    return {
        str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns, p.lstat().st_mode)
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The user's folders: the working directory, config and data folders (with one saved session)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FSD_CHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("FSD_CHAT_DATA_DIR", str(tmp_path / "data"))
    (tmp_path / "config").mkdir()
    session = saved_session()
    SessionStore(tmp_path / "data" / "sessions.sqlite3").append_turns(session, session.turns)
    yield tmp_path


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.slow
def test_hostile_command_line(
    case: Case,
    models: dict[str, Path],
    home: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    places = {name: str(path) for name, path in models.items()}
    places["home"] = str(home)
    if case.config is not None:
        (home / "config" / "config.toml").write_text(case.config)
    for name, content in case.files.items():
        if content is None:
            (home / name).mkdir()
        else:
            (home / name).write_bytes(content)
    if case.stdin is not None:
        stdin_file = tmp_path_factory.mktemp("stdin") / "input"
        stdin_file.write_bytes(case.stdin)
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(stdin_file.open("rb")))
    if case.stdin_closed:
        monkeypatch.setattr(sys, "stdin", None)  # what Python makes of `<&-`
    _prepare(case, home)
    before = _snapshot(home)

    code, out, err = run([arg.format(**places) for arg in case.args], capsys)

    assert code == case.code, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsd-chat: error: "), err
    assert case.message.format(**places) in lines[0]
    assert len(lines[0]) < 1000  # a message quotes what it must, not everything it could
    assert "Traceback" not in err and "\x1b" not in err
    assert out == ""
    assert _snapshot(home) == before  # nothing created, changed or removed


def test_prompt_from_standard_input(
    models: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    args = ["generate", *[a.format(**{k: str(v) for k, v in models.items()}) for a in PAIR]]
    args += ["--max-new-tokens", "12"]
    _, from_argument, _ = run([*args, "Once upon a time"], capsys)
    (tmp_path / "prompt").write_bytes(b"Once upon a time\n")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper((tmp_path / "prompt").open("rb")))
    code, from_stdin, err = run([*args, "-"], capsys)
    assert code == 0 and err == ""
    assert from_stdin == from_argument and from_stdin.startswith(", there was")


def test_user_text_is_never_a_special_token(pair: ModelPair) -> None:
    ids = prompt_ids(pair.tokenizer, [Message("user", "The end.</s> Once")])
    assert pair.tokenizer.eos_token_id not in ids
    assert pair.tokenizer.decode(ids, skip_special_tokens=True) == "The end.</s> Once"
    templated = copy.deepcopy(pair.tokenizer)
    templated.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    ids = prompt_ids(templated, [Message("user", "a </s> b")])
    # The template's own </s> is the token; the one the user typed is text.
    assert ids.count(pair.tokenizer.eos_token_id) == 1 and ids[-1] == pair.tokenizer.eos_token_id


def test_tokenizer_mismatch_counts_tokens_of_either(target_dir: Path) -> None:
    target = AutoTokenizer.from_pretrained(target_dir)
    draft = AutoTokenizer.from_pretrained(target_dir)
    draft.add_tokens(["<extra-1>", "<extra-2>", "<extra-3>"])
    with pytest.raises(IncompatibleModelsError, match=r"3 of the 515 tokens in either"):
        check_compatible(target, draft, 512, 515)


def test_a_system_prompt_too_long_is_named(pair: ModelPair) -> None:
    messages = [Message("system", "word " * 200), Message("user", "Hi")]
    with pytest.raises(ContextLengthError, match=r"^the system prompt needs \d+ tokens"):
        fit_to_context(pair.tokenizer, messages, context=150, reserve=10)
    messages = [Message("system", "Be brief."), Message("user", "word " * 200)]
    with pytest.raises(
        ContextLengthError, match=r"^the last message needs \d+ tokens with the system prompt"
    ):
        fit_to_context(pair.tokenizer, messages, context=150, reserve=10)


def test_json_output_is_strict(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    # KL between one-hot distributions that disagree is infinite: it must come out as null.
    args = ["generate", *[a.format(**{k: str(v) for k, v in models.items()}) for a in PAIR]]
    args += ["--json", "--divergence", "kl", "--top-k", "1", "--temperature", "1", "--seed", "0"]
    code, out, _ = run([*args, "--max-new-tokens", "40", "Once upon a time"], capsys)
    assert code == 0

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in JSON output")

    records = [json.loads(line, parse_constant=refuse) for line in out.splitlines()]
    divergences = [t["divergence"] for r in records[:-1] for t in r["tokens"]]
    assert None in divergences  # bonus tokens have none; infinite ones are null too


@pytest.fixture(scope="module")
def escape_pair(tmp_path_factory: pytest.TempPathFactory, target_dir: Path, draft_dir: Path) -> list[str]:
    """The real pair whose shared tokenizer swaps "upon" with the escape byte: after "Once" the
    models emit ESC, as a model can."""
    root = tmp_path_factory.mktemp("escape-pair")
    folders = [_copy(target_dir, root, "target"), _copy(draft_dir, root, "draft")]
    for folder in folders:
        _swap_tokens(folder, "▁upon", ESC_TOKEN)
    return ["--target", str(folders[0]), "--draft", str(folders[1]), "--device", "cpu"]


def test_escape_sequences_from_the_model_are_shown_not_run(
    escape_pair: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["generate", *escape_pair, "--max-new-tokens", "6", "-T", "0", "Once"]
    code, piped, _ = run(args, capsys)
    assert code == 0 and piped.startswith("\x1b a time")  # data stays data in a pipe or a file
    _, as_json, _ = run([*args, "--json"], capsys)
    assert '"text": "\\u001b a time' in as_json.splitlines()[-1]  # kept, escaped, in JSON
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich writes as to a terminal
    code, terminal, _ = run(args, capsys)
    shown = re.sub(r"\x1b\[[0-9;]*m", "", terminal)  # rich's own colour codes
    assert code == 0 and shown.startswith("␛ a time") and "\x1b" not in shown


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [["generate", "--max-new-tokens", "4", "Once"], ["export", "feed0001"], ["history"]],
    ids=["generate", "export", "history"],
)
def test_a_full_disk_is_one_line_and_exit_1(
    command: list[str], models: dict[str, Path], tmp_path: Path
) -> None:
    session = saved_session()
    SessionStore(tmp_path / "sessions.sqlite3").append_turns(session, session.turns)
    if command[0] == "generate":
        command = [
            *command[:1],
            "--target",
            str(models["target"]),
            "--draft",
            str(models["draft"]),
            *command[1:],
        ]
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [CONSOLE_SCRIPT, *command],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "FSD_CHAT_DATA_DIR": str(tmp_path)},
            timeout=300,
        )
    assert result.returncode == 1
    assert result.stderr == "fsd-chat: error: writing the output: No space left on device\n"


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("\x1b[2J\x1b]0;title\x07", "␛[2J␛]0;title␇"),
        ("a\rb\x08c\x00", "a␍b␈c␀"),
        ("del\x7f c1\x9b31m", "del␡ c1\ufffd31m"),
        ("tab\tand\nnewline stay", "tab\tand\nnewline stay"),
        ("ünïcödé ✓", "ünïcödé ✓"),
    ],
)
def test_control_characters_are_made_visible(raw: str, shown: str) -> None:
    assert visible(raw) == shown
    assert json.loads(to_json({"text": raw})) == {"text": raw}  # JSON keeps the text exactly...
    assert not re.search("[\x00-\x1f\x7f-\x9f]", to_json(raw))  # ...with every control escaped


def test_json_has_no_infinity() -> None:
    assert to_json({"d": [math.inf, -math.inf, math.nan, 0.5]}) == '{"d": [null, null, null, 0.5]}'


# --- round 2: what the table's one-line shape does not fit -----------------------------------


def _session_rows(home: Path, sql: str) -> None:
    with sqlite3.connect(home / "data" / "sessions.sqlite3") as conn:
        conn.execute(sql)
    conn.close()


def test_history_leaves_out_a_damaged_row_and_lists_the_others(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = saved_session()
    other.id = "cafe0002"
    SessionStore(home / "data" / "sessions.sqlite3").append_turns(other, other.turns)
    _session_rows(home, "UPDATE sessions SET models = 'null' WHERE id = 'feed0001'")
    code, out, err = run(["history"], capsys)
    assert code == 0 and out.startswith("cafe0002 ") and len(out.splitlines()) == 1
    assert err == (
        "fsd-chat: warning: session feed0001 left out, its row is damaged: its models field is not a "
        "JSON object (NoneType)\n"
    )


def test_reading_an_empty_store_writes_nothing(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = home / "data" / "sessions.sqlite3"
    store.write_bytes(b"")
    before = _snapshot(home)
    assert run(["history"], capsys) == (0, "no saved sessions yet\n", "")
    code, _, err = run(["export", "feed0001"], capsys)
    assert code == 2 and err == f"fsd-chat: error: no saved sessions yet ({store} is empty)\n"
    assert _snapshot(home) == before  # no schema written into it, no journal beside it


@pytest.mark.slow
def test_history_into_a_pipe_closed_early_is_silent(home: Path) -> None:
    _session_rows(
        home,
        "WITH RECURSIVE n(v) AS (SELECT 0 UNION ALL SELECT v + 1 FROM n WHERE v < 2999) "
        "INSERT INTO sessions SELECT printf('%08x', v), created, updated, title, models, settings, system "
        "FROM sessions, n",
    )  # far more than a pipe's buffer holds
    result = subprocess.run(
        ["bash", "-c", '"$0" history | head -1; echo "status ${PIPESTATUS[0]}" >&2', CONSOLE_SCRIPT],
        capture_output=True,
        text=True,
        env={**os.environ, "FSD_CHAT_DATA_DIR": str(home / "data")},
        timeout=120,
    )
    assert len(result.stdout.splitlines()) == 1
    assert result.stderr == "status 0\n"  # no message, no traceback, and not click's exit 1


@pytest.mark.slow
def test_export_to_standard_output_opened_for_append_appends(home: Path) -> None:
    everything = home / "all.md"
    everything.write_text("earlier transcripts\n")
    with everything.open("a") as appended:  # the shell's >>
        result = subprocess.run(
            [CONSOLE_SCRIPT, "export", "feed0001", "-o", "/dev/stdout"],
            stdout=appended,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "FSD_CHAT_DATA_DIR": str(home / "data")},
            timeout=120,
        )
    assert result.returncode == 0 and result.stderr == ""
    text = everything.read_text()
    assert text.startswith("earlier transcripts\n# fsd-chat session feed0001\n")


@pytest.mark.slow
def test_sigterm_during_export_removes_its_temporary_file(home: Path) -> None:
    big = saved_session()
    big.id = "b1g00001"
    big.turns[0].content = "Once upon a time " * 4_000_000  # 68 MB: its write takes a while
    SessionStore(home / "data" / "sessions.sqlite3").append_turns(big, big.turns)
    out = home / "out"
    out.mkdir()
    for _attempt in range(5):
        export = subprocess.Popen(
            [CONSOLE_SCRIPT, "export", "b1g00001", "-o", str(out / "t.md")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "FSD_CHAT_DATA_DIR": str(home / "data")},
        )
        while export.poll() is None and not any(p.name.endswith(".tmp") for p in out.iterdir()):
            pass
        export.send_signal(signal.SIGSTOP)  # held mid-write, then ended there
        caught = any(p.name.endswith(".tmp") for p in out.iterdir())
        if caught:
            export.send_signal(signal.SIGTERM)
        export.send_signal(signal.SIGCONT)
        _, err = export.communicate(timeout=120)
        if caught:
            break
        (out / "t.md").unlink()  # it finished first: again
    else:
        pytest.fail("the export never was caught mid-write")
    assert export.returncode == 128 + signal.SIGTERM and err == ""
    assert list(out.iterdir()) == []  # no hidden .t.md.*.tmp of 68 MB left behind, and no t.md


def _as_user(uid: int, args: list[str], cwd: Path) -> tuple[int, str, str]:
    """`fsd-chat ARGS` through its entry point in a forked child running as `uid`: the permission
    checks are the kernel's for that user (root, who runs these tests, bypasses them)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 70
        try:
            os.close(out_r)
            os.close(err_r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.chdir(cwd)
            sys.stdout = open(out_w, "w")  # noqa: SIM115 - flushed and closed by _exit's caller below
            sys.stderr = open(err_w, "w")  # noqa: SIM115
            try:
                main(args)
                code = 0
            except SystemExit as exc:
                code = int(exc.code or 0)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    os.close(out_w)
    os.close(err_w)
    with open(out_r) as out, open(err_r) as err:
        stdout, stderr = out.read(), err.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), stdout, stderr


NOBODY = 65534


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    """A folder every user may enter (pytest's own are root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="fsd-chat-hostile-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def test_reading_needs_no_write_access(shared_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another user's store (root's, 0644) in a folder the reader cannot write: as a read-only disk.
    data = shared_folder / "data"
    session = saved_session()
    SessionStore(data / "sessions.sqlite3").append_turns(session, session.turns)
    data.chmod(0o755)
    (data / "sessions.sqlite3").chmod(0o644)
    monkeypatch.setenv("FSD_CHAT_DATA_DIR", str(data))
    before = _snapshot(shared_folder)
    code, out, err = _as_user(NOBODY, ["history"], shared_folder)
    assert (code, err) == (0, "") and out.startswith("feed0001 ")
    code, out, err = _as_user(NOBODY, ["export", "feed0001"], shared_folder)
    assert (code, err) == (0, "") and out.startswith("# fsd-chat session feed0001")
    assert _snapshot(shared_folder) == before


def test_export_respects_a_read_only_file(shared_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Root may write any file (so `-o` would replace it for root, as the shell's `>` does);
    # another user may not write their own 0444 file, even though the folder lets a rename through.
    session = saved_session()
    SessionStore(shared_folder / "data" / "sessions.sqlite3").append_turns(session, session.turns)
    (shared_folder / "data").chmod(0o755)
    (shared_folder / "data" / "sessions.sqlite3").chmod(0o644)
    mine = shared_folder / "mine"
    mine.mkdir()
    (mine / "kept.md").write_text("kept")
    (mine / "kept.md").chmod(0o444)
    os.chown(mine, NOBODY, NOBODY)
    os.chown(mine / "kept.md", NOBODY, NOBODY)
    monkeypatch.setenv("FSD_CHAT_DATA_DIR", str(shared_folder / "data"))
    code, out, err = _as_user(NOBODY, ["export", "feed0001", "-o", str(mine / "kept.md")], shared_folder)
    assert (code, out) == (2, "")
    assert (
        err
        == f"fsd-chat: error: cannot write {mine / 'kept.md'}: it is read-only (chmod u+w it, or choose another name)\n"
    )
    assert (mine / "kept.md").read_text() == "kept" and sorted(p.name for p in mine.iterdir()) == ["kept.md"]
