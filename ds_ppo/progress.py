"""Rank 0's progress line helpers: its numbers, and the expected time left from the mean of
recent iterations."""
from __future__ import annotations

import math
import time
from collections import deque


def format_duration(seconds: float) -> str:
    """45s, 3m20s, 2h05m (rounded to whole seconds, or to minutes past an hour)."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_signed(x: float) -> str:
    """+0.0213, or +2.13e-05 below 1e-3 (where four decimals would print +0.0000), +0.0000 for
    exactly 0 (either sign)."""
    if x == 0 or math.isnan(x) or abs(x) >= 1e-3:
        return f"{x + 0.0:+.4f}"
    return f"{x:+.2e}"


class Eta:
    """Time left = mean wall time of the last `window` iterations x iterations left. An
    iteration's wall time runs from the previous `tick` to this one, so it includes the previous
    iteration's checkpoint save and evaluation, which the remaining iterations will pay as well;
    the first tick of a run (no previous one) takes the iteration's own duration."""

    def __init__(self, window: int = 10, clock=time.perf_counter) -> None:
        self.durations: deque[float] = deque(maxlen=window)
        self.clock, self.last, self.iteration = clock, None, None

    def tick(self, iteration: int, duration: float) -> None:
        """Call once per finished iteration with its own `duration` (seconds), used when it does
        not follow the previous tick's iteration (a new or resumed run starts afresh)."""
        now = self.clock()
        if self.iteration is None or iteration != self.iteration + 1:
            self.durations.clear()
            self.last = None
        self.durations.append(duration if self.last is None else now - self.last)
        self.last, self.iteration = now, iteration

    def left(self, iterations_left: int) -> float:
        """Seconds expected for `iterations_left` more iterations."""
        if not self.durations:
            return float("nan")
        return sum(self.durations) / len(self.durations) * iterations_left
