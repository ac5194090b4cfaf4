"""The environment interface of a multi-turn rollout, and how one is loaded from the config.

An episode starts from a dataset row: `reset(prompt, **keys)` (keys: the row's data.reward_keys
columns). Then, after each model turn, `step(action)` (the turn's text) returns a `Step`: the
observation to append (text, or a chat message such as {"role": "tool", "content": ...}; None
or "" for nothing), the turn's reward and whether the episode is done.

Given as one of:
- env.function = `module:Name` naming a class: one instance per episode, `Name().reset(...)`,
  then `.step(action)` per turn;
- env.function = `module:function`: a stateless step `function(prompt, actions, **keys)` with
  every model turn so far (`actions[-1]` the newest); no reset;
- env.url: an HTTP service (ds_ppo.envs.http_env), stateless like a step function.
"""
from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ds_ppo.errors import ConfigError, RewardTimeout


class EnvFailed(RewardTimeout):
    """The environment raised, hung past env.timeout_s or answered something that is not a
    step. The run stops like after a hung reward function: a checkpoint of the last completed
    iteration (the failing one's rollout had not trained anything yet), so the same command
    resumes; the message names the environment, the episode and the turn. `hung`: the call
    ran past env.timeout_s (only then does the advice name it)."""

    def __init__(self, message: str, hung: bool = False) -> None:
        super().__init__(message)
        self.fix = ("Find what makes the environment hang, or raise env.timeout_s" if hung else
                    "Fix the environment")


@dataclass(frozen=True)
class Step:
    """What the environment answers to one model turn."""

    observation: str | dict | None = None  # appended before the next turn; None/"": nothing
    reward: float = 0.0  # the turn's reward, given at its last model token
    done: bool = False  # the episode ends (no more turns)
    info: dict = field(default_factory=dict)  # numbers to report: metric env/<key>, the mean
    # over the steps that give the key (e.g. {"correct": 1.0} on an answer turn)

    @property
    def text(self) -> str:
        """The observation's text (a message's content)."""
        o = self.observation
        return "" if o is None else str(o.get("content", "")) if isinstance(o, dict) else o


def as_step(raw: Any, name: str) -> Step:
    """`raw`, what environment `name` returned for a turn, as a Step: a Step, a dict with keys
    observation/reward/done/info, or a tuple (observation, reward, done[, info]). Anything else, a
    non-finite reward, or a message without "role"/"content" is an EnvFailed naming it."""
    if isinstance(raw, Step):
        step = raw
    elif isinstance(raw, dict) and set(raw) <= {"observation", "reward", "done", "info"}:
        step = Step(**raw)
    elif isinstance(raw, (tuple, list)) and len(raw) in (3, 4):
        step = Step(*raw)
    else:
        raise EnvFailed(f"{name} returned {_short(raw)} for a step; return a Step, a dict "
                        "{observation, reward, done[, info]} or a tuple (observation, reward, "
                        "done[, info])")
    r = step.reward
    if isinstance(r, bool) or not isinstance(r, numbers.Real) or r != r or abs(r) == float("inf"):
        raise EnvFailed(f"{name} returned the reward {_short(r)}; it must be a finite number")
    o = step.observation
    if not (o is None or isinstance(o, str) or
            (isinstance(o, dict) and isinstance(o.get("role"), str) and "content" in o)):
        raise EnvFailed(f"{name} returned the observation {_short(o)}; it must be text, None or "
                        'a chat message {"role": ..., "content": ...}')
    info = step.info
    if not isinstance(info, dict) or not all(
            isinstance(k, str) and isinstance(v, numbers.Real) and not isinstance(v, bool)
            for k, v in info.items()):
        raise EnvFailed(f"{name} returned the info {_short(info)}; it must map names to numbers")
    return Step(o, float(r), bool(step.done), {k: float(v) for k, v in info.items()})


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class Episode:
    """One episode's history on the host (what a stateless environment is sent)."""

    prompt: str
    keys: dict  # the row's data.reward_keys values
    actions: list[str] = field(default_factory=list)  # the model's turns so far
    state: Any = None  # env.class: the episode's instance


def _import(spec: str, key: str):
    from ds_ppo.rewards.call import import_spec  # the same lookup as reward.function

    return import_spec(spec, key)


def _takes(fn: Callable, positional: int, keys: Sequence[str], key: str, spec: str,
           example: str) -> None:
    """A ConfigError unless fn takes `positional` positional arguments and the keywords."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*range(positional), **{k: None for k in keys})
    except TypeError as e:
        raise ConfigError(f"{key} = {spec!r}: {e}; define it as {example}") from None


def load_python_env(spec: str, keys: Sequence[str]) -> tuple[str, Any, str]:
    """(kind, object, name) for env.function = `spec`, checked: a class ("class") whose reset
    and step take what they are given, or a step function ("function") taking
    (prompt, actions, **keys). A ConfigError names the key and the fix (`ds-ppo train
    --dry-run` runs this)."""
    key = "env.function"
    obj = _import(spec, key)
    kw = "".join(f", {k}" for k in keys)
    if isinstance(obj, type):
        for method, example in (("reset", f"def reset(self, prompt{kw})"),
                                ("step", "def step(self, action) -> Step")):
            fn = getattr(obj, method, None)
            if not callable(fn):
                raise ConfigError(f"{key} = {spec!r}: class {obj.__name__} has no method "
                                  f"{method}(); define {example}")
            _takes(fn, 2, keys if method == "reset" else (), key, spec, example)
        return "class", obj, f"{key} = {spec!r}"
    _takes(obj, 2, keys, key, spec,
           f"def {spec.partition(':')[2]}(prompt, actions{kw}) -> Step")
    return "function", obj, f"{key} = {spec!r}"
