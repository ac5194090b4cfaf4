"""reward.timeout_s is a deadline for the whole request, against real
slow-drip servers on 127.0.0.1: a server that sends its answer a byte at a time, each byte well
within any socket timeout, is stopped at the deadline, not when it finishes; an answer over the
size limit is refused with a clear error. Each server stops dripping after DRIP_S seconds (the
bound of these tests: without the deadline a call would take that long and then succeed)."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from ds_ppo.http_deadline import AnswerTooLarge, Connection, HttpTimeout
from ds_ppo.rewards.service import RewardService, RewardServiceError

DRIP_S = 6.0  # the longest a drip lasts; the deadline under test is 1 s
SCORES = json.dumps({"scores": [0.5]}).encode()


class DripServer:
    """A raw TCP server on 127.0.0.1: reads a request, then sends `answer` in pieces of
    `piece` bytes every `every` seconds (headers included when `headers_too`), for at most
    DRIP_S seconds; `chunked` frames the body without a Content-Length."""

    def __init__(self, body: bytes = SCORES, every: float = 0.2, piece: int = 1,
                 headers_too: bool = False, length: int | None = None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/score"
        self.body, self.every, self.piece, self.headers_too = body, every, piece, headers_too
        self.length = len(body) if length is None else length
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            want = int(next(v for k, v in (ln.split(b":", 1) for ln in head.split(b"\r\n")[1:])
                            if k.strip().lower() == b"content-length"))
            while len(rest) < want:
                rest += conn.recv(65536)
            self.requests += 1
            headers = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\nConnection: close\r\n\r\n" % self.length)
            if not self.headers_too:
                conn.sendall(headers)
                headers = b""
            out, end = headers + self.body, time.monotonic() + DRIP_S
            try:
                for i in range(0, len(out), self.piece):
                    if time.monotonic() > end:
                        return
                    conn.sendall(out[i:i + self.piece])
                    time.sleep(self.every)
            except OSError:  # the client gave up
                return

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def drip():
    servers = []

    def start(**kw):
        servers.append(DripServer(**kw))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


@pytest.mark.parametrize("headers_too", [False, True], ids=["body", "status-and-headers"])
def test_a_slow_drip_answer_is_stopped_at_the_deadline(drip, headers_too):
    """17 bytes at 0.2 s each (3.4 s; with headers 20 s, cut at DRIP_S): a socket timeout of 1 s
    never fires, the 1 s deadline does."""
    srv = drip(headers_too=headers_too)
    t0 = time.monotonic()
    with pytest.raises(HttpTimeout):
        Connection(srv.url).post(b"{}", timeout_s=1.0)
    assert time.monotonic() - t0 < 2.0


def test_the_reward_service_gives_up_a_dripping_request_after_reward_timeout_s(drip):
    srv = drip()
    svc = RewardService(srv.url, timeout_s=1.0, retries=1, backoff_s=0.01)
    t0 = time.monotonic()
    with pytest.raises(RewardServiceError) as e:
        svc(["p"], ["good"])
    took = time.monotonic() - t0
    assert took < 3.5, took  # two attempts of 1 s each, not 2 x 3.4 s of drip
    assert srv.requests == 2
    assert "no answer within reward.timeout_s = 1.0 s" in str(e.value)
    assert srv.url in str(e.value)


def test_a_fast_answer_and_keep_alive_still_work(drip):
    srv = drip(every=0.0, piece=1 << 16)
    conn = Connection(srv.url)
    for _ in range(2):  # the server closes each connection: the second post reconnects
        answer = conn.post(b"{}", timeout_s=5.0)
        assert (answer.status, json.loads(answer.body)) == (200, {"scores": [0.5]})
    assert RewardService(srv.url, timeout_s=5.0)(["p"], ["good"]) == [0.5]


@pytest.mark.parametrize("announced", [True, False], ids=["content-length", "as-it-comes"])
def test_an_answer_over_the_size_limit_is_refused(drip, announced):
    big = b'{"scores": [0.5], "pad": "' + b"x" * 5000 + b'"}'
    srv = drip(body=big, every=0.0, piece=1024, length=None if announced else 10)
    if not announced:  # a Content-Length that lies low is cut there: read as-it-comes instead
        srv.length = len(big)
    svc = RewardService(srv.url, timeout_s=5.0, retries=3, max_answer_bytes=1000)
    with pytest.raises(RewardServiceError) as e:
        svc(["p"], ["good"])
    assert srv.requests == 1  # not retried: the service's answer is wrong, not late
    assert "over the limit of 1,000" in str(e.value) or "more than 1,000 bytes" in str(e.value)
    assert str(e.value).endswith("send fewer rows per request (lower reward.batch_size)")
    from ds_ppo.envs.base import EnvFailed
    from ds_ppo.envs.http_env import EnvService

    env = EnvService(srv.url, timeout_s=5.0, retries=0, max_answer_bytes=1000)
    with pytest.raises(EnvFailed) as e:  # an environment is not told to return scores
        env._post_all([{"responses": ["x"]}], None)
    assert "scores" not in str(e.value), str(e.value)
    assert str(e.value).endswith("send fewer rows per request (lower env.batch_size)")
    with pytest.raises(AnswerTooLarge):
        Connection(srv.url).post(b"{}", timeout_s=5.0, max_bytes=1000)

