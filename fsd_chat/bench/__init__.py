"""`fsd-chat bench`: the speed/cost trade-off of FSD's lossy rules against their baselines, measured
side by side.

Modules, one job each, by stage:

- What to run and what was measured, torch-free: `records` (setup, configuration, measurement,
  sweep result), `prompts` (prompt sets and answer checks), `sweep` (the configurations to run).
- Measuring, with the models: `meter` (forward-pass counts and times), `methods` (one generation
  per method), `quality` (target NLL), `runner` (the interleaved sweep), `environment` (versions,
  device, threads).
- Analysis, torch-free: `metrics` (per-configuration summaries, cost per token, greedy agreement,
  the trade-off's Pareto front), `curves` (the rules' curves compared at matched cost), `report`
  (report.json, written and read back, and report.md), `plot` (tradeoff.png), `terminal` (table and
  plot on the terminal).
- `pipeline`: one run: load, sweep, write, show; the typer command is `fsd_chat.cli.bench`.
"""
