"""A built-in tool environment whose answer cannot be known, only copied (preset `lookup`).

Task (`data.path: builtin:lookup`, ds_ppo/data/lookup.jsonl): "look up the code of the red box
." with the row's `code` column one of CODES: each prompt appears once with every code, so
nothing in the prompt tells the answer. A model turn that
contains `=` is a lookup (the preset's `env.stop: ["="]` ends the turn there): the observation
is the code (" 7"). Any other turn is the answer: its first number is compared with the code.

Rewards: CALL_REWARD for the first lookup of an episode; 1 on the answer turn (which ends the
episode) if its first number is the code. A policy that never copies the observation is right
1 / len(CODES) of the time at best (always naming one code); copying is right
every time. Step.info reports `lookup` (the episode looked the code up) and `correct` on the
answer turn: metrics env/lookup and env/correct, and env/correct_<code> over the episodes of each
code (which codes a policy copies).

This is where a group estimator collapses: once the lookup is learned, a policy that always
names one code scores the same in most groups (zero_std_frac near 1, no gradient), and its
entropy falls until copying is never sampled (docs/RESULTS.md).
"""
from __future__ import annotations

import random
import re

from ds_ppo.envs.base import Step

CALL_REWARD = 0.1
CODES = ("3", "5", "7", "9")
_NUMBER = re.compile(r"-?\d+")
COLOURS = ("red", "blue", "green", "black", "white", "brown", "pink", "gold")
THINGS = ("box", "door", "car", "book", "bag", "cup", "key", "bike")


class Lookup:
    """One episode of the lookup task (env.function: ds_ppo.envs.lookup:Lookup)."""

    def reset(self, prompt: str, code: str) -> None:
        self.code, self.calls = str(code).strip(), 0

    def step(self, action: str) -> Step:
        if "=" in action and self.calls == 0:  # a lookup
            self.calls += 1
            return Step(f" {self.code}", reward=CALL_REWARD)
        numbers = _NUMBER.findall(action)
        correct = bool(numbers) and numbers[0] == self.code
        return Step(None, reward=float(correct), done=True,
                    info={"lookup": float(self.calls > 0), "correct": float(correct),
                          f"correct_{self.code}": float(correct)})


def tasks(seed: int = 0) -> list[dict[str, str]]:
    """Every colour x thing prompt once per code, in a random order (the packaged data: 256
    rows): no prompt, and no order of the rows, favours a code."""
    rows = [{"prompt": f"look up the code of the {c} {t} .", "code": code}
            for c in COLOURS for t in THINGS for code in CODES]
    random.Random(seed).shuffle(rows)
    return rows
