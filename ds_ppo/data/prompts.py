"""Prompts: read a dataset, validate every row, render chat, tokenise, truncate; and the
sampler that hands each data-parallel rank its share of every rollout batch.

Everything that can be wrong with the data is found here, before training starts, and raised
as a :class:`~ds_ppo.errors.DataError` naming the file, the row and the column (the CLI prints
it without a traceback and exits 2). With ``data.on_bad_row=skip`` bad rows are counted and
skipped instead. What leaves this module (a :class:`PromptSet`) cannot crash training.

Sources (``data.path``, read as ``data.format`` says or as the file ending says):

==========================  =========================================  ====================
source                      read by                                    rows are numbered as
==========================  =========================================  ====================
``.jsonl`` JSON lines       ``json`` line by line                      ``line N`` of file
``.json`` array of objects  ``json`` (JSON lines in a .json file too)  ``row N`` (element)
``.csv`` with a header      ``csv`` (every value is text)              ``line N`` of file
``.parquet``                ``datasets.load_dataset("parquet")``       ``row N``
``save_to_disk`` directory  ``datasets.load_from_disk``                ``row N``
hub name / data directory   ``datasets.load_dataset(name)``            ``row N``
``DIR/<split>.jsonl`` etc.  as that file's format                      as that format
null                        the shipped tiny corpus (no ``datasets``)  ``row N``
==========================  =========================================  ====================

N is 1-based everywhere. The text formats are parsed here rather than by ``datasets``: its
JSON reader rejects a column whose type changes between rows with no line number, and its
CSV reader silently shifts a row that has too many fields into an index column. Every source
then goes through the same ``datasets.Dataset.map(batched=True)`` tokenisation (the builtin
prompts excepted: they must work where ``datasets`` is not installed).

Splits: a single file (and the builtin prompts) is the one split ``train``; a save_to_disk
``DatasetDict`` or a hub dataset has its own; a directory holding ``train.jsonl`` and
``test.jsonl`` (or .json, .csv, .parquet) has one per file. Any split may be sliced as in
``datasets``: ``train[:90%]`` / ``train[90%:]``, ``train[100:200]``. ``data.eval_split`` may
also be the path of a second file.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from ds_ppo.data.tokenizer import tiny_corpus_path
from ds_ppo.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ds_ppo.config import DataConfig

log = logging.getLogger("ds_ppo")

ROLES = ("system", "user", "assistant")
SINGLE_SPLIT = "train"  # the name of the one split of a single file / the builtin prompts
_LISTED = 5  # bad rows quoted in an error message; the rest are counted
_MISSING = object()  # a row without the column (JSON objects may lack keys)
_SUFFIX_FORMAT = {".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv",
                  ".parquet": "parquet", ".pq": "parquet"}
_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


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


# -------------------------------------------------------------------------------- reading
@dataclass
class _Table:
    """The rows of one split as read, before any validation.

    ``column(name)`` gives one value per row (``_MISSING`` where a row lacks it); ``where[i]``
    names row i in messages ("line 7"); ``broken`` maps rows that could not be read as records
    at all (a malformed JSON line) to the reason.
    """

    source: str
    columns: list[str]
    where: list[str]
    column: Callable[[str], list[Any]]
    broken: dict[int, str] = field(default_factory=dict)
    row_keys: Callable[[int], list[str]] | None = None  # per-row columns, for JSON rows

    def __len__(self) -> int:
        return len(self.where)


def _records_table(source: str, records: list[dict | None], where: list[str],
                   broken: dict[int, str]) -> _Table:
    """A table over parsed JSON/CSV records (None for a broken row)."""
    columns: list[str] = []
    for r in records:
        for k in r or ():
            if k not in columns:
                columns.append(k)
    return _Table(source=source, columns=columns, where=where, broken=broken,
                  column=lambda name: [_MISSING if r is None else r.get(name, _MISSING)
                                       for r in records],
                  row_keys=lambda i: list(records[i] or ()))


# bytes that are not UTF-8, as `errors="surrogateescape"` keeps them (U+DC80..U+DCFF)
_UNDECODABLE = re.compile("[\udc80-\udcff]")


def _undecodable(text: str) -> str | None:
    """Why a row's text is unreadable (None: it is UTF-8): the first byte that is not."""
    m = _UNDECODABLE.search(text)
    return None if m is None else (f"not UTF-8 text (byte 0x{ord(m.group()) - 0xDC00:02x} at "
                                   f"column {m.start() + 1}; re-save the file as UTF-8)")


