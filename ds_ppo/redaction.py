"""Credentials out of every message: a tracking URI may carry user:password and query tokens
(`http://alice:SECRET@host/?token=...`); no log line, MLflow param or artifact may show them."""
from __future__ import annotations

import logging
import re
from typing import Any

_URL = re.compile(r"(?:[A-Za-z][\w+.-]*:/|/)[^\s'\"<>]+")  # also a bare /path?query
_USERINFO = re.compile(r"://[^/\s?#]*@")  # user:password@ (up to the authority's last @)
_QUERY_VALUE = re.compile(r"([?&][^=&#]+=)[^&#]*")


def redact(text: str) -> str:
    """`text` with the user:password and the query values (tokens) of every URL in it replaced
    by ***: what a tracking URI may carry and no log line, param or artifact may show."""
    def one(m: re.Match) -> str:
        return _QUERY_VALUE.sub(r"\1***", _USERINFO.sub("://***@", m.group(0)))

    return _URL.sub(one, text)


def redact_url(url: str | None) -> str | None:
    """One URL (e.g. reward.url) as `redact` shows it: http://user:secret@host/x ->
    http://***@host/x; None and "" unchanged."""
    return redact(url) if url else url


def redact_logs() -> None:
    """Every log record of this process, ours and MLflow's and its HTTP stack's (which name
    request URLs), is redacted as it is made (a record factory: logger filters miss records of
    child loggers such as urllib3.connectionpool)."""
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
