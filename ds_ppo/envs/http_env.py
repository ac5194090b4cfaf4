"""An environment served over HTTP (`env.url`), on the reward service's machinery
(ds_ppo.rewards.service: batching, concurrency, retries with back-off, timeouts, the call's
deadline on several ranks, basic auth from the URL never shown).

Stateless contract, one POST per `env.batch_size` live episodes, JSON both ways:

    request   {"prompts": [str, ...], "actions": [[str, ...], ...], "responses": [str, ...],
               <key>: [...], ...}
              per episode: its prompt, every model turn so far (the newest last), the newest
              turn again as "responses", and one <key> list per data.reward_keys column
    response  200 {"steps": [{"observation": str | {"role": ..., "content": ...} | null,
                              "reward": float, "done": bool}, ...]}   one per episode, in order

The same request may come twice (a retry after a timeout): answer it from the request alone.
"""
from __future__ import annotations

import json
import time

from ds_ppo.envs.base import EnvFailed
from ds_ppo.rewards.service import RewardService


class EnvService(RewardService):
    """`steps(episodes)` -> one raw step (a dict) per episode, posted like reward requests."""

    KEY = "env.url"
    PHASE = "environment step"

    @classmethod
    def from_config(cls, env, deadline_s: float | None = None) -> "EnvService":
        return cls(env.url, env.batch_size, env.concurrency, env.timeout_s, env.retries,
                   deadline_s=deadline_s)

    def steps(self, episodes) -> list[dict]:
        size = self.batch_size
        payloads = []
        for s in range(0, len(episodes), size):
            part = episodes[s:s + size]
            payload = {"prompts": [e.prompt for e in part],
                       "actions": [list(e.actions) for e in part],
                       "responses": [e.actions[-1] for e in part]}
            for k in (part[0].keys if part else {}):
                payload[k] = [e.keys[k] for e in part]
            payloads.append(payload)
        end = None if self.deadline_s is None else time.monotonic() + self.deadline_s
        answers = self._post_all(payloads, end)
        self.retries += sum(a.retries for a in answers)
        return [s for a in answers for s in a.scores]

    def _parse(self, text: str, expected: int) -> list[dict]:
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        steps = data.get("steps") if isinstance(data, dict) else None
        if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
            raise self._error(f'answered without a JSON {{"steps": [{{...}}, ...]}} body: '
                              f"{self._quote(text)}", "return one step per episode")
        if len(steps) != expected:
            raise self._error(f"answered {len(steps)} steps for {expected} episodes: "
                              f"{self._quote(text)}", "return one step per episode, in order")
        return steps

    def _error(self, what: str, fix: str) -> EnvFailed:
        what = what.replace("reward.", "env.").replace("the reward service", "the environment")
        fix = fix.replace("reward.", "env.").replace("reward service", "environment service")
        return EnvFailed(f"{self.KEY} = {self.shown}: the environment service {what}; {fix}")
