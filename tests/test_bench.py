"""`fsd-chat bench` end to end on the real offline pair, and its parts on real data files.

The sweeps are tiny (a few prompts, a few dozen tokens, one torch thread so that other processes on
a small machine cannot stall it); speed is never asserted, only the report's structure and the
invariants that hold whatever the timing: exact SD and transformers' assisted generation reproduce
target-only greedy output, fuzzy SD at T = 0 is exact SD, acceptance and cost grow with the threshold,
lossless methods cost exactly 0 and the mixture rule stays within its budget. The analysis itself
(speed-ups, curves at matched cost, the report read back) is checked on constructed measurements
whose speeds and costs are known, in test_bench_analysis.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsd_chat.bench.methods import PairRunner
from fsd_chat.bench.metrics import summarize
from fsd_chat.bench.pipeline import write_outputs
from fsd_chat.bench.prompts import (
    choice_correct,
    generic_correct,
    load_prompt_set,
    number_correct,
)
from fsd_chat.bench.records import Configuration, Setup
from fsd_chat.bench.runner import run_sweep
from fsd_chat.cli import main
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.errors import FsdChatError

pytestmark = pytest.mark.slow  # runs benchmark sweeps

DATA_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
MIXTURE_LOW, MIXTURE_HIGH = 0.05, 0.5
"""The mixture rule's budgets in the sweep (nats per token; greedy: regret)."""
ENSEMBLE_WEIGHT = 0.6
"""hf-ensemble's weight in the sweep: far enough from 1 that its tokens cost something."""
REQUIRED_KEYS = {
    "method",
    "divergence",
    "threshold",
    "draft_tokens",
    "tokens_per_second",
    "mean_accepted_length",
    "acceptance_rate",
    "fuzzy_share",
    "quality",
}


