"""Values resolved from several keys of a parsed config, which the engine, the loop and
`ds-ppo plan` all ask here so that each is decided in one place: the world size, the critic
warm-up, where the value model and the reference come from, the longest response, the
watchdog's limit and the LoRA output head."""
from __future__ import annotations

import os

from ds_ppo.config.sections import Config
from ds_ppo.errors import ConfigError
from ds_ppo.http_deadline import call_deadline


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def critic_warmup(cfg: Config, iteration: int) -> bool:
    """Iteration `iteration` (1-based) trains the value model only (ppo.critic_warmup_iterations)."""
    warmup = cfg.ppo.critic_warmup_iterations
    return cfg.ppo.uses_critic and warmup > 0 and iteration <= warmup


def value_init_source(cfg: Config) -> str:
    """Where the value model starts (value.init_from resolved; the engine and `ds-ppo plan` both
    ask here): `path` (value.path / value.arch), `reward` (reward.model) or `policy`. auto: path
    when value.path or value.arch is given (e.g. a reward model's export), else the reward model
    if there is one, else the policy."""
    v = cfg.value
    if v.init_from != "auto":
        return v.init_from
    if v.path is not None or v.arch is not None:
        return "path"
    return "reward" if cfg.reward.model is not None else "policy"


def uses_reference(cfg: Config) -> bool:
    """Whether the run reads reference log-probs: always, but under on-policy distillation
    (an estimator with a teacher, whose KL may only be a loss term) only with ppo.kl_loss_coef
    > 0. Without, no reference is built and the KL metrics read 0."""
    from ds_ppo.algo.choices import ESTIMATORS

    return not ESTIMATORS[cfg.ppo.advantage_estimator].teacher or cfg.ppo.kl_loss_coef > 0


def reference_from_policy_base(cfg: Config) -> bool:
    """Whether the reference log-probs come from the LoRA policy's base (adapters off)."""
    from_base = cfg.reference.from_policy_base
    if cfg.policy.lora is None:
        return False
    return from_base is True or (from_base == "auto" and cfg.reference.path is None)


def max_model_tokens(cfg: Config) -> int:
    """The most model tokens one response can hold: generation.max_new_tokens, or for a
    multi-turn episode that per turn times env.max_turns, at most env.max_total_tokens (the
    L_max of ppo.loss_aggregation = seq_mean_token_sum_norm)."""
    g, e = cfg.generation, cfg.env
    if not e.enabled:
        return g.max_new_tokens
    return min(g.max_new_tokens * e.max_turns, e.max_total_tokens)


def max_response_tokens(cfg: Config) -> int:
    """The longest response in the context: generation.max_new_tokens, or for a multi-turn
    episode env.max_total_tokens (its turns and observations; what `ds-ppo plan` sizes)."""
    return cfg.env.max_total_tokens if cfg.env.enabled else cfg.generation.max_new_tokens


def watchdog_limit_s(cfg: Config) -> float | None:
    """Seconds without progress after which the watchdog stops a rank (None: off): the
    configured watchdog_minutes, or by default the collective timeout less half the reward
    service's margin (`call_deadline`), so that a reward call's own deadline comes first, then
    the watchdog, then the collective timeout."""
    if cfg.watchdog_minutes is not None:
        return 60.0 * cfg.watchdog_minutes if cfg.watchdog_minutes > 0 else None
    timeout_s = 60.0 * cfg.dist_timeout_minutes
    return timeout_s - 0.5 * (timeout_s - call_deadline(cfg.dist_timeout_minutes, 2))


def lora_output_head(lora_cfg, random_init: bool, tied: bool) -> bool:
    """policy.lora.output_head resolved (the engine and `ds-ppo plan` both ask here): auto = a
    random-init model (policy.arch) whose output head is not tied to its input embeddings. Such
    a head's weights are as small as every initialised weight (std initializer_range, 0.02), so
    after the final norm the logits span about +-1 whatever adapters below it learn, and the
    output stays near uniform."""
    if lora_cfg.output_head == "auto":
        return random_init and not tied
    if lora_cfg.output_head and tied:
        raise ConfigError("policy.lora.output_head = True: this model's output head is tied to "
                          "its input embeddings (one weight), which an adapter on the head alone "
                          "cannot follow; set policy.lora.output_head=false")
    return bool(lora_cfg.output_head)


def job_config(cfg: Config, job: str) -> Config:
    """The config a supervised job (`sft` or `rm`) trains the policy section's model with: its
    own learning rate (`sft.lr`, `rm.lr`) in place of policy.lr when set. A new tree, built once
    before the job starts."""
    lr = getattr(cfg, job).lr
    if lr is None:
        return cfg
    return cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"lr": lr})})
