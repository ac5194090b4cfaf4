"""Reward functions given as `module:function`, and the tiny default's task.

A reward function takes the batch's prompts and responses as text and returns one float per
response: `f(prompts: list[str], responses: list[str]) -> list[float]`.
"""
from __future__ import annotations

import importlib
import re
from typing import Callable

from ds_ppo.errors import ConfigError

_WORD = re.compile(r"[a-z']+")


def positive_words(prompts: list[str], responses: list[str]) -> list[float]:
    """The tiny default's task: the share of a response's words that are positive words
    (good, happy, love, ...; ds_ppo.data.words.POSITIVE_WORDS). A random policy says few of them;
    PPO teaches it to speak positively. Range [0, 1]; an empty response scores 0."""
    from ds_ppo.data.words import POSITIVE_WORDS

    positive = set(POSITIVE_WORDS)
    scores = []
    for text in responses:
        words = _WORD.findall(text.lower())
        scores.append(sum(w in positive for w in words) / len(words) if words else 0.0)
    return scores


def load_reward_function(spec: str) -> Callable[[list[str], list[str]], list[float]]:
    """Import `module:function`; a clear ConfigError when it cannot be found."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"reward.function = {spec!r}: cannot import module {module_name!r} "
                          f"({e}); is it on PYTHONPATH?") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"reward.function = {spec!r}: module {module_name!r} has no callable "
                          f"{attr!r}")
    return fn
