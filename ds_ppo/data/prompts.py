"""Prompts: read a dataset, validate every row, render chat, tokenise, truncate.

Everything that can be wrong with the data is found before training starts, and raised
as a :class:`~ds_ppo.errors.DataError` naming the file, the row and the column (the CLI prints
it without a traceback and exits 2). With ``data.on_bad_row=skip`` bad rows are counted and
skipped instead. What leaves :func:`load_prompts` (a :class:`PromptSet`) cannot crash training.

The parts: ``readers`` (the sources ``data.path`` may name, and split specs), ``validate``
(every row, chat rendering), this module (tokenising, ``data.max_prompt_len``, the whole
pipeline) and ``sampler`` (which prompts each data-parallel rank takes). This module is the
package's entry point: it re-exports what callers use from the other three.

Every source goes through the same ``datasets.Dataset.map(batched=True)`` tokenisation (the
builtin prompts excepted: they must work where ``datasets`` is not installed).

Splits: a single file (and the builtin prompts) is the one split ``train``; a save_to_disk
``DatasetDict`` or a hub dataset has its own; a directory holding ``train.jsonl`` and
``test.jsonl`` (or .json, .csv, .parquet) has one per file. Any split may be sliced as in
``datasets``: ``train[:90%]`` / ``train[90%:]``, ``train[100:200]``. ``data.eval_split`` may
also be the path of a second file.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ds_ppo.data.readers import (SINGLE_SPLIT, is_file_spec, parse_split, quiet_datasets,
                                 read_table, slice_rows)
from ds_ppo.data.sampler import PromptSampler, left_pad
from ds_ppo.data.tokenizer import tiny_corpus_path
from ds_ppo.data.validate import Valid, report_bad, validate_rows
from ds_ppo.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ds_ppo.config import DataConfig

__all__ = ["PromptSet", "PromptSampler", "builtin_prompts", "format_stats", "left_pad",
           "load_prompts", "parse_split", "slice_rows", "truncate_left"]

log = logging.getLogger("ds_ppo")


@dataclass
class PromptSet:
    """The prompts of one split, validated and tokenised.

    ``input_ids[i]`` are prompt i's token ids, unpadded, 1..max_prompt_len long (with the
    BOS the tokenizer or chat template adds). ``extras[i]`` holds row i's values of the
    ``data.reward_keys`` columns, for the reward function. ``texts[i]`` is the prompt as
    rendered (after the chat template); for a prompt truncated to its end, the decoded kept
    tokens. ``stats``
    counts rows: ``rows`` in the split, ``used``, ``truncated``, ``dropped_too_long``,
    ``skipped_bad``, and ``max_prompt_len`` (the limit) and ``longest`` (tokens).
    """

    input_ids: list[list[int]]
    texts: list[str]
    stats: dict[str, int] = field(default_factory=dict)
    extras: list[dict[str, Any]] | None = None  # per prompt: its data.reward_keys values
    # per prompt: its chat messages (None: a plain-text prompt), for a reward model that renders
    # them with its own chat template; None when no row is a chat
    messages: list[list[dict[str, str]] | None] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def extra(self, i: int) -> dict[str, Any]:
        """Prompt i's data.reward_keys values ({} without any)."""
        return self.extras[i] if self.extras is not None else {}

    def chat(self, i: int) -> list[dict[str, str]] | None:
        """Prompt i's chat messages (None for a plain-text prompt)."""
        return self.messages[i] if self.messages is not None else None


# ------------------------------------------------------------------------------ builtin
def builtin_data(path: str | None) -> str | None:
    """data.path `builtin:NAME` -> the data file shipped as ds_ppo/data/NAME.jsonl (e.g.
    builtin:calculator, the calculator environment's task); other paths unchanged."""
    if path is None or not path.startswith("builtin:"):
        return path
    from pathlib import Path

    here = Path(__file__).parent
    file = here / f"{path.partition(':')[2]}.jsonl"
    if not file.is_file():
        names = ", ".join(f"builtin:{p.stem}" for p in sorted(here.glob("*.jsonl")))
        raise DataError(f"data.path = {path!r}: no such builtin data (there are: {names})")
    return str(file)


def builtin_prompts() -> list[str]:
    """The tiny default's prompts: the first 2, 3 or 4 words (cycling) of each corpus line.

    Deterministic; duplicates are dropped, first occurrence kept. At least one word of each
    line is left for the policy to continue.
    """
    prompts: list[str] = []
    seen: set[str] = set()
    lines = tiny_corpus_path().read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(w.split() for w in lines):
        if len(line) < 2:
            continue
        prompt = " ".join(line[:min(2 + i % 3, len(line) - 1)])
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    return prompts


# --------------------------------------------------------------------------- tokenising
def _tokenize(texts: list[str], chat: list[bool], tokenizer: PreTrainedTokenizerBase
              ) -> list[list[int]]:
    """Token ids per text. Plain text gets the tokenizer's specials (e.g. BOS); chat text does
    not, because the chat template already wrote them (no double BOS)."""
    ids: list[list[int]] = [[] for _ in texts]
    for is_chat in (False, True):
        pick = [j for j, c in enumerate(chat) if c == is_chat]
        if pick:
            enc = tokenizer([texts[j] for j in pick], add_special_tokens=not is_chat)
            for j, row in zip(pick, enc["input_ids"]):
                ids[j] = list(row)
    return ids


