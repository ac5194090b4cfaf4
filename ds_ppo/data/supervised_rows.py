"""Rows of the supervised jobs, read, checked and tokenised before any model loads: SFT sequences
(prompt + completion, or a chat whose assistant turns are learned) and reward-model preference
pairs (prompt + chosen + rejected, or two chats).

Every reader `ds-ppo train` has reads them (data/readers.py: JSON lines, JSON, CSV, Parquet,
save_to_disk, hub; splits and slices, `data.eval_split` as a split or a file). A bad row (a
missing or non-text column, a malformed chat, a margin that is not a number) stops the job with
the file, the row and the reason, or with `data.on_bad_row=skip` is counted and skipped. Rows
longer than the job's `max_len` are dropped and counted.

Tokens: a text prompt is tokenised with the tokenizer's specials (its BOS), as `ds-ppo train`
tokenises prompts; a chat prompt is rendered with the chat template and the generation prompt
(no specials: the template wrote them); the completion / answer follows, tokenised alone, then
the EOS. So the SFT model learns exactly the tokens PPO's rollout will sample after that prompt,
and the reward model scores what PPO's reward role will read (prompt + response + EOS).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ds_ppo.data.readers import MISSING, SINGLE_SPLIT, is_file_spec, parse_split, read_table, \
    slice_rows
from ds_ppo.data.validate import check_messages, check_text, render_chat, report_bad
from ds_ppo.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ds_ppo.config import Config


class _Bad(Exception):
    """A row that cannot be used: the reason, for the bad-row report."""


@dataclass
class SFTSet:
    """SFT rows of one split. ``ids[i]``: row i's tokens (BOS ... EOS); ``loss_mask[i]`` (same
    length): True on the tokens the loss predicts (the completion and its EOS, or the assistant
    turns). ``stats``: rows, used, dropped_too_long, skipped_bad, max_len, longest."""

    ids: list[list[int]] = field(default_factory=list)
    loss_mask: list[list[bool]] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    def lengths(self) -> list[int]:
        return [len(r) for r in self.ids]

    def counted(self, rows: list[int]) -> int:
        """Tokens the loss covers in these rows (host)."""
        return sum(sum(self.loss_mask[i]) for i in rows)


@dataclass
class PairSet:
    """Preference pairs of one split: ``chosen[i]`` / ``rejected[i]`` token ids (prompt +
    answer + EOS); ``chosen_mask[i]`` / ``rejected_mask[i]`` (same lengths): True on the
    answer's tokens and its EOS (a whole chat: its assistant turns; text without a prompt: every
    token), what `ds-ppo dpo` scores; ``margin[i]`` (None without rm.margin_key)."""

    chosen: list[list[int]] = field(default_factory=list)
    rejected: list[list[int]] = field(default_factory=list)
    chosen_mask: list[list[bool]] = field(default_factory=list)
    rejected_mask: list[list[bool]] = field(default_factory=list)
    margin: list[float] | None = None
    stats: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.chosen)

    def lengths(self) -> list[int]:
        return [max(len(c), len(r)) for c, r in zip(self.chosen, self.rejected)]


# ------------------------------------------------------------------------- shared parts
def _open_split(cfg: Config, split: str | None):
    """(table, rows) of a split spec, or of a file given as data.eval_split."""
    d = cfg.data
    split = d.split if split is None else split
    path, fmt = d.path, d.format
    if split != d.split and is_file_spec(split):
        path, fmt, split = split, "auto", SINGLE_SPLIT
    if path is None:
        raise DataError("data.path = null: the supervised jobs read a dataset file (the builtin "
                        "prompts have no completions or preference pairs)")
    name, start, end = parse_split(split)
    table = read_table(path, fmt, name)
    rows = slice_rows(len(table), start, end)
    if not rows:
        raise DataError(f"{table.source}: split {split!r} selects no rows (it has {len(table)})")
    return table, rows


def _need_columns(table, names: list[str], what: str) -> None:
    absent = [n for n in names if n not in table.columns]
    if absent:
        raise DataError(f"{table.source}: no column {', '.join(map(repr, absent))} ({what}); "
                        f"its columns are: {', '.join(map(repr, table.columns)) or '(none)'}")


def _text(value: Any, key: str, what: str = "prompt") -> str:
    why = "missing" if value is MISSING else check_text(value, key, what)
    if why == "missing":
        raise _Bad(f"missing column {key!r}")
    if why is not None:
        raise _Bad(why)
    return value


def _encode(tokenizer, text: str, specials: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=specials)["input_ids"])


def _prompt_ids(tokenizer, value: Any, key: str) -> list[int]:
    """A prompt cell as token ids: text with the tokenizer's specials, or chat messages rendered
    with the generation prompt (as `ds-ppo train` renders prompts)."""
    if isinstance(value, list):
        messages, why = check_messages(value, key)
        if why is None:
            text, why = render_chat(tokenizer, messages, key, generation_prompt=True)
        if why is not None:
            raise _Bad(why)
        return _encode(tokenizer, text, specials=False)
    return _encode(tokenizer, _text(value, key), specials=True)


def _answer_ids(tokenizer, value: Any, key: str) -> list[int]:
    """A completion / answer after a prompt: its tokens alone, then the EOS."""
    text = _text(value, key, "answer")
    return _encode(tokenizer, text, specials=False) + [tokenizer.eos_token_id]


def chat_ids(tokenizer, value: Any, key: str) -> tuple[list[int], list[bool]]:
    """A whole chat as (token ids, loss mask True on the assistant turns' tokens). Each assistant
    turn k is the tokens that rendering messages[:k+1] adds to messages[:k] with the generation
    prompt; both renderings must tokenise as prefixes of the whole chat (else a bad row). An EOS
    ends a chat whose last turn is the assistant's (learned: the model must learn to stop)."""
    messages, why = check_messages(value, key)
    if why is not None:
        raise _Bad(why)
    if tokenizer.chat_template is None:
        raise DataError(f"column {key!r} holds chat messages but the tokenizer has no chat "
                        "template; use a tokenizer with one")

    def ids_of(msgs, generation_prompt):
        text, why = render_chat(tokenizer, msgs, key, generation_prompt=generation_prompt,
                                allow_empty=not msgs)
        if why is not None:
            raise _Bad(why)
        return _encode(tokenizer, text, specials=False)

    ids = ids_of(messages, False)
    mask = [False] * len(ids)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, upto = ids_of(messages[:k], True), ids_of(messages[:k + 1], False)
        if ids[:len(upto)] != upto or upto[:len(before)] != before:
            raise _Bad(f"column {key!r}: assistant message {k + 1} does not tokenise as a "
                       "continuation of the messages before it (the chat template's rendering "
                       "of a prefix is not a prefix of the whole chat's tokens)")
        mask[len(before):len(upto)] = [True] * (len(upto) - len(before))
    if not any(mask):
        raise _Bad(f"column {key!r}: no assistant message with content to learn")
    if messages[-1]["role"] == "assistant" and ids[-1] != tokenizer.eos_token_id:
        ids.append(tokenizer.eos_token_id)
        mask.append(True)
    return ids, mask


def _finish(table, bad: list[str], rows: range, used: int, dropped: int, longest: int,
            max_len: int, on_bad_row: str) -> dict[str, int]:
    skipped = report_bad(table.source, bad, on_bad_row)
    stats = {"rows": len(rows), "used": used, "dropped_too_long": dropped,
             "skipped_bad": skipped, "max_len": max_len, "longest": longest}
    if not used:
        raise DataError(f"{table.source}: no rows left ({format_stats(stats)})")
    return stats


def format_stats(stats: dict[str, int]) -> str:
    """One line: '1000 rows, 990 used (longest 87 tokens), 5 dropped as longer than ...'."""
    parts = [f"{stats.get('rows', 0)} rows", f"{stats.get('used', 0)} used"
             + (f" (longest {stats['longest']} tokens)" if stats.get("longest") else "")]
    if stats.get("dropped_too_long"):
        parts.append(f"{stats['dropped_too_long']} dropped as longer than "
                     f"{stats['max_len']} tokens")
    if stats.get("skipped_bad"):
        parts.append(f"{stats['skipped_bad']} bad rows skipped")
    return ", ".join(parts)


# --------------------------------------------------------------------------------- SFT
def load_sft(cfg: Config, tokenizer: PreTrainedTokenizerBase, split: str | None = None
             ) -> SFTSet:
    """The SFT rows of a split (default data.split): prompt (data.prompt_key) + completion
    (sft.completion_key) rows, or chats (data.messages_key) when the completion column is absent.

    Raises:
        DataError: no usable columns, a bad row (data.on_bad_row=error), or no row left.
    """
    d, s = cfg.data, cfg.sft
    table, rows = _open_split(cfg, split)
    paired = s.completion_key in table.columns
    if paired:
        _need_columns(table, [d.prompt_key], "data.prompt_key, with sft.completion_key")
        prompts, answers = table.column(d.prompt_key), table.column(s.completion_key)
    else:
        _need_columns(table, [d.messages_key], f"data.messages_key; or {s.completion_key!r} "
                      "(sft.completion_key) with a prompt column")
        chats = table.column(d.messages_key)
    out, bad, dropped = SFTSet(), [], 0
    for i in rows:
        try:
            if i in table.broken:
                raise _Bad(table.broken[i])
            if paired:
                p = _prompt_ids(tokenizer, prompts[i], d.prompt_key)
                c = _answer_ids(tokenizer, answers[i], s.completion_key)
                ids, mask = p + c, [False] * len(p) + [True] * len(c)
            else:
                ids, mask = chat_ids(tokenizer, chats[i], d.messages_key)
        except _Bad as e:
            bad.append(f"{table.where[i]}: {e}")
            continue
        if len(ids) > s.max_len:
            dropped += 1
            continue
        out.ids.append(ids)
        out.loss_mask.append(mask)
    out.stats = _finish(table, bad, rows, len(out), dropped, max(out.lengths(), default=0),
                        s.max_len, d.on_bad_row)
    return out


def check_rows(cfg: Config, job: str, split: str | None = None) -> None:
    """`--dry-run`: the rows `load_sft` / `load_pairs` would read (job sft, or a pair job: rm,
    dpo), checked as
    they check them but without a tokenizer (no torch, no transformers): the columns, rows that
    do not read (not UTF-8, malformed JSON), cells that are not text, malformed chats, a chat
    without an assistant turn, margins that are not numbers, pairs whose answers are the same.
    Token counts (rows longer than max_len, chat templates) are the real start's.

    Raises:
        DataError: what the loader would raise (with data.on_bad_row=error, the first bad row;
            with skip, a split with no row left).
    """
    d = cfg.data
    table, rows = _open_split(cfg, split)
    from ds_ppo.config import PairJob

    pairs = isinstance(getattr(cfg, job), PairJob)
    if not pairs:
        paired = cfg.sft.completion_key in table.columns
        keys = ([d.prompt_key, cfg.sft.completion_key] if paired else [d.messages_key])
        if paired:
            _need_columns(table, [d.prompt_key], "data.prompt_key, with sft.completion_key")
        else:
            _need_columns(table, keys, f"data.messages_key; or {cfg.sft.completion_key!r} "
                          "(sft.completion_key) with a prompt column")
        margin_key = None
    else:
        chosen_key, rejected_key, margin_key = _pair_keys(cfg, job)
        _need_columns(table, [chosen_key, rejected_key] + ([margin_key] if margin_key else []),
                      f"{job}.chosen_key, {job}.rejected_key" + (f", {job}.margin_key"
                                                                 if margin_key else ""))
        paired = d.prompt_key in table.columns
        keys = ([d.prompt_key] if paired else []) + [chosen_key, rejected_key]
    columns = {k: table.column(k) for k in keys}
    margins = table.column(margin_key) if margin_key else None
    bad = []
    for i in rows:
        try:
            if i in table.broken:
                raise _Bad(table.broken[i])
            cells = [columns[k][i] for k in keys]
            if not pairs and not paired:
                _chat_shape(cells[0], d.messages_key)
            elif not pairs or paired:
                _prompt_shape(cells[0], d.prompt_key)
                for k, v in zip(keys[1:], cells[1:]):
                    _text(v, k, "answer")
            else:
                for k, v in zip(keys, cells):
                    if isinstance(v, list):
                        _chat_shape(v, k)
                    else:
                        _text(v, k, "answer")
            if pairs:
                if margins is not None:
                    _margin(margins[i], margin_key)
                if cells[-2] == cells[-1]:
                    raise _Bad(f"columns {keys[-2]!r} and {keys[-1]!r} are the same answer (a "
                               "pair must prefer one answer to another)")
        except _Bad as e:
            bad.append(f"{table.where[i]}: {e}")
    report_bad(table.source, bad, d.on_bad_row)
    if len(bad) == len(rows):
        raise DataError(f"{table.source}: no rows left ({len(rows)} rows, {len(bad)} bad)")


def _prompt_shape(value: Any, key: str) -> None:
    if isinstance(value, list):
        why = check_messages(value, key)[1]
        if why is not None:
            raise _Bad(why)
    else:
        _text(value, key)


def _chat_shape(value: Any, key: str) -> None:
    messages, why = check_messages(value, key)
    if why is not None:
        raise _Bad(why)
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        raise _Bad(f"column {key!r}: no assistant message with content to learn")


# ---------------------------------------------------------------------------------- RM
def _margin(value: Any, key: str) -> float:
    if value is MISSING:
        raise _Bad(f"missing column {key!r}")
    if isinstance(value, str):  # CSV cells are text
        try:
            value = float(value)
        except ValueError:
            raise _Bad(f"column {key!r} (rm.margin_key) must be a number, got {value!r}") \
                from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Bad(f"column {key!r} (rm.margin_key) must be a finite number, got {value!r}")
    return float(value)


def _pair_ids(tokenizer, cell: Any, key: str, prompt: list[int] | None
              ) -> tuple[list[int], list[bool]]:
    """(token ids, answer mask) of one answer of a pair (`PairSet`)."""
    if prompt is not None:
        answer = _answer_ids(tokenizer, cell, key)
        return prompt + answer, [False] * len(prompt) + [True] * len(answer)
    if isinstance(cell, list):  # a whole chat, scored with its EOS
        ids, mask = chat_ids(tokenizer, cell, key)
        if ids[-1] != tokenizer.eos_token_id:
            ids, mask = ids + [tokenizer.eos_token_id], mask + [True]
        return ids, mask
    ids = _encode(tokenizer, _text(cell, key, "answer"), specials=True) + [tokenizer.eos_token_id]
    return ids, [True] * len(ids)


def _pair_keys(cfg: Config, job: str) -> tuple[str, str, str | None]:
    """The (chosen, rejected, margin or None) columns of the pair job `job` (rm, dpo)."""
    r = getattr(cfg, job)
    return r.chosen_key, r.rejected_key, getattr(r, "margin_key", None)


def load_pairs(cfg: Config, tokenizer: PreTrainedTokenizerBase, split: str | None = None,
               job: str = "rm") -> PairSet:
    """The preference pairs of a split (default data.split) for the pair job `job` (rm, dpo):
    <job>.chosen_key and <job>.rejected_key, each an answer after data.prompt_key (text or
    chat) when that column exists, else a whole chat or text; rm.margin_key's number when set.

    Raises:
        DataError: a missing column, a bad row (data.on_bad_row=error), or no row left.
    """
    d, r = cfg.data, getattr(cfg, job)
    chosen_key, rejected_key, margin_key = _pair_keys(cfg, job)
    table, rows = _open_split(cfg, split)
    _need_columns(table, [chosen_key, rejected_key] + ([margin_key] if margin_key else []),
                  f"{job}.chosen_key, {job}.rejected_key" + (f", {job}.margin_key"
                                                             if margin_key else ""))
    has_prompt = d.prompt_key in table.columns
    prompts = table.column(d.prompt_key) if has_prompt else None
    chosen, rejected = table.column(chosen_key), table.column(rejected_key)
    margins = table.column(margin_key) if margin_key else None
    out, bad, dropped = PairSet(margin=[] if margins is not None else None), [], 0
    for i in rows:
        try:
            if i in table.broken:
                raise _Bad(table.broken[i])
            p = _prompt_ids(tokenizer, prompts[i], d.prompt_key) if has_prompt else None
            c, cm = _pair_ids(tokenizer, chosen[i], chosen_key, p)
            j, jm = _pair_ids(tokenizer, rejected[i], rejected_key, p)
            m = _margin(margins[i], margin_key) if margins is not None else None
            if c == j:  # the loss is log 2 whatever the model: nothing to learn, a tie to score
                raise _Bad(f"columns {chosen_key!r} and {rejected_key!r} are the same "
                           "answer (a pair must prefer one answer to another)")
        except _Bad as e:
            bad.append(f"{table.where[i]}: {e}")
            continue
        if max(len(c), len(j)) > r.max_len:
            dropped += 1
            continue
        out.chosen.append(c)
        out.rejected.append(j)
        out.chosen_mask.append(cm)
        out.rejected_mask.append(jm)
        if out.margin is not None:
            out.margin.append(m)
    out.stats = _finish(table, bad, rows, len(out), dropped, max(out.lengths(), default=0),
                        r.max_len, d.on_bad_row)
    return out
