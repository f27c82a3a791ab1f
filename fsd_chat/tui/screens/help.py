"""The help screen (f1): the keys, what each colour means, what the dial does, what T = 0 means."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Markdown, Static

from fsd_chat.decoding.events import Origin
from fsd_chat.tui.keys import key_rows
from fsd_chat.tui.themes import origin_style

COLOURS: dict[Origin, str] = {
    Origin.DRAFT_EXACT: "draft token accepted by the exact speculative test: follows the target's distribution, costs 0",
    Origin.DRAFT_FUZZY: "draft token kept where the relaxed test decided (D ≤ T, or mixture's blend): the text may depart from the target",
    Origin.TARGET_RESAMPLED: "token drawn from the target after it rejected a draft token",
    Origin.TARGET_BONUS: "the target's extra token after all k draft tokens were accepted",
    Origin.TARGET: "the target's own token, from a step that drafted nothing: no lookup match (on the default chat most steps), the draft policy paused (k 0), autoregressive mode, or no room left to draft",
}

DIAL = """\
## The dial

`T 1.00 ▕████████▏ regret nats/tok fuzzy · k ≤ 5 goodput` — the threshold **T** of Fuzzy
Speculative Decoding, a bar over the dial's range, the unit T is in, and the acceptance rule in force.

**Greedy decoding** (a model without sampling settings, such as the default chat's): T is a bound
in nats on each kept draft token's regret, how much less likely it is than the target's own choice
(log p(argmax) − log p(token)): 0.5 keeps a token at least 61% as likely as the target's choice,
1 (the default, and the dial's top) one at least 37% as likely. It is the cost the token is
charged, under every rule. The top is the largest step measured to keep replies whole
(docs/decoding.md, "The dial's scale").

For every draft token the target model checks the draft's proposal. With the **fuzzy** rule a
draft token is kept when the exact speculative test accepts it **or** when the divergence between
the target's and the draft's next-token distributions is at most T. Raising T keeps more draft
tokens: faster replies (higher acceptance, longer accepted runs τ) that may drift from what the
target alone would write. A change applies from the next decoding step and is marked ⟨…⟩ in the
reply. When sampling, each divergence has its own units and step: kl and reverse-kl in nats (0–2
on the dial), js in nats (0–ln 2), tv a probability (0–1).

**T = 0** (ctrl+r) is exact speculative decoding under every rule, pure included: only the exact
test accepts, so the replies follow the target model's own distribution — lossless, only faster than decoding with the target alone.

**What a token costs.** Every token is drawn from some law r — the draft's where the fuzzy test
decided, the target's otherwise — and its **cost** is KL(r ‖ p) in nats: 0 for every token that
follows the target (greedy: how much less likely the token is than the target's own choice, in
nats). Summed over a reply it measures how far the reply's law departs from the target's. The
stats strip shows it per token beside tokens/s, so the dial shows both sides of the trade-off.

**The rules** (ctrl+g): **fuzzy** (FSD, the default), **mixture**, **pure** (the paper's released
code: D ≤ T alone decides) and **exact**. Under **mixture** the target's law at each position is
replaced by the blend (1 − λ)p + λq̄ (q̄: the draft's law on the tokens the target's top-k /
top-p / min-p keep) with the largest λ whose KL from p stays within T, and exact speculative
sampling runs against that blend; so T is a hard budget, in nats, on every token's cost, and the
dial reads in the same units as the cost figure. Under truncated sampling, fuzzy and pure compare
the models' untruncated laws, so T means the same with or without top-k, top-p and min-p.

What T costs, in nats per token (sampling at temperature 1 · greedy), measured on the offline pair
with k = 5 (docs/benchmarks.md, "The divergences' scales"); under mixture every token costs at most T:

| divergence | T 0.02 | T 0.05 | T 0.1 | T 0.2 | T 0.4 |
|---|---|---|---|---|---|
| js | 0.016 · 0.001 | 0.060 · 0.021 | 0.127 · 0.063 | 0.250 · 0.131 | 0.359 · 0.199 |
| tv | 0.003 · 0.000 | 0.010 · 0.000 | 0.018 · 0.000 | 0.054 · 0.008 | 0.175 · 0.069 |
| kl | 0.004 · 0.000 | 0.011 · 0.000 | 0.023 · 0.006 | 0.068 · 0.021 | 0.126 · 0.065 |
| reverse-kl | 0.001 · 0.000 | 0.004 · 0.000 | 0.011 · 0.006 | 0.033 · 0.019 | 0.085 · 0.053 |

The stats strip shows tokens/s, acceptance rate and mean accepted length τ (tokens per target
forward pass) over the last 16 steps, the share of fuzzy-accepted tokens and the cost per token
since the reply's first token, why drafting is paused when it is, and a sparkline of tokens per
step. In a narrow terminal the figures are abbreviated (⏸: paused).
"""


def keys_markdown(keymap: dict[str, str]) -> str:
    """The key table with the user's keymap applied."""
    rows = "\n".join(f"| `{keys}` | {what} | `{binding_id}` |" for keys, binding_id, what in key_rows(keymap))
    return f"## Keys\n\n| Keys | Action | Binding id |\n|---|---|---|\n{rows}\n"


def colours_content() -> Content:
    """One line per origin: a sample in its theme colour, then what it means."""
    lines: list[Content | tuple[str, str] | str] = []
    for origin, meaning in COLOURS.items():
        lines += [(f"■ {origin.value:<17}", origin_style(origin)), f"{meaning}\n"]
    return Content.assemble(*lines)


class HelpScreen(ModalScreen[None]):
    """Keys, colours, the dial. Esc, f1 or q closes it."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,f1,q", "app.pop_screen", "Close")]

    def __init__(self, keymap: dict[str, str], sampling: str = "") -> None:
        super().__init__()
        self.keymap = keymap
        self.sampling = sampling

    def compose(self) -> ComposeResult:
        """The help text."""
        with VerticalScroll(id="help-box"):
            yield Markdown("# fsd-chat help\n\n" + keys_markdown(self.keymap))
            yield Markdown("## Colours")
            yield Static(colours_content(), id="help-colours")
            yield Markdown(DIAL)
            if self.sampling:
                yield Markdown("## Sampling in force")
                # Plain content: the line holds the model's folder name, shown literally.
                yield Static(Content(self.sampling), id="help-sampling")
