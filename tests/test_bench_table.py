"""bench's two tables, the terminal's and report.md's, read back cell by cell against report.json:
every shown figure is the figure of its header, for each kind of baseline set (model-draft
baselines, transformers' prompt lookup beside a draft model, and no draft at its default
baselines). The tables are parsed from the real command's output; what each header means is
written here independently of `bench.report.COLUMNS`, so a column shifted, renamed or filled from
another field fails.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.test_bench import _bench

pytestmark = pytest.mark.slow  # three benchmark sweeps

Item = dict[str, Any]
Check = Callable[[str, Item], None]

NUMBER = re.compile(r"[+-]?\d+(?:\.(\d+))?(%?)")
SPEEDUPS = {
    "×AR": "autoregressive",
    "×exact": "exact",
    "×hf-assisted": "hf-assisted",
    "×hf-assisted-default": "hf-assisted-default",
    "×hf-prompt-lookup": "hf-prompt-lookup",
    "×hf-autoregressive": "hf-autoregressive",
    "×hf-static": "hf-static",
    "×llama.cpp": "llama.cpp",
    "×llama.cpp-lookup": "llama.cpp-lookup",
}
"""Each speed-up header's baseline."""


def _path(item: Item, path: str) -> Any:
    value: Any = item
    for key in path.split("."):
        value = value.get(key)
        if value is None:
            return None
    return value


def _figures(cell: str, values: list[float | None]) -> None:
    """The numbers written in `cell` are `values`, each to the precision it is written with (a
    percentage: the value × 100); "–" stands for a single None."""
    if values[0] is None:
        assert cell == "–"
        return
    written = list(NUMBER.finditer(cell))
    assert len(written) == len(values), (cell, values)
    for match, value in zip(written, values, strict=True):
        assert value is not None, (cell, values)
        decimals, percent = len(match.group(1) or ""), match.group(2) == "%"
        number = float(match.group(0).rstrip("%"))
        scale = 100 if percent else 1
        # Half a unit of the last written digit, and float rounding at the boundary.
        assert abs(number - scale * value) <= 0.5 * 10**-decimals + 1e-9, (cell, value)


def _number(path: str, scale: float = 1.0) -> Check:
    def check(cell: str, item: Item) -> None:
        value = _path(item, path)
        _figures(cell, [None if value is None else scale * value])

    return check


def _with_interval(path: str, half_width: str) -> Check:
    def check(cell: str, item: Item) -> None:
        value, half = _path(item, path), _path(item, half_width)
        _figures(cell, [value] if half is None else [value, half])

    return check


def _speedup(clock: str, method: str) -> Check:
    def check(cell: str, item: Item) -> None:
        value = item[clock].get(method)
        interval = item[f"{clock}_ci95"].get(method)
        shown = [value] if interval is None or interval[0] == interval[1] else [value, *interval]
        _figures(cell, shown)

    return check


def _text(path: str) -> Check:
    def check(cell: str, item: Item) -> None:
        value = _path(item, path)
        assert cell == ("–" if value is None else str(value))

    return check


def _threshold(cell: str, item: Item) -> None:
    value = item["threshold"]
    assert cell == "–" if value is None else float(cell) == pytest.approx(value)


def _policy(cell: str, item: Item) -> None:
    fsd_chat_method = item["method"] in ("exact", "fuzzy", "pure", "mixture")
    assert cell == (item["draft_policy"] if fsd_chat_method else "–")


def _tokens_per_second(cell: str, item: Item) -> None:
    spread = item["tokens_per_second_spread"]
    assert item["tokens_per_second"] == spread["median"]
    _figures(cell, [spread["median"], spread["q1"], spread["q3"]])


