"""Stopping cleanly when a scheduler asks, so that a preempted run loses no finished iteration.

SIGTERM (what Kubernetes, `scancel` and the `deepspeed` launcher send before killing; the
launcher waits 30 s) and SIGUSR1 (Slurm's advance notice with `sbatch --signal=USR1@300`) set a
flag. After each iteration the ranks agree on it (one max all-reduce of one number, so a
signal that reached only some ranks stops all of them together), save a checkpoint unless one
was just saved, and the run ends with `Preempted`: the CLI exits 128 + the signal number (143
for SIGTERM), so a scheduler does not take the run for finished. The same command resumes it.

SIGTERM does not wait for what may take long: a reward call, an environment call or a decode in
progress (or started later) is given up (`ds_ppo.abandon`), and the run exits 143 within
seconds without saving the half-done iteration (`abandoned`): the last checkpoint is the resume
point. A SIGTERM during scoring's forwards or the update lets the iteration finish and saves it.
SIGUSR1, an advance notice, always lets the iteration finish.

Ctrl-C (SIGINT) does what SIGUSR1 does (exit 130); a second Ctrl-C aborts at once
(KeyboardInterrupt), for a user who does not want to wait for the iteration and the save.
"""
from __future__ import annotations

import logging
import signal
import threading

import torch

from ds_ppo import abandon
from ds_ppo.engine import dist

log = logging.getLogger("ds_ppo")

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Preempted(Exception):
    """The run stopped on a signal: at an iteration boundary, its checkpoint saved, or (`phase`
    set) in the middle of an iteration, given up (`abandoned`); `checkpoint` is the resume
    point (None: there is none, the same command starts over)."""

    def __init__(self, signum: int, iteration: int, checkpoint: str | None,
                 phase: str | None = None) -> None:
        self.signum, self.iteration, self.checkpoint = signum, iteration, checkpoint
        self.phase = phase
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        if phase is None:
            message = (f"stopped by {name} after iteration {iteration}; checkpoint "
                       f"{checkpoint}; run the same command again to resume")
        elif checkpoint is None:
            message = (f"{name} during {phase}: abandoned; no checkpoint yet: the same command "
                       "starts the run over")
        else:
            message = (f"{name} during {phase}: abandoned; resume from checkpoint iteration "
                       f"{iteration} ({checkpoint}): run the same command again")
        super().__init__(message)


def abandoned(stop: abandon.Abandoned, saved_at: int, checkpoint: str | None) -> Preempted:
    """The Preempted of a run whose `stop.phase` was given up on a signal: nothing is saved,
    the last checkpoint (of iteration `saved_at`; None: none) is where the run resumes."""
    return Preempted(stop.signum, saved_at, checkpoint, stop.phase)


class StopRequests:
    """Records the first SIGTERM/SIGUSR1/SIGINT while installed (a context manager; the previous
    handlers come back on exit). Installs nothing off the main thread, where Python cannot take
    signals."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signum = 0
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait
        if signum == signal.SIGTERM and not abandon.requested():  # also after a SIGUSR1
            log.warning("received SIGTERM: stopping; a reward call, environment call or decode "
                        "in progress is abandoned (the last checkpoint is the resume point), "
                        "else this iteration finishes and is saved")
            abandon.request(signum)  # the waits on such calls end now, on any thread
        elif not self.signum:
            log.warning("received %s: finishing this iteration, then saving a checkpoint and "
                        "stopping%s", signal.Signals(signum).name,
                        " (Ctrl-C again to abort now, without saving)"
                        if signum == signal.SIGINT else "")
        self.signum = self.signum or signum

    def __enter__(self) -> "StopRequests":
        if self.enabled:
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        abandon.clear()

    def agreed(self, device: torch.device) -> int:
        """Collective: the signal any rank received (0: none). Every rank must call it."""
        if not self.enabled:
            return 0
        flag = torch.tensor([float(self.signum)], device=device)
        return int(dist.all_reduce_max(flag).item())
