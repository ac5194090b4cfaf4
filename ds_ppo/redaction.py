"""Credentials out of every message: a tracking URI or reward.url may carry user:password and
query tokens (`http://alice:SECRET@host/?token=...`); no log line, printed line, MLflow param,
tag or artifact may show them.

Three layers, because a secret reaches text in many shapes:
- `redact_url(url)`: one URL, taken apart with a URL parser (urllib.parse), so any character
  a URL allows in a password (`'`, `;`, `!`, `%40`, ...) is hidden with the rest;
- `register_url(url)` / `register_secret(s)`: the password and query values of the URLs the
  job was given, remembered for this process; `redact(text)` replaces each of them wherever it
  appears (as given, percent-decoded or -encoded), then masks what looks like credentials in
  any other URL (`scheme://user:pw@`, `?key=value`) by pattern;
- `redact_output()`: this process's log records and everything written to sys.stdout /
  sys.stderr (MLflow prints "View run ... at: <tracking URI>" itself) pass through `redact`.
"""
from __future__ import annotations

import logging
import re
import sys
import urllib.parse
from typing import Any

MASK = "***"
_MIN_SECRET = 4  # shorter values are masked by the URL forms only, not wherever they appear
_SECRETS: set[str] = set()
_URL = re.compile(r"(?:[A-Za-z][\w+.-]*:/|/)[^\s'\"<>]+")  # also a bare /path?query
# user:password@ after a scheme, up to the authority's last @; a quote may be part of a password
_USERINFO = re.compile(r"([A-Za-z][\w+.-]*://)[^\s/?#\"<>]*@")
_QUERY_VALUE = re.compile(r"([?&][^=&#]+=)[^&#]*")


def register_secret(value: str | None) -> None:
    """Hide `value` (a password, a token) wherever `redact` sees it from now on."""
    if not value or len(value) < _MIN_SECRET:
        return
    for form in (value, urllib.parse.unquote(value), urllib.parse.quote(value, safe=""),
                 urllib.parse.unquote_plus(value)):
        if len(form) >= _MIN_SECRET:
            _SECRETS.add(form)


def register_url(url: str | None) -> None:
    """Remember the password, user:password and query values of `url` as secrets."""
    if not url:
        return
    parts = _split(url)
    if parts is None:
        return
    userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
    if userinfo:
        register_secret(userinfo)
        if ":" in userinfo:
            register_secret(userinfo.split(":", 1)[1])
    for item in parts.query.split("&"):
        if "=" in item:
            register_secret(item.split("=", 1)[1])


def _split(url: str) -> urllib.parse.SplitResult | None:
    try:
        return urllib.parse.urlsplit(url.strip())
    except ValueError:  # e.g. an invalid IPv6 literal
        return None


def redact_url(url: str | None) -> str | None:
    """One URL with its user:password and query values replaced by ***, by its parts:
    http://user:s'cret@host/x?token=t -> http://***@host/x?token=***; None and "" unchanged."""
    if not url:
        return url
    parts = _split(url)
    if parts is None or not (parts.scheme and parts.netloc):
        return redact(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{MASK}@{netloc.rpartition('@')[2]}"
    query = "&".join(f"{item.split('=', 1)[0]}={MASK}" if "=" in item else item
                     for item in parts.query.split("&")) if parts.query else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact(text: str) -> str:
    """`text` with every registered secret replaced by ***, and the user:password and the query
    values (tokens) of every URL in it: what no log line, param or artifact may show."""
    for secret in sorted(_SECRETS, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, MASK)
    text = _USERINFO.sub(rf"\1{MASK}@", text)

    def one(m: re.Match) -> str:
        return _QUERY_VALUE.sub(rf"\1{MASK}", m.group(0))

    return _URL.sub(one, text)


def redact_tree(obj: Any) -> Any:
    """A config dict (nested dicts and lists) with every string redacted: a URL by its parts
    (`redact_url`), other text by `redact`."""
    if isinstance(obj, dict):
        return {k: redact_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_tree(v) for v in obj]
    if isinstance(obj, str):
        parts = _split(obj)
        if parts is not None and parts.scheme and parts.netloc and " " not in obj.strip():
            return redact(redact_url(obj))
        return redact(obj)
    return obj


class _RedactingStream:
    """Writes `redact(text)` to the text stream it wraps; everything else (fileno, isatty,
    encoding, buffer, ...) is the wrapped stream's."""

    redacts = True

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact(text))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def redact_output() -> None:
    """From now on every log record of this process (ours, MLflow's and its HTTP stack's, which
    name request URLs) and everything written to sys.stdout / sys.stderr is redacted."""
    redact_logs()
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not getattr(stream, "redacts", False):
            setattr(sys, name, _RedactingStream(stream))


def redact_logs() -> None:
    """Every log record of this process is redacted as it is made (a record factory: logger
    filters miss records of child loggers such as urllib3.connectionpool)."""
    old = logging.getLogRecordFactory()
    if getattr(old, "redacts", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = old(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed call: logging reports it when it formats the record
            return record
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return record

    factory.redacts = True
    logging.setLogRecordFactory(factory)
