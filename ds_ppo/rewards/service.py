"""Rewards from an HTTP service (`reward.url`): verifiable rewards (unit tests, a maths checker,
a judge model on its own GPUs) that run beside the trainer, not inside it.

Contract (one POST per `reward.batch_size` responses, JSON both ways):

    request   {"prompts": [str, ...], "responses": [str, ...], <key>: [...], ...}
              one <key> list per `data.reward_keys` column, each as long as "responses"
    response  200 {"scores": [float, ...]}  one finite number per response, in request order

Each rank posts its own share of the rollout, `reward.concurrency` requests in flight at once.
A connection error, a timeout (`reward.timeout_s` for the whole request: connecting, sending and
the answer's last byte, `ds_ppo.http_deadline`) or a 5xx answer is retried `reward.retries`
times with exponential back-off, then the job stops with an error naming the URL and what came
back; a 4xx answer, an answer over MAX_ANSWER_BYTES (8 MiB) or a malformed body (not JSON, no
`scores`, the wrong count, a non-number) stops it at once, quoting the body's start. User and
password in the URL are sent (HTTP basic auth) but never printed or logged: see `redact_url`.

On several ranks a call also has a deadline (`deadline_s`, set from dist_timeout_minutes): the
ranks agree on the scores' outcome with a collective, so a rank whose requests keep failing
gives up (with the service's error) before the other ranks, waiting in that collective, would
fail on its timeout without it. Attempts and back-off are shortened to fit the deadline.
"""
from __future__ import annotations

import http.client
import json
import logging
import math
import queue
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from ds_ppo import abandon, watchdog
from ds_ppo.errors import RewardError
from ds_ppo.http_deadline import AnswerTooLarge, Connection, HttpTimeout, backoff_pause
from ds_ppo.redaction import redact_url

log = logging.getLogger("ds_ppo")

BODY_QUOTE = 300  # characters of an unexpected answer quoted in the error
MAX_BODY_BYTES = 8 * 2**20  # an answer's body, decompressed: scores take ~20 bytes per response


class RewardServiceError(RewardError):
    """The reward service failed for good (retries spent, a 4xx, a malformed answer)."""


@dataclass(frozen=True)
class Answer:
    """One request's outcome: the scores and how many retries it took."""

    scores: list[float]
    retries: int


