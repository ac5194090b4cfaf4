"""Reward functions given as `module:function`: load, check the signature, call, check the scores.

A reward function takes the batch's prompts and responses as text and returns one float per
response: `f(prompts: list[str], responses: list[str]) -> list[float]`. With
`data.reward_keys: [answer]` it also gets each response's dataset value of that column:
`f(prompts, responses, answer=[...])` (a reference answer for a verifiable reward). A function
that names a parameter `messages` also gets each prompt's chat as the dataset gave it (a list of
{role, content}; None for a plain-text prompt): `f(prompts, responses, messages=[...])`, as TRL
hands a conversational dataset's prompts to its reward functions. The prompt texts are the
rendered prompts with the special tokens removed; the responses never hold template tokens.
"""
from __future__ import annotations

import importlib
import inspect
import numbers
import os
import sys
import threading
import traceback
from typing import Any, Callable, Sequence

from ds_ppo import abandon
from ds_ppo.errors import ConfigError, RewardFunctionError, RewardTimeout, UserError


def import_spec(spec: str, key: str) -> Callable:
    """The callable `module:name` that config key `key` names (reward.function, env.function),
    looked up in the directory the job started in first; a ConfigError naming the key when the
    module does not import or has no such callable."""
    module_name, _, attr = spec.partition(":")
    _put_cwd_on_path()
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key} = {spec!r}: cannot import module {module_name!r} ({e}); put "
                          f"{module_name.replace('.', '/')}.py in the directory the job starts "
                          f"in ({os.getcwd()}) or on PYTHONPATH") from None
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise ConfigError(f"{key} = {spec!r}: module {module_name!r} has no callable {attr!r}")
    return obj


def load_reward_function(spec: str, keys: Sequence[str] = ()
                         ) -> Callable[..., list[float]]:
    """Import `module:function`; a clear ConfigError when it cannot be found or does not take
    the keyword arguments `keys` (data.reward_keys). The module is looked up in the directory
    the job started in first, for every entry point (`ds-ppo`, `python -m ds_ppo`, each rank of
    the `deepspeed` launcher, which starts every node's ranks in that same path)."""
    fn = import_spec(spec, "reward.function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check (some builtins): call and see
        return fn
    if takes_messages(fn) and MESSAGES not in keys:
        keys = (*keys, MESSAGES)
    problem = signature_problem(signature, keys, spec.partition(":")[2])
    if problem:
        raise ConfigError(f"reward.function = {spec!r} {problem}")
    return fn


MESSAGES = "messages"  # the keyword that hands a reward function each prompt's chat


def takes_messages(fn: Callable) -> bool:
    """Whether `fn` names a `messages` parameter (a **kwargs alone does not count: a function
    written before it existed gets no new argument)."""
    try:
        param = inspect.signature(fn).parameters.get(MESSAGES)
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


def signature_problem(signature: inspect.Signature, keys: Sequence[str], name: str = "f"
                      ) -> str | None:
    """Why a function `name` with `signature` cannot be called as f(prompts, responses,
    **columns) with one column per name in `keys` (data.reward_keys), or None when it can."""
    try:
        signature.bind([], [], **{k: [] for k in keys})
        return None
    except TypeError:
        pass
    params = signature.parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        return ("must take the prompts and the responses as its first two positional "
                f"arguments (it takes {len(positional)})")
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        missing = [k for k in keys if k not in named]
        if missing:
            takes = [p.name for p in params if p.name in named][2:]
            return (f"takes no keyword argument {', '.join(missing)} (data.reward_keys = "
                    f"{list(keys)}; after prompts and responses it takes "
                    f"{', '.join(takes) or 'nothing'}); define it as "
                    f"def {name}({', '.join(['prompts', 'responses', *keys])}): ...")
    rest = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.default is p.empty][2 if len(positional) >= 2 else len(positional):]
    required = [p.name for p in rest if p.name not in keys]
    return (f"requires argument {', '.join(required)}, which data.reward_keys = {list(keys)} "
            f"does not supply: add {'it' if len(required) == 1 else 'them'} to "
            "data.reward_keys (dataset columns passed by name), or give "
            f"{'it' if len(required) == 1 else 'them'} a default")


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _source(spec: str) -> str:
    """How errors name the reward: `reward.function = 'mod:fn'`, or for a service (its redacted
    URL), `reward.url = 'http://...'`."""
    key = "reward.url" if spec.startswith(("http://", "https://")) else "reward.function"
    return f"{key} = {spec!r}"