def _tokenize_with_datasets(texts: list[str], chat: list[bool],
                            tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    with quiet_datasets() as datasets:
        ds = datasets.Dataset.from_dict({"text": texts, "chat": chat})
        # new_fingerprint: an in-memory dataset is never cached, so hashing the tokenizer
        # (slow for large vocabularies, and a warning when it cannot be pickled) buys nothing
        ds = ds.map(lambda b: {"input_ids": _tokenize(b["text"], b["chat"], tokenizer)},
                    batched=True, remove_columns=["text", "chat"],
                    new_fingerprint="ds_ppo_tokenize_prompts")
        return [list(r) for r in ds["input_ids"]]


def truncate_left(ids: list[int], max_len: int, keep_first: bool) -> list[int]:
    """Keep the last ``max_len`` tokens; with ``keep_first`` the first (a BOS) stays in front."""
    if len(ids) <= max_len:
        return ids
    if keep_first and max_len > 1:
        return ids[:1] + ids[len(ids) - (max_len - 1):]
    return ids[len(ids) - max_len:]


# ------------------------------------------------------------------------------- loading
def load_prompts(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase,
                 split: str | None = None) -> PromptSet:
    """Read, validate, render and tokenise the prompts of one split.

    Args:
        cfg: the ``data`` section of the config.
        tokenizer: the policy's tokenizer (its chat template renders chat rows).
        split: a split spec (``train``, ``test``, ``train[:90%]``) or the path of another
            file of prompts (.jsonl, .json, .csv, .parquet); default ``cfg.split``. The
            trainer passes ``cfg.eval_split`` for the evaluation prompts.

    Returns:
        A PromptSet with at least one prompt. Logs one summary line.

    Raises:
        DataError: anything wrong with the data (see the module docstring); in skip mode only
            what concerns the whole source (unreadable, empty, no such column, nothing left).
    """
    split = cfg.split if split is None else split
    path_str, fmt = builtin_data(cfg.path), cfg.format
    if split != cfg.split and is_file_spec(split):
        path_str, fmt, split = split, "auto", SINGLE_SPLIT  # eval_split given as a file
    name, start, end = parse_split(split)

    if path_str is None:
        if name != SINGLE_SPLIT:
            raise DataError(f"the builtin prompts (data.path = null) have only the split "
                            f"{SINGLE_SPLIT!r}, not {name!r}; slice it, e.g. {SINGLE_SPLIT}[-10%:]")
        texts = builtin_prompts()
        rows = slice_rows(len(texts), start, end)
        valid = Valid(texts=[texts[i] for i in rows], chat=[False] * len(rows),
                      where=[f"row {i + 1}" for i in rows])
        source = "builtin prompts (tiny corpus)"
        ids = _tokenize(valid.texts, valid.chat, tokenizer)  # plain Python: no datasets here
    else:
        table = read_table(path_str, fmt, name)
        rows = slice_rows(len(table), start, end)
        source = table.source
        if not rows:
            raise DataError(f"{source}: split {split!r} selects no rows (it has {len(table)})")
        valid = validate_rows(table, rows, cfg, tokenizer)
        ids = _tokenize_with_datasets(valid.texts, valid.chat, tokenizer) if valid.texts else []

    prompts = _apply_max_len(valid, ids, cfg, tokenizer, source)
    prompts.stats.update(rows=len(rows), skipped_bad=prompts.stats["skipped_bad"] + valid.skipped)
    if not prompts.input_ids:
        raise DataError(f"{source} split {split!r}: no prompts left "
                        f"({format_stats(prompts.stats)})")
    log.info("prompts, split %s, from %s: %s", split, source, format_stats(prompts.stats))
    return prompts


def _apply_max_len(valid: Valid, ids: list[list[int]], cfg: DataConfig,
                   tokenizer: PreTrainedTokenizerBase, source: str) -> PromptSet:
    limit, bos = cfg.max_prompt_len, tokenizer.bos_token_id
    out = PromptSet(input_ids=[], texts=[], stats={}, extras=[] if cfg.reward_keys else None)
    extras = valid.extras if cfg.reward_keys else [{}] * len(valid.texts)
    chats = valid.messages if any(m is not None for m in valid.messages) else None
    if chats is not None:
        out.messages = []
    truncated = dropped = 0
    # A tokenizer may normalise a whole text away (e.g. only zero-width characters).
    empty = [f"{w}: the prompt has no tokens after tokenising" for w, r in zip(valid.where, ids)
             if not r]
    skipped = report_bad(source, empty, cfg.on_bad_row)
    for n, (text, row, extra) in enumerate(zip(valid.texts, ids, extras)):
        if not row:
            continue
        if len(row) > limit:
            if cfg.truncation == "drop":
                dropped += 1
                continue
            row = truncate_left(row, limit, keep_first=bos is not None and row[0] == bos)
            text = tokenizer.decode(row, skip_special_tokens=True)
            truncated += 1
        out.input_ids.append(row)
        out.texts.append(text)
        if out.extras is not None:
            out.extras.append(extra)
        if chats is not None:
            out.messages.append(chats[n])
    out.stats = {"rows": 0, "used": len(out.input_ids), "truncated": truncated,
                 "dropped_too_long": dropped, "skipped_bad": skipped, "max_prompt_len": limit,
                 "longest": max((len(r) for r in out.input_ids), default=0)}
    return out


def format_stats(stats: dict[str, int]) -> str:
    """One line: '1000 rows, 990 used (longest 87 tokens), 5 truncated to 256 tokens, ...'."""
    parts = [f"{stats.get('rows', 0)} rows", f"{stats.get('used', 0)} used"
             + (f" (longest {stats['longest']} tokens)" if stats.get("longest") else "")]
    limit = stats.get("max_prompt_len")
    if stats.get("truncated"):
        parts.append(f"{stats['truncated']} truncated to their last {limit} tokens")
    if stats.get("dropped_too_long"):
        parts.append(f"{stats['dropped_too_long']} dropped as longer than {limit} tokens")
    if stats.get("skipped_bad"):
        parts.append(f"{stats['skipped_bad']} bad rows skipped")
    return ", ".join(parts)
