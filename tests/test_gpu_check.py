"""`make gpu-check` on a machine without CUDA: its one-line message, its table of test outcomes,
its arguments, and its bench run through the same code on the CPU (the tiny offline pair)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from rich.table import Table

from fsd_chat.decoding.settings import DEFAULT_DRAFT_POLICY
from scripts.gpu_check import _rate_table, _test_table, main
from tests.conftest import DRAFT_DIR, TARGET_DIR
from tests.test_bench import DATA_DIR

pytestmark = pytest.mark.slow  # runs pytest and fsd-chat bench in subprocesses


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_it_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA device" in out


def test_a_bad_argument_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--limit", "four"])
    assert exit_.value.code == 2
    assert "--limit" in capsys.readouterr().err


def test_on_the_cpu_the_benches_report_every_method(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The check's phases on the CPU with the tiny pair, and the real-cost pair built at tiny
    shapes by the shared builder: each bench's report has its methods, each with tok/s and ×AR,
    its advice line, and no configuration compiled during its measured runs."""
    out, real, whole = tmp_path / "bench", tmp_path / "real", tmp_path / "whole"
    code = main(
        [
            *("--device", "cpu", "--dtype", "float32"),
            *("--target", str(TARGET_DIR), "--draft", str(DRAFT_DIR), "--data-dir", str(DATA_DIR)),
            *("--limit", "1", "--max-new-tokens", "8", "--output", str(out), "--real-output", str(real)),
            *("--whole-step-output", str(whole)),
            *("--real-target", "128,256,6,16", "--real-draft", "128,256,3,16"),
        ]
    )
    assert code == 0
    printed = capfd.readouterr().out  # the benches run in subprocesses: their output, too
    for phase in range(1, 6):
        assert f"gpu-check {phase}/5: " in printed and f"gpu-check {phase}/5: done in " in printed
    scaled = json.loads((out / "report.json").read_text())
    assert {c["method"] for c in scaled["configs"]} == {"autoregressive", "exact", "hf-static", "hf-assisted"}
    report = json.loads((real / "report.json").read_text())
    rows = {(c["method"], c["draft_policy"]) for c in report["configs"]}
    fsd = {(m, p) for m in ("exact", "fuzzy", "mixture") for p in ("fixed", DEFAULT_DRAFT_POLICY)}
    assert rows == {("autoregressive", "fixed"), ("hf-static", "fixed"), ("hf-assisted", "fixed"), *fsd}
    # The same fsd-chat rows as whole steps, and one table of both.
    whole_report = json.loads((whole / "report.json").read_text())
    assert whole_report["sweep"]["whole_step"] is True
    assert {(c["method"], c["draft_policy"]) for c in whole_report["configs"]} == {
        ("autoregressive", "fixed"),
        *fsd,
    }
    assert "whole steps (--whole-step) vs today's steps" in printed
    assert all(c["tokens_per_second"] > 0 for c in whole_report["configs"])
    for data in (scaled, report):
        assert data["advice"].startswith("advice: ") and data["advice"] in printed
        assert report["sweep"]["max_new_tokens"] == 8 and report["sweep"]["prompt_count"] == 1
        for c in data["configs"]:
            assert c["tokens_per_second"] > 0 and c["speedup"]["autoregressive"] > 0
            assert c["compiled_graphs"] == 0 and c["status"] == "ok" and c["warmup_seconds"] > 0
        (autoregressive,) = [c for c in data["configs"] if c["method"] == "autoregressive"]
        assert autoregressive["speedup"]["autoregressive"] == pytest.approx(1.0)
    # The builder's shapes (the source's 5 and 2 layers scaled to 6 and 3).
    built = {
        json.loads(path.read_text())["num_hidden_layers"]: json.loads(path.read_text())
        for path in Path(".cache").glob("stories260K*-as-128-256-*-16/config.json")
    }
    assert {n: (c["hidden_size"], c["intermediate_size"], c["head_dim"]) for n, c in built.items()} == {
        6: (128, 256, 16),
        3: (128, 256, 16),
    }


def junit_report(folder: Path, test_file: str) -> Path:
    """Run pytest on `folder`/`test_file` as gpu-check runs `pytest -m cuda`: its JUnit report."""
    junit = folder / "out.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        test_file,
    ]
    subprocess.run(command, cwd=folder, capture_output=True)
    return junit


def rendered(table: Table) -> str:
    """A rich table as the terminal shows it, 200 columns wide."""
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_the_table_counts_what_pytest_reported(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='no GPU')\n"
        "def test_skipped(): pass\n"
    )
    table, failed = _test_table(junit_report(tmp_path, "test_sample.py"))
    assert failed == 1
    text = rendered(table)
    assert "test_ok" in text and "passed" in text
    assert "failed: AssertionError: one is not two" in text
    assert "skipped: no GPU" in text


def test_the_rate_table_pairs_whole_steps_with_compiled_steps(tmp_path: Path) -> None:
    (tmp_path / "test_rates.py").write_text(
        "def test_speed(record_property):\n"
        "    record_property('exact k4 graphs', 900.0)\n"
        "    record_property('exact k4 compiled', 450.0)\n"
        "    record_property('unrelated', 1)\n"
    )
    table = _rate_table(junit_report(tmp_path, "test_rates.py"))
    assert table is not None and table.row_count == 1
    text = rendered(table)
    assert "exact k4" in text and "900" in text and "450" in text and "2.00" in text
