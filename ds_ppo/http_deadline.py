"""HTTP POSTs with a deadline for the whole request, and a cap on the answer's size.

A socket timeout (what `requests` and `urllib` offer) bounds each read, not the request: a
service that sends its answer a byte at a time, each within the timeout, holds the caller as
long as it likes (one request held 51 s against a 3 s `reward.timeout_s`). Here the deadline
covers connecting, sending, waiting for the status line and headers, and reading the body: when
it passes, a timer shuts the socket down, which ends any read blocked in it, and the call raises
`HttpTimeout`. An answer longer than `max_bytes` (by its Content-Length, or as it arrives) raises
`AnswerTooLarge` without reading the rest.

Used by the reward service (`ds_ppo.rewards.service`) and meant for any other JSON-over-HTTP
client of the trainer (environments). Stdlib only (http.client): user and password in the URL
are sent as HTTP basic auth; connections are kept alive and reused by one thread at a time
(`Connection`); no proxy is used (HTTP(S)_PROXY are not read: the services are the job's own).
The retry arithmetic (back-off, the worst case of a request, a call's deadline on several ranks)
is here too, where the config's checks read it without importing a client.
"""
from __future__ import annotations

import base64
import http.client
import select
import socket
import ssl
import threading
import time
import zlib
import urllib.parse
from dataclasses import dataclass

MAX_ANSWER_BYTES = 16 * 2**20  # 16 MiB: far beyond any scores list, small enough to hold
CHUNK = 64 * 1024


class HttpTimeout(OSError):
    """The request's deadline passed (connecting, sending, waiting or reading the answer)."""


class AnswerTooLarge(ValueError):
    """The answer's body is longer than the caller's limit."""


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


class Connection:
    """A keep-alive connection to `url`'s host for one thread at a time; `post` reconnects
    when the server closed it in between."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("the URL must look like http(s)://host[:port]/path")
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.headers = {"Host": parts.netloc.rsplit("@", 1)[-1]}
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            self.headers["Authorization"] = f"Basic {token}"
        self._conn: http.client.HTTPConnection | None = None

    def post(self, body: bytes, timeout_s: float | None, headers: dict | None = None,
             max_bytes: int = MAX_ANSWER_BYTES) -> HttpAnswer:
        """POST `body`; the answer within `timeout_s` seconds in all (None: no limit).
        Raises HttpTimeout, AnswerTooLarge, or the connection's OSError / HTTPException."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        reused = self._conn is not None and self._conn.sock is not None and not self._closed()
        if not reused:
            self.close()
        try:
            return self._once(body, end, headers or {}, max_bytes)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            if not reused:
                raise
            self.close()  # the server dropped the idle connection as we reused it: once more
            return self._once(body, end, headers or {}, max_bytes)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _closed(self) -> bool:
        """An idle kept-alive socket that is readable was closed by the server (EOF)."""
        try:
            return bool(select.select([self._conn.sock], [], [], 0)[0])
        except (OSError, ValueError):
            return True

    def _new(self, timeout: float | None) -> http.client.HTTPConnection:
        if self.https:
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout,
                                               context=ssl.create_default_context())
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def _once(self, body: bytes, end: float | None, headers: dict, max_bytes: int
              ) -> HttpAnswer:
        left = None if end is None else end - time.monotonic()
        if left is not None and left <= 0:
            raise HttpTimeout("no time left before the deadline")
        if self._conn is None:
            self._conn = self._new(left)  # bounds connecting (and the TLS handshake)
        conn, expired, held = self._conn, threading.Event(), []

        def expire() -> None:  # wakes any read or write blocked in the socket
            expired.set()
            for sock in held[:1] or [conn.sock]:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except (OSError, AttributeError):
                    pass
        timer = threading.Timer(left, expire) if left is not None else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            if conn.sock is None:
                conn.connect()
            # the socket itself: http.client drops conn.sock when the answer ends the
            # connection (Connection: close), while the answer is still being read from it
            held.append(conn.sock)
            if expired.is_set():  # the deadline came while connecting
                raise HttpTimeout("the deadline passed while connecting")
            conn.sock.settimeout(max(end - time.monotonic(), 1e-3) if end is not None else None)
            conn.request("POST", self.path, body=body, headers={
                **self.headers, "Content-Type": "application/json", **headers})
            answer = conn.getresponse()
            data = _read(answer, max_bytes)
        except (OSError, http.client.HTTPException) as err:
            self.close()
            if expired.is_set() or isinstance(err, TimeoutError):
                raise HttpTimeout("the deadline passed") from None
            raise
        except AnswerTooLarge:
            self.close()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if expired.is_set():  # shut down as the last bytes came: not a whole answer
            self.close()
            raise HttpTimeout("the deadline passed")
        if answer.will_close:
            self.close()
        return HttpAnswer(answer.status, data)