def _bench(target: Path, draft: Path | None, out: Path, *sweep: str, prompts: str = "tinystories") -> dict:
    """`fsd-chat bench` through the real CLI on `prompts` (TinyStories), k = 3, CPU float32, one
    torch thread, plus `sweep`'s options (no draft: prompt lookup); returns report.json."""
    threads = torch.get_num_threads()  # --threads sets a process-wide value: give it back after
    main(
        [
            "bench",
            "--target", str(target),
            *(["--draft", str(draft)] if draft is not None else []),
            "--prompts", prompts,
            "--data-dir", str(DATA_DIR),
            "--draft-tokens", "3",
            "--device", "cpu",
            "--dtype", "float32",
            "--threads", "1",
            "--output", str(out),
            *sweep,
        ]
    )  # fmt: skip
    torch.set_num_threads(threads)
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def report(target_dir: Path, draft_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One tiny sweep through the real CLI: greedy and sampling, four baselines (transformers' lossy
    hf-ensemble among them), fuzzy js at three thresholds and mixture at two budgets."""
    out = tmp_path_factory.mktemp("bench")
    data = _bench(
        target_dir,
        draft_dir,
        out,
        "--limit", "3",
        "--max-new-tokens", "24",
        "--thresholds", "0,0.2,0.7",
        "--divergences", "js",
        "--rules", "fuzzy,mixture",
        "--mixture-thresholds", f"{MIXTURE_LOW},{MIXTURE_HIGH}",
        "--baselines", "autoregressive,exact,hf-assisted,hf-ensemble",
        "--ensemble-weights", str(ENSEMBLE_WEIGHT),
        "--temperature", "0,1",
    )  # fmt: skip
    return data, out


def _config(report: dict, temperature: float, method: str, threshold: float | None = None) -> dict:
    (match,) = [
        c
        for c in report["configs"]
        if c["temperature"] == temperature and c["method"] == method and c["threshold"] == threshold
    ]
    return match


def test_report_structure(report: tuple[dict, Path]) -> None:
    data, out = report
    env = data["environment"]
    assert env["packages"]["torch"] and env["packages"]["transformers"]
    assert env["device"] == ["cpu"] and env["torch_threads"] == 1
    # The machine's load when the run finished: 1-, 5- and 15-minute averages (Linux has them).
    assert len(env["load_average"]) == 3 and all(load >= 0 for load in env["load_average"])
    assert data["interrupted"] is False
    # 2 temperatures × (autoregressive, exact, hf-assisted, hf-ensemble, fuzzy at 3 thresholds,
    # mixture at 2)
    assert len(data["configs"]) == 18
    for config in data["configs"]:
        assert config.keys() >= REQUIRED_KEYS
        assert config["runs"] == 3 and config["tokens"] > 0 and config["tokens_per_second"] > 0
        assert config["quality"]["target_nll"] > 0
        assert config["quality"]["cost_per_token"] >= 0 and config["quality"]["cost_per_token_ci95"] >= 0
        # Forward passes are metered during the reply only (not while the decoder is built or the
        # quality is scored): they take part of its wall clock, never all of it.
        assert 0 < config["outside_forward_share"] < 1
        assert config["limit_tokens_per_second"] > 0
        assert config["quality"]["accuracy"] is None  # TinyStories has no answers
        assert (config["quality"]["greedy_agreement"] is None) == (config["temperature"] != 0)
    autoregressive = _config(data, 0, "autoregressive")
    assert autoregressive["target_forwards_per_token"] == 1.0 and autoregressive["acceptance_rate"] is None
    methods = {c["method"] for c in data["configs"]}
    assert methods == {"autoregressive", "exact", "hf-assisted", "hf-ensemble", "fuzzy", "mixture"}
    assert (out / "tradeoff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (out / "report.md").read_text()
    assert "| setup | sampling | method |" in markdown and "hf-assisted" in markdown
    assert "cost/tok (±95%)" in markdown and "## Curves at matched cost" in markdown


@pytest.mark.parametrize("temperature", [0, 1])
def test_lossless_methods_cost_exactly_zero(report: tuple[dict, Path], temperature: float) -> None:
    data, _ = report
    for method in ("autoregressive", "exact"):
        quality = _config(data, temperature, method)["quality"]
        assert quality["cost_per_token"] == 0.0 and quality["cost_per_token_ci95"] == 0.0
    assert _config(data, temperature, "fuzzy", 0.0)["quality"]["cost_per_token"] == 0.0


@pytest.mark.parametrize("temperature", [0, 1])
def test_mixture_stays_within_its_budget(report: tuple[dict, Path], temperature: float) -> None:
    data, _ = report
    costs = [
        _config(data, temperature, "mixture", t)["quality"]["cost_per_token"]
        for t in (MIXTURE_LOW, MIXTURE_HIGH)
    ]
    # Every token costs ≤ T, so every prompt's mean does (float32 rounding aside).
    assert costs[0] <= MIXTURE_LOW + 1e-6 and costs[1] <= MIXTURE_HIGH + 1e-6
    assert costs[1] > 0  # the larger budget is used: the bound is not met vacuously


@pytest.mark.parametrize("temperature", [0, 1])
def test_cost_rises_with_threshold(report: tuple[dict, Path], temperature: float) -> None:
    data, _ = report
    costs = [_config(data, temperature, "fuzzy", t)["quality"]["cost_per_token"] for t in (0.0, 0.2, 0.7)]
    assert costs[0] == 0.0 < costs[1]
    # Greedy, T bounds the regret: a short sweep may meet no token between 0.2 and 0.7 nats.
    assert costs[1] < costs[2] if temperature else costs[1] <= costs[2]


def test_hf_ensemble_costs_something_and_is_a_curve(report: tuple[dict, Path]) -> None:
    data, _ = report
    for temperature in (0, 1):
        config = _config(data, temperature, "hf-ensemble", ENSEMBLE_WEIGHT)
        assert config["label"] == f"hf-ensemble w={ENSEMBLE_WEIGHT:g} k=3"
        assert config["quality"]["cost_per_token"] > 0 and config["fuzzy_share"] == 0.0
    # Sampling: v = w·p + (1 − w)·q accepts more than p alone (1 − w of the rejections turn to acceptances).
    assert (
        _config(data, 1, "hf-ensemble", ENSEMBLE_WEIGHT)["acceptance_rate"]
        >= _config(data, 1, "hf-assisted")["acceptance_rate"]
    )


def test_curves_compared_in_the_report(report: tuple[dict, Path]) -> None:
    data, _ = report
    clocks = ["wall clock", "forward work", "τ"]
    assert [(v["temperature"], v["clock"]) for v in data["curves"]] == [
        (t, c) for t in (0, 1) for c in clocks
    ]
    curves = {"fuzzy js k=3", "mixture k=3", "hf-ensemble k=3"}
    for verdict in data["curves"]:
        pairs = [{c["a"], c["b"]} for c in verdict["comparisons"]]
        # Every two curves with a common cost range: the mixture's and hf-ensemble's costs start
        # from 0 but may not reach fuzzy's first point, so some pairs may have none.
        assert all(pair <= curves and len(pair) == 2 for pair in pairs) and pairs
        for comparison in verdict["comparisons"]:
            assert comparison["ratio"] >= 1 and comparison["prompts"] == 3
            assert comparison["ci95"] is None and comparison["winner"] is None  # 3 prompts: no interval
            top = comparison["levels"][-1]["cost"]
            assert [level["cost"] for level in comparison["at_costs"]] == [
                c for c in (0.01, 0.02, 0.05) if c <= top
            ]


def test_report_is_rebuilt_from_its_json_without_torch(report: tuple[dict, Path], tmp_path: Path) -> None:
    """A real report.json, read back where torch and transformers cannot be imported, gives report.md
    again byte for byte (its title is not in the JSON: it is report.md's first line)."""
    _, out = report
    written = (out / "report.md").read_text(encoding="utf-8")
    title = written.splitlines()[0].removeprefix("# ")
    script = (
        "import sys; from pathlib import Path\n"
        "sys.modules['torch'] = sys.modules['transformers'] = None\n"
        "from fsd_chat.bench import report\n"
        "results = report.read_json(Path(sys.argv[1]) / 'report.json')\n"
        "report.write_markdown(Path(sys.argv[2]), results, title=sys.argv[3], plot_name='tradeoff.png')\n"
    )
    rebuilt = tmp_path / "report.md"
    result = subprocess.run(
        [sys.executable, "-c", script, str(out), str(rebuilt), title],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert rebuilt.read_text(encoding="utf-8") == written


def test_lossless_baselines_reproduce_greedy_output(report: tuple[dict, Path]) -> None:
    data, _ = report
    exact = _config(data, 0, "exact")
    # Agreement 1.0 for both means both equal target-only greedy output token for token.
    assert exact["quality"]["greedy_agreement"] == 1.0
    assert _config(data, 0, "hf-assisted")["quality"]["greedy_agreement"] == 1.0
    assert _config(data, 0, "fuzzy", 0.0)["quality"]["greedy_agreement"] == 1.0
    assert _config(data, 0, "fuzzy", 0.0)["acceptance_rate"] == exact["acceptance_rate"]
    assert exact["fuzzy_share"] == 0.0
    # The forward-work clock sees only forward counts: the same decoding is the same speed.
    assert _config(data, 0, "fuzzy", 0.0)["work_speedup"]["exact"] == 1.0


@pytest.mark.parametrize("temperature", [0, 1])
def test_acceptance_grows_with_threshold(report: tuple[dict, Path], temperature: float) -> None:
    data, _ = report
    rates = [_config(data, temperature, "fuzzy", t)["acceptance_rate"] for t in (0.0, 0.2, 0.7)]
    assert rates[0] <= rates[1] <= rates[2]
    # Sampling: js ≤ ln 2 < 0.7, so every draft token is accepted, most of them only by the
    # divergence test. Greedy: T bounds the regret, and tokens further from the argmax are refused.
    assert rates[2] == 1.0 if temperature else rates[0] < rates[2] < 1.0
    assert _config(data, temperature, "fuzzy", 0.7)["fuzzy_share"] > 0
    assert _config(data, temperature, "fuzzy", 0.0)["fuzzy_share"] == 0.0


def test_hf_assisted_and_exact_greedy_outputs_identical(pair: ModelPair) -> None:
    runner = PairRunner(pair)
    setup = Setup("float32")
    ids = prompt_ids(pair.tokenizer, [Message("user", "Once upon a time, there was a little cat.")])
    try:
        outputs = {
            method: runner.run(
                Configuration(setup, 0.0, method, 4), ids, max_new_tokens=40, seed=0, stop_strings=()
            ).token_ids
            for method in ("exact", "hf-assisted")
        }
    finally:
        runner.close()
    assert len(outputs["exact"]) > 0
    assert outputs["exact"] == outputs["hf-assisted"]


def test_the_meters_count_the_replys_forward_passes_only(pair: ModelPair) -> None:
    """A decoder's caches run a probe forward when they are made; the runner builds the decoder
    before its meters start, so each tally holds the reply's passes: the prompt's prefill first, then
    one pass a step (the engine prefills all prompt tokens but the last; each step reads its last
    token), so the tallies and the engine's counts agree."""
    runner = PairRunner(pair)
    ids = prompt_ids(pair.tokenizer, [Message("user", "Once upon a time, there was a little cat.")])
    try:
        run = runner.run(
            Configuration(Setup("float32"), 0.0, "autoregressive"),
            ids,
            max_new_tokens=12,
            seed=0,
            stop_strings=(),
        )
        exact = runner.run(
            Configuration(Setup("float32"), 0.0, "exact", 3), ids, max_new_tokens=12, seed=0, stop_strings=()
        )
    finally:
        runner.close()
    assert len(run.token_ids) == 12
    assert run.stats is not None and run.stats.target_forwards == 12
    assert (run.target.calls, run.target.decode_calls) == (1 + 12, 12)
    assert exact.stats is not None
    assert exact.target.decode_calls == exact.stats.target_forwards
    assert exact.draft.decode_calls == exact.stats.draft_forwards
    assert run.target.seconds < run.seconds and exact.target.seconds + exact.draft.seconds < exact.seconds


def test_default_assisted_generation_and_draft_policies_reproduce_greedy_output(pair: ModelPair) -> None:
    """hf-assisted-default (transformers' own k and confidence exit) and exact SD under each
    draft-length policy emit target-only greedy output, and each policy's steps report their k."""
    runner = PairRunner(pair)
    setup = Setup("float32")
    ids = prompt_ids(pair.tokenizer, [Message("user", "Once upon a time, there was a little cat.")])
    configs = [
        Configuration(setup, 0.0, "autoregressive"),
        Configuration(setup, 0.0, "hf-assisted-default"),
        *(Configuration(setup, 0.0, "exact", 4, draft_policy=p) for p in ("fixed", "heuristic", "latency")),
    ]
    try:
        runs = {c.label: runner.run(c, ids, max_new_tokens=40, seed=0, stop_strings=()) for c in configs}
    finally:
        runner.close()
    # latency's timing passes (made once per pair) are metered in no run.
    latency = runs["exact k=4 latency"]
    assert latency.stats is not None and latency.target.decode_calls == latency.stats.target_forwards
    reference = runs["autoregressive"].token_ids
    assert len(reference) == 40
    assert all(run.token_ids == reference for run in runs.values()), runs.keys()
    assert list(runs) == [
        "autoregressive",
        "hf-assisted-default",
        "exact k=4",
        "exact k=4 heuristic",
        "exact k=4 latency",
    ]
    fixed, heuristic = runs["exact k=4"].stats, runs["exact k=4 heuristic"].stats
    assert fixed is not None and heuristic is not None
    assert heuristic.drafted != fixed.drafted


def test_interrupt_keeps_what_was_measured(pair: ModelPair, tmp_path: Path) -> None:
    setup = Setup("float32")
    configs = [Configuration(setup, 0.0, "autoregressive"), Configuration(setup, 0.0, "exact", 3)]
    prompt_set = load_prompt_set("tinystories", data_dir=DATA_DIR, limit=2)
    calls = []

    def ctrl_c_after_three(config: Configuration, phase: str) -> None:
        calls.append(phase)
        if calls.count("measure") == 3:
            raise KeyboardInterrupt

    result = run_sweep(
        {setup: pair}, configs, prompt_set, max_new_tokens=8, seed=0, repeats=1, on_run=ctrl_c_after_three
    )
    assert result.interrupted and len(result.runs) == 3
    write_outputs(
        tmp_path,
        runs=result.runs,
        configs=configs,
        pairs={"float32": pair},
        sweep={},
        interrupted=True,
        title="t",
    )
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["interrupted"] is True
    assert sorted(c["runs"] for c in data["configs"]) == [1, 2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompts", "nosuchset"], "unknown prompt set 'nosuchset'"),
        (["--prompts", "gsm8k", "--data-dir", "/nonexistent"], "data file not found"),
        (["--prompts", "missing.jsonl"], "data file not found"),
        (["--prompts", "tinystories", "--thresholds", "0.1,abc"], "--thresholds: bad value 'abc'"),
        (["--prompts", "tinystories", "--thresholds", "-1"], "--thresholds: threshold must be a finite"),
        (["--prompts", "tinystories", "--divergences", "js,cosine"], "--divergences: unknown value 'cosine'"),
        (["--prompts", "tinystories", "--rules", "exact"], "--rules: unknown value 'exact'"),
        (["--prompts", "tinystories", "--draft-tokens", "0"], "--draft-tokens: draft length k must be"),
        (
            ["--prompts", "tinystories", "--mixture-thresholds", "0.1,-0.1"],
            "--mixture-thresholds: threshold must be a finite",
        ),
        (
            ["--prompts", "tinystories", "--ensemble-weights", "0.9,1"],
            "--ensemble-weights: an ensemble weight must lie in the open interval (0, 1)",
        ),
        (["--prompts", "tinystories", "--top-p", "1,1.5"], "--top-p: top-p must be in"),
        (["--prompts", "tinystories", "--min-p", "x"], "--min-p: bad value 'x'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(
            ["bench", "--target", "t", "--draft", "d", "--data-dir", str(DATA_DIR), *args, "--output", "out"]
        )
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.count("\n") == 1 and err.startswith("fsd-chat: error:") and message in err
    assert not (tmp_path / "out").exists()  # nothing loaded, nothing written


def test_presets_read_the_real_data() -> None:
    csqa = load_prompt_set("commonsenseqa", data_dir=DATA_DIR, limit=2)
    first = csqa.items[0]
    assert first.answer == "A" and first.text.endswith("(E) new york\nA:")
    assert first.text.count("Therefore, the answer is") == 7 and csqa.stop_strings == ("\nQ:",)
    gsm8k = load_prompt_set("gsm8k", data_dir=DATA_DIR, limit=1)
    assert gsm8k.items[0].answer == "18" and gsm8k.items[0].text.startswith("Q: Janet")
    stories = load_prompt_set("tinystories", data_dir=DATA_DIR, limit=2)
    assert stories.items[0].text == "One day, a little girl named Lily found a needle in her room."
    assert len(load_prompt_set("mt-bench", data_dir=DATA_DIR, limit=None).items) == 80


def test_answer_checks() -> None:
    assert choice_correct("Blotters absorb ink. Therefore, the answer is E.", "E")
    assert not choice_correct("the answer is (C), no wait, the answer is (B)", "C")
    assert number_correct("16 - 3 - 4 = 9 eggs, 9 * 2 = 18. The answer is $18.", "18")
    assert number_correct("She makes 1,250 dollars", "1250")
    assert not number_correct("The answer is 17. 18 was a typo", "18")
    assert generic_correct("It is in Paris.", "paris") and not generic_correct("Lyon", "Paris")


def test_jsonl_prompt_file(tmp_path: Path) -> None:
    path = tmp_path / "set.jsonl"
    path.write_text('{"prompt": "2+2?", "answer": 4}\n\n{"prompt": "Hi"}\n')
    prompt_set = load_prompt_set(str(path), data_dir=tmp_path, limit=None)
    assert [i.text for i in prompt_set.items] == ["2+2?", "Hi"]
    assert prompt_set.items[0].answer == "4" and prompt_set.checker is generic_correct
    path.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(FsdChatError, match="no string `prompt` field"):
        load_prompt_set(str(path), data_dir=tmp_path, limit=None)


def test_accuracy_on_a_set_with_answers(pair: ModelPair, tmp_path: Path) -> None:
    path = tmp_path / "qa.jsonl"
    path.write_text(
        '{"prompt": "Lily and Ben went to the park.", "answer": "Lily"}\n'
        '{"prompt": "Tom had a red ball.", "answer": "zebra crossing"}\n'
    )
    setup = Setup("float32")
    configs = [Configuration(setup, 0.0, "autoregressive"), Configuration(setup, 0.0, "fuzzy", 3, "js", 0.2)]
    prompt_set = load_prompt_set(str(path), data_dir=tmp_path, limit=None)
    result = run_sweep({setup: pair}, configs, prompt_set, max_new_tokens=48, seed=0, repeats=1)
    summaries = summarize(configs, result.runs)
    for summary in summaries:
        runs = [r for r in result.runs if r.config == summary.config]
        assert [r.correct for r in runs if r.prompt == 1] == [False]  # no story mentions a zebra crossing
        assert summary.quality.accuracy == sum(bool(r.correct) for r in runs) / 2


def test_results_are_shown_even_when_the_reports_cannot_be_written(
    pair: ModelPair, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    setup = Setup("float32")
    configs = [Configuration(setup, 0.0, "autoregressive")]
    prompt_set = load_prompt_set("tinystories", data_dir=DATA_DIR, limit=1)
    result = run_sweep({setup: pair}, configs, prompt_set, max_new_tokens=4, seed=0, repeats=1)
    (tmp_path / "report.json").mkdir()  # taken after the check at the start, mid-run
    with pytest.raises(
        FsdChatError, match=r"report\.json: Is a directory \(the table above has the results\)"
    ):
        write_outputs(
            tmp_path,
            runs=result.runs,
            configs=configs,
            pairs={"float32": pair},
            sweep={},
            interrupted=False,
            title="[/] run of [bold]x\x1b[2J",  # model paths are text, not markup or escapes
        )
    out = capsys.readouterr().out
    assert "[/] run of [bold]x␛[2J" in out and "autoregressive" in out


def test_truncations_are_each_measured(target_dir: Path, draft_dir: Path, tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    out = tmp_path / "bench-truncation"
    main(
        [
            "bench",
            "--target", str(target_dir),
            "--draft", str(draft_dir),
            "--prompts", "tinystories",
            "--data-dir", str(DATA_DIR),
            "--limit", "2",
            "--max-new-tokens", "24",
            "--rules", "mixture",
            "--mixture-thresholds", "0.1",
            "--baselines", "exact",
            "--draft-tokens", "3",
            "--temperature", "0.8",
            "--top-p", "1,0.9",
            "--min-p", "0,0.1",
            "--device", "cpu",
            "--threads", "1",
            "--output", str(out),
        ]
    )  # fmt: skip
    torch.set_num_threads(threads)
    configs = json.loads((out / "report.json").read_text())["configs"]
    measured = {(c["method"], c["top_p"], c["min_p"]) for c in configs}
    assert measured == {(m, p, q) for m in ("exact", "mixture") for p in (1.0, 0.9) for q in (0.0, 0.1)}
    for c in configs:
        # Each truncation keeps the mixture live, within its budget, and exact SD lossless.
        cost = c["quality"]["cost_per_token"]
        assert cost == 0.0 if c["method"] == "exact" else 0.0 < cost <= 0.1
    assert "top-p 0.9 · min-p 0.1" in (out / "report.md").read_text()


def _tiny_sweep(target: Path, draft_dir: Path, out: Path, *extra: str) -> dict:
    return _bench(
        target, draft_dir, out,
        "--limit", "1", "--max-new-tokens", "6", "--rules", "none", "--baselines", "exact", *extra,
    )  # fmt: skip


def test_sampling_not_given_is_the_targets_generation_config(
    target_dir: Path, draft_dir: Path, tmp_path: Path
) -> None:
    """Like chat and generate, bench starts from the target's own sampling; a given list overrides
    its value alone, and processors fsd-chat does not apply are recorded."""
    target = tmp_path / "sampling-target"
    shutil.copytree(target_dir, target)
    config = json.loads((target / "generation_config.json").read_text())
    config |= {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.05}
    (target / "generation_config.json").write_text(json.dumps(config))

    data = _tiny_sweep(target, draft_dir, tmp_path / "model")
    sampling = {(c["temperature"], c["top_k"], c["top_p"], c["min_p"]) for c in data["configs"]}
    assert sampling == {(0.7, 0, 0.9, 0.0)}
    assert (
        data["sweep"]["model_sampling"] == "sampling-target's generation_config: temperature 0.7, top-p 0.9"
    )
    assert data["sweep"]["not_applied"] == ["repetition_penalty 1.05"]

    data = _tiny_sweep(target, draft_dir, tmp_path / "given", "--temperature", "0,1", "--top-p", "1")
    sampling = {(c["temperature"], c["top_p"]) for c in data["configs"]}
    assert sampling == {(0.0, 1.0), (1.0, 1.0)}

    # The offline target's config asks for nothing: greedy, untruncated, as before.
    data = _tiny_sweep(target_dir, draft_dir, tmp_path / "plain")
    assert {(c["temperature"], c["top_p"]) for c in data["configs"]} == {(0.0, 1.0)}
    assert data["sweep"]["model_sampling"] == "built-in default"