CHECKS: dict[str, Check] = {
    "setup": _text("setup"),
    "sampling": _text("sampling"),
    "method": _text("method"),
    "div": _text("divergence"),
    "T": _threshold,
    "k": _text("draft_tokens"),
    "policy": _policy,
    "tok/s (median [q1–q3])": _tokens_per_second,
    **{header: _speedup("speedup", method) for header, method in SPEEDUPS.items()},
    "×exact work": _speedup("work_speedup", "exact"),
    "×AR decode": _speedup("decode_speedup", "autoregressive"),
    "×llama.cpp decode": _speedup("decode_speedup", "llama.cpp"),
    "decode tok/s": _number("decode_tokens_per_second"),
    "TTFT ms": _number("time_to_first_token", 1000),
    "limit tok/s": _number("limit_tokens_per_second"),
    "τ": _number("mean_accepted_length"),
    "mean k": _number("draft_tokens_per_step"),
    "accept": _number("acceptance_rate"),
    "fuzzy": _number("fuzzy_share"),
    "cost/tok (±95%)": _with_interval("quality.cost_per_token", "quality.cost_per_token_ci95"),
    "NLL": _number("quality.target_nll"),
    "ΔNLL (±95%)": _with_interval("quality.target_nll_change", "quality.target_nll_change_ci95"),
    "greedy agree": _number("quality.greedy_agreement"),
    "accuracy": _number("quality.accuracy"),
    "status": _text("status"),
    "warm-up s": _number("warmup_seconds"),
    "graphs": _text("compiled_graphs"),
    "target fwd ms": _number("target_forward_seconds", 1000),
    "draft fwd ms": _number("draft_forward_seconds", 1000),
    "outside fwd": _number("outside_forward_share"),
}
"""What each header shows, as a check of its cell against the report.json item of its row."""
TERMINAL_HEADERS = set(CHECKS) - {
    "setup",
    "sampling",
    "limit tok/s",
    "decode tok/s",
    "TTFT ms",
    "NLL",
    "target fwd ms",
    "draft fwd ms",
    "outside fwd",
    "warm-up s",
    "graphs",
}
"""The headers the terminal shows (setup and sampling are in each table's title)."""


def _cells(line: str, border: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip(border).split(border)]


WIDTH = 160
"""The widest line bench prints."""
LEFT_OUT = "in report.md, not shown at this width: "


def _terminal_tables(out: str) -> list[tuple[str, list[str], list[list[str]], list[str]]]:
    """Each rich table printed: its title, headers, rows, and the headers it says it left out for
    the width (each cell on one line: figures are never wrapped)."""
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    tables = []
    for at, line in enumerate(lines):
        if line.startswith("┏"):
            rows = []
            end = at + 3
            for row in lines[at + 3 :]:
                if not row.startswith("│"):
                    break
                rows.append(_cells(row, "│"))
                end += 1
            note = lines[end + 1] if end + 1 < len(lines) else ""
            left_out = note.removeprefix(LEFT_OUT).split(", ") if note.startswith(LEFT_OUT) else []
            tables.append((lines[at - 1].strip(), _cells(lines[at + 1], "┃"), rows, left_out))
    return tables


def _markdown_table(text: str) -> tuple[list[str], list[list[str]]]:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert set(lines[1]) == {"|", "-"}
    return _cells(lines[0], "|"), [_cells(line, "|") for line in lines[2:]]


def _key(item: Item) -> tuple[str, ...]:
    """A row's identity: the configuration's cells as both tables write them."""
    threshold = "–" if item["threshold"] is None else f"{item['threshold']:g}"
    k = "–" if item["draft_tokens"] is None else str(item["draft_tokens"])
    return (item["method"], item["divergence"] or "–", threshold, k)


def _row_key(cells: dict[str, str]) -> tuple[str, ...]:
    # The terminal leaves out a column no row has a figure in: "–" in every row.
    return tuple(cells.get(header, "–") for header in ("method", "div", "T", "k"))


def _check_rows(headers: list[str], rows: list[list[str]], items: list[Item]) -> None:
    """Every row is one item's, every item has one row, and every cell is its header's figure."""
    assert len(headers) == len(set(headers)) and set(headers) <= set(CHECKS), headers
    by_key = {_key(item): item for item in items}
    assert len(by_key) == len(items) == len(rows)
    for row in rows:
        assert len(row) == len(headers), row  # the row's cells are the header's: none shifted
        cells = dict(zip(headers, row, strict=True))
        item = by_key.pop(_row_key(cells))
        for header, cell in cells.items():
            CHECKS[header](cell, item)
    assert not by_key


