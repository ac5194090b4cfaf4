"""The `ppo` section's policy-loss keys (the base of `algorithm.PPOConfig`): `ppo.policy_loss`,
read from the table ds_ppo/algo/choices.POLICY_LOSSES, the clip or gate settings each loss
reads, and the rules that tie a loss to the aggregation, the estimator and the rollout
correction its objective is defined with."""
from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from ds_ppo.algo.choices import (ESTIMATORS, POLICY_LOSSES, PolicyLossName,
                                 describe_policy_losses)
from ds_ppo.config.section_base import Section


class PolicyLossFields(Section):
    policy_loss: PolicyLossName = Field(
        "ppo", description="The policy's objective (the table ds_ppo/algo/choices.py; "
        "docs/GUIDE.md, Choosing a policy loss): " + describe_policy_losses() + ". Each reads "
        "only its own clip settings. gspo, gspo_token and gmpo are defined with "
        "loss_aggregation seq_mean_token_mean (their default), gspo and gmpo with one advantage "
        "per response (grpo, dr_grpo, rloo), and none of the three takes rollout_correction "
        "(their ratios are not per-token weights; use old_logprobs=rollout, whose ratio is "
        "against the sampler); sapo's default aggregation is seq_mean_token_mean.")
    clip_eps: float = Field(0.2, gt=0, description="Policy ratio clip range (policy_loss ppo).")
    clip_eps_high: float | None = Field(
        None, description="policy_loss ppo: upper ratio clip 1 + clip_eps_high (DAPO's "
        "clip-higher, Yu et al. 2025); null = clip_eps.")
    dual_clip: float | None = Field(
        None, description="policy_loss ppo: dual clip c > 1 (Ye et al. 2020): the loss of a "
        "token with negative advantage is at most -A x c; null = off.")
    gspo_clip_eps: float = Field(
        3e-4, gt=0, lt=1, description="policy_loss gspo, gspo_token: the response ratio's "
        "lower clip 1 - gspo_clip_eps (GSPO's 3e-4: a geometric mean per token moves far less "
        "than a token's ratio).")
    gspo_clip_eps_high: float = Field(
        4e-4, gt=0, description="policy_loss gspo, gspo_token: the response ratio's upper clip "
        "1 + gspo_clip_eps_high (GSPO's 4e-4).")
    cispo_eps_low: float | None = Field(
        None, gt=0, lt=1, description="policy_loss cispo: the importance weight's lower bound "
        "1 - cispo_eps_low; null = none (MiniMax-M1 tunes only the upper bound).")
    cispo_eps_high: float = Field(
        0.28, gt=0, description="policy_loss cispo: the importance weight's upper bound 1 + "
        "cispo_eps_high (the weight is held constant: a token above it keeps its gradient, its "
        "weight capped).")
    gmpo_clip_eps: float = Field(
        0.4, gt=0, description="policy_loss gmpo: each token's log-ratio is clipped to "
        "+-gmpo_clip_eps nats on the side its advantage pushes it (GMPO's 0.4: ratios in "
        "[e^-0.4, e^0.4]).")
    sapo_tau_pos: float = Field(
        1.0, gt=0, description="policy_loss sapo: the soft gate's temperature on tokens of "
        "positive advantage (larger: the gate closes sooner as the ratio leaves 1).")
    sapo_tau_neg: float = Field(
        1.05, gt=0, description="policy_loss sapo: the gate's temperature on tokens of zero or "
        "negative advantage (SAPO keeps it above sapo_tau_pos: their updates are the less "
        "stable).")

    @model_validator(mode="before")
    @classmethod
    def _aggregation_default(cls, data: Any) -> Any:
        # loss_aggregation's default follows the policy loss (its first allowed mode)
        spec = POLICY_LOSSES.get(data.get("policy_loss")) if isinstance(data, dict) else None
        if spec is not None and "loss_aggregation" not in data:
            default = cls.model_fields["loss_aggregation"].default
            if spec.aggregations[0] != default:
                data = {**data, "loss_aggregation": spec.aggregations[0]}
        return data

    def policy_loss_problems(self) -> list[str]:
        """The policy loss against the aggregation, the estimator and the rollout correction
        its objective is defined with (the table row's rules)."""
        p, out = self, []
        spec = POLICY_LOSSES[p.policy_loss]
        where = f"ppo.policy_loss = {p.policy_loss!r}"
        if p.loss_aggregation not in spec.aggregations:
            out.append(f"{where} is defined with ppo.loss_aggregation "
                       f"{' or '.join(spec.aggregations)}, but ppo.loss_aggregation = "
                       f"{p.loss_aggregation!r}: set ppo.loss_aggregation="
                       f"{spec.aggregations[0]}, or another ppo.policy_loss")
        if spec.per_response and not ESTIMATORS[p.advantage_estimator].per_response:
            first, *rest = (n for n, s in ESTIMATORS.items() if s.per_response)
            out.append(f"{where} weighs each response by one advantage, but "
                       f"ppo.advantage_estimator = {p.advantage_estimator!r} gives each token "
                       f"its own: set ppo.advantage_estimator={first} (or {', '.join(rest)}), "
                       "or ppo.policy_loss="
                       + ("gspo_token" if p.policy_loss == "gspo" else "ppo"))
        if not spec.token_correction and p.rollout_correction != "none":
            out.append(f"{where} bounds a ratio of whole responses (a geometric mean of token "
                       "ratios), which the per-token weights of ppo.rollout_correction = "
                       f"{p.rollout_correction!r} do not correct: set "
                       "ppo.rollout_correction=none with ppo.old_logprobs=rollout (the ratio "
                       "then starts from the sampler's log-probs), or another ppo.policy_loss")
        return out

    def ignored_policy_loss_settings(self) -> list[str]:
        """The keys given (set explicitly) that another policy loss reads, not this one."""
        mine = set(POLICY_LOSSES[self.policy_loss].settings)
        others = {k for s in POLICY_LOSSES.values() for k in s.settings} - mine
        return sorted(others & self.model_fields_set)