def _read_text_file(path: Path) -> str:
    """The file's text; bytes that are not UTF-8 stay in it (as lone surrogates) for the
    line-by-line readers to report as bad rows with their line number."""
    try:
        # utf-8-sig: a byte-order mark, as spreadsheet programs write, is not part of the data
        text = path.read_bytes().decode("utf-8-sig", errors="surrogateescape")
    except OSError as e:
        raise DataError(f"file {path}: cannot read it ({e.strerror or e})") from None
    if not text.strip():
        raise DataError(f"file {path}: the file is empty")
    return text


def _read_jsonl(path: Path, text: str | None = None) -> _Table:
    text = _read_text_file(path) if text is None else text
    records: list[dict | None] = []
    where: list[str] = []
    broken: dict[int, str] = {}
    # split("\n"), not splitlines(): U+2028 and friends may stand unescaped inside JSON strings
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue  # blank lines are not rows (many writers end with one)
        where.append(f"line {n}")
        if _undecodable(line):
            broken[len(records)] = _undecodable(line)
            records.append(None)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            broken[len(records)] = f"malformed JSON: {e.msg} (column {e.colno})"
            records.append(None)
            continue
        if not isinstance(obj, dict):
            broken[len(records)] = f"expected a JSON object, got {_describe(obj)}"
            records.append(None)
            continue
        records.append(obj)
    return _records_table(f"file {path}", records, where, broken)


def _read_json(path: Path) -> _Table:
    text = _read_text_file(path)
    bad = _UNDECODABLE.search(text)
    if bad and not _looks_like_json_lines(text):  # one document: no row to skip
        line = text.count("\n", 0, bad.start()) + 1
        raise DataError(f"file {path} line {line}: "
                        f"{_undecodable(text[text.rfind(chr(10), 0, bad.start()) + 1:])}")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        # Many ".json" files are JSON lines (datasets reads them so too): a first line that is
        # an object on its own says so, and the line-by-line reader then names the bad line.
        if _looks_like_json_lines(text):
            return _read_jsonl(path, text)
        raise DataError(f"file {path} line {e.lineno} column {e.colno}: malformed JSON: "
                        f"{e.msg}") from None
    if isinstance(doc, dict) and SINGLE_SPLIT in doc and isinstance(doc[SINGLE_SPLIT], list):
        doc = doc[SINGLE_SPLIT]  # {"train": [...]}
    elif isinstance(doc, dict) and doc and all(isinstance(v, list) for v in doc.values()):
        lengths = {len(v) for v in doc.values()}  # columnar: {"prompt": [...], ...}
        if len(lengths) != 1:
            raise DataError(f"file {path}: columns have different lengths "
                            f"({', '.join(f'{k}: {len(v)}' for k, v in doc.items())})")
        doc = [dict(zip(doc, values)) for values in zip(*doc.values())]
    if isinstance(doc, dict):
        doc = [doc]  # a single object is one row
    if not isinstance(doc, list):
        raise DataError(f"file {path}: expected a list of objects (one per prompt), got "
                        f"{_describe(doc)}")
    if not doc:
        raise DataError(f"file {path}: the file is empty (an empty list)")
    broken = {i: f"expected a JSON object, got {_describe(r)}"
              for i, r in enumerate(doc) if not isinstance(r, dict)}
    records = [r if isinstance(r, dict) else None for r in doc]
    return _records_table(f"file {path}", records, [f"row {i}" for i in range(1, len(doc) + 1)],
                          broken)


def _looks_like_json_lines(text: str) -> bool:
    """A first line that is a JSON object on its own (and a document that is not one)."""
    first = text.lstrip().split("\n")[0]
    try:
        return isinstance(json.loads(first), dict) and first.strip() != text.strip()
    except json.JSONDecodeError:
        return False


def _read_csv(path: Path) -> _Table:
    text = _read_text_file(path)
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader)
        rows: list[tuple[int, list[str]]] = []
        start = reader.line_num + 1
        for row in reader:
            if row:  # a blank line is not a row
                rows.append((start, row))
            start = reader.line_num + 1
    except csv.Error as e:
        raise DataError(f"file {path} line {reader.line_num}: malformed CSV: {e}") from None
    header = [h.strip() for h in header]
    if not rows:
        raise DataError(f"file {path}: the file is empty (a header line but no rows)")
    records: list[dict | None] = []
    broken: dict[int, str] = {}
    for i, (_, row) in enumerate(rows):
        if _undecodable(",".join(row)):
            broken[i] = _undecodable(",".join(row))
            records.append(None)
        elif len(row) != len(header):
            broken[i] = (f"has {len(row)} fields, the header has {len(header)} "
                         f"({', '.join(header)})")
            records.append(None)
        else:
            records.append(dict(zip(header, row)))
    return _records_table(f"file {path}", records, [f"line {n}" for n, _ in rows], broken)


