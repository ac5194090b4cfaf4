"""Hangs that name themselves: a watchdog thread on every rank.

Each rank records the phase it is in (generation, scoring, reward call, update, save, export,
...: the iteration and the micro-batch) and its progress (a new phase or micro-batch). A daemon
thread writes that record, with a beat counter, into the job's store (the TCPStore the ranks
met through) every `beat_s` seconds and at once when the rank enters or leaves a phase, and a
rank that made progress within `limit_s` adds 1 to a shared counter. When a rank has made no progress for `limit_s` (a collective some rank never
joins, a deadlock, a call that never returns) and the counter stands still (no rank is making
progress: a rank that is merely slower, e.g. in a longer generation, keeps the others waiting
without a false alarm), or a collective fails under it, or another rank has declared a hang, the
rank

- reads every rank's record twice, `beat_s` apart: a rank whose beat did not move is stopped or
  gone (SIGSTOP, a dead node, a GPU hang that froze the process); one that beats but sits in
  another phase is elsewhere (a mismatched collective);
- prints one line naming its own phase and those ranks,
- writes every thread's Python stack (faulthandler) to `out_dir/hang-<rank>.txt`,
- declares the hang in the store (so every rank that can still act does the same at once) and
  exits with EXIT_HANG, so a scheduler restarts the job, which resumes from its last checkpoint.

Every store call runs in a helper thread and is given up after `store_timeout_s`: a
TCPStore client waits forever for an answer from a stopped store host (rank 0), and one stuck
call holds the client's lock for every later one; after that the store counts as gone.

Stdlib only; the store is any object with set/get/check/add (a TCPStore client from
`ds_ppo.engine.dist.watchdog_store`), None on one rank. The phase record is written by the
stages (`phase`, `progress`: no-ops but the record until `install`).
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

log = logging.getLogger("ds_ppo")

EXIT_HANG = 4  # the process exit code of a rank the watchdog stopped
_KEY = "ds_ppo_watchdog/"
_UNSET = object()
LEFT = "left (its work done)"  # the last record of a rank that stopped on purpose


class StoreGone(Exception):
    """The job's store did not answer in time (its host, rank 0, is stopped or gone)."""


@dataclass
class _Phase:
    name: str
    iteration: int | None
    limit_s: float | None  # None: exempt (work with its own bound, e.g. rank 0's solitary work)
    micro: int | None = None

    def where(self) -> str:
        parts = [p for p in (f"iteration {self.iteration}" if self.iteration else None,
                             f"micro-batch {self.micro}" if self.micro is not None else None) if p]
        return self.name + (f" ({', '.join(parts)})" if parts else "")


