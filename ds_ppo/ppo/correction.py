"""Step 2b of an iteration: the sampler's log-probs (the rollout's) against the trainer's (the
scored old log-probs) for the same tokens. Measured every iteration (metrics rollout/*) and,
with ppo.rollout_correction, turned into importance weights of the policy loss
(`ds_ppo.algo.correction`, Yao et al. 2025)."""
from __future__ import annotations

from dataclasses import replace

import torch

from ds_ppo.algo import rollout_is_weights, rollout_mismatch
from ds_ppo.config import Config
from ds_ppo.containers import Experience, Rollout
from ds_ppo.errors import ConfigError
from ds_ppo.metrics import Accumulator


def sampler_logprobs(rollout: Rollout, key: str, value: str, off: str) -> torch.Tensor:
    """The rollout's sampler log-probs, which ppo.<key> = `value` reads; a ConfigError naming
    ppo.<key>=`off` when HF generate sampled the rollout (generation.loop=auto fell back to it
    for this policy: the config checks could not know)."""
    if rollout.rollout_logprobs is None:
        raise ConfigError(f"ppo.{key} = {value!r} needs the rollout log-probs of our decoding "
                          "loop, but this policy's rollouts came from HF generate "
                          f"(generation.loop resolved to hf): set ppo.{key}={off}, or "
                          "generation.loop=own")
    return rollout.rollout_logprobs


def rollout_correction(exp: Experience, cfg: Config, acc: Accumulator) -> Experience:
    """Metrics of the gap (token means over all ranks; the max over ranks):
    rollout/logprob_abs_diff_mean, rollout/logprob_abs_diff_max, rollout/kl_k3; with
    ppo.rollout_correction also rollout_is/weight_mean (over the kept tokens) and
    rollout_is/clipped_frac (tokens truncated by tis or dropped by mis), and the experience
    with its weights. A rollout without log-probs (HF generate), or with ppo.old_logprobs =
    rollout (they are the old log-probs), adds nothing."""
    mode = cfg.ppo.rollout_correction
    if exp.rollout.rollout_logprobs is None and mode == "none":  # HF generate: no gap to measure
        return exp
    rollout_lp = sampler_logprobs(exp.rollout, "rollout_correction", mode, "none")
    if cfg.ppo.old_logprobs == "rollout":  # they are the old log-probs: no gap to measure
        return exp
    mask = exp.mask
    diff, kl = rollout_mismatch(exp.old_logprobs, rollout_lp, mask)
    acc.add_tensor_mean("rollout/logprob_abs_diff_mean", diff, mask)
    acc.add_max("rollout/logprob_abs_diff_max", float(diff.max()) if diff.numel() else 0.0)
    acc.add_tensor_mean("rollout/kl_k3", kl, mask)
    if mode == "none":
        return exp
    weights, kept, cut = rollout_is_weights(exp.old_logprobs, rollout_lp, mask, mode,
                                            cfg.ppo.rollout_is_cap)
    acc.add_tensor_mean("rollout_is/weight_mean", weights, kept)
    acc.add_tensor_mean("rollout_is/clipped_frac", cut.float(), mask)
    return replace(exp, is_weights=weights, is_kept=kept, is_kept_lens=kept.sum(1).tolist())
