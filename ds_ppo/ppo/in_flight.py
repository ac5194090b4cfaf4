"""The range checks of a checkpoint's in-flight rollouts (`RolloutSchedule.state_dict`, read back
from in_flight/rank_N.pt) before a resumed run uses them. The manifest (checkpoint.verify) finds
a damaged file by its CRC; with checkpoint.verify = false nothing else would, and a flipped byte
in a version, a length or a count trains on silently (a token 1022 updates *newer* than the
weights that train it). Every number that says where a rollout belongs or how long it is must be
in the range the run that saved it could write: versions 0 .. the checkpoint's iteration, rollouts
for the next iterations only, shapes that agree with one another, token ids in the vocabulary.
"""
from __future__ import annotations

import math

import torch

from ds_ppo.algo.choices import max_lag
from ds_ppo.containers import Rollout
from ds_ppo.ppo.partial import Partial
from ds_ppo.ppo.rollout_worker import Buffered

_KEYS = ("schedule", "max_staleness", "completed", "buffer", "generator")


def in_flight_problem(saved, completed: int, prompts: int, vocab: int | None) -> str | None:
    """What in a checkpoint's in-flight state `saved` (one rank's) is out of range, as the words
    after "holds", or None when every number is in range.

    Args:
        saved: the unpickled in_flight/rank_N.pt (None: nothing in flight, always fine).
        completed: the checkpoint's iteration (iterations completed).
        prompts: the prompts of the run's data (a partial rollout's prompt indices).
        vocab: the policy's vocabulary size (token ids), None: not checked.
    """
    if saved is None:
        return None
    if not isinstance(saved, dict) or any(k not in saved for k in _KEYS):
        return f"no rollout schedule state (a {type(saved).__name__}, not a dict with {_KEYS})"
    schedule, n = saved["schedule"], saved["max_staleness"]
    if schedule not in ("one_step_off", "async"):
        return f"ppo.schedule = {schedule!r} (one_step_off or async save rollouts in flight)"
    if not _int_in(n, 0, 64):
        return f"ppo.max_staleness = {n!r} (0 to 64)"
    if saved["completed"] != completed:
        return (f"rollouts saved after iteration {saved['completed']!r}, but the checkpoint is "
                f"of iteration {completed}")
    state = saved["generator"]
    if not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1):
        return "a random stream state that is not a 1-D uint8 tensor"
    buffered = saved["buffer"]
    buffered = [] if buffered is None else [buffered] if isinstance(buffered, Buffered) \
        else buffered
    ahead = max(1, max_lag(schedule, n))  # the next iterations a rollout may be saved for
    if not isinstance(buffered, list) or len(buffered) > ahead:
        return f"{_count(buffered)} buffered rollouts (at most {ahead} at max_staleness {n})"
    for b in buffered:
        problem = _buffered_problem(b, completed, ahead, vocab)
        if problem is not None:
            return problem
    partial = saved.get("partial") or []
    if not isinstance(partial, list) or len(partial) > ahead:
        return f"{_count(partial)} rollouts decoded in part (at most {ahead})"
    for p in partial:
        problem = _partial_problem(p, completed, ahead, n, prompts, vocab)
        if problem is not None:
            return problem
    return None


def _entry_problem(x, cls: type, label: str, completed: int, ahead: int) -> str | None:
    """An in-flight entry (`label`: how messages name it) of the wrong class, or for an
    iteration outside the `ahead` after the checkpoint's `completed` one."""
    if not isinstance(x, cls):
        return f"{label} that is a {type(x).__name__}"
    if not _int_in(x.iteration, completed + 1, completed + ahead):
        return (f"{label} for iteration {x.iteration!r} (after iteration {completed}: "
                f"{completed + 1} to {completed + ahead})")
    return None


def _buffered_problem(b, completed: int, ahead: int, vocab: int | None) -> str | None:
    problem = _entry_problem(b, Buffered, "a buffered rollout", completed, ahead)
    if problem is not None:
        return problem
    what = f"the buffered rollout of iteration {b.iteration}"
    if not _int_in(b.version, 0, completed):
        return f"{what} from policy version {b.version!r} (0 to {completed})"
    if b.rollout is None:
        return None if b.env_error is not None else f"{what} with no rollout and no env error"
    problem = _rollout_problem(b.rollout, completed, vocab)
    if problem is None and b.called is not None and b.called.error is None:
        rows = len(b.rollout.prompts)
        if len(b.called.scores) != rows or not all(map(math.isfinite, b.called.scores)):
            problem = f"{len(b.called.scores)} reward scores (one finite score per row: {rows})"
    return None if problem is None else f"{what} with {problem}"


