"""Validating the rows of a split: every bad row is found before training starts, and reported
as a :class:`~ds_ppo.errors.DataError` naming the source, the row and the column (the CLI
prints it without a traceback and exits 2); with ``data.on_bad_row=skip`` bad rows are
counted, logged and skipped instead. Chat rows are rendered with the tokenizer's template here.
"""
from __future__ import annotations

import difflib
import json
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ds_ppo.data.readers import MISSING, Table, describe_value, read_table
from ds_ppo.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ds_ppo.config import DataConfig

log = logging.getLogger("ds_ppo")

ROLES = ("system", "user", "assistant")
_LISTED = 5  # bad rows quoted in an error message; the rest are counted


_SURROGATE = re.compile("[\ud800-\udfff]")


def _not_unicode(text: str, where: str) -> str | None:
    """Why `text` cannot be encoded (a lone surrogate: JSON allows an unpaired \\uD83D escape,
    UTF-8 and the tokenizers do not), or None."""
    m = _SURROGATE.search(text)
    return None if m is None else (
        f"{where} holds a lone surrogate U+{ord(m.group()):04X} (character {m.start() + 1}): "
        "not valid Unicode text (an unpaired \\uD8xx-\\uDFxx escape?)")


def check_text(value: Any, key: str, what: str = "prompt") -> str | None:
    """Why a plain-text cell (a prompt, or `what`: a completion, an answer) is bad, or None."""
    if value is MISSING:
        return None  # reported by the caller, which knows the row's columns
    if value is None:
        return f"column {key!r} is null"
    if not isinstance(value, str):
        return f"column {key!r} must be a string, got {describe_value(value)}"
    if not value.strip():
        return f"column {key!r} is an empty {what}"
    return _not_unicode(value, f"column {key!r}")


