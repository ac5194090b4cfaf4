"""Reading the rows of one split of ``data.path``, before any validation, and the split specs.

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
CSV reader silently shifts a row that has too many fields into an index column.

What cannot be read at all (no such file, empty, not the format) is a
:class:`~ds_ppo.errors.DataError` naming the source; a row that cannot be read as a record (a
malformed JSON line, a CSV row with too many fields) is kept in ``Table.broken`` for the
validation to report with the other bad rows.
"""
from __future__ import annotations

import csv
import io
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ds_ppo.errors import DataError

SINGLE_SPLIT = "train"  # the name of the one split of a single file / the builtin prompts
MISSING = object()  # a row without the column (JSON objects may lack keys)
_SUFFIX_FORMAT = {".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv",
                  ".parquet": "parquet", ".pq": "parquet"}
_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass
class Table:
    """The rows of one split as read, before any validation.

    ``column(name)`` gives one value per row (``MISSING`` where a row lacks it); ``where[i]``
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
                   broken: dict[int, str]) -> Table:
    """A table over parsed JSON/CSV records (None for a broken row)."""
    columns: list[str] = []
    for r in records:
        for k in r or ():
            if k not in columns:
                columns.append(k)
    return Table(source=source, columns=columns, where=where, broken=broken,
                 column=lambda name: [MISSING if r is None else r.get(name, MISSING)
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


def _read_jsonl(path: Path, text: str | None = None) -> Table:
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
            broken[len(records)] = f"expected a JSON object, got {describe_value(obj)}"
            records.append(None)
            continue
        records.append(obj)
    return _records_table(f"file {path}", records, where, broken)


def _read_json(path: Path) -> Table:
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
                        f"{describe_value(doc)}")
    if not doc:
        raise DataError(f"file {path}: the file is empty (an empty list)")
    broken = {i: f"expected a JSON object, got {describe_value(r)}"
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


def _read_csv(path: Path) -> Table:
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


def _dataset_table(ds: Any, source: str) -> Table:
    """A table over a datasets.Dataset (Parquet, save_to_disk, hub)."""
    return Table(source=source, columns=list(ds.column_names),
                 where=[f"row {i}" for i in range(1, len(ds) + 1)],
                 column=lambda name: list(ds[name]))


@contextmanager
def quiet_datasets() -> Iterator[Any]:
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


def _load(where: str, cannot: str, load: Callable[[Any], Any]) -> Any:
    """`load(datasets)` with the progress bars off; any failure is a DataError `<where>: cannot
    <cannot> (Type: message)` (pyarrow, json, the network, auth... raise many types: all mean
    the data cannot be read)."""
    with quiet_datasets() as datasets:
        try:
            return load(datasets)
        except Exception as e:  # noqa: BLE001
            raise DataError(f"{where}: cannot {cannot} ({type(e).__name__}: {e})") from None


def _read_parquet(path: Path) -> Table:
    _check_readable(path)
    ds = _load(f"file {path}", "read it as Parquet",
               lambda d: d.load_dataset("parquet", data_files=str(path), split="train"))
    if len(ds) == 0:
        raise DataError(f"file {path}: the file is empty (no rows)")
    return _dataset_table(ds, f"file {path}")


def _read_disk(path: Path, split: str) -> Table:
    ds = _load(f"directory {path}", "read it as a save_to_disk dataset",
               lambda d: d.load_from_disk(str(path)))
    from datasets import DatasetDict  # present: _load has imported it

    if isinstance(ds, DatasetDict):
        if split not in ds:
            raise DataError(f"directory {path}: no split {split!r} (splits: {', '.join(ds)})")
        ds = ds[split]
    elif split != SINGLE_SPLIT:
        raise DataError(f"directory {path} holds a single Dataset (split {SINGLE_SPLIT!r}), "
                        f"not a DatasetDict with a split {split!r}")
    if len(ds) == 0:
        raise DataError(f"directory {path} split {split!r}: the dataset is empty (no rows)")
    return _dataset_table(ds, f"directory {path} split {split!r}")


def _read_hub(name: str, split: str) -> Table:
    ds = _load(f"dataset {name!r} split {split!r}", "load it with datasets.load_dataset",
               lambda d: d.load_dataset(name, split=split))
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


def read_table(path_str: str, fmt: str, split_name: str) -> Table:
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


def peek_columns(path_str: str, fmt: str, split_name: str, rows: int = 100
                 ) -> tuple[str, list[str]] | None:
    """(source, columns) of a local file of prompts, from its first `rows` rows (a CSV's header,
    a Parquet file's schema), read cheaply for `ds-ppo train --dry-run`; None where only the real
    read can tell (a save_to_disk directory, a hub name, a file that does not read as its
    format: the real start reports those)."""
    try:
        fmt = _resolve_format(path_str, fmt)
    except DataError:
        return None
    path = Path(path_str).expanduser()
    if fmt == "hub" and path.is_dir() and (one := _split_file(path, split_name)) is not None:
        fmt, path, split_name = _SUFFIX_FORMAT[one.suffix.lower()], one, SINGLE_SPLIT
    if fmt in ("hub", "disk") or split_name != SINGLE_SPLIT or not path.is_file():
        return None
    try:
        if fmt == "jsonl":
            with path.open(encoding="utf-8-sig", errors="replace") as f:
                text = "".join(line for line, _ in zip(f, range(rows)))
            table = _read_jsonl(path, text)
        elif fmt == "json":
            table = _read_json(path)
        elif fmt == "csv":
            with path.open(encoding="utf-8-sig", errors="replace", newline="") as f:
                return f"file {path}", [h.strip() for h in next(csv.reader(f), [])]
        else:  # parquet: the schema, no rows
            import pyarrow.parquet as pq

            return f"file {path}", list(pq.read_schema(path).names)
    except Exception:  # noqa: BLE001 (unreadable here: the real read names the problem)
        return None
    return (table.source, table.columns) if len(table) else None


def describe_value(value: Any) -> str:
    """A value for a message: its type and its repr, cut to 40 characters."""
    r = repr(value)
    return f"{type(value).__name__} {r if len(r) <= 40 else r[:37] + '...'}"


def is_file_spec(split: str) -> bool:
    """A split argument that names a file of prompts rather than a split."""
    p = Path(split).expanduser()
    return p.is_file() and (p.suffix.lower() in _SUFFIX_FORMAT or "/" in split)


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