def _dataset_table(ds: Any, source: str) -> _Table:
    """A table over a datasets.Dataset (Parquet, save_to_disk, hub)."""
    return _Table(source=source, columns=list(ds.column_names),
                  where=[f"row {i}" for i in range(1, len(ds) + 1)],
                  column=lambda name: list(ds[name]))


@contextmanager
def _quiet_datasets() -> Iterator[Any]:
    """The datasets module, its progress bars off (one summary line is logged instead)."""
    try:
        import datasets
    except ImportError:
        raise DataError("reading data.path needs the `datasets` package (pip install datasets); "
                        "only the builtin prompts (data.path = null) work without it") from None
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _read_parquet(path: Path) -> _Table:
    _check_readable(path)
    with _quiet_datasets() as datasets:
        try:
            ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
        except Exception as e:  # pyarrow raises many types; all mean "not readable Parquet"
            raise DataError(f"file {path}: cannot read it as Parquet "
                            f"({type(e).__name__}: {e})") from None
    if len(ds) == 0:
        raise DataError(f"file {path}: the file is empty (no rows)")
    return _dataset_table(ds, f"file {path}")


def _read_disk(path: Path, split: str) -> _Table:
    with _quiet_datasets() as datasets:
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:  # a damaged directory fails in arrow or json: unreadable
            raise DataError(f"directory {path}: cannot read it as a save_to_disk dataset "
                            f"({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"directory {path}: no split {split!r} (splits: {', '.join(ds)})")
        ds = ds[split]
    elif split != SINGLE_SPLIT:
        raise DataError(f"directory {path} holds a single Dataset (split {SINGLE_SPLIT!r}), "
                        f"not a DatasetDict with a split {split!r}")
    if len(ds) == 0:
        raise DataError(f"directory {path} split {split!r}: the dataset is empty (no rows)")
    return _dataset_table(ds, f"directory {path} split {split!r}")


def _read_hub(name: str, split: str) -> _Table:
    with _quiet_datasets() as datasets:
        try:
            ds = datasets.load_dataset(name, split=split)
        except Exception as e:  # network, auth, missing split, bad files: all alike
            raise DataError(f"dataset {name!r} split {split!r}: cannot load it with "
                            f"datasets.load_dataset ({type(e).__name__}: {e})") from None
    if len(ds) == 0:
        raise DataError(f"dataset {name!r} split {split!r}: the dataset is empty (no rows)")
    return _dataset_table(ds, f"dataset {name!r} split {split!r}")


def _check_readable(path: Path) -> None:
    try:
        with path.open("rb") as f:
            if not f.read(1):
                raise DataError(f"file {path}: the file is empty")
    except OSError as e:
        raise DataError(f"file {path}: cannot read it ({e.strerror or e})") from None


def _resolve_format(path_str: str, fmt: str) -> str:
    """'json' | 'jsonl' | 'csv' | 'parquet' | 'disk' | 'hub' for data.path."""
    path = Path(path_str).expanduser()
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "disk" if any((path / m).is_file() for m in _DISK_MARKERS) else "hub"
    suffix = path.suffix.lower()
    if suffix in _SUFFIX_FORMAT:
        return _SUFFIX_FORMAT[suffix]
    if path.exists():
        raise DataError(f"data.path = {path_str!r}: cannot tell the format from the file ending "
                        f"{suffix or '(none)'!r}; set data.format (json, jsonl, csv, parquet)")
    if path_str.startswith(("/", "./", "../", "~")):
        raise DataError(f"file {path_str}: not found")
    return "hub"  # e.g. "Dahoas/rm-static"


def _split_file(directory: Path, split_name: str) -> Path | None:
    """``DIR/<split>.<jsonl|json|csv|parquet>`` when exactly one such file exists."""
    found = [directory / f"{split_name}{suffix}" for suffix in _SUFFIX_FORMAT]
    found = [f for f in found if f.is_file()]
    return found[0] if len(found) == 1 else None


def _read_table(path_str: str, fmt: str, split_name: str) -> _Table:
    fmt = _resolve_format(path_str, fmt)
    path = Path(path_str).expanduser()
    if fmt == "hub" and path.is_dir() and (one := _split_file(path, split_name)) is not None:
        # DIR/train.jsonl + DIR/test.jsonl: read each split as a file, with line numbers
        fmt, path, split_name = _SUFFIX_FORMAT[one.suffix.lower()], one, SINGLE_SPLIT
    elif fmt == "hub":
        return _read_hub(path_str, split_name)
    if not path.exists():
        raise DataError(f"{'directory' if fmt == 'disk' else 'file'} {path_str}: not found")
    if fmt == "disk":
        return _read_disk(path, split_name)
    if split_name != SINGLE_SPLIT:
        raise DataError(f"file {path} is a single split named {SINGLE_SPLIT!r}, it has no split "
                        f"{split_name!r}; slice it (e.g. {SINGLE_SPLIT}[90%:]), give a file path, "
                        "or use a save_to_disk DatasetDict or hub dataset")
    if path.is_dir():
        raise DataError(f"data.path = {path_str!r} is a directory; data.format={fmt} needs a file")
    return {"json": _read_json, "jsonl": _read_jsonl, "csv": _read_csv,
            "parquet": _read_parquet}[fmt](path)


# ------------------------------------------------------------------------------- splits
_SPLIT_RE = re.compile(r"^\s*([\w.-]+)\s*(?:\[\s*(-?\d+%?)?\s*:\s*(-?\d+%?)?\s*\])?\s*$")


def parse_split(spec: str) -> tuple[str, str | None, str | None]:
    """``"train[10%:-5]"`` -> ``("train", "10%", "-5")``; ``"train"`` -> ``("train", None, None)``.

    Raises DataError for anything else (datasets' ``+`` unions are not supported).
    """
    m = _SPLIT_RE.match(spec)
    if not m:
        raise DataError(f"split {spec!r}: expected NAME or NAME[START:END] with START/END "
                        "integers or percentages, e.g. train[:90%]")
    return m.group(1), m.group(2), m.group(3)


def slice_rows(n: int, start: str | None, end: str | None) -> range:
    """Row indices of a split slice over n rows; percentages round to the closest row."""

    def bound(b: str | None, default: int) -> int:
        if b is None:
            return default
        v = round(n * int(b[:-1]) / 100) if b.endswith("%") else int(b)
        v = v + n if v < 0 else v
        return min(max(v, 0), n)

    return range(bound(start, 0), max(bound(start, 0), bound(end, n)))


# ----------------------------------------------------------------------------- validation
def _describe(value: Any) -> str:
    r = repr(value)
    return f"{type(value).__name__} {r if len(r) <= 40 else r[:37] + '...'}"


def _check_text(value: Any, key: str) -> str | None:
    """Why a plain-text prompt is bad, or None."""
    if value is _MISSING:
        return None  # reported by the caller, which knows the row's columns
    if value is None:
        return f"column {key!r} is null"
    if not isinstance(value, str):
        return f"column {key!r} must be a string, got {_describe(value)}"
    if not value.strip():
        return f"column {key!r} is an empty prompt"
    return None


def _check_messages(value: Any, key: str) -> tuple[list[dict[str, str]] | None, str | None]:
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
                      f"got {_describe(value)}")
    if not value:
        return None, f"column {key!r} is an empty list of messages"
    out = []
    for j, m in enumerate(value, start=1):
        if not isinstance(m, dict):
            return None, f"column {key!r} message {j}: expected a {{role, content}} object, " \
                         f"got {_describe(m)}"
        role, content = m.get("role", _MISSING), m.get("content", _MISSING)
        if role not in ROLES:
            got = "no role" if role is _MISSING else f"bad role {role!r}"
            return None, f"column {key!r} message {j}: {got} (valid: {', '.join(ROLES)})"
        if not isinstance(content, str):
            got = "no content" if content is _MISSING else f"got {_describe(content)}"
            return None, f"column {key!r} message {j}: content must be a string, {got}"
        out.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in out):
        return None, f"column {key!r}: every message is empty (an empty prompt)"
    return out, None


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], key: str
            ) -> tuple[str | None, str | None]:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja's TemplateError and the template's own raise_exception
        return None, f"column {key!r}: the chat template rejected it ({type(e).__name__}: {e})"
    if not isinstance(text, str) or not text.strip():
        return None, f"column {key!r}: the chat template rendered an empty prompt"
    return text, None


