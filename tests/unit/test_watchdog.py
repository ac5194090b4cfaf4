"""The watchdog (ds_ppo/watchdog.py) in process: a fake store, an exit that records its code.

The real thing (two gloo ranks, one stopped with SIGSTOP, the other's line, exit code and the
resume) is tests/dist/test_watchdog_dist.py.
"""
from __future__ import annotations

import json
import threading
import time

from ds_ppo import watchdog
from ds_ppo.watchdog import EXIT_HANG, Watchdog


class Exited(BaseException):
    pass


class FakeStore:
    """set/get/check of a dict, as a TCPStore client; `frozen` makes every call block forever
    (a store whose host, rank 0, is stopped)."""

    def __init__(self):
        self.data, self.frozen = {}, threading.Event()

    def _wait(self):
        if self.frozen.is_set():
            threading.Event().wait()  # never returns (a daemon thread: abandoned)

    def set(self, key, value):
        self._wait()
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        self._wait()
        return self.data[key]

    def check(self, keys):
        self._wait()
        return all(k in self.data for k in keys)

    def add(self, key, n):
        self._wait()
        self.data[key] = str(int(self.data.get(key, b"0")) + n).encode()
        return int(self.data[key])


def run_until_exit(dog: Watchdog, timeout: float = 10.0) -> list[int]:
    """Start `dog` with an exit that records the code; wait for it."""
    codes: list[int] = []
    done = threading.Event()

    def record(code):
        codes.append(code)
        done.set()
        threading.Event().wait()  # os._exit never returns: the (daemon) thread stays here
    dog._exit = record
    dog.start()
    return codes if done.wait(timeout) else []


def test_a_stuck_phase_names_itself_and_the_rank_that_did_not_arrive(tmp_path, capsys):
    store = FakeStore()
    # rank 1 beat once from "generation" and then stopped (SIGSTOP: its beat never moves)
    store.set("ds_ppo_watchdog/beat/1", json.dumps({"seq": 3, "phase": "generation",
                                                    "iteration": 7, "micro": None, "idle_s": 0}))
    # rank 2 beats on, in the same phase as rank 0 (it waits too)
    stop = threading.Event()

    def rank2():
        n = 0
        while not stop.wait(0.05):
            n += 1
            store.set("ds_ppo_watchdog/beat/2", json.dumps(
                {"seq": n, "phase": "update", "iteration": 7, "micro": 2, "idle_s": 0}))
    threading.Thread(target=rank2, daemon=True).start()
    dog = Watchdog(0.6, rank=0, world_size=3, store=store, out_dir=tmp_path, beat_s=0.1)
    t0 = time.monotonic()
    with dog.phase("update", 7):
        dog.progress(2)
        codes = run_until_exit(dog)
    stop.set()
    assert codes == [EXIT_HANG] and time.monotonic() - t0 < 5
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if "watchdog" in ln]
    assert len(line) == 1, err
    assert "rank 0 in update (iteration 7, micro-batch 2): no progress for" in line[0]
    assert "did not arrive: rank 1 (last in generation (iteration 7))" in line[0]
    assert "rank 2" not in line[0]  # alive, in the same phase: waiting like rank 0
    assert f"exit {EXIT_HANG}" in line[0] and "resume" in line[0]
    stacks = (tmp_path / "hang-0.txt").read_text()
    assert "did not arrive: rank 1" in stacks and "Thread" in stacks and "test_watchdog" in stacks
    assert store.data["ds_ppo_watchdog/hang"] == b"0"  # the other ranks stop with it


def test_a_stuck_phase_on_one_rank_fires_within_the_limit(tmp_path, capsys):
    """No store (one rank): a hung reward call is named and exits 4 within the limit (the
    watchdog thread once died reading the store)."""
    dog = Watchdog(0.4, out_dir=tmp_path, beat_s=0.05)
    t0 = time.monotonic()
    with dog.phase("reward", 3):
        codes = run_until_exit(dog)
    assert codes == [EXIT_HANG] and time.monotonic() - t0 < 5
    line = [ln for ln in capsys.readouterr().err.splitlines() if "watchdog" in ln]
    assert len(line) == 1 and "rank 0 in reward (iteration 3): no progress for" in line[0], line
    assert (tmp_path / "hang-0.txt").exists()