def check_scores(raw: Any, spec: str, n: int) -> list[float]:
    """`raw`, what reward.function `spec` returned for n responses, as n finite floats; else a
    RewardFunctionError naming the function and what it returned. Strict: a string such as
    "0.5", None, or a nested list is an error, never converted. Accepted: a list or tuple (or a
    1-D tensor / array) of ints, floats or bools (numpy scalars and 0-dim tensors included)."""
    fix = f"it must return a list of {n} floats, one per response"
    if hasattr(raw, "tolist") and getattr(raw, "ndim", 1) == 1:  # a 1-D tensor or array
        raw = raw.tolist()
    if not isinstance(raw, (list, tuple)):
        raise RewardFunctionError(f"{_source(spec)} returned {type(raw).__name__} "
                                  f"{_short(raw)}; {fix}")
    if len(raw) != n:
        raise RewardFunctionError(f"{_source(spec)} returned {len(raw)} scores for "
                                  f"{n} responses; {fix}")
    scores, bad = [], []
    for i, v in enumerate(raw):
        if hasattr(v, "item") and getattr(v, "ndim", None) == 0:  # numpy scalar, 0-dim tensor
            v = v.item()
        if not isinstance(v, numbers.Real):
            bad.append(f"score {i} is {_short(v)} ({type(v).__name__})")
            continue
        v = float(v)
        if v != v or v in (float("inf"), float("-inf")):
            bad.append(f"score {i} is {v} (non-finite)")
        scores.append(v)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise RewardFunctionError(f"{_source(spec)} returned {'; '.join(bad[:3])}"
                                  f"{more}; {fix} (finite numbers, not strings or None)")
    return scores


def call_reward_function(fn: Callable[..., Any], spec: str, prompts: list[str],
                         responses: list[str], columns: dict[str, list], timeout_s: float | None
                         ) -> list[float]:
    """fn(prompts, responses, **columns) checked by `check_scores`.

    With `timeout_s`, the call runs in a daemon worker thread (with the caller's CUDA device and
    grad mode) and this thread waits at most that long: a call still running raises
    RewardTimeout (the hung thread is left behind; being a daemon, it does not keep the process
    alive). A SIGTERM (`abandon.request`) ends the wait too: `abandon.Abandoned`, at once. A
    function that raises becomes a RewardFunctionError naming it, the exception and
    the line it came from."""
    import torch

    outcome: dict[str, Any] = {}
    # torch's grad mode and current CUDA device are per thread: a new thread would run with
    # gradients on and on cuda:0 (every rank's GPU work on one device); the worker gets the
    # caller's
    grad = torch.is_grad_enabled()
    device = (torch.cuda.current_device()
              if torch.cuda.is_available() and torch.cuda.is_initialized() else None)

    def run() -> None:
        try:
            if device is not None and torch.cuda.current_device() != device:
                torch.cuda.set_device(device)
            with torch.set_grad_enabled(grad):
                outcome["value"] = fn(prompts, responses, **columns)
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            outcome["error"] = e

    if timeout_s is None:
        run()
    else:
        worker = threading.Thread(target=run, name=f"reward.function {spec}", daemon=True)
        worker.start()
        abandon.join(worker, timeout_s, "reward call")
        if worker.is_alive():
            raise RewardTimeout(f"{_source(spec)} did not return within "
                                f"reward.timeout_s = {timeout_s:g} s (on {len(responses)} "
                                "responses)")
    if "error" in outcome:
        e = outcome["error"]
        # a reward service's own stop, or its requests given up on SIGTERM
        if isinstance(e, (KeyboardInterrupt, UserError, abandon.Abandoned)):
            raise e
        frames = traceback.extract_tb(e.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if len(frames) > 1 else ""
        raise RewardFunctionError(f"{_source(spec)} raised {type(e).__name__}: {e}"
                                  f"{where}") from e
    return check_scores(outcome["value"], spec, len(responses))


def _put_cwd_on_path() -> None:
    """What `python -m` does (the console script `ds-ppo` does not): the working directory
    first on the import path, so `my_rewards.py` next to the job imports as `my_rewards`."""
    cwd = os.getcwd()
    if not any(os.path.abspath(p or ".") == cwd for p in sys.path):
        sys.path.insert(0, cwd)
