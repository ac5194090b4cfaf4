"""Streaming rewards (reward.stream): a rollout's reward.function / reward.url calls start as the
decoding loop finishes its responses, while the other rows still decode and while scoring's
forwards run, instead of one call after generation.

The loop hands in the rows it finds ended at each of its checks (`engine/generation/loop.py`'s
`on_done`); a partial rollout's (ppo.partial_rollouts) in the segment they end, so one stream
may run beside several iterations. Up to reward.concurrency calls run at once on this rank;
rows handed in while all of them are busy go together into the next call. Scoring takes the
outcome (`result`) after its forwards, on the training thread, then agrees on it across ranks
as for one call (`scoring._function_scores`). A reward model's forwards are collective: it
never streams.

The scores are those of one call on the whole rollout, in row order, for any function that
scores each response on its own: `result` checks every row's texts against the rollout's and
calls the reward again for any row that was not handed in or differs (e.g. a chunk decoded
again after running out of memory). A failing call fails the rollout's reward as one failing
call does (the error of the failed call with the lowest row).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

from ds_ppo import watchdog
from ds_ppo.algo.masks import counted_tokens
from ds_ppo.containers import Rollout
from ds_ppo.engine import dist
from ds_ppo.errors import UserError
from ds_ppo.ppo.scoring import RewardCall, RewardCallSettings, call_reward_rows
from ds_ppo.rewards.encode import decode_responses
from ds_ppo.thread_pools import shared_pool


def _pool(size: int) -> ThreadPoolExecutor:
    """The process's reward-call threads."""
    return shared_pool("reward-stream", size)


def reward_stream(s: RewardCallSettings, fn) -> RewardStream | None:
    """A RewardStream for one rollout, or None where the reward is called after generation:
    reward.stream off, no reward function or service (`fn`: `Engines.reward_fn`), a
    reward.function with reward.timeout_s null (it runs on the calling thread), or sequence
    parallelism (a group's first rank calls for all)."""
    if fn is None or not s.stream or (s.unlimited and not s.service) or dist.sp_size() > 1:
        return None
    return RewardStream(fn, s, _pool(s.concurrency))


class RewardStream:
    """The reward calls of one rollout on this rank, made as its responses finish decoding."""

    def __init__(self, fn, s: RewardCallSettings, pool: ThreadPoolExecutor) -> None:
        self.fn, self.settings, self.pool = fn, s, pool
        self.limit = s.concurrency
        self.cond = threading.Condition()
        # (row, prompt, response, extra, chat messages or None)
        self.pending: list[tuple[int, str, str, dict, list | None]] = []
        self.running = 0  # calls (drain loops) in flight
        self.scored: dict[int, tuple[str, str, float]] = {}  # row -> (prompt, response, score)
        self.errors: list[tuple[int, UserError]] = []  # (the call's lowest row, its error)
        self.crash: BaseException | None = None  # a bug in a drain loop, raised by `result`
        self.start: float | None = None  # the first call's start (perf_counter)
        self.retries0 = getattr(fn, "retries", None)  # a RewardService counts its retries

    # ------------------------------------------------------------------ the decoding side
    def watch(self, tokenizer, prompt_ids: list[list[int]], extras: list[dict],
              eos_ids: list[int], messages: list | None = None):
        """The `on_done(rows, tokens)` of a decoding call over these rows (unpadded prompt ids,
        dataset rows and chat messages (None: plain-text prompts) by row): each response's
        counted tokens (up to and including its first EOS) decoded with its prompt, as the
        rollout decodes them, then handed in."""
        eos = set(eos_ids)

        def on_done(rows: list[int], tokens: list[list[int]]) -> None:
            counted = [counted_tokens(t, eos) for t in tokens]
            prompts, responses = decode_responses(tokenizer, [prompt_ids[i] for i in rows],
                                                  counted)
            self.add(rows, prompts, responses, [extras[i] for i in rows],
                     [messages[i] for i in rows] if messages is not None else None)
        return on_done

    def add(self, rows: list[int], prompts: list[str], responses: list[str],
            extras: list[dict], messages: list | None = None) -> None:
        """Rows whose responses are final: into the next call (a new one when fewer than
        reward.concurrency run)."""
        with self.cond:
            self.pending.extend(zip(rows, prompts, responses, extras,
                                    messages if messages is not None else [None] * len(rows)))
            if self.running >= self.limit:
                return  # a running loop takes them when its call returns
            self.running += 1
            if self.start is None:
                self.start = time.perf_counter()
        self.pool.submit(self._drain)

    def _drain(self) -> None:
        """Calls on the rows pending, all of them per call, until none are (or one failed)."""
        try:
            while True:
                with self.cond:
                    if not self.pending or self.errors:
                        return
                    batch, self.pending = self.pending, []
                rows, prompts, responses, extras, messages = (list(x) for x in zip(*batch))
                call = call_reward_rows(prompts, responses, extras, self.fn, self.settings,
                                        in_worker=True, messages=messages)
                with self.cond:
                    if call.error is not None:
                        self.errors.append((min(rows), call.error))
                    else:
                        self.scored.update((i, (p, r, s)) for i, p, r, s in
                                           zip(rows, prompts, responses, call.scores))
        except BaseException as e:  # noqa: BLE001 (raised on the scoring thread)
            with self.cond:
                self.crash = e
        finally:
            with self.cond:
                self.running -= 1
                self.cond.notify_all()

    # ------------------------------------------------------------------ the scoring side
    def result(self, rollout: Rollout, in_worker: bool = False,
               since: float | None = None) -> RewardCall:
        """The reward call's outcome on the whole `rollout` (this rank's rows), once the calls
        in flight have returned; rows not handed in, or handed in with other texts, are called
        now. `in_worker`: on ppo.schedule's background worker (no watchdog phase). Its seconds
        count from the first call's start, or from `since` (perf_counter) when that is later (a
        partial rollout's calls may have started beside an earlier iteration)."""
        exempt = {"limit_s": None} if self.settings.unlimited else {}
        with nullcontext() if in_worker else watchdog.phase("reward call", **exempt):
            with self.cond:
                while self.running:
                    self.cond.wait()
            t_first = self.start if self.start is not None else time.perf_counter()
            t_first = t_first if since is None else max(t_first, since)
            if self.crash is not None:
                raise self.crash
            error = min(self.errors, key=lambda e: e[0])[1] if self.errors else None
            missing = [i for i in range(len(rollout)) if error is None and self.scored.get(
                i, (None, None))[:2] != (rollout.prompts[i], rollout.responses[i])]
            if missing:
                call = call_reward_rows([rollout.prompts[i] for i in missing],
                                        [rollout.responses[i] for i in missing],
                                        [rollout.extras[i] for i in missing], self.fn,
                                        self.settings, in_worker=True,
                                        messages=None if rollout.messages is None else
                                        [rollout.messages[i] for i in missing])
                error = call.error
                self.scored.update((i, (rollout.prompts[i], rollout.responses[i], s))
                                   for i, s in zip(missing, call.scores))
        retries = None if self.retries0 is None else self.fn.retries - self.retries0
        seconds = time.perf_counter() - t_first
        if error is not None:
            return RewardCall([], error, seconds, retries)
        return RewardCall([self.scored[i][2] for i in range(len(rollout))], None, seconds,
                          retries)
