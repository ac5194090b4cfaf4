"""Giving up the waits of an iteration on SIGTERM, so a preempted run exits within seconds.

A scheduler's SIGTERM comes with a short grace period (the `deepspeed` launcher and Kubernetes
wait 30 s by default). run/preemption.py's `StopRequests` calls `request(signum)` when it
arrives; from then on a reward call (reward.function's worker thread, reward.url's requests),
an environment call (envs/runner.py) or a decode (the decoding loop, between steps) in
progress, or one that starts later, is given up: its wait raises `Abandoned` within
`SLICE_S`, and the run exits 128 + the signal without saving the half-done iteration
(run/driver.py). The threads left running are daemons and do not keep the process up.

Stdlib only: every layer below the run (rewards, envs, the engine's decoding loop) reads it.
"""
from __future__ import annotations

import threading

SLICE_S = 0.05  # how often a wait looks at the request (the delay it adds to a stop)

_requested = threading.Event()
_signum = 0


class Abandoned(BaseException):
    """A wait on a reward call, an environment call or a decode given up on a signal.

    A BaseException, as KeyboardInterrupt is: the `except Exception` of a stage (an OOM retry,
    an error report) must not take it for that stage's failure."""

    def __init__(self, signum: int, phase: str) -> None:
        self.signum, self.phase = signum, phase
        super().__init__(f"{phase} abandoned on signal {signum}")


def elsewhere(phase: str) -> Abandoned:
    """What a rank raises when the ranks' agreement on `phase` (a reward call, the episodes'
    turns) says another rank gave it up; SIGTERM is the only signal that gives calls up."""
    import signal

    return Abandoned(_signum or signal.SIGTERM, phase)


def request(signum: int) -> None:
    """From now on every wait of `join`, `check` and `wait` raises Abandoned (any thread)."""
    global _signum
    _signum = signum
    _requested.set()


def clear() -> None:
    """Waits run to their end again (the handlers of `StopRequests` are gone)."""
    global _signum
    _requested.clear()
    _signum = 0


def requested() -> int:
    """The signal that asked for the waits to stop (0: none)."""
    return _signum if _requested.is_set() else 0


def check(phase: str) -> None:
    """Raise Abandoned(phase) when a stop was requested: the cheap test a loop makes per step."""
    if _requested.is_set():
        raise Abandoned(_signum, phase)


def join(thread: threading.Thread, timeout_s: float | None, phase: str) -> None:
    """`thread.join(timeout_s)` that raises Abandoned(phase) within SLICE_S of a request (also
    one made before the call): the thread is then left running."""
    wait(lambda: not thread.is_alive(), timeout_s, phase, thread)


def wait(done, timeout_s: float | None, phase: str, thread: threading.Thread | None = None
         ) -> None:
    """Return once `done()` is true or `timeout_s` passed (None: no limit); Abandoned(phase)
    within SLICE_S of a stop request. `thread`: the one whose end makes `done()` true, joined
    in the slices so that its end returns at once."""
    import time

    end = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        check(phase)
        if done():
            return
        left = SLICE_S if end is None else min(SLICE_S, end - time.monotonic())
        if left <= 0:
            return
        if thread is not None:
            thread.join(left)
        else:
            _requested.wait(left)
