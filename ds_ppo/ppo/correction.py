"""Step 2b of an iteration: the sampler's log-probs (the rollout's) against the trainer's (the
scored old log-probs) for the same tokens. Measured every iteration (metrics rollout/*) and,
with ppo.rollout_correction, turned into importance weights of the policy loss
(`ds_ppo.algo.correction`, Yao et al. 2025)."""
from __future__ import annotations

from dataclasses import replace

from ds_ppo.algo import rollout_is_weights, rollout_mismatch
from ds_ppo.config import Config
from ds_ppo.containers import Experience
from ds_ppo.errors import ConfigError
from ds_ppo.metrics import Accumulator


def rollout_correction(exp: Experience, cfg: Config, acc: Accumulator) -> Experience:
    """Metrics of the gap (token means over all ranks; the max over ranks):
    rollout/logprob_abs_diff_mean, rollout/logprob_abs_diff_max, rollout/kl_k3; with
    ppo.rollout_correction also rollout_is/weight_mean (over the kept tokens) and
    rollout_is/clipped_frac (tokens truncated by tis or dropped by mis), and the experience
    with its weights. A rollout without log-probs (HF generate), or with ppo.old_logprobs =
    rollout (they are the old log-probs), adds nothing."""
    rollout_lp = exp.rollout.rollout_logprobs
    mode = cfg.ppo.rollout_correction
    if rollout_lp is None:
        if mode != "none":  # generation.loop=auto fell back to HF generate for this policy
            raise ConfigError(f"ppo.rollout_correction = {mode!r} needs the rollout log-probs "
                              "of our decoding loop, but this policy's rollouts came from HF "
                              "generate (generation.loop resolved to hf): set "
                              "ppo.rollout_correction=none, or generation.loop=own")
        return exp
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
