"""Running an environment over a batch of episodes: every live episode's call at once.

`EnvRunner.start` resets the rank's episodes, `EnvRunner.step` sends each live episode its
newest model turn and returns the `Step`s. Python environments (env.class, env.function) run
in up to env.concurrency daemon worker threads, each call for at most env.timeout_s; a service
(env.url) gets the episodes' histories in requests of env.batch_size, env.concurrency in flight
(ds_ppo.envs.http_env). A call that raises, hangs or answers something that is not a step is an
`EnvFailed` naming the environment, the episode and the turn. A SIGTERM gives the calls in
flight up at once (`abandon.Abandoned`).
"""
from __future__ import annotations

import threading
import time
import traceback
from typing import Any, Callable

from ds_ppo import abandon
from ds_ppo.envs.base import Episode, EnvFailed, Step, as_step, load_python_env


def run_calls(calls: list[Callable[[], Any]], concurrency: int, timeout_s: float | None,
              name: str, what: Callable[[int], str], phase: str = "environment step"
              ) -> list[Any]:
    """Each of `calls` run in a daemon worker thread, at most `concurrency` at once, their
    results in order. A call still running `timeout_s` after it started, or one that raised,
    is an EnvFailed: `name` (the environment) and `what(i)` (which call) in its message; a
    SIGTERM is abandon.Abandoned(`phase`). Calls still running then are abandoned (daemon
    threads do not keep the process up)."""
    import torch

    grad = torch.is_grad_enabled()  # per thread, like the reward function's worker
    results: list[Any] = [None] * len(calls)
    errors: dict[int, BaseException] = {}
    started: dict[int, float] = {}
    done = threading.Semaphore(0)
    slots = threading.Semaphore(concurrency)

    def work(i: int) -> None:
        try:
            with torch.set_grad_enabled(grad):
                results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 (reported in the caller's thread)
            errors[i] = e
        finally:
            slots.release()
            done.release()

    threads = []
    for i in range(len(calls)):
        while not slots.acquire(timeout=abandon.SLICE_S):
            abandon.check(phase)
            _check(started, errors, timeout_s, name, what)
        started[i] = time.monotonic()
        t = threading.Thread(target=work, args=(i,), name=f"env {i}", daemon=True)
        t.start()
        threads.append(t)
    for _ in calls:
        while not done.acquire(timeout=abandon.SLICE_S):
            abandon.check(phase)
            _check(started, errors, timeout_s, name, what, threads)
        _check(started, errors, None, name, what)
    return results


def _check(started: dict[int, float], errors: dict[int, BaseException], timeout_s, name, what,
           threads=None) -> None:
    if errors:
        i = min(errors)
        e = errors[i]
        if isinstance(e, (KeyboardInterrupt, EnvFailed)):
            raise e
        frames = traceback.extract_tb(e.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if len(frames) > 1 else ""
        raise EnvFailed(f"{name} raised {type(e).__name__}: {e}{where} ({what(i)})") from e
    if timeout_s is None or threads is None:
        return
    now = time.monotonic()
    for i, t in enumerate(threads):
        if t.is_alive() and now - started[i] > timeout_s:
            raise EnvFailed(f"{name} did not return within env.timeout_s = {timeout_s:g} s "
                            f"({what(i)})", hung=True)


class EnvRunner:
    """One environment (from the `env` config section) over the episodes of a rollout."""

    def __init__(self, env_cfg, keys: list[str], deadline_s: float | None = None) -> None:
        self.cfg, self.keys = env_cfg, keys
        if env_cfg.url is not None:
            from ds_ppo.envs.http_env import EnvService

            self.kind, self.impl = "url", EnvService.from_config(env_cfg, deadline_s)
            self.name = f"env.url = {self.impl.shown!r}"
        else:
            self.kind, self.impl, self.name = load_python_env(env_cfg.function, keys)

    @property
    def retries(self) -> int | None:
        """env.url: the requests retried so far on this rank (None for a Python environment)."""
        return self.impl.retries if self.kind == "url" else None

    def start(self, prompts: list[str], extras: list[dict]) -> list[Episode]:
        """The rank's episodes, reset (env.class: one instance each, `reset(prompt, **keys)`)."""
        episodes = [Episode(p, {k: e[k] for k in self.keys}) for p, e in zip(prompts, extras)]
        if self.kind == "class":
            def reset(ep: Episode) -> None:
                ep.state = self.impl()
                ep.state.reset(ep.prompt, **ep.keys)
            run_calls([lambda ep=ep: reset(ep) for ep in episodes], self.cfg.concurrency,
                      self.cfg.timeout_s, self.name + " (reset)", lambda i: f"episode {i}",
                      "environment reset")
        return episodes

    def step(self, episodes: list[Episode], ids: list[int], actions: list[str],
             turn: int) -> list[Step]:
        """Episodes `ids` take their turn `turn` (0-based), `actions`: one Step each."""
        for i, a in zip(ids, actions):
            episodes[i].actions.append(a)
        what = (lambda k: f"episode {ids[k]}, turn {turn + 1}")
        if self.kind == "url":
            raw = self.impl.steps([episodes[i] for i in ids])
        elif self.kind == "class":
            raw = run_calls([lambda ep=episodes[i], a=a: ep.state.step(a)
                             for i, a in zip(ids, actions)],
                            self.cfg.concurrency, self.cfg.timeout_s, self.name, what)
        else:
            fn = self.impl
            raw = run_calls([lambda ep=episodes[i]: fn(ep.prompt, list(ep.actions), **ep.keys)
                             for i in ids], self.cfg.concurrency, self.cfg.timeout_s,
                            self.name, what)
        steps = []
        for k, r in enumerate(raw):
            try:
                steps.append(as_step(r, self.name))
            except EnvFailed as e:
                raise EnvFailed(f"{e} ({what(k)})") from None
        return steps