def test_progress_keeps_it_quiet_and_exempt_phases_have_no_limit(tmp_path):
    dog = Watchdog(0.4, out_dir=tmp_path, beat_s=0.05)
    codes: list[int] = []
    dog._exit = codes.append
    dog.start()
    with dog.phase("update", 1):
        for k in range(6):  # 0.6 s of micro-batches, each well inside the limit
            dog.progress(k)
            time.sleep(0.1)
    with dog.phase("registering the policy", limit_s=None):
        time.sleep(0.6)
    dog.stop()
    assert codes == []


def test_a_hang_declared_by_another_rank_stops_this_one(tmp_path, capsys):
    store = FakeStore()
    dog = Watchdog(60.0, rank=1, world_size=2, store=store, out_dir=tmp_path, beat_s=0.05)
    store.set("ds_ppo_watchdog/beat/0", json.dumps({"seq": 1, "phase": "scoring",
                                                    "iteration": 2, "micro": 0, "idle_s": 0}))
    store.set("ds_ppo_watchdog/hang", "0")
    with dog.phase("scoring", 2):
        codes = run_until_exit(dog)
    assert codes == [EXIT_HANG]
    err = capsys.readouterr().err
    assert "rank 1 in scoring (iteration 2): rank 0 saw a hang" in err
    assert (tmp_path / "hang-1.txt").exists()


def test_a_stopped_store_host_is_named_and_does_not_hang_the_watchdog(tmp_path, capsys):
    """Rank 0 holds the TCPStore: stopped, every store call waits forever (its client has no
    read timeout); the watchdog gives each call up and still reports, in bounded time."""
    store = FakeStore()
    dog = Watchdog(0.5, rank=1, world_size=2, store=store, out_dir=tmp_path, beat_s=0.1,
                   store_timeout_s=0.3)
    store.frozen.set()
    t0 = time.monotonic()
    with dog.phase("generation", 4):
        codes = run_until_exit(dog)
    assert codes == [EXIT_HANG] and time.monotonic() - t0 < 5
    err = capsys.readouterr().err
    assert "rank 1 in generation (iteration 4)" in err
    assert "the job's store (on rank 0's node) does not answer: rank 0 is stopped or gone" in err


def test_the_process_record_is_a_no_op_without_a_thread():
    with watchdog.phase("scoring", 3):
        watchdog.progress(1)
        phase, idle = watchdog.current()._current()
        assert (phase.name, phase.iteration, phase.micro) == ("scoring", 3, 1) and idle < 1
    watchdog.at("metrics", 3)
    with watchdog.phase("save"):  # the iteration of the loop's record
        assert watchdog.current()._current()[0].where() == "save (iteration 3)"


def test_a_slower_rank_that_still_progresses_is_waited_for(tmp_path, capsys):
    """Rank 0 waits (in a collective) past its limit while rank 1 still works (its progress
    moves the shared counter): no alarm until rank 1 stops too."""
    store = FakeStore()
    works_until = time.monotonic() + 1.0

    def rank1():
        n = 0
        while time.monotonic() < works_until:
            n += 1
            store.set("ds_ppo_watchdog/beat/1", json.dumps(
                {"seq": n, "phase": "generation", "iteration": 5, "micro": n, "idle_s": 0}))
            store.add("ds_ppo_watchdog/alive", 1)
            time.sleep(0.1)
    threading.Thread(target=rank1, daemon=True).start()
    dog = Watchdog(0.3, rank=0, world_size=2, store=store, out_dir=tmp_path, beat_s=0.1)
    with dog.phase("scoring", 5):
        codes = run_until_exit(dog)
    assert codes == [EXIT_HANG] and time.monotonic() > works_until
    assert "did not arrive: rank 1 (last in generation (iteration 5, micro-batch" \
        in capsys.readouterr().err


def test_collective_failures_are_told_apart_from_other_errors():
    """What the loop hands to the watchdog instead of printing a bare gloo/NCCL traceback."""
    import torch.distributed as tdist

    from ds_ppo.engine.dist import is_collective_failure

    gloo = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
            "closed by peer [127.0.0.1]:7372")
    timeout = ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
               "120000ms for recv operation to complete")
    assert is_collective_failure(RuntimeError(gloo))
    assert is_collective_failure(RuntimeError(timeout))
    assert is_collective_failure(tdist.DistBackendError("NCCL watchdog timeout"))
    assert not is_collective_failure(RuntimeError("shape mismatch"))
    assert not is_collective_failure(ValueError("Connection closed by peer"))


