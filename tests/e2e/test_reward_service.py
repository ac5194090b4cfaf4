"""reward.url against real HTTP servers (stdlib http.server in a thread): the request/answer
contract, row order with data.reward_keys, retries of 5xx and timeouts, the stops (4xx, wrong
count, server down), redaction of credentials, and one short training run scored over HTTP."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import SMALL, free_port, read_metrics, run_cli
from ds_ppo.config import load_config, validate
from ds_ppo.errors import ConfigError
from ds_ppo.http_deadline import call_deadline
from ds_ppo.rewards.service import RewardService, RewardServiceError, redact_url
from ds_ppo.rewards.functions import positive_words


class Server:
    """A threaded HTTP server on 127.0.0.1; `answer(request_dict, n) -> (status, body str)`
    decides each reply (n counts requests from 1). Records every request it parsed."""

    def __init__(self, answer, delay_s: float = 0.0) -> None:
        self.requests: list[dict] = []
        self.auth: list[str | None] = []
        self.count = 0
        self.in_flight = self.max_in_flight = 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    outer.count += 1
                    n = outer.count
                    outer.requests.append(body)
                    outer.auth.append(self.headers.get("Authorization"))
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                time.sleep(delay_s)
                status, text = answer(body, n)
                with lock:
                    outer.in_flight -= 1
                data = text.encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (timeout test)
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def positive_words_service(body: dict, n: int) -> tuple[int, str]:
    """The tiny default's task, served: the same function, over HTTP."""
    return 200, json.dumps({"scores": positive_words(body["prompts"], body["responses"])})


@pytest.fixture
def server():
    servers = []

    def start(answer, delay_s=0.0):
        servers.append(Server(answer, delay_s))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _service(url, **kw) -> RewardService:
    kw.setdefault("backoff_s", 0.01)
    return RewardService(url, **kw)


def test_scores_in_row_order_with_reward_keys_columns(server):
    # score = answer - the response's length: only right when the columns travel with their rows
    def answer(body, n):
        return 200, json.dumps({"scores": [a - len(r) for r, a in
                                           zip(body["responses"], body["answer"])]})

    srv = server(answer, delay_s=0.05)
    responses = ["x" * i for i in range(11)]
    answers = [100 * i for i in range(11)]
    prompts = [f"p{i}" for i in range(11)]
    svc = _service(srv.url, batch_size=3, concurrency=3)
    scores = svc(prompts, responses, answer=answers)
    assert scores == [a - len(r) for r, a in zip(responses, answers)]
    assert sorted(len(r["responses"]) for r in srv.requests) == [2, 3, 3, 3]  # reward.batch_size
    assert sorted(p for r in srv.requests for p in r["prompts"]) == sorted(prompts)
    assert set(srv.requests[0]) == {"prompts", "responses", "answer"}
    assert srv.max_in_flight > 1  # reward.concurrency: requests overlap
    assert svc.retries == 0


def test_served_task_gives_the_in_process_functions_scores(server):
    srv = server(positive_words_service)
    texts = ["good happy day", "the cat sat", "", "love love love it", "sad but good"]
    prompts = ["p"] * len(texts)
    assert _service(srv.url, batch_size=2)(prompts, texts) == positive_words(prompts, texts)


def test_500_twice_then_success_is_retried_logged_and_counted(server, caplog):
    srv = server(lambda body, n: (500, "overloaded") if n <= 2 else
                 positive_words_service(body, n))
    svc = _service(srv.url, retries=3, backoff_s=0.1)
    with caplog.at_level("WARNING", logger="ds_ppo"):
        assert svc(["p"], ["good"]) == [1.0]
    assert srv.count == 3 and svc.retries == 2
    # one line per retry as it is made: what failed, the attempt, the wait before the next
    assert [r.getMessage() for r in caplog.records] == [
        f"reward.url = {srv.url}: HTTP 500: 'overloaded' (attempt 1 of 4); next attempt in 0.1 s",
        f"reward.url = {srv.url}: HTTP 500: 'overloaded' (attempt 2 of 4); next attempt in 0.2 s"]


