"""Drafts with another tokenizer, built from the offline draft: the same model and token strings
under other ids (`permuted_draft`), or with part of its vocabulary removed (`pruned_draft`)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Collection
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

SPECIALS = 3
"""<unk>, <s>, </s>: ids 0-2 in both tokenizers (added tokens; the configs name 1 and 2)."""


def _rewrite(source: Path, directory: Path, new_ids: dict[int, int]) -> Path:
    """Copy the model at `source` to `directory`, giving old id i the new id new_ids[i] (tokens
    absent from new_ids are removed, with every merge that makes or uses them)."""
    shutil.copytree(source, directory)
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    bpe = tokenizer["model"]
    kept = {token: new_ids[i] for token, i in bpe["vocab"].items() if i in new_ids}
    bpe["vocab"] = dict(sorted(kept.items(), key=lambda item: item[1]))
    bpe["merges"] = [m for m in bpe["merges"] if m[0] in kept and m[1] in kept and m[0] + m[1] in kept]
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    model = AutoModelForCausalLM.from_pretrained(source)
    old = torch.tensor(sorted(new_ids))
    rows = torch.empty(len(new_ids), dtype=torch.long)
    rows[torch.tensor([new_ids[int(i)] for i in old])] = old
    with torch.no_grad():
        weight = model.get_input_embeddings().weight
        embedding = torch.nn.Embedding(len(new_ids), weight.shape[1])
        embedding.weight.copy_(weight[rows])
        model.set_input_embeddings(embedding)
        model.config.vocab_size = len(new_ids)
        model.tie_weights()  # the draft's lm_head is its embedding
    model.save_pretrained(directory)
    return directory


def permuted_draft(source: Path, directory: Path, seed: int) -> tuple[Path, torch.Tensor]:
    """The draft with its non-special token ids shuffled; returns its directory and `order`, the
    new id of each old id (shape [vocab] int64)."""
    vocab = json.loads((source / "tokenizer.json").read_text())["model"]["vocab"]
    generator = torch.Generator().manual_seed(seed)
    order = torch.cat(
        [torch.arange(SPECIALS), SPECIALS + torch.randperm(len(vocab) - SPECIALS, generator=generator)]
    )
    return _rewrite(source, directory, {i: int(order[i]) for i in range(len(vocab))}), order


def pruned_draft(source: Path, directory: Path, removed: Collection[int]) -> tuple[Path, torch.Tensor]:
    """The draft without the tokens `removed` (old ids; neither special nor byte tokens); returns
    its directory and `kept`, the old ids it keeps in order of their new ids (shape [kept] int64)."""
    vocab = json.loads((source / "tokenizer.json").read_text())["model"]["vocab"]
    kept = [i for i in range(len(vocab)) if i not in removed]
    return _rewrite(source, directory, {old: new for new, old in enumerate(kept)}), torch.tensor(kept)


def multi_character_tokens(source: Path) -> list[int]:
    """Ids of the draft's tokens that stand for more than one character (BPE merges): removing
    some leaves every text spellable, one character at a time at worst."""
    vocab = json.loads((source / "tokenizer.json").read_text())["model"]["vocab"]
    return [i for token, i in vocab.items() if not token.startswith("<") and len(token.replace("▁", " ")) > 1]
