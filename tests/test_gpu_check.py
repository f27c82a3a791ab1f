"""`make gpu-check` on a machine without CUDA: its one-line message, its table of test outcomes,
its arguments, and its bench run through the same code on the CPU (the tiny offline pair)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console
from rich.table import Table

from fsd_chat.decoding.settings import DEFAULT_DRAFT_POLICY
from scripts import gpu_check
from scripts.gpu_check import _rate_table, _test_table, main, run_capped
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


STALL_CAP = 5.0
"""Seconds the stalled configuration is given: enough for its Python to start (faulthandler on) on
a loaded machine and sit in its sleep, where the cut finds it."""


class Stalled(gpu_check.Bench):
    """A bench that stalls, capped at `STALL_CAP` whatever the check's load and configuration caps."""

    def cap(self, args: argparse.Namespace) -> float:
        return STALL_CAP


def test_on_the_cpu_the_check_runs_every_phase_and_cuts_a_stalled_one(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check's whole flow on the CPU with the tiny pair, and the real-cost pair built at tiny
    shapes by the shared builder: every phase prints; each bench's report has its rows, the
    whole-step rows their profile (kernel counts 0 on the CPU, and the table says so); and a
    configuration that stalls (hf-assisted replaced by a process that sleeps: the GPU's hang cannot
    run here) is killed at its cap, shown as cut, and the check goes on.

    The sleeper's cap is its own, `STALL_CAP`, below the least a real bench is started with
    (`MIN_CAP`, lowered to it here): the same cut as at the 20 s the benches' load cap would give
    it, without 15 s more of waiting."""
    real_row = gpu_check.transformers_row
    monkeypatch.setattr(gpu_check, "MIN_CAP", STALL_CAP)

    def stalled(
        args: argparse.Namespace, target: str, draft: str, output: Path, method: str
    ) -> gpu_check.Bench:
        if method != "hf-assisted":
            return real_row(args, target, draft, output, method)
        sleeper = [
            sys.executable,
            "-c",
            "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)",
        ]
        return Stalled("transformers' hf-assisted k 4", sleeper, 0, output)

    monkeypatch.setattr(gpu_check, "transformers_row", stalled)
    out = tmp_path / "reports"
    start = time.monotonic()
    code = main(
        [
            *("--device", "cpu", "--dtype", "float32", "--output", str(out)),
            *("--target", str(TARGET_DIR), "--draft", str(DRAFT_DIR), "--data-dir", str(DATA_DIR)),
            *("--limit", "1", "--max-new-tokens", "8", "--load-cap", "20", "--config-cap", "40"),
            *("--budget", "1500"),  # a loaded 2-core machine; the budget's own test is below
            *("--real-target", "128,256,6,16", "--real-draft", "128,256,3,16"),
        ]
    )
    printed, errors = capfd.readouterr()  # the benches run in subprocesses: their output, too
    assert code == 1  # a configuration was cut
    for number in range(1, 7):
        assert f"gpu-check {number}/6: " in printed and f"gpu-check {number}/6: done in " in printed
    assert "gpu-check: cut: transformers' hf-assisted k 4 ran past its cap of 5 s and was killed" in printed
    assert "Fatal Python error: Aborted" in errors  # its stacks, where it sat, before the kill
    assert printed.index("hf-assisted k 4 ran past") < printed.index(
        "whole steps (--whole-step) vs per-forward steps"
    )
    assert time.monotonic() - start < 20 * 60

    def rows(name: str) -> dict[tuple[str, object, str], dict[str, object]]:
        report = json.loads((out / name / "report.json").read_text())
        assert report["sweep"]["max_new_tokens"] == 8 and report["sweep"]["prompt_count"] == 1
        return {(c["method"], c["draft_tokens"], c["draft_policy"]): c for c in report["configs"]}

    # The real-cost pair's starts: the first over an empty compile cache, the second over what it
    # left (on the CPU the whole step runs eagerly: nothing is compiled, but the flow is the GPU's).
    starts = json.loads((out / "start.json").read_text())
    assert [s["outcome"] for s in starts["starts"]] == ["ok", "ok"]
    assert all(s["seconds"] > 0 for s in starts["starts"]) and "--whole-step" in starts["command"]
    assert "gpu-check: the real-cost pair's first start " in printed and "(goal ≤ 10 s)" in printed

    whole = rows("real-whole")
    exact = {("exact", k, p) for k in (2, 4, 6) for p in ("fixed", DEFAULT_DRAFT_POLICY)}
    assert whole.keys() == {("autoregressive", None, "fixed"), *exact}
    assert rows("real-per-forward").keys() == whole.keys()
    assert {m for m, _, _ in rows("real-lossy")} == {"fuzzy", "mixture"}
    assert {m for m, _, _ in rows("real-hf-static")} == {"hf-static"}
    assert not (out / "real-hf-assisted" / "report.json").exists()  # killed before it wrote one
    for name in ("real-whole", "real-lossy", "scaled-whole"):
        for c in rows(name).values():
            assert c["status"] == "ok" and c["tokens_per_second"] > 0 and c["compiled_graphs"] == 0
            profile = c["profile"]
            assert profile["on_device"] is False and profile["kernels"] == 0 and profile["busy_ms"] == 0
            assert (
                profile["wall_ms"] > 0
                and profile["weight_bytes_per_token"] > 0
                and profile["bandwidth_use"] > 0
            )
    assert all(c["profile"] is None for c in rows("real-per-forward").values())
    assert "on the CPU there are no kernels: kernel, busy, launch and wait columns are 0" in printed
    # The builder's shapes (the source's 5 and 2 layers scaled to 6 and 3).
    built = {
        json.loads(path.read_text())["num_hidden_layers"]: json.loads(path.read_text())
        for path in Path(".cache").glob("stories260K*-as-128-256-*-16/config.json")
    }
    assert {n: (c["hidden_size"], c["intermediate_size"], c["head_dim"]) for n, c in built.items()} == {
        6: (128, 256, 16),
        3: (128, 256, 16),
    }


def test_past_the_checks_budget_every_phase_still_prints(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """With its budget spent, no bench starts (each says so in one line), and every phase prints."""
    code = main(
        [
            *("--device", "cpu", "--dtype", "float32", "--output", str(tmp_path), "--budget", "1"),
            *("--target", str(TARGET_DIR), "--draft", str(DRAFT_DIR), "--data-dir", str(DATA_DIR)),
            *("--real-target", "128,256,6,16", "--real-draft", "128,256,3,16"),
        ]
    )
    printed = capfd.readouterr().out
    assert code == 1
    for number in range(1, 7):
        assert f"gpu-check {number}/6: done in " in printed
    not_run = [line for line in printed.splitlines() if "not run: the check's 1 s are spent" in line]
    # Phase 2's starts and two benches, the per-forward steps, hf-static, hf-assisted, the scaled pair's.
    assert len(not_run) == 7
    assert not list(tmp_path.iterdir())  # no bench ran


def test_a_process_past_its_cap_is_killed_with_its_children(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """`run_capped` has a cut process print its stacks (faulthandler), then kills its group: a
    child that ignores SIGTERM and its own child go."""
    pids = tmp_path / "pids"
    script = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],"
        " stderr=subprocess.DEVNULL)\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(600)\n"
    )
    console = Console(record=True, width=200)
    start = time.monotonic()
    assert run_capped(console, [sys.executable, "-c", script], 3.0, "a stalled bench") == "cut"
    assert time.monotonic() - start < 30
    assert "cut: a stalled bench ran past its cap of 3 s and was killed" in console.export_text()
    stacks = capfd.readouterr().err
    # Both processes get SIGABRT and print at once; faulthandler writes in pieces, so two stacks on
    # one stderr interleave within lines. The grandchild's stderr goes nowhere: only the child's is read.
    assert "Fatal Python error: Aborted" in stacks and "line 5 in <module>" in stacks
    for pid in map(int, pids.read_text().split()):
        with pytest.raises(ProcessLookupError):
            for _ in range(100):  # the grandchild is reaped by init: gone once it is
                os.kill(pid, 0)
                time.sleep(0.05)
    assert run_capped(console, [sys.executable, "-c", "pass"], 30.0, "a quick one") == "ok"
    assert (
        run_capped(console, [sys.executable, "-c", "raise SystemExit(3)"], 30.0, "a failing one") == "failed"
    )


def test_pytest_that_cannot_start_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No JUnit report (conftest failed to import, as on the first GPU run): one line, the check
    goes on (1 counts as a failure)."""
    monkeypatch.chdir(tmp_path)  # no tests/ here: pytest exits 4 without a report
    (tmp_path / ".cache").mkdir()
    console = Console(record=True, width=200)
    args = argparse.Namespace(tests_cap=60.0, models=tmp_path)
    assert gpu_check.cuda_tests(console, args) == 1
    text = console.export_text()
    assert text.count("\n") == 1 and "gpu-check: pytest -m cuda did not start or finish (failed" in text


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


def test_the_hf_assisted_reproduction_runs_its_variants_in_processes_of_their_own() -> None:
    """scripts/repro_hf_assisted.py on the CPU (its stall needs CUDA's compilation): a JSON line a
    variant, assisted generation eager (no frame through torch._dynamo) and producing tokens."""
    done = subprocess.run(
        [
            *(sys.executable, "scripts/repro_hf_assisted.py", str(TARGET_DIR), str(DRAFT_DIR)),
            *("--device", "cpu", "--dtype", "float32", "--variants", "alone,after-static", "--cap", "300"),
            *("--max-new-tokens", "16"),  # tokens produced eagerly: 16 show it as well as 64
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [line["variant"] for line in lines] == ["alone", "after-static"]
    for line in lines:
        assert line["tok_s"] > 0 and line["warmup_s"] > 0 and line["dynamo_frames_during_assisted"] == 0