def check_messages(value: Any, key: str) -> tuple[list[dict[str, str]] | None, str | None]:
    """(messages with only role/content, None) or (None, why they are bad)."""
    if value is None:
        return None, f"column {key!r} is null"
    if isinstance(value, str):  # CSV cells can only hold chat as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            return None, f"column {key!r}: chat messages as text must be JSON ({e.msg})"
    if not isinstance(value, list):
        return None, (f"column {key!r} must be a list of {{role, content}} messages, "
                      f"got {describe_value(value)}")
    if not value:
        return None, f"column {key!r} is an empty list of messages"
    out = []
    for j, m in enumerate(value, start=1):
        if not isinstance(m, dict):
            return None, f"column {key!r} message {j}: expected a {{role, content}} object, " \
                         f"got {describe_value(m)}"
        role, content = m.get("role", MISSING), m.get("content", MISSING)
        if role not in ROLES:
            got = "no role" if role is MISSING else f"bad role {role!r}"
            return None, f"column {key!r} message {j}: {got} (valid: {', '.join(ROLES)})"
        if not isinstance(content, str):
            got = "no content" if content is MISSING else f"got {describe_value(content)}"
            return None, f"column {key!r} message {j}: content must be a string, {got}"
        why = _not_unicode(content, f"column {key!r} message {j}")
        if why is not None:
            return None, why
        out.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in out):
        return None, f"column {key!r}: every message is empty (an empty prompt)"
    return out, None


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], key: str,
                generation_prompt: bool = True, allow_empty: bool = False
                ) -> tuple[str | None, str | None]:
    """(text, None) of chat messages rendered by the tokenizer's chat template (with the
    assistant's generation prompt unless `generation_prompt` is False), or (None, why not)."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja's TemplateError and the template's own raise_exception
        return None, f"column {key!r}: the chat template rejected it ({type(e).__name__}: {e})"
    if not isinstance(text, str) or (not allow_empty and not text.strip()):
        return None, f"column {key!r}: the chat template rendered an empty prompt"
    return text, None


@dataclass
class Valid:
    """The rows of a split that passed validation, rendered, in order; and the count skipped."""

    texts: list[str] = field(default_factory=list)  # rendered prompts
    chat: list[bool] = field(default_factory=list)  # rendered by the chat template
    where: list[str] = field(default_factory=list)  # "line 7": for messages
    extras: list[dict] = field(default_factory=list)  # data.reward_keys values
    messages: list = field(default_factory=list)  # chat messages (None: plain text), if any
    skipped: int = 0                                # bad rows skipped


def column_problems(source: str, columns: list[str], cfg: DataConfig) -> list[str]:
    """The prompt column (data.prompt_key, else data.messages_key) and every data.reward_keys
    column must be among `columns`: one message per missing one, naming the key, the closest
    column (a likely typo) and the columns there are."""
    have = f"its columns are: {', '.join(map(repr, columns)) or '(none)'}"

    def hint(name: str) -> str:
        close = difflib.get_close_matches(name, columns, n=1, cutoff=0.6)
        return f"did you mean {close[0]!r}? " if close else ""

    problems = []
    if cfg.prompt_key not in columns and cfg.messages_key not in columns:
        problems.append(f"{source}: no column {cfg.prompt_key!r} (data.prompt_key) or "
                        f"{cfg.messages_key!r} (data.messages_key); "
                        f"{hint(cfg.prompt_key) or hint(cfg.messages_key)}{have}")
    for k in cfg.reward_keys:
        if k not in columns:
            problems.append(f"{source}: no column {k!r} (data.reward_keys); {hint(k)}{have}")
    return problems


def validate_rows(table: Table, rows: range, cfg: DataConfig,
                  tokenizer: PreTrainedTokenizerBase) -> Valid:
    """Check each row of the split; render chat rows. Raises DataError unless skipping."""
    problems = column_problems(table.source, table.columns, cfg)
    if problems:
        raise DataError("\n  ".join(problems))
    key = cfg.prompt_key if cfg.prompt_key in table.columns else cfg.messages_key
    values = table.column(key)
    extra_values = {k: table.column(k) for k in cfg.reward_keys}
    bad: list[str] = []
    out = Valid()
    for i in rows:
        value, why = values[i], table.broken.get(i)
        extra = {k: extra_values[k][i] for k in cfg.reward_keys}
        for n, (col, cell) in enumerate([(key, value), *extra.items()]):
            if why is None and cell is MISSING:
                has = ", ".join(map(repr, table.row_keys(i))) if table.row_keys else "?"
                why = f"missing column {col!r} (this row has: {has or 'nothing'})"
            elif why is None and n > 0 and cell is None:  # a reward_keys value
                why = f"column {col!r} (data.reward_keys) is null"
        if why is None and (isinstance(value, list) or key == cfg.messages_key):
            messages, why = check_messages(value, key)
            if why is None:
                if tokenizer.chat_template is None:
                    raise DataError(f"{table.source}: column {key!r} holds chat messages but the "
                                    "tokenizer has no chat template; use a tokenizer with one")
                text, why = render_chat(tokenizer, messages, key)
                if why is None:
                    out.texts.append(text)
                    out.messages.append(messages)
                    out.chat.append(True)
                    out.where.append(table.where[i])
        elif why is None:
            why = check_text(value, key)
            if why is None:
                out.texts.append(value)
                out.messages.append(None)
                out.chat.append(False)
                out.where.append(table.where[i])
        if why is not None:
            bad.append(f"{table.where[i]}: {why}")
        else:  # the row's text was appended above
            out.extras.append(extra)
    out.skipped = report_bad(table.source, bad, cfg.on_bad_row)
    return out


def report_bad(source: str, bad: list[str], on_bad_row: str) -> int:
    """Raise a DataError quoting the first bad rows, or (skip) log them; returns the count."""
    if bad and on_bad_row == "error":
        listed = "\n  ".join(bad[:_LISTED])
        more = f"\n  ... and {len(bad) - _LISTED} more" if len(bad) > _LISTED else ""
        raise DataError(f"{source}: {len(bad)} bad row(s) (data.on_bad_row=skip would "
                        f"skip them):\n  {listed}{more}")
    if bad:
        log.warning("%s: skipped %d bad row(s) (data.on_bad_row=skip), e.g.\n  %s",
                    source, len(bad), "\n  ".join(bad[:_LISTED]))
    return len(bad)


def read_ptx(path: str, fmt: str, prompt_key: str):
    """(table, text mode, its columns' cells) of data.ptx_path, every row checked (no tokenizer:
    `--dry-run` calls it too). Raises DataError naming the file, row and column of a bad row."""
    table = read_table(path, fmt, "train")
    if table.broken:
        i, why = next(iter(table.broken.items()))
        raise DataError(f"data.ptx_path {table.source}: {table.where[i]}: {why}")
    if not len(table):
        raise DataError(f"data.ptx_path {table.source}: the file holds no rows")
    text_mode = "text" in table.columns
    keys = ["text"] if text_mode else [prompt_key, "completion"]
    if not text_mode and not set(keys) <= set(table.columns):
        raise DataError(f"data.ptx_path {table.source}: rows need a `text` column, or "
                        f"`{prompt_key}` (data.prompt_key) and `completion`; found columns "
                        f"{table.columns}")
    columns = [table.column(k) for k in keys]
    for k, col in zip(keys, columns):
        for i, v in enumerate(col):
            if v is MISSING:
                raise DataError(f"data.ptx_path {table.source}: {table.where[i]}: column {k!r} "
                                "is missing (every row needs it)")
            if not isinstance(v, str) or not v:
                raise DataError(f"data.ptx_path {table.source}: {table.where[i]}: column {k!r} "
                                f"must be a non-empty string, got {v!r:.60}")
    return table, text_mode, columns