def _rollout_problem(r: Rollout, completed: int, vocab: int | None) -> str | None:
    """Shapes that agree, lengths within them, token ids in the vocabulary, and each counted
    token's version within 0 .. `completed`."""
    if not isinstance(r, Rollout):
        return f"a {type(r).__name__} for its rollout"
    B = len(r.prompts)
    P, T = _width(r.prompt_ids), _width(r.response_ids)
    shapes = {"prompt_ids": (r.prompt_ids, (B, P)), "prompt_mask": (r.prompt_mask, (B, P)),
              "response_ids": (r.response_ids, (B, T)), "mask": (r.mask, (B, T)),
              "ended": (r.ended, (B,))}
    for name in ("rollout_logprobs", "context_mask", "turn_rewards", "turn_starts",
                 "token_versions"):
        if getattr(r, name) is not None:
            shapes[name] = (getattr(r, name), (B, T))
    for name, (x, shape) in shapes.items():
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
            return f"{name} of shape {_shape(x)} (rows x tokens: {shape})"
    for name in ("prompt_mask", "mask", "ended", "context_mask", "turn_starts"):
        if getattr(r, name) is not None and getattr(r, name).dtype != torch.bool:
            return f"{name} of dtype {getattr(r, name).dtype} (bool)"
    for name in ("responses", "prompt_lens", "response_lens", "extras"):
        if len(getattr(r, name)) != B:
            return f"{len(getattr(r, name))} {name} for {B} rows"
    for name, lens, most in (("prompt_lens", r.prompt_lens, P), ("response_lens",
                                                                  r.response_lens, T)):
        if not all(_int_in(v, 0, most) for v in lens):
            return f"{name} {list(lens)} (0 to {most})"
    for name in ("prompt_ids", "response_ids"):
        problem = _ids_problem(name, getattr(r, name), vocab)
        if problem is not None:
            return problem
    if r.rollout_logprobs is not None:
        lp = r.rollout_logprobs[r.mask]
        if lp.numel() and not (bool(torch.isfinite(lp).all()) and float(lp.max()) <= 1e-3):
            return "sampler log-probs that are not finite and <= 0"
    if r.token_versions is not None:
        v = r.token_versions[r.mask]
        if v.numel() and (int(v.min()) < 0 or int(v.max()) > completed):
            return (f"token versions {int(v.min())} to {int(v.max())} (0 to the checkpoint's "
                    f"iteration {completed})")
    return None


def _partial_problem(p, completed: int, ahead: int, n: int, prompts: int,
                     vocab: int | None) -> str | None:
    problem = _entry_problem(p, Partial, "a rollout decoded in part", completed, ahead)
    if problem is not None:
        return problem
    what = f"the rollout of iteration {p.iteration} decoded in part"
    B, T = len(p.indices), _width(p.response_ids)
    for name, x, shape in (("response_ids", p.response_ids, (B, T)),
                           ("logprobs", p.logprobs, (B, T)), ("versions", p.versions, (B, T)),
                           ("live", p.live, (B,))):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
            return f"{what} with {name} of shape {_shape(x)} ({shape})"
    if p.live.dtype != torch.bool:
        return f"{what} with live of dtype {p.live.dtype} (bool)"
    if not all(_int_in(i, 0, prompts - 1) for i in p.indices):
        return f"{what} with prompt indices outside 0 to {prompts - 1}"
    if not (_int_in(p.segments, 0, n) and _int_in(p.tokens, 0, T)):
        return f"{what} after {p.segments!r} segments and {p.tokens!r} tokens (0 to {n}, {T})"
    if not _int_in(p.first_version, -1, completed):
        return f"{what} from policy version {p.first_version!r} (0 to {completed})"
    if p.versions.numel() and (int(p.versions.min()) < -1 or int(p.versions.max()) > completed):
        return (f"{what} with token versions {int(p.versions.min())} to "
                f"{int(p.versions.max())} (-1 for none, 0 to {completed})")
    problem = _ids_problem("response_ids", p.response_ids, vocab)
    return None if problem is None else f"{what} with {problem}"


def _ids_problem(name: str, ids: torch.Tensor, vocab: int | None) -> str | None:
    if ids.numel() and (int(ids.min()) < 0 or vocab is not None and int(ids.max()) >= vocab):
        return (f"{name} {int(ids.min())} to {int(ids.max())} (token ids: 0 to "
                f"{'the vocabulary' if vocab is None else vocab - 1})")
    return None


def _int_in(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _width(x) -> int:
    return x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 2 else -1


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def _count(items) -> str:
    return str(len(items)) if isinstance(items, list) else f"a {type(items).__name__} of"