@dataclass
class _Valid:
    texts: list[str] = field(default_factory=list)  # rendered prompts
    chat: list[bool] = field(default_factory=list)  # rendered by the chat template
    where: list[str] = field(default_factory=list)  # "line 7": for messages
    extras: list[dict] = field(default_factory=list)  # data.reward_keys values
    messages: list = field(default_factory=list)  # chat messages (None: plain text), if any
    skipped: int = 0                                # bad rows skipped


def _validate(table: _Table, rows: range, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase
              ) -> _Valid:
    """Check each row of the split; render chat rows. Raises DataError unless skipping."""
    if cfg.prompt_key in table.columns:
        key = cfg.prompt_key
    elif cfg.messages_key in table.columns:
        key = cfg.messages_key
    else:
        raise DataError(
            f"{table.source}: no column {cfg.prompt_key!r} (data.prompt_key) or "
            f"{cfg.messages_key!r} (data.messages_key); its columns are: "
            f"{', '.join(map(repr, table.columns)) or '(none)'}")
    absent = [k for k in cfg.reward_keys if k not in table.columns]
    if absent:
        raise DataError(f"{table.source}: no column {', '.join(map(repr, absent))} "
                        f"(data.reward_keys); its columns are: "
                        f"{', '.join(map(repr, table.columns)) or '(none)'}")
    values = table.column(key)
    extra_values = {k: table.column(k) for k in cfg.reward_keys}
    bad: list[str] = []
    out = _Valid()
    for i in rows:
        value, why = values[i], table.broken.get(i)
        extra = {k: extra_values[k][i] for k in cfg.reward_keys}
        for n, (col, cell) in enumerate([(key, value), *extra.items()]):
            if why is None and cell is _MISSING:
                has = ", ".join(map(repr, table.row_keys(i))) if table.row_keys else "?"
                why = f"missing column {col!r} (this row has: {has or 'nothing'})"
            elif why is None and n > 0 and cell is None:  # a reward_keys value
                why = f"column {col!r} (data.reward_keys) is null"
        if why is None and (isinstance(value, list) or key == cfg.messages_key):
            messages, why = _check_messages(value, key)
            if why is None:
                if tokenizer.chat_template is None:
                    raise DataError(f"{table.source}: column {key!r} holds chat messages but the "
                                    "tokenizer has no chat template; use a tokenizer with one")
                text, why = _render(tokenizer, messages, key)
                if why is None:
                    out.texts.append(text)
                    out.messages.append(messages)
                    out.chat.append(True)
                    out.where.append(table.where[i])
        elif why is None:
            why = _check_text(value, key)
            if why is None:
                out.texts.append(value)
                out.messages.append(None)
                out.chat.append(False)
                out.where.append(table.where[i])
        if why is not None:
            bad.append(f"{table.where[i]}: {why}")
        else:  # the row's text was appended above
            out.extras.append(extra)
    out.skipped = _report_bad(table.source, bad, cfg.on_bad_row)
    return out