def _check_tables(out: str, report_dir: Path) -> list[Item]:
    """report.md's and the terminal's tables against report.json; returns its items."""
    items = json.loads((report_dir / "report.json").read_text(encoding="utf-8"))["configs"]
    headers, rows = _markdown_table((report_dir / "report.md").read_text(encoding="utf-8"))
    assert headers == list(CHECKS)  # report.md has every column
    assert len(rows) == len(items)
    groups: dict[str, list[Item]] = {}
    for item in items:
        groups.setdefault(f"{item['setup']} · {item['sampling']}", []).append(item)
    for group, members in groups.items():
        _check_rows(headers, [row for row in rows if f"{row[0]} · {row[1]}" == group], members)
    tables = _terminal_tables(out)
    assert [title for title, _, _, _ in tables] == list(groups)
    for title, headers, rows, left_out in tables:
        _check_rows(headers, rows, groups[title])
        # A terminal column is left out where no row has its figure, or, said so, for the width.
        assert not set(left_out) & set(headers) and set(left_out) <= TERMINAL_HEADERS
        for header in TERMINAL_HEADERS - set(headers) - set(left_out):
            for item in groups[title]:
                CHECKS[header]("ok" if header == "status" else "–", item)
    return items


def test_model_draft_baselines_table(
    target_dir: Path, draft_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "draft"
    _bench(
        target_dir, draft_dir, out,
        "--limit", "2", "--max-new-tokens", "8", "--temperature", "0,1",
        "--baselines", "autoregressive,exact,hf-assisted,hf-assisted-default,hf-ensemble,hf-autoregressive,hf-static",
        "--ensemble-weights", "0.6",
        "--rules", "fuzzy,mixture", "--divergences", "js", "--thresholds", "0.2", "--mixture-thresholds", "0.1",
    )  # fmt: skip
    items = _check_tables(capsys.readouterr().out, out)
    assert {i["method"] for i in items} == {
        "autoregressive", "exact", "hf-assisted", "hf-assisted-default", "hf-ensemble", "hf-autoregressive",
        "hf-static", "fuzzy", "mixture",
    }  # fmt: skip


def test_prompt_lookup_baseline_table(
    target_dir: Path, draft_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """transformers' prompt lookup beside a draft model, sampled with truncation."""
    out = tmp_path / "lookup"
    _bench(
        target_dir, draft_dir, out,
        "--limit", "2", "--max-new-tokens", "8", "--temperature", "1", "--top-p", "0.9",
        "--baselines", "autoregressive,exact,hf-prompt-lookup", "--rules", "none",
    )  # fmt: skip
    items = _check_tables(capsys.readouterr().out, out)
    assert {i["method"] for i in items} == {"autoregressive", "exact", "hf-prompt-lookup"}
    assert {i["sampling"] for i in items} == {"temperature 1 · top-p 0.9"}


def test_no_draft_default_baselines_table(
    target_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No draft and no --baselines: the defaults need no draft model (prompt lookup's, not
    transformers' assisted generation); on a set with answers, accuracy is filled in."""
    prompts = tmp_path / "qa.jsonl"
    prompts.write_text(
        '{"prompt": "Lily and Ben went to the park.", "answer": "Lily"}\n'
        '{"prompt": "Tom had a red ball.", "answer": "zebra crossing"}\n'
    )
    out = tmp_path / "none"
    _bench(
        target_dir, None, out,
        "--max-new-tokens", "8", "--rules", "fuzzy", "--divergences", "tv", "--thresholds", "0.3",
        prompts=str(prompts),
    )  # fmt: skip
    items = _check_tables(capsys.readouterr().out, out)
    assert {i["method"] for i in items} == {"autoregressive", "exact", "hf-prompt-lookup", "fuzzy"}
    assert all(i["quality"]["accuracy"] is not None for i in items)
