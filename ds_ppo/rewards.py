"""Reward functions given as `module:function`, and the tiny default's task.

A reward function takes the batch's prompts and responses as text and returns one float per
response: `f(prompts: list[str], responses: list[str]) -> list[float]`. With
`data.reward_keys: [answer]` it also gets each response's dataset value of that column:
`f(prompts, responses, answer=[...])` (a reference answer for a verifiable reward).
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from typing import Callable, Sequence

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


def load_reward_function(spec: str, keys: Sequence[str] = ()
                         ) -> Callable[..., list[float]]:
    """Import `module:function`; a clear ConfigError when it cannot be found or does not take
    the keyword arguments `keys` (data.reward_keys). The module is looked up in the directory
    the job started in first, for every entry point (`ds-ppo`, `python -m ds_ppo`, each rank of
    the `deepspeed` launcher, which starts every node's ranks in that same path)."""
    module_name, _, attr = spec.partition(":")
    _put_cwd_on_path()
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"reward.function = {spec!r}: cannot import module {module_name!r} "
                          f"({e}); put {module_name.replace('.', '/')}.py in the directory the job "
                          f"starts in ({os.getcwd()}) or on PYTHONPATH") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"reward.function = {spec!r}: module {module_name!r} has no callable "
                          f"{attr!r}")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to check (some builtins): call and see
        return fn
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        missing = [k for k in keys if k not in named]
        if missing:
            raise ConfigError(f"reward.function = {spec!r} takes no keyword argument "
                              f"{', '.join(missing)} (data.reward_keys); define it as "
                              f"def {attr}(prompts, responses, {', '.join(keys)}): ...")
    return fn


def _put_cwd_on_path() -> None:
    """What `python -m` does (the console script `ds-ppo` does not): the working directory
    first on the import path, so `my_rewards.py` next to the job imports as `my_rewards`."""
    cwd = os.getcwd()
    if not any(os.path.abspath(p or ".") == cwd for p in sys.path):
        sys.path.insert(0, cwd)
