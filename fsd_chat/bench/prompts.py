"""Prompt sets for the benchmark: built-in presets over ../shared/data and JSONL files.

Presets (paths relative to the data directory):

- `tinystories`: the first sentence of each story in `tinystories/*.txt` (stories separated by
  `<|endoftext|>`), for base story models; no answers.
- `commonsenseqa`: CommonsenseQA dev (`commonsenseqa/dev_rand_split.jsonl`) in the few-shot
  chain-of-thought format of Wei et al. 2022 (Table 25's seven exemplars), each rationale ending
  "Therefore, the answer is X." as in the FSD paper's evaluation (Holsman et al. 2025, §4); the
  reply's last "answer is X" is compared with `answerKey`.
- `gsm8k`: GSM8K test (`gsm8k/test.jsonl`) with zero-shot chain of thought ("Let's think step by
  step.", Kojima et al. 2022); the number after "answer is" (else the last number) of the reply is
  compared with the number after "####".
- `mt-bench`: the first turn of each MT-Bench question (`mt_bench/question.jsonl`); no answers.
- `tinystories-retell`: text to be repeated with its own names, where prompt lookup pays: each
  story of `tinystories/*.txt` (its first RETELL_CHARS characters, cut at a sentence's end), a
  blank line, then the story's first sentence again, so that a story model goes on to retell it;
  no answers.
- `tinystories-retell-chat`, `tinystories-summarise-chat`: the same quoted stories after an
  instruction, for chat models ("Retell this story in your own words." or "Summarise this
  story.", a blank line, the story): the copy-heavy requests a chat user makes, where a reply
  copies some of the prompt's phrases (retelling more of them than summarising); no answers.

Any other value is read as a JSONL file whose rows have a `prompt` field and optionally `answer`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fsd_chat.support.errors import FsdChatError
from fsd_chat.support.text import read_utf8, require_utf8

Checker = Callable[[str, str], bool]
"""(reply text, reference answer) -> correct?"""

PRESETS = (
    "tinystories",
    "tinystories-retell",
    "tinystories-retell-chat",
    "tinystories-summarise-chat",
    "commonsenseqa",
    "gsm8k",
    "mt-bench",
)

RETELL_CHARS = 600
"""Longest story `tinystories-retell` (and the chat sets) quote, in characters (stories260K's context
is 512 tokens)."""
RETELL_INSTRUCTION = "Retell this story in your own words."
SUMMARISE_INSTRUCTION = "Summarise this story."

# Few-shot prompts continue with a new "Q:" once the answer is given; stop there.
_QA_STOP = ("\nQ:",)

_CSQA_EXEMPLARS = (
    (
        "What do people use to absorb extra ink from a fountain pen?",
        ("shirt pocket", "calligrapher's hand", "inkwell", "desk drawer", "blotter"),
        "The answer must be an item that can absorb ink. Of the above choices, only blotters are used to absorb ink.",
        "E",
    ),
    (
        "What home entertainment equipment requires cable?",
        ("radio shack", "substation", "television", "cabinet"),
        "The answer must require cable. Of the above choices, only television requires cable.",
        "C",
    ),
    (
        "The fox walked from the city into the forest, what was it looking for?",
        ("pretty flowers", "hen house", "natural habitat", "storybook"),
        "The answer must be something in the forest. Of the above choices, only natural habitat is in the forest.",
        "C",
    ),
    (
        "Sammy wanted to go to where the people were. Where might he go?",
        ("populated areas", "race track", "desert", "apartment", "roadblock"),
        "The answer must be a place with a lot of people. Of the above choices, only populated areas have a lot of people.",
        "A",
    ),
    (
        "Where do you put your grapes just before checking out?",
        ("mouth", "grocery cart", "super market", "fruit basket", "fruit market"),
        "The answer should be the place where grocery items are placed before checking out. Of the above choices, grocery cart makes the most sense for holding grocery items.",
        "B",
    ),
    (
        "Google Maps and other highway and street GPS services have replaced what?",
        ("united states", "mexico", "countryside", "atlas"),
        "The answer must be something that used to do what Google Maps and GPS services do, which is to give directions. Of the above choices, only atlases are used to give directions.",
        "D",
    ),
    (
        "Before getting a divorce, what did the wife feel who was doing all the work?",
        ("harder", "anguish", "bitterness", "tears", "sadness"),
        "The answer should be the feeling of someone getting divorced who was doing all the work. Of the above choices, the closest feeling is bitterness.",
        "C",
    ),
)

_CHOICE = re.compile(r"answer is:?\s*\(?([A-E])\b")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_ANSWER_NUMBER = re.compile(r"answer is:?\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)")


@dataclass(frozen=True, slots=True)
class PromptItem:
    """One prompt: its text (a user turn; plain text for base models) and its reference answer."""

    text: str
    answer: str | None = None


@dataclass(frozen=True, slots=True)
class PromptSet:
    """A named list of prompts, the stop strings its format needs, and how answers are checked.

    Attributes:
        name: Preset name or file path.
        items: The prompts.
        stop_strings: Texts that end a reply (few-shot formats would otherwise run on).
        checker: Compares a reply with an item's answer; None when the set has no answers.
    """

    name: str
    items: tuple[PromptItem, ...]
    stop_strings: tuple[str, ...] = ()
    checker: Checker | None = None


def choice_correct(reply: str, answer: str) -> bool:
    """Whether the last "answer is X" (X a choice letter A–E) in `reply` names `answer`."""
    found = _CHOICE.findall(reply)
    return bool(found) and found[-1] == answer.strip().upper()


def _to_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").rstrip("."))
    except ValueError:
        return None


def number_correct(reply: str, answer: str) -> bool:
    """Whether the reply's final number (after the last "answer is", else its last number) equals
    `answer` numerically."""
    stated = _ANSWER_NUMBER.findall(reply) or _NUMBER.findall(reply)
    if not stated:
        return False
    got, want = _to_number(stated[-1]), _to_number(answer)
    return got is not None and want is not None and got == want


def generic_correct(reply: str, answer: str) -> bool:
    """Check of JSONL answers: numbers numerically, a choice letter A–E as a choice, any other text
    by case-insensitive containment."""
    if _to_number(answer) is not None:
        return number_correct(reply, answer)
    if re.fullmatch(r"\s*[A-Ea-e]\s*", answer):
        return choice_correct(reply, answer)
    return answer.strip().lower() in reply.lower()


def _csqa_block(stem: str, choices: tuple[str, ...] | list[str]) -> str:
    listed = " ".join(f"({chr(ord('A') + i)}) {text}" for i, text in enumerate(choices))
    return f"Q: {stem}\nAnswer Choices: {listed}\nA:"


def commonsenseqa_prompt(stem: str, choices: list[str]) -> str:
    """The few-shot chain-of-thought prompt for one CommonsenseQA question (ends with "A:")."""
    shots = "\n\n".join(
        f"{_csqa_block(q, c)} {rationale} Therefore, the answer is {letter}."
        for q, c, rationale, letter in _CSQA_EXEMPLARS
    )
    return f"{shots}\n\n{_csqa_block(stem, choices)}"


def _jsonl_rows(path: Path) -> Iterator[dict[str, object]]:
    for number, line in enumerate(_read(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise FsdChatError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise FsdChatError(f"{path}:{number}: expected a JSON object")
        yield row


def _read(path: Path) -> str:
    try:
        return read_utf8(path)
    except OSError as exc:
        raise FsdChatError(f"cannot read {path}: {exc.strerror or exc}") from None


def _need(path: Path) -> Path:
    if not path.is_file():
        raise FsdChatError(f"data file not found: {path} (set --data-dir)")
    return path


def _stories(data_dir: Path) -> list[str]:
    """The stories of the TinyStories file, each on one line (whitespace runs made one space)."""
    folder = data_dir / "tinystories"
    files = sorted(folder.glob("*.txt")) if folder.is_dir() else []
    if not files:
        raise FsdChatError(f"data file not found: {folder}/*.txt (set --data-dir)")
    stories = (" ".join(story.split()) for story in _read(files[0]).split("<|endoftext|>"))
    return [story for story in stories if story]


def _first_sentence(story: str) -> str | None:
    match = re.match(r"(.+?[.!?])(?:\s|$)", story)
    return match.group(1) if match else None


def _tinystories(data_dir: Path) -> PromptSet:
    # The opening is the first sentence: enough to set a story going, as a user would.
    openings = [PromptItem(first) for first in map(_first_sentence, _stories(data_dir)) if first]
    return PromptSet("tinystories", tuple(openings))


def _quoted(story: str) -> str:
    """The story's first RETELL_CHARS characters, cut where the last whole sentence in them ends
    ("" when none does)."""
    cut = max((m.end() for m in re.finditer(r"[.!?](?=\s|$)", story[:RETELL_CHARS])), default=0)
    return story[:cut]


def _tinystories_retell(data_dir: Path) -> PromptSet:
    items = []
    for story in _stories(data_dir):
        first, quoted = _first_sentence(story), _quoted(story)
        if first and len(quoted) > len(first):
            items.append(PromptItem(f"{quoted}\n\n{first}"))
    return PromptSet("tinystories-retell", tuple(items))


def _instructed(name: str, instruction: str) -> Callable[[Path], PromptSet]:
    def load(data_dir: Path) -> PromptSet:
        quoted = (_quoted(story) for story in _stories(data_dir))
        return PromptSet(name, tuple(PromptItem(f"{instruction}\n\n{text}") for text in quoted if text))

    return load


def _commonsenseqa(data_dir: Path) -> PromptSet:
    path = _need(data_dir / "commonsenseqa" / "dev_rand_split.jsonl")
    items = []
    for row in _jsonl_rows(path):
        question = row["question"]
        assert isinstance(question, dict)
        choices = [c["text"] for c in question["choices"]]
        items.append(PromptItem(commonsenseqa_prompt(question["stem"], choices), str(row["answerKey"])))
    return PromptSet("commonsenseqa", tuple(items), _QA_STOP, choice_correct)


def _gsm8k(data_dir: Path) -> PromptSet:
    path = _need(data_dir / "gsm8k" / "test.jsonl")
    items = [
        PromptItem(
            f"Q: {row['question']}\nA: Let's think step by step.",
            str(row["answer"]).rsplit("####", 1)[-1].strip(),
        )
        for row in _jsonl_rows(path)
    ]
    return PromptSet("gsm8k", tuple(items), _QA_STOP, number_correct)


def _mt_bench(data_dir: Path) -> PromptSet:
    path = _need(data_dir / "mt_bench" / "question.jsonl")
    items = []
    for number, row in enumerate(_jsonl_rows(path), 1):
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns:
            raise FsdChatError(f"{path}: row {number} has no `turns` list")
        items.append(PromptItem(str(turns[0])))
    return PromptSet("mt-bench", tuple(items))


def _jsonl_file(path: Path) -> PromptSet:
    items = []
    for number, row in enumerate(_jsonl_rows(path), 1):
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            raise FsdChatError(f"{path}: row {number} has no string `prompt` field")
        # JSON can spell a lone surrogate ("\\udcff"), which no tokenizer can encode.
        require_utf8(prompt, f"{path}: the prompt of row {number}")
        answer = row.get("answer")
        items.append(PromptItem(prompt, None if answer is None else str(answer)))
    has_answers = any(item.answer is not None for item in items)
    return PromptSet(str(path), tuple(items), (), generic_correct if has_answers else None)


_LOADERS: dict[str, Callable[[Path], PromptSet]] = {
    "tinystories": _tinystories,
    "tinystories-retell": _tinystories_retell,
    "tinystories-retell-chat": _instructed("tinystories-retell-chat", RETELL_INSTRUCTION),
    "tinystories-summarise-chat": _instructed("tinystories-summarise-chat", SUMMARISE_INSTRUCTION),
    "commonsenseqa": _commonsenseqa,
    "gsm8k": _gsm8k,
    "mt-bench": _mt_bench,
}


def load_prompt_set(spec: str, *, data_dir: Path, limit: int | None) -> PromptSet:
    """A preset by name (read under `data_dir`) or a JSONL file by path; the first `limit` prompts.

    Raises:
        FsdChatError: unknown preset, missing or malformed file, an empty set, or limit < 1.
    """
    if limit is not None and limit < 1:
        raise FsdChatError(f"--limit must be ≥ 1, got {limit}")
    if spec in _LOADERS:
        prompt_set = _LOADERS[spec](data_dir)
    elif spec.endswith(".jsonl") or Path(spec).is_file():
        prompt_set = _jsonl_file(_need(Path(spec)))
    else:
        raise FsdChatError(f"unknown prompt set {spec!r}: use {', '.join(PRESETS)} or a .jsonl file")
    items = prompt_set.items[:limit]
    if not items:
        raise FsdChatError(f"prompt set {spec!r} has no prompts")
    return PromptSet(prompt_set.name, items, prompt_set.stop_strings, prompt_set.checker)
