"""`fsd-chat bench`: the speed/quality trade-off of FSD against its baselines, measured side by side.

Modules, one job each: `prompts` (prompt sets and answer checks), `sweep` (the configurations to
run), `meter` (forward-pass counts and costs), `methods` (one generation per method), `quality`
(target NLL, accuracy, greedy agreement), `runner` (the interleaved sweep), `metrics` (per-config
summaries), `report` (report.json / report.md), `plot` (tradeoff.png), `terminal` (table and plot
on the terminal), `command` (the typer command) and `session` (one run: load, sweep, write, show).
"""