def test_5xx_past_retries_stops_naming_url_and_answer(server):
    srv = server(lambda body, n: (503, "model is loading"))
    with pytest.raises(RewardServiceError) as e:
        _service(srv.url, retries=2)(["p"], ["good"])
    assert srv.count == 3
    msg = str(e.value)
    assert srv.url in msg and "HTTP 503" in msg and "model is loading" in msg
    assert "reward.retries = 2" in msg
    # the advice fits the cause: a 5xx is not a timeout
    assert msg.endswith("check the service's log, or raise reward.retries")


def test_slow_server_times_out_after_retries(server):
    srv = server(positive_words_service, delay_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RewardServiceError) as e:
        _service(srv.url, timeout_s=0.2, retries=1)(["p"], ["good"])
    assert time.monotonic() - t0 < 0.95  # two 0.2 s attempts, not a 1 s answer
    assert srv.count == 2
    assert "reward.timeout_s = 0.2 s" in str(e.value) and srv.url in str(e.value)
    assert str(e.value).endswith("check that the service answers within reward.timeout_s, or "
                                 "raise reward.timeout_s / reward.retries")


def test_a_call_gives_up_at_its_deadline_with_the_services_error(server):
    """10 attempts of 1 s each would take 10 s; the call's 1.5 s deadline (on several ranks: the
    collective timeout less a margin) stops it in time, naming the deadline and the last error."""
    srv = server(positive_words_service, delay_s=5.0)
    t0 = time.monotonic()
    with pytest.raises(RewardServiceError) as e:
        _service(srv.url, timeout_s=1.0, retries=9, deadline_s=1.5)(["p"], ["good"])
    took = time.monotonic() - t0
    assert took < 2.5, took
    assert "deadline of 2 s" in str(e.value) and "no answer within" in str(e.value)
    assert srv.url in str(e.value)


def test_the_deadline_follows_the_collective_timeout():
    assert call_deadline(30, 1) is None  # one rank: nothing waits in a collective
    assert call_deadline(30, 8) == 30 * 60 - 180  # 10% margin
    assert call_deadline(1, 2) == 30  # at least 30 s margin, never under half the timeout
    assert call_deadline(0.5, 2) == 15
    assert call_deadline(600, 2) == 600 * 60 - 300  # at most a 5 min margin


def test_wrong_count_stops_at_once_quoting_the_body(server):
    srv = server(lambda body, n: (200, json.dumps({"scores": [0.5]})))
    with pytest.raises(RewardServiceError) as e:
        _service(srv.url, retries=3)(["p", "q"], ["a", "b"])
    assert srv.count == 1  # not retried
    assert "1 scores for 2 responses" in str(e.value) and '{"scores": [0.5]}' in str(e.value)


@pytest.mark.parametrize("status,body,says", [
    (400, "missing field answer", "HTTP 400"),
    (200, "<html>oops</html>", "without a JSON"),
    (200, '{"scores": ["high"]}', "not all finite numbers"),
])
def test_4xx_or_malformed_body_stops_at_once(server, status, body, says):
    srv = server(lambda b, n: (status, body))
    with pytest.raises(RewardServiceError) as e:
        _service(srv.url, retries=3)(["p"], ["a"])
    assert srv.count == 1 and says in str(e.value) and body[:10] in str(e.value)


def test_a_failed_request_stops_the_call_without_waiting_for_the_others(server):
    # the first batch hangs (10 s), the second is refused at once: the error comes at once
    def answer(body, n):
        if body["responses"][0] == "slow":
            time.sleep(10)
        return 400, "bad request"

    srv = server(answer)
    t0 = time.monotonic()
    with pytest.raises(RewardServiceError, match="HTTP 400"):
        _service(srv.url, batch_size=1, concurrency=2, timeout_s=60)(["p", "q"], ["slow", "x"])
    assert time.monotonic() - t0 < 5


def test_server_down_stops_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}/score"
    with pytest.raises(RewardServiceError) as e:
        _service(url, retries=1)(["p"], ["a"])
    assert url in str(e.value) and "ConnectionError" in str(e.value)
    assert str(e.value).endswith("check that the service is up at that address, or raise "
                                 "reward.retries")