def _report_bad(source: str, bad: list[str], on_bad_row: str) -> int:
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
    with _quiet_datasets() as datasets:
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
def _is_file_spec(split: str) -> bool:
    """A split argument that names a file of prompts rather than a split."""
    p = Path(split).expanduser()
    return p.is_file() and (p.suffix.lower() in _SUFFIX_FORMAT or "/" in split)


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
    path_str, fmt = cfg.path, cfg.format
    if split != cfg.split and _is_file_spec(split):
        path_str, fmt, split = split, "auto", SINGLE_SPLIT  # eval_split given as a file
    name, start, end = parse_split(split)

    if path_str is None:
        if name != SINGLE_SPLIT:
            raise DataError(f"the builtin prompts (data.path = null) have only the split "
                            f"{SINGLE_SPLIT!r}, not {name!r}; slice it, e.g. {SINGLE_SPLIT}[-10%:]")
        texts = builtin_prompts()
        rows = slice_rows(len(texts), start, end)
        valid = _Valid(texts=[texts[i] for i in rows], chat=[False] * len(rows),
                       where=[f"row {i + 1}" for i in rows])
        source = "builtin prompts (tiny corpus)"
        ids = _tokenize(valid.texts, valid.chat, tokenizer)  # plain Python: no datasets here
    else:
        table = _read_table(path_str, fmt, name)
        rows = slice_rows(len(table), start, end)
        source = table.source
        if not rows:
            raise DataError(f"{source}: split {split!r} selects no rows (it has {len(table)})")
        valid = _validate(table, rows, cfg, tokenizer)
        ids = _tokenize_with_datasets(valid.texts, valid.chat, tokenizer) if valid.texts else []

    prompts = _apply_max_len(valid, ids, cfg, tokenizer, source)
    prompts.stats.update(rows=len(rows), skipped_bad=prompts.stats["skipped_bad"] + valid.skipped)
    if not prompts.input_ids:
        raise DataError(f"{source} split {split!r}: no prompts left "
                        f"({format_stats(prompts.stats)})")
    log.info("prompts, split %s, from %s: %s", split, source, format_stats(prompts.stats))
    return prompts