class Watchdog:
    """One rank's phase record and watchdog thread (see the module docstring).

    limit_s: seconds without progress that end the job (None: the thread only beats and
    listens; a failed collective is still reported). beat_s: the heartbeat period.
    generation_ranks: how many of the last of the world_size ranks are a split placement's
    generation ranks (named so in the line)."""

    def __init__(self, limit_s: float | None, rank: int = 0, world_size: int = 1,
                 store: Any = None, out_dir: str | os.PathLike = ".", beat_s: float | None = None,
                 setting: str = "watchdog_minutes", store_timeout_s: float = 5.0,
                 exit: Callable[[int], None] = os._exit, run_token: str = "",
                 generation_ranks: int = 0) -> None:
        self.limit_s, self.rank, self.world_size = limit_s, rank, world_size
        self.generation_ranks = generation_ranks
        self.store, self.out_dir, self.setting = store, Path(out_dir), setting
        self.store_timeout_s = store_timeout_s
        # keys of this start of the job only: a store that outlives a restart (torchrun's
        # elastic agent) must not hand the old hang to the new processes
        self.key = f"{_KEY}{run_token}/" if run_token else _KEY
        self.beat_s = beat_s or (min(max(limit_s / 10, 0.5), 10.0) if limit_s else 10.0)
        self._exit = exit
        self._stack: list[_Phase] = []
        self._progress_at = time.monotonic()
        self._seq = 0
        self._lock, self._fire_lock = threading.Lock(), threading.Lock()
        self._stopped = threading.Event()
        self._wake = threading.Event()  # a new phase: beat it at once, not at the next beat
        self._thread: threading.Thread | None = None
        self._stuck: threading.Thread | None = None
        self._alive = (-1, time.monotonic())  # the shared counter's value, when it last moved

    # ------------------------------------------------------------------ the phase record
    @contextmanager
    def phase(self, name: str, iteration: int | None = None, limit_s: Any = _UNSET
              ) -> Iterator[None]:
        """Record `name` (iteration: default the enclosing phase's) while the block runs;
        limit_s None exempts it (default: the watchdog's limit)."""
        with self._lock:
            outer = self._stack[-1] if self._stack else None
            if iteration is None and outer is not None:
                iteration = outer.iteration
            limit = self.limit_s if limit_s is _UNSET else limit_s
            self._stack.append(_Phase(name, iteration, limit))
            self._progress_at = time.monotonic()
        self._wake.set()
        try:
            yield
        finally:
            with self._lock:
                self._stack.pop()
                self._progress_at = time.monotonic()
            self._wake.set()

    def at(self, name: str, iteration: int | None = None) -> None:
        """Set the loop's own position (the record under any `phase`), counted as progress."""
        with self._lock:
            if iteration is None and self._stack:
                iteration = self._stack[0].iteration
            record = _Phase(name, iteration, self.limit_s)
            if self._stack:
                self._stack[0] = record
            else:
                self._stack.append(record)
            self._progress_at = time.monotonic()
        self._wake.set()

    def progress(self, micro: int | None = None) -> None:
        """Progress inside the current phase (a micro-batch, a generate call)."""
        with self._lock:
            if self._stack and micro is not None:
                self._stack[-1].micro = micro
            self._progress_at = time.monotonic()

    def _current(self) -> tuple[_Phase, float]:
        with self._lock:
            top = self._stack[-1] if self._stack else _Phase("between phases", None, self.limit_s)
            return _Phase(top.name, top.iteration, top.limit_s, top.micro), \
                time.monotonic() - self._progress_at

    # ---------------------------------------------------------------------- the thread
    def start(self) -> "Watchdog":
        self._beat()
        self._thread = threading.Thread(target=self._run, name="ds_ppo-watchdog", daemon=True)
        self._thread.start()
        return self

    def leave(self) -> None:
        """This rank's work is done (a generation rank told to stop): a last record says so, so
        the others do not count it as missing, then `stop`."""
        self.at(LEFT)
        self._beat()
        self.stop()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.beat_s)

    def _run(self) -> None:
        """Beat every beat_s, and at once when the rank enters or leaves a phase (so the
        record another rank reads when this one stops is its phase, not the one before);
        the checks keep the beat_s period."""
        due = time.monotonic() + self.beat_s
        while True:
            woken = self._wake.wait(max(0.0, due - time.monotonic()))
            if self._stopped.is_set():
                return
            self._wake.clear()
            self._beat()
            if woken and time.monotonic() < due:
                continue
            due = time.monotonic() + self.beat_s
            declared = self._declared()
            if declared is not None:
                self.fire(f"rank {declared} saw a hang")
            phase, idle = self._current()
            if phase.limit_s is not None and idle > phase.limit_s and not self._others_move():
                self.fire(f"no progress for {idle:.0f} s ({self.setting} = "
                          f"{phase.limit_s / 60:g})")

    def _others_move(self) -> bool:
        """Whether some rank made progress lately: the shared counter moved within the last
        2.5 beats (the ranks' beats are not in step). False without a store (one rank)."""
        if self.store is None:
            return False
        try:
            count = int(self._ask(self.store.add, f"{self.key}alive", 0))
        except StoreGone:
            return False
        now = time.monotonic()
        if count != self._alive[0]:
            self._alive = (count, now)
        return now - self._alive[1] < 2.5 * self.beat_s

    def _beat(self) -> None:
        if self.store is None:
            return
        phase, idle = self._current()
        self._seq += 1
        record = {"seq": self._seq, "phase": phase.name, "iteration": phase.iteration,
                  "micro": phase.micro, "idle_s": round(idle, 1)}
        try:
            self._ask(self.store.set, f"{self.key}beat/{self.rank}", json.dumps(record))
            if phase.limit_s is None or idle <= phase.limit_s:  # this rank moves
                self._ask(self.store.add, f"{self.key}alive", 1)
        except StoreGone:  # seen when firing
            pass

    def _declared(self) -> int | None:
        if self.store is None:
            return None
        try:
            if self._ask(self.store.check, [f"{self.key}hang"]):
                return int(self._ask(self.store.get, f"{self.key}hang"))
        except StoreGone:
            pass
        return None

    def _ask(self, fn: Callable, *args):
        """fn(*args) on the store, given up after store_timeout_s (then the store is gone)."""
        if self.store is None:
            raise StoreGone
        if self._stuck is not None:  # a call that never came back holds the client's lock
            if self._stuck.is_alive():
                raise StoreGone
            self._stuck = None
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["value"] = fn(*args)
            except BaseException as err:  # noqa: BLE001  (handed to the caller)
                box["error"] = err

        t = threading.Thread(target=call, name="ds_ppo-watchdog-store", daemon=True)
        t.start()
        t.join(self.store_timeout_s)
        if t.is_alive():
            self._stuck = t
            raise StoreGone
        if "error" in box:
            raise StoreGone
        return box.get("value")

    # ---------------------------------------------------------------------- stopping
    def fire(self, reason: str) -> None:
        """Report the hang (one line, the stacks file), tell the other ranks, exit EXIT_HANG.
        Once per process: a second caller waits for the first one's exit."""
        if not self._fire_lock.acquire(blocking=False):
            while True:
                time.sleep(60)
        phase, idle = self._current()
        if self.store is not None and self._declared() is None:
            try:
                self._ask(self.store.set, f"{self.key}hang", str(self.rank))
            except StoreGone:
                pass
        others = self._others()
        stacks = self._dump_stacks(reason, phase, others)
        print(f"ds-ppo: error: watchdog: {self._name(self.rank)} in {phase.where()}: {reason}; "
              f"{others}; Python stacks in {stacks}; stopping this rank (exit {EXIT_HANG}): "
              "run the same command again to resume from the last checkpoint",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        for handler in logging.getLogger().handlers + log.handlers:
            try:
                handler.flush()
            except (OSError, ValueError):  # a closed or broken stream must not keep the rank up
                pass
        self._exit(EXIT_HANG)

    def _others(self) -> str:
        """What the other ranks are doing: those whose beat did not move in 1.5 beats did not
        arrive (stopped or gone); those in another phase or iteration are elsewhere."""
        if self.world_size <= 1:
            return "no other ranks"
        if self.store is None:
            return "the other ranks cannot be asked (no store)"
        first = self._read_beats()
        if first is None:
            return ("the job's store (on rank 0's node) does not answer: rank 0 is stopped or "
                    "gone")
        time.sleep(1.5 * self.beat_s)
        second = self._read_beats() or {}
        me, _ = self._current()
        missing, elsewhere = [], []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            a, b = first.get(r), second.get(r)
            if b is not None and b["phase"] == LEFT:
                continue
            if b is None or a is None or a["seq"] == b["seq"]:
                last = f"last in {_where(b or a)}" if (b or a) else "never seen"
                missing.append(f"{self._name(r)} ({last})")
            elif (b["phase"], b["iteration"]) != (me.name, me.iteration):
                elsewhere.append(f"{self._name(r)} ({_where(b)})")
        parts = [f"did not arrive: {', '.join(missing)}" if missing else "every rank answers"]
        if elsewhere:
            parts.append(f"in another phase: {', '.join(elsewhere)}")
        return "; ".join(parts)

    def _name(self, r: int) -> str:
        return ("generation rank" if r >= self.world_size - self.generation_ranks else
                "rank") + f" {r}"

    def _read_beats(self) -> dict[int, dict] | None:
        beats = {}
        for r in range(self.world_size):
            if r == self.rank:
                continue
            key = f"{self.key}beat/{r}"
            try:
                if self._ask(self.store.check, [key]):
                    beats[r] = json.loads(self._ask(self.store.get, key))
            except StoreGone:
                return None
        return beats

    def _dump_stacks(self, reason: str, phase: _Phase, others: str) -> Path:
        path = self.out_dir / f"hang-{self.rank}.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(f"rank {self.rank} in {phase.where()}: {reason}; {others}\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as err:
            return Path(f"<not written: {err}>")
        return path


def _where(beat: dict) -> str:
    return _Phase(beat["phase"], beat.get("iteration"), None, beat.get("micro")).where()


# -------------------------------------------------------- the process's watchdog
_active: Watchdog = Watchdog(None)  # a record without a thread until `install`


def install(dog: Watchdog) -> Watchdog:
    global _active
    _active = dog
    return dog


def current() -> Watchdog:
    return _active


def phase(name: str, iteration: int | None = None, limit_s: Any = _UNSET):
    """The process's watchdog's `phase` (a record only when none is running)."""
    return _active.phase(name, iteration, limit_s)


def at(name: str, iteration: int | None = None) -> None:
    _active.at(name, iteration)


def progress(micro: int | None = None) -> None:
    _active.progress(micro)
