"""Batch-size arithmetic against the world size: the data-parallel size, gradient
accumulation and optimizer steps, the batch-size rules of `validate` (with a set of batch
sizes that works, as the README promises) and the estimator's needs of them."""
from __future__ import annotations

import itertools

from ds_ppo.algo.choices import ESTIMATORS
from ds_ppo.config.sections import Config, PPOConfig


def data_parallel_size(cfg: Config, world_size: int) -> int:
    """Ranks with rows of their own: world / deepspeed.sequence_parallel_size (the world when
    it does not divide: that problem is reported on its own)."""
    sp = cfg.deepspeed.sequence_parallel_size
    return world_size // sp if world_size % sp == 0 else world_size


def grad_accum_steps(cfg: Config, world_size: int) -> int:
    """Micro-batches accumulated per optimizer step on each rank (of world / N data-parallel
    ranks with deepspeed.sequence_parallel_size = N: a sequence-parallel group shares its rows)."""
    return cfg.ppo.mini_batch_size // (cfg.ppo.micro_batch_size
                                       * data_parallel_size(cfg, world_size))


def steps_per_iteration(cfg: Config) -> int:
    """Optimizer steps of one iteration (each trained role): epochs x mini-batches."""
    p = cfg.ppo
    return p.ppo_epochs * (p.rollout_batch_size * p.samples_per_prompt // p.mini_batch_size)


def optimizer_steps(cfg: Config, role: str = "value") -> int:
    """Optimizer steps of the whole run of `role`: iterations x epochs x mini-batches; the
    policy takes none in the ppo.critic_warmup_iterations (its LR schedule spans the rest)."""
    iterations = cfg.iterations
    if role == "policy":
        iterations = max(1, iterations - cfg.ppo.critic_warmup_iterations)
    return iterations * steps_per_iteration(cfg)


def job_accum_steps(cfg: Config, job: str, world_size: int) -> int:
    """Micro-batches accumulated per optimizer step on each rank of `ds-ppo sft` / `ds-ppo rm`
    (`job`: the section's name)."""
    j = getattr(cfg, job)
    return max(1, j.batch_size // (j.micro_batch_size * world_size))


def batch_problems(cfg: Config, world_size: int) -> list[str]:
    """Batch sizes against the (data-parallel) world size, the estimator's needs and the PPO
    clips."""
    p, problems = cfg.ppo, []
    if p.rollout_batch_size % world_size:
        problems.append(
            f"ppo.rollout_batch_size = {p.rollout_batch_size} must be divisible by the "
            f"data-parallel world size {world_size} (e.g. {world_size * max(1, p.rollout_batch_size // world_size)})")
    n = p.samples_per_prompt
    if (p.rollout_batch_size * n) % p.mini_batch_size:
        problems.append(
            f"ppo.mini_batch_size = {p.mini_batch_size} must divide ppo.rollout_batch_size = "
            f"{p.rollout_batch_size}" + (f" x ppo.samples_per_prompt = {n} (responses per "
                                         "iteration)" if n > 1 else ""))
    problems += _estimator_problems(p, world_size)
    if p.mini_batch_size % (p.micro_batch_size * world_size):
        problems.append(
            f"ppo.mini_batch_size = {p.mini_batch_size} must be a multiple of "
            f"ppo.micro_batch_size * world size = {p.micro_batch_size} * {world_size} = "
            f"{p.micro_batch_size * world_size}")
    if p.value_clip_eps is not None and p.value_clip_eps <= 0:
        problems.append(f"ppo.value_clip_eps = {p.value_clip_eps} must be > 0 or null")
    fix = working_batch_sizes(p, world_size)
    if fix:  # the README promises a value that works
        problems.append(f"batch sizes that work at world size {world_size}: "
                        + " ".join(f"ppo.{k}={v}" for k, v in fix.items()))
    return problems


def _estimator_problems(p: PPOConfig, world_size: int) -> list[str]:
    """Checks of the advantage estimator, samples per prompt and the extra loss terms."""
    problems, n = [], p.samples_per_prompt
    if ESTIMATORS[p.advantage_estimator].groups and n < 2:
        problems.append(f"ppo.advantage_estimator = {p.advantage_estimator!r} compares the "
                        f"responses to one prompt, but ppo.samples_per_prompt = {n}: set "
                        "ppo.samples_per_prompt=4 (any n >= 2)")
    if n > 1 and p.mini_batch_size % n:
        problems.append(f"ppo.mini_batch_size = {p.mini_batch_size} counts responses and must "
                        f"be a multiple of ppo.samples_per_prompt = {n} (e.g. {n * max(1, p.mini_batch_size // n)})")
    elif n > 1 and (p.mini_batch_size // n) % world_size:
        problems.append(f"ppo.mini_batch_size = {p.mini_batch_size} holds "
                        f"{p.mini_batch_size // n} prompts of {n} responses; each of the "
                        f"{world_size} ranks needs whole prompts: make mini_batch_size / "
                        f"samples_per_prompt divisible by the world size (e.g. "
                        f"ppo.mini_batch_size={n * world_size * max(1, p.mini_batch_size // (n * world_size))})")
    if p.kl_loss_coef < 0:
        problems.append(f"ppo.kl_loss_coef = {p.kl_loss_coef} must be >= 0 (0 = no KL loss term)")
    if p.clip_eps_high is not None and p.clip_eps_high <= 0:
        problems.append(f"ppo.clip_eps_high = {p.clip_eps_high} must be > 0, or null for the "
                        "same as ppo.clip_eps")
    if p.dual_clip is not None and p.dual_clip <= 1:
        problems.append(f"ppo.dual_clip = {p.dual_clip} must be > 1 (e.g. 3.0), or null to turn "
                        "the dual clip off")
    if p.entropy_target is not None and p.entropy_coef <= 0:
        problems.append(f"ppo.entropy_target = {p.entropy_target:g} steers the entropy bonus's "
                        "coefficient up to ppo.entropy_coef, which is 0: set ppo.entropy_coef "
                        "> 0 (e.g. 0.005), or ppo.entropy_target=null")
    if p.dynamic_sampling and n < 2:
        problems.append("ppo.dynamic_sampling = true keeps groups whose responses score "
                        "differently: set ppo.samples_per_prompt >= 2 (e.g. 4)")
    if p.filter_zero_std_groups and n < 2:
        problems.append("ppo.filter_zero_std_groups = true needs groups: set "
                        "ppo.samples_per_prompt >= 2")
    return problems


def _batch_sizes_fit(rollout: int, mini: int, micro: int, n: int, world: int) -> bool:
    """Every batch-size rule: whole prompts per rank, mini-batches that split the iteration's
    responses, whole prompts per rank in each mini-batch, whole micro-batches per rank."""
    return (rollout % world == 0 and (rollout * n) % mini == 0 and mini % n == 0
            and (mini // n) % world == 0 and mini % (micro * world) == 0)


def working_batch_sizes(p: PPOConfig, world_size: int) -> dict[str, int] | None:
    """The fewest, smallest changes to rollout_batch_size / mini_batch_size / micro_batch_size
    that satisfy every batch-size rule at `world_size` ({} when they already do; None when no
    value up to twice the given ones does)."""
    n, w = p.samples_per_prompt, world_size
    given = {"rollout_batch_size": p.rollout_batch_size, "mini_batch_size": p.mini_batch_size,
             "micro_batch_size": p.micro_batch_size}
    ranges = {"rollout_batch_size": range(w, 2 * p.rollout_batch_size + w, w),
              "mini_batch_size": range(n * w, 2 * p.mini_batch_size + n * w, n * w),
              "micro_batch_size": range(1, 2 * p.micro_batch_size + 1)}

    def fits(v: dict[str, int]) -> bool:
        return _batch_sizes_fit(v["rollout_batch_size"], v["mini_batch_size"],
                                v["micro_batch_size"], n, w)

    if fits(given):
        return {}
    for keys in (("mini_batch_size",), ("micro_batch_size",), ("rollout_batch_size",),
                 ("mini_batch_size", "micro_batch_size"),
                 ("rollout_batch_size", "mini_batch_size"),
                 ("rollout_batch_size", "mini_batch_size", "micro_batch_size")):
        best = None
        for values in itertools.product(*(ranges[k] for k in keys)):
            trial = {**given, **dict(zip(keys, values))}
            cost = sum(abs(v - given[k]) / given[k] for k, v in zip(keys, values))
            if fits(trial) and (best is None or cost < best[0]):
                best = (cost, dict(zip(keys, values)))
        if best is not None:
            return best[1]
    return None
