"""`make gpu-check` on a machine without CUDA, and its table of test outcomes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from scripts.gpu_check import _test_table, main

pytestmark = pytest.mark.slow  # runs pytest in a subprocess


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_it_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA device" in out


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