def _apply_max_len(valid: _Valid, ids: list[list[int]], cfg: DataConfig,
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
    skipped = _report_bad(source, empty, cfg.on_bad_row)
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


# ------------------------------------------------------------------------------- sampling
class PromptSampler:
    """Which prompts each data-parallel rank takes at each iteration; no state to save.

    The stream of prompt indices is the concatenation of one permutation per epoch
    (epoch e shuffled by a ``torch.Generator`` seeded with ``seed + e``; the identity when
    ``shuffle`` is False). Iteration i's global batch is ``stream[i*B:(i+1)*B]``, cut into
    groups of ``group_size`` G (the PPO mini-batch; default B); rank r takes the slice
    ``[r*G/W, (r+1)*G/W)`` of every group, in group order. So mini-batch j (the j-th G/W
    samples of every rank) holds the same prompts for any world size W, and a 1-rank run and a
    2-rank run train on the same mini-batches. Every epoch covers each prompt exactly
    once over all ranks; a batch may straddle an epoch boundary (its tail comes from the next
    epoch's permutation), so no prompt is ever dropped or repeated within an epoch. Resuming
    at iteration i needs nothing but i.
    """

    def __init__(self, num_prompts: int, global_batch_size: int, rank: int, world_size: int,
                 seed: int, shuffle: bool = True, group_size: int | None = None) -> None:
        if num_prompts <= 0:
            raise ValueError(f"num_prompts must be > 0, got {num_prompts}")
        if global_batch_size <= 0 or world_size <= 0:
            raise ValueError(f"global_batch_size ({global_batch_size}) and world_size "
                             f"({world_size}) must be > 0")
        if global_batch_size % world_size:
            raise ValueError(f"global batch size {global_batch_size} is not divisible by the "
                             f"world size {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        self.num_prompts, self.global_batch_size = num_prompts, global_batch_size
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.group_size = group_size or global_batch_size
        if global_batch_size % self.group_size or self.group_size % world_size:
            raise ValueError(f"group size {self.group_size} must divide the global batch size "
                             f"{global_batch_size} and be divisible by the world size "
                             f"{world_size}")
        self.per_rank = global_batch_size // world_size
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # consecutive batches need the last one or two epochs
                self._perms.pop(min(self._perms))
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._perms[epoch] = torch.randperm(self.num_prompts, generator=g).tolist()
            else:
                self._perms[epoch] = list(range(self.num_prompts))
        return self._perms[epoch]

    def _at(self, positions: range) -> list[int]:
        n = self.num_prompts
        return [self._perm(p // n)[p % n] for p in positions]

    def epoch(self, iteration: int) -> int:
        """The epoch of the first prompt of iteration ``iteration``'s global batch (0-based)."""
        return iteration * self.global_batch_size // self.num_prompts

    def global_indices(self, iteration: int) -> list[int]:
        """The whole global batch of iteration ``iteration``: B prompt indices."""
        b = self.global_batch_size
        return self._at(range(iteration * b, (iteration + 1) * b))

    def indices(self, iteration: int) -> list[int]:
        """This rank's B/W prompt indices of iteration ``iteration`` (0-based)."""
        g, w = self.group_size, self.world_size
        share = g // w
        out: list[int] = []
        for start in range(iteration * self.global_batch_size,
                           (iteration + 1) * self.global_batch_size, g):
            first = start + self.rank * share
            out.extend(self._at(range(first, first + share)))
        return out


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists for generation.

    Args:
        seqs: B lists of token ids, each non-empty.
        pad_id: the id written into padding positions.

    Returns:
        ``input_ids`` (B, P) long and ``attention_mask`` (B, P) long (1 = real token,
        0 = padding), P = the longest sequence; real tokens are right-aligned.
    """
    if not seqs:
        raise ValueError("left_pad needs at least one sequence")
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        if s:
            input_ids[b, width - len(s):] = torch.tensor(s, dtype=torch.long)
            attention_mask[b, width - len(s):] = 1
    return input_ids, attention_mask
