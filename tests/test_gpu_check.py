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

from scripts.gpu_check import _test_table, main
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


def test_on_the_cpu_the_bench_reports_every_method(tmp_path: Path) -> None:
    """The bench of the check, on the CPU with the tiny pair: one report with target-only decoding,
    exact, fuzzy, mixture and transformers' assisted generation, each with tok/s and ×AR."""
    out = tmp_path / "bench"
    code = main(
        [
            *("--device", "cpu", "--dtype", "float32", "--quantize", "none"),
            *("--target", str(TARGET_DIR), "--draft", str(DRAFT_DIR), "--data-dir", str(DATA_DIR)),
            *("--limit", "1", "--max-new-tokens", "8", "--output", str(out)),
        ]
    )
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    methods = {c["method"]: c for c in report["configs"]}
    assert set(methods) == {"autoregressive", "exact", "fuzzy", "mixture", "hf-assisted"}
    assert all(c["tokens_per_second"] > 0 and c["speedup"]["autoregressive"] > 0 for c in methods.values())
    assert methods["autoregressive"]["speedup"]["autoregressive"] == pytest.approx(1.0)
    assert report["sweep"]["max_new_tokens"] == 8 and report["sweep"]["prompt_count"] == 1


def test_the_table_counts_what_pytest_reported(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='no GPU')\n"
        "def test_skipped(): pass\n"
    )
    junit = tmp_path / "out.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            "test_sample.py",
        ],
        cwd=tmp_path,
        capture_output=True,
    )
    table, failed = _test_table(junit)
    assert failed == 1
    console = Console(width=200, record=True)
    console.print(table)
    text = console.export_text()
    assert "test_ok" in text and "passed" in text
    assert "failed: AssertionError: one is not two" in text
    assert "skipped: no GPU" in text