def test_a_new_phase_is_in_the_record_at_once_not_at_the_next_beat():
    """A rank that enters a phase and then stops (SIGSTOP, a dead node) is named by the others
    with that phase, not the one its last periodic beat recorded (beat_s = 30 s here)."""
    store = FakeStore()
    dog = Watchdog(600.0, rank=1, world_size=2, store=store, beat_s=30.0).start()

    def recorded(timeout: float = 3.0) -> str | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            beat = json.loads(store.data[f"{dog.key}beat/1"])
            if beat["phase"] == want:
                return beat["phase"]
            time.sleep(0.01)
        return json.loads(store.data[f"{dog.key}beat/1"])["phase"]

    try:
        with dog.phase("update", 3):
            want = "update"
            assert recorded() == "update"
            with dog.phase("save"):
                want = "save"
                assert recorded() == "save"
        want = "between phases"
        assert recorded() == "between phases"
    finally:
        dog.stop()


def test_a_split_placement_names_its_generation_ranks_and_skips_those_that_left(tmp_path,
                                                                             capsys):
    """Ranks 0 and 1 train, 2 and 3 generate: generation rank 2 stopped (its beat never moves)
    is named so; generation rank 3 finished its work (`leave`), so it is not missing."""
    store = FakeStore()
    store.set("ds_ppo_watchdog/beat/1", json.dumps({"seq": 1, "phase": "update",
                                                    "iteration": 4, "micro": None, "idle_s": 0}))
    store.set("ds_ppo_watchdog/beat/2", json.dumps({"seq": 5, "phase": "generation",
                                                    "iteration": 4, "micro": None, "idle_s": 0}))
    left = Watchdog(None, rank=3, world_size=4, store=store, out_dir=tmp_path, beat_s=0.1,
                    generation_ranks=2).start()
    left.leave()
    dog = Watchdog(0.3, rank=0, world_size=4, store=store, out_dir=tmp_path, beat_s=0.1,
                   generation_ranks=2)
    with dog.phase("update", 4):
        codes = run_until_exit(dog)
    assert codes == [EXIT_HANG]
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "watchdog" in ln]
    assert line.startswith("ds-ppo: error: watchdog: rank 0 in update (iteration 4)"), line
    assert ("did not arrive: rank 1 (last in update (iteration 4)), generation rank 2 (last in "
            "generation (iteration 4))") in line, line
    assert "rank 3" not in line, line


def test_a_log_handler_on_a_closed_stream_does_not_keep_the_rank_up(tmp_path):
    """The watchdog flushes the log handlers before it exits: one whose stream was closed (a
    redirected output gone) must not kill the watchdog's thread before the exit."""
    import logging

    stream = open(tmp_path / "gone.log", "w")  # noqa: SIM115  (closed below, on purpose)
    handler = logging.StreamHandler(stream)
    logging.getLogger().addHandler(handler)
    stream.close()
    try:
        dog = Watchdog(0.3, out_dir=tmp_path, beat_s=0.05)
        with dog.phase("reward", 1):
            assert run_until_exit(dog) == [EXIT_HANG]
    finally:
        logging.getLogger().removeHandler(handler)


def test_the_run_log_writes_to_stdout_as_it_is_now(capsys):
    """setup_logging's handler follows sys.stdout: a line logged after the stream it was set
    up on is gone reaches the current one, and no logging error is printed."""
    import logging
    import sys

    from ds_ppo.run.log_setup import setup_logging

    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    saved_factory = logging.getLogRecordFactory()
    real = sys.stdout
    import io

    first = io.StringIO()
    sys.stdout = first
    try:
        setup_logging("info")
        first.close()
        sys.stdout = real
        logging.getLogger("ds_ppo").warning("after the swap")
    finally:
        sys.stdout = real
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        logging.setLogRecordFactory(saved_factory)
    out = capsys.readouterr()
    assert "after the swap" in out.out and "Logging error" not in out.err