class RewardService:
    """A reward function backed by a service: `service(prompts, responses, **columns)` ->
    one float per response, in row order (the signature of a `reward.function`).

    `retries` counts the retried requests of every call so far (for the metric
    `reward/retries`); the calls themselves are made from this rank only. Each retry is
    logged as it is made (a warning: every rank shows it)."""

    KEY = "reward.url"  # the config key, in messages
    PHASE = "reward call"  # what a SIGTERM gives up (abandon.Abandoned)

    def __init__(self, url: str, batch_size: int = 64, concurrency: int = 4,
                 timeout_s: float | None = 600.0, retries: int = 3, backoff_s: float = 1.0,
                 deadline_s: float | None = None,
                 max_answer_bytes: int = MAX_BODY_BYTES) -> None:
        self.url, self.shown = url, redact_url(url)
        self.max_answer_bytes = max_answer_bytes
        self.deadline_s = deadline_s
        self.batch_size, self.concurrency, self.timeout_s = batch_size, concurrency, timeout_s
        self.max_retries, self.backoff_s = retries, backoff_s
        self.retries = 0
        self._secret = urllib.parse.urlsplit(url).password
        self._sessions: queue.SimpleQueue = queue.SimpleQueue()  # keep-alive, reused per call

    @classmethod
    def from_config(cls, reward, deadline_s: float | None = None) -> RewardService:
        """From the `reward` config section (`deadline_s`: see `call_deadline`)."""
        return cls(reward.url, reward.batch_size, reward.concurrency, reward.timeout_s,
                   reward.retries, deadline_s=deadline_s)

    def __call__(self, prompts: list[str], responses: list[str], **columns: list) -> list[float]:
        n, size = len(responses), self.batch_size
        payloads = [{"prompts": list(prompts[i:i + size]),
                     "responses": list(responses[i:i + size]),
                     **{k: list(v[i:i + size]) for k, v in columns.items()}}
                    for i in range(0, n, size)]
        end = None if self.deadline_s is None else time.monotonic() + self.deadline_s
        answers = self._post_all(payloads, end)
        self.retries += sum(a.retries for a in answers)
        return [s for a in answers for s in a.scores]

    def _post_all(self, payloads: list[dict], end: float | None) -> list[Answer]:
        """The answers in payload order, `concurrency` requests at a time. The first failure
        returns at once (no waiting for requests still in flight: their daemon threads stop
        retrying and are abandoned, so they hold up neither the error nor the exit)."""
        results: list[Answer | None] = [None] * len(payloads)
        first_error: list[BaseException] = []
        todo = iter(range(len(payloads)))
        lock, failed = threading.Lock(), threading.Event()

        def work() -> None:
            session = self._take_session()
            while not failed.is_set():
                with lock:
                    i = next(todo, None)
                if i is None:
                    break
                try:
                    results[i] = self._post(payloads[i], session, failed, end)
                except BaseException as err:  # noqa: BLE001  (handed to the caller)
                    with lock:
                        if not failed.is_set():  # the first failure is the one reported
                            first_error.append(err)
                            failed.set()
            self._sessions.put(session)

        threads = [threading.Thread(target=work, name="reward-service", daemon=True)
                   for _ in range(min(self.concurrency, len(payloads)))]
        for t in threads:
            t.start()
        for t in threads:  # a SIGTERM gives the requests up (abandon.Abandoned)
            abandon.wait(lambda: not t.is_alive() or failed.is_set(), None, self.PHASE, t)
        if first_error:
            raise first_error[0]
        if any(r is None for r in results):  # a worker died outside a request (cannot happen)
            raise RuntimeError(f"reward.url = {self.shown}: a request got no answer")
        return results  # type: ignore[return-value]

    def _take_session(self) -> Connection:
        try:
            return self._sessions.get_nowait()
        except queue.Empty:
            return Connection(self.url)

    def _post(self, payload: dict[str, Any], session, failed: threading.Event,
              end: float | None = None) -> Answer:
        """One request with its retries (none once another request of the call `failed`, none
        past the call's deadline `end`, a time.monotonic() value). Each attempt counts as the
        rank's progress for the watchdog."""
        body = json.dumps(payload, default=str).encode()
        expected = len(payload["responses"])
        key = self.KEY.partition(".")[0]  # the config section: reward or env
        what, fix = "no attempt fitted in the call's deadline", ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                pause = backoff_pause(attempt, self.backoff_s)
                if end is not None and time.monotonic() + pause >= end:
                    raise self._out_of_time(what)
                if failed.is_set():
                    break  # the call has failed already: no more tries
                log.warning("%s = %s: %s (attempt %d of %d); next attempt in %.1f s", self.KEY,
                            self.shown, what, attempt, self.max_retries + 1, pause)
                if failed.wait(pause):
                    break
            timeout = self.timeout_s
            if end is not None:
                left = end - time.monotonic()
                if left <= 0:
                    raise self._out_of_time(what)
                timeout = left if timeout is None else min(timeout, left)
            watchdog.progress()
            try:  # the whole request, to the answer's last byte, within `timeout`
                r = session.post(body, timeout, max_bytes=self.max_answer_bytes)
            except HttpTimeout:
                what = (f"no answer within {key}.timeout_s = {self.timeout_s} s"
                        if timeout == self.timeout_s else
                        f"no answer within the {timeout:.1f} s left before the deadline")
                fix = (f"check that the service answers within {key}.timeout_s, or raise "
                       f"{key}.timeout_s / {key}.retries")
                continue
            except AnswerTooLarge as err:
                raise self._error(f"answered {err}; refused unread",
                                  "send fewer rows per request (lower reward.batch_size)") from None
            except (OSError, http.client.HTTPException) as err:
                what = f"ConnectionError: {type(err).__name__}: {self._hide(str(err))[:BODY_QUOTE]}"
                fix = f"check that the service is up at that address, or raise {key}.retries"
                continue
            if r.status >= 500:
                what = f"HTTP {r.status}: {self._quote(r.text)}"
                fix = f"check the service's log, or raise {key}.retries"
                continue
            if r.status != 200:
                raise self._error(f"answered HTTP {r.status}: {self._quote(r.text)}",
                                  "check the request format (docs/GUIDE.md: A reward service) "
                                  "and the service's log")
            return Answer(self._parse(r.text, expected), attempt)
        raise self._error(f"failed {self.max_retries + 1} times ({key}.retries = "
                          f"{self.max_retries}); last: {what}", fix)

    def _out_of_time(self, what: str) -> RewardServiceError:
        return self._error(f"did not answer within the call's deadline of {self.deadline_s:.0f} s "
                          f"(dist_timeout_minutes, less a margin: the other ranks wait for this "
                          f"rank's scores in a collective); last: {what}",
                          "check that the service is up and answers in time, or raise "
                          "dist_timeout_minutes")

    def _parse(self, text: str, expected: int) -> list[float]:
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        scores = data.get("scores") if isinstance(data, dict) else None
        if not isinstance(scores, list):
            raise self._error(f'answered without a JSON {{"scores": [...]}} body: '
                              f"{self._quote(text)}", "return one score per response")
        if len(scores) != expected:
            raise self._error(f"answered {len(scores)} scores for {expected} responses: "
                              f"{self._quote(text)}", "return one score per response, in order")
        ok = all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s)
                 for s in scores)
        if not ok:
            raise self._error(f"answered scores that are not all finite numbers: "
                              f"{self._quote(text)}", "return one float per response")
        return [float(s) for s in scores]

    def _hide(self, text: str) -> str:
        return text.replace(self._secret, "***") if self._secret else text

    def _quote(self, text: str) -> str:
        text = self._hide(text.strip())
        return repr(text[:BODY_QUOTE] + ("..." if len(text) > BODY_QUOTE else ""))

    def _error(self, what: str, fix: str) -> RewardServiceError:
        return RewardServiceError(f"reward.url = {self.shown}: the reward service {what}; {fix}")
