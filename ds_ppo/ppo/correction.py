"""Step 2b of an iteration: the sampler's log-probs (the rollout's) against the trainer's (the
scored old log-probs) for the same tokens. Measured every iteration (metrics rollout/*) and,
with ppo.rollout_correction, turned into importance weights of the policy loss
(`ds_ppo.algo.importance_sampling`, Yao et al. 2025)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ds_ppo.algo import rollout_is_weights, rollout_mismatch
from ds_ppo.algo.choices import RolloutCorrection
from ds_ppo.config import Config
from ds_ppo.containers import Experience, Rollout
from ds_ppo.engine import dist
from ds_ppo.errors import ConfigError, NotOnPolicy
from ds_ppo.metrics import Accumulator


def sampler_logprobs(rollout: Rollout, key: str, value, off: str) -> torch.Tensor:
    """The rollout's sampler log-probs, which `key` (ppo.<key> unless dotted) = `value` reads;
    a ConfigError naming <key>=`off` when HF generate sampled the rollout
    (generation.loop=auto fell back to it for this policy: the config checks could not know)."""
    if rollout.rollout_logprobs is None:
        key = key if "." in key else f"ppo.{key}"
        raise ConfigError(f"{key} = {value!r} needs the rollout log-probs of our decoding "
                          "loop, but this policy's rollouts came from HF generate "
                          f"(generation.loop resolved to hf): set {key}={off}, or "
                          "generation.loop=own")
    return rollout.rollout_logprobs


@dataclass(frozen=True)
class CorrectionSettings:
    """Everything step 2b reads from the config."""

    mode: RolloutCorrection  # ppo.rollout_correction
    cap: float  # ppo.rollout_is_cap
    require_exact: bool  # generation.require_exact
    old_from_rollout: bool  # ppo.old_logprobs = rollout: the sampler's are the old log-probs
    batch_invariant: bool  # generation.batch_invariant: the gap should be 0


def correction_settings(cfg: Config) -> CorrectionSettings:
    """Step 2b's settings from the config."""
    return CorrectionSettings(cfg.ppo.rollout_correction, cfg.ppo.rollout_is_cap,
                              cfg.generation.require_exact, cfg.ppo.old_logprobs == "rollout",
                              cfg.generation.batch_invariant)


def rollout_correction(exp: Experience, s: CorrectionSettings, acc: Accumulator) -> Experience:
    """Metrics of the gap (token means over all ranks; the max over ranks):
    rollout/logprob_abs_diff_mean, rollout/logprob_abs_diff_max, rollout/kl_k3; with
    ppo.rollout_correction also rollout_is/weight_mean (over the kept tokens) and
    rollout_is/clipped_frac (tokens truncated by tis or dropped by mis), and the experience
    with its weights. A rollout without log-probs (HF generate), or with ppo.old_logprobs =
    rollout (they are the old log-probs), adds nothing."""
    mode, exact = s.mode, s.require_exact
    if exp.rollout.rollout_logprobs is None and mode == "none" and not exact:
        return exp  # HF generate: no gap to measure
    rollout_lp = (sampler_logprobs(exp.rollout, "rollout_correction", mode, "none")
                  if mode != "none" else
                  sampler_logprobs(exp.rollout, "generation.require_exact", True, "false"))
    if s.old_from_rollout:  # they are the old log-probs: no gap to measure
        return exp
    mask = exp.mask
    diff, kl = rollout_mismatch(exp.old_logprobs, rollout_lp, mask)
    largest = float(diff.max()) if diff.numel() else 0.0
    acc.add_tensor_mean("rollout/logprob_abs_diff_mean", diff, mask)
    acc.add_max("rollout/logprob_abs_diff_max", largest)
    acc.add_tensor_mean("rollout/kl_k3", kl, mask)
    if exact:
        require_exact(largest, exp.rollout.rollout_logprobs.device, s.batch_invariant)
    if mode == "none":
        return exp
    weights, kept, cut = rollout_is_weights(exp.old_logprobs, rollout_lp, mask, mode, s.cap)
    acc.add_tensor_mean("rollout_is/weight_mean", weights, kept)
    acc.add_tensor_mean("rollout_is/clipped_frac", cut.float(), mask)
    return replace(exp, is_weights=weights, is_kept=kept, is_kept_lens=kept.sum(1).tolist())


def require_exact(largest: float, device: torch.device, batch_invariant: bool) -> None:
    """generation.require_exact: a NotOnPolicy error on every rank when any rank's largest
    |old_logprobs - rollout_logprobs| over its counted tokens (`largest`) is not 0 (one
    all-reduce, so all ranks stop together, before the update). `batch_invariant`:
    generation.batch_invariant is on, so the advice is not to set it."""
    worst = float(dist.all_reduce_max(torch.tensor([largest], dtype=torch.float64,
                                                   device=device)))
    if worst == 0.0:
        return
    head = (f"generation.require_exact: the sampler's log-probs differ from the trainer's by up "
            f"to {worst:.3g} nats (rollout/logprob_abs_diff_max)")
    if batch_invariant:
        raise NotOnPolicy(
            f"{head} with generation.batch_invariant = true: this model or device reduces "
            "outside the batch-invariant kernels (docs/SAMPLING.md says where they are exact): "
            "set generation.require_exact=false")
    raise NotOnPolicy(
        f"{head}; the decoding step and the training forward reduce in different orders "
        "(docs/SAMPLING.md): set generation.batch_invariant=true, or "
        "generation.require_exact=false")