def test_credentials_are_sent_but_never_shown(server, caplog):
    srv = server(lambda body, n: (500, "no"))
    url = srv.url.replace("http://", "http://alice:s3cret@")
    assert redact_url(url) == srv.url.replace("http://", "http://***@")
    with pytest.raises(RewardServiceError) as e, caplog.at_level("WARNING", logger="ds_ppo"):
        _service(url, retries=1)(["p"], ["a"])
    assert srv.auth[0] and srv.auth[0].startswith("Basic ")  # requests sent them
    assert "s3cret" not in str(e.value) and "alice" not in str(e.value)
    assert "http://***@" in caplog.text and "s3cret" not in caplog.text  # the retry's line
    with pytest.raises(ConfigError) as e:  # the config error shows the redacted form too
        validate(load_config(None, [f"reward.url={url}",  # and a function: one source only
                                    "reward.function=ds_ppo.rewards:positive_words"]), 1)
    assert "exactly one" in str(e.value) and "s3cret" not in str(e.value)


def test_a_compressed_answer_is_cut_off_once_decompressed():
    """A small gzip answer that expands past MAX_BODY_BYTES (valid JSON: scores, then padding)
    is refused without being held whole: a 300 KB answer must not cost 300 MB."""
    import gzip

    from ds_ppo.rewards.service import MAX_BODY_BYTES

    body = gzip.compress(b'{"scores": [0.5]}' + b" " * (MAX_BODY_BYTES + 2**20))

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        service = _service(f"http://127.0.0.1:{httpd.server_port}/s", retries=0)
        assert len(body) < 64 * 2**10
        with pytest.raises(RewardServiceError, match=r"answered a body larger than 8 MiB once "
                                                     r"decompressed \(Content-Encoding: gzip\)"):
            service(["p"], ["r"])
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_config_checks_url_scheme_and_allows_reward_keys():
    with pytest.raises(ConfigError, match="must start with http"):
        validate(load_config(None, ["reward.function=null", "reward.url=localhost:8000"]), 1)
    cfg = load_config(None, ["reward.function=null", "reward.url=http://h:1/s",
                             "data.path=x.jsonl", "data.reward_keys=[answer]"])
    validate(cfg, 1)  # no complaint about reward_keys


@pytest.mark.slow
def test_training_scored_by_a_service(server, tmp_path):
    """One short run whose reward comes over HTTP: it trains, every response was posted in
    reward.batch_size requests, the service's answers are the run's scores, and the metrics
    carry the reward time and the retries (one 500 answered along the way)."""
    answered: list[float] = []

    def answer(body, n):
        if n == 2:
            return 500, "hiccup"
        status, text = positive_words_service(body, n)
        answered.extend(json.loads(text)["scores"])
        return status, text

    srv = server(answer)
    out = tmp_path / "out"
    run_cli(["train", *SMALL, "iterations=3", "reward.function=null", f"reward.url={srv.url}",
             "reward.batch_size=5", f"output_dir={out}"], cwd=tmp_path)
    rows = read_metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert len(answered) == 3 * 16
    assert max(len(r["responses"]) for r in srv.requests) == 5
    assert all(set(r) == {"prompts", "responses"} for r in srv.requests)
    assert [r["reward/retries"] for r in rows] == [1, 0, 0]
    assert all(r["time/reward_s"] > 0 for r in rows)
    # the run's score/mean is the mean of what the service answered, iteration by iteration
    means = [sum(answered[16 * i:16 * (i + 1)]) / 16 for i in range(3)]
    assert [r["score/mean"] for r in rows] == pytest.approx(means, abs=1e-6)



def test_score_checks_name_the_service_by_its_key():
    from ds_ppo.errors import RewardFunctionError
    from ds_ppo.rewards.call import check_scores

    with pytest.raises(RewardFunctionError, match=r"^reward.url = 'http://\*\*\*@h/s' returned 1"):
        check_scores([1.0], "http://***@h/s", 2)
    with pytest.raises(RewardFunctionError, match=r"^reward.function = 'm:f' returned 1"):
        check_scores([1.0], "m:f", 2)
