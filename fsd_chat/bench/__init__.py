"""`fsd-chat bench`: the speed/cost trade-off of FSD's lossy rules against their baselines, measured
side by side.

Modules, one job each: `prompts` (prompt sets and answer checks), `sweep` (the configurations to
run), `meter` (forward-pass counts and costs), `methods` (one generation per method), `quality`
(target NLL, accuracy, greedy agreement), `runner` (the interleaved sweep), `metrics` (per-config
summaries, cost per token among them), `curves` (the rules' curves compared at matched cost),
`report` (report.json / report.md), `plot` (tradeoff.png), `terminal` (table and plot on the
terminal) and `pipeline` (one run: load, sweep, write, show); the typer command is
`fsd_chat.bench_command`.
"""