def _read(answer: http.client.HTTPResponse, max_bytes: int) -> bytes:
    """The answer's body, decompressed (gzip, deflate) a chunk at a time; past `max_bytes`
    (raw or decompressed: a small compressed answer may expand a thousandfold) AnswerTooLarge."""
    length = answer.getheader("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > max_bytes:
        raise AnswerTooLarge(f"an answer of {int(length):,} bytes (Content-Length), over the "
                             f"limit of {max_bytes:,}")
    encoding = (answer.getheader("Content-Encoding") or "").strip().lower()
    inflate = None
    if encoding in ("gzip", "x-gzip", "deflate"):
        inflate = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib header, detected
    data, raw = bytearray(), 0
    while True:
        chunk = answer.read1(CHUNK)
        if not chunk:
            break
        raw += len(chunk)
        if raw > max_bytes:
            raise AnswerTooLarge(f"an answer of more than {max_bytes:,} bytes, the limit")
        if inflate is not None:
            chunk = inflate.decompress(chunk, max_bytes + 1 - len(data))
        data += chunk
        if len(data) > max_bytes:
            raise AnswerTooLarge(f"a body larger than {max_bytes // 2**20} MiB once decompressed "
                                 f"(Content-Encoding: {encoding})" if inflate is not None else
                                 f"an answer of more than {max_bytes:,} bytes, the limit")
    if answer.length:  # fewer bytes than its Content-Length: cut off
        raise http.client.IncompleteRead(bytes(data), answer.length)
    return bytes(data)


def call_within(fn, timeout_s: float, what: str):
    """`fn()` with a deadline, for HTTP clients this process does not own (MLflow's, whose
    socket timeout bounds each read, not the call): fn runs in a daemon thread; its result, or
    its exception, or HttpTimeout naming `what` after `timeout_s` (the thread is left behind:
    being a daemon, it holds up neither the caller nor the exit)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001  (re-raised in the caller)
            box["error"] = err

    worker = threading.Thread(target=run, name="ds_ppo-deadline", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise HttpTimeout(f"{what} did not finish within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ------------------------------------------------ retries and deadlines of a call (also config)
MAX_BACKOFF_S = 30.0


def backoff_pause(attempt: int, backoff_s: float = 1.0) -> float:
    """Seconds to wait before retry `attempt` (1, 2, ...): backoff_s doubling each time, at
    most MAX_BACKOFF_S."""
    return min(backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)


def worst_request_s(timeout_s: float, retries: int, backoff_s: float = 1.0) -> float:
    """How long a request that never answers takes to be given up without a deadline: every
    attempt times out, with the back-off between them."""
    return timeout_s * (retries + 1) + sum(backoff_pause(k, backoff_s)
                                           for k in range(1, retries + 1))


def call_deadline(dist_timeout_minutes: float, world_size: int) -> float | None:
    """The deadline of one reward-service call on `world_size` ranks: none on one rank (no
    collective waits for it); else the collective timeout less a margin for the rest of the
    scoring (10%, at least 30 s and at most 5 min), so a failing rank reports the service's error
    before the others time out."""
    if world_size <= 1:
        return None
    timeout_s = 60.0 * dist_timeout_minutes
    return max(timeout_s - min(max(0.1 * timeout_s, 30.0), 300.0), 0.5 * timeout_s)
