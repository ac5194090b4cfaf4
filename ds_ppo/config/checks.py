"""Cross-field rules of a parsed config that need the world size (``validate`` and
``validate_job``, fatal, every problem listed with the key and the fix) and warnings for
settings that do nothing (``config_warnings``). The rules among one section's own fields are
that section's ``problems()`` (next to its fields); the batch-size rules live in ``batches``,
the models' in ``model_checks``; the numbers derived from several keys in ``batches`` and
``derived``.
"""
from __future__ import annotations

from pathlib import Path

from ds_ppo.algo.choices import POLICY_LOSSES, training_ranks
from ds_ppo.config.batches import batch_problems, data_parallel_size
from ds_ppo.config.derived import watchdog_limit_s
from ds_ppo.config.metric_checks import metric_problems
from ds_ppo.config.model_checks import (expert_parallel_problems, model_fields, model_problems,
                                        sequence_parallel_problems, source_problems)
from ds_ppo.config.jobs import SupervisedJob
from ds_ppo.config.sections import Config, PairJob
from ds_ppo.errors import ConfigError
from ds_ppo.http_deadline import call_deadline, worst_request_s


def validate(cfg: Config, world_size: int) -> None:
    """Cross-field checks that need the world size; raises ConfigError listing every problem
    (one checker per part of the config, each returning its problems). The batch rules hold per
    data-parallel rank: with deepspeed.sequence_parallel_size = N the N ranks of a
    sequence-parallel group share their rows (world / N data-parallel ranks); under
    ppo.placement = split only the training ranks hold rows."""
    # a supervised job's section holds another command's settings (`validate_job` checks it)
    problems = [p for section in cfg.sections() if not isinstance(section, SupervisedJob)
                for p in section.problems()]
    placement = placement_problems(cfg, world_size)
    problems += placement
    trainers = world_size if placement else training_ranks(
        cfg.ppo.placement, world_size, cfg.ppo.generation_ranks)
    problems += batch_problems(cfg, data_parallel_size(cfg, trainers))
    for check in (_reward_problems, _env_problems, model_problems, _generation_problems,
                  _schedule_problems, _tracking_problems, _recipe_problems, _distill_problems):
        problems += check(cfg, world_size)
    problems += sequence_parallel_problems(cfg, trainers)
    problems += expert_parallel_problems(cfg, trainers)
    problems += metric_problems(cfg)
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def _distill_problems(cfg: Config, world_size: int) -> list[str]:
    """A teacher exactly when the estimator reads one (on-policy distillation), and groups for
    the reward's part of the mix."""
    from ds_ppo.algo.choices import ESTIMATORS

    est, t, d = cfg.ppo.advantage_estimator, cfg.teacher, cfg.distill
    reads_teacher = ESTIMATORS[est].teacher
    if reads_teacher and not t.enabled:
        return [f"ppo.advantage_estimator = {est!r} distils a teacher, but teacher.path is not "
                "set: set teacher.path=<a causal LM with the student's vocabulary>"]
    if t.enabled and not reads_teacher:
        what = f"teacher.path = {t.path!r}" if t.path is not None else "teacher.arch"
        return [f"{what} is set, but ppo.advantage_estimator = {est!r} reads no teacher: set "
                "ppo.advantage_estimator=distill, or drop the teacher section"]
    if reads_teacher and d.reward_coef > 0 and cfg.ppo.samples_per_prompt < 2:
        return [f"distill.reward_coef = {d.reward_coef:g} mixes in the reward's group advantage "
                f"({d.reward_estimator}), but ppo.samples_per_prompt = "
                f"{cfg.ppo.samples_per_prompt}: set ppo.samples_per_prompt=4 (any n >= 2), or "
                "distill.reward_coef=0"]
    p = cfg.ppo
    filters = [k for k, on in (("ppo.filter_zero_std_groups", p.filter_zero_std_groups),
                               ("ppo.dynamic_sampling", p.dynamic_sampling)) if on]
    if reads_teacher and filters and d.reward_coef == 0:
        return [f"{' and '.join(filters)} choose groups by their reward's spread, but "
                "distill.reward_coef = 0 trains on the teacher's signal alone, which every "
                f"response carries: set {filters[0]}=false, or distill.reward_coef > 0"]
    return []


def _reward_problems(cfg: Config, world_size: int) -> list[str]:
    """Exactly one reward source, well formed, and the dataset columns it reads."""
    problems = []
    from ds_ppo.redaction import redact_url  # stdlib only: no heavy import

    r = cfg.reward
    sources = sum(x is not None for x in (r.function, r.model, r.url))
    if sources > 1 or (sources == 0 and not cfg.env.enabled):
        problems.append("reward: set exactly one of reward.function (module:function), "
                        "reward.model and reward.url (got function="
                        f"{r.function!r}, model={r.model!r}, url={redact_url(r.url)!r}); with "
                        "an env, at most one (the environment's turn rewards may be all)")
    keys = cfg.data.reward_keys
    if keys and r.function is None and r.url is None and not cfg.env.enabled:
        problems.append(f"data.reward_keys = {keys}: only a reward.function or reward.url "
                        "takes dataset columns (a reward model reads the text)")
    if keys and cfg.data.path is None:
        problems.append(f"data.reward_keys = {keys}: the builtin prompts (data.path = null) "
                        "have no other columns")
    if len(set(keys)) != len(keys) or {"prompts", "responses"} & set(keys):
        problems.append(f"data.reward_keys = {keys}: names must be distinct and not prompts "
                        "or responses (the function's first two arguments)")
    return problems


def _tensor_parallel_problems(cfg: Config) -> list[str]:
    """generation.mode = tensor_parallel with a generation.tp_size the policy's shape (read
    without loading it) does not split by: the engine's rule
    (`tensor_parallel_shapes.unshardable`)."""
    import types

    from ds_ppo.config.tensor_parallel_shapes import unshardable

    g = cfg.generation
    if g.mode != "tensor_parallel" or g.tp_size is None:
        return []
    fields = model_fields(cfg.policy.path, cfg.policy.arch)
    if fields.get("model_type") is None:
        return []
    why = unshardable(types.SimpleNamespace(**fields), g.tp_size)
    return [f"generation.mode = 'tensor_parallel' with generation.tp_size = {g.tp_size}: {why}; "
            "set generation.tp_size to a divisor of them, or generation.mode=auto"] if why else []


def _generation_problems(cfg: Config, world_size: int) -> list[str]:
    """Generation lengths, tensor parallelism and the decoding loop's options."""
    problems = []
    g = cfg.generation
    if g.tp_size is not None and world_size % g.tp_size:
        problems.append(f"generation.tp_size = {g.tp_size} must divide the world size "
                        f"{world_size}: set generation.tp_size to the GPUs per node")
    # the settings that read the sampler's log-probs, which only our decoding loop keeps
    for key, value, off in (("ppo.rollout_correction", cfg.ppo.rollout_correction, "none"),
                            ("ppo.old_logprobs", cfg.ppo.old_logprobs, "training"),
                            ("generation.require_exact", g.require_exact, False)):
        if g.hf_generate and value != off:
            problems.append(f"{key} = {value!r} needs the rollout log-probs of our decoding "
                            f"loop, but generation.loop = {g.loop!r} / generation.mode = "
                            f"{g.mode!r} use HF generate: set generation.loop=own (mode "
                            f"gathered or tensor_parallel), or {key}={str(off).lower()}")
    problems += _old_logprob_problems(cfg)
    if cfg.ppo.router_replay and cfg.env.enabled:
        problems.append("ppo.router_replay = true replays the experts our decoding loop "
                        "records for a prompt and its response, but env.enabled = true builds "
                        "episodes whose observations the sampler never routed: set "
                        "ppo.router_replay=false")
    if cfg.ppo.router_replay and (g.loop == "hf" or g.mode not in ("gathered", "tensor_parallel")
                                  or cfg.deepspeed.sequence_parallel_size > 1):
        problems.append(f"ppo.router_replay = true replays the experts our decoding loop "
                        f"records on a replica, but generation.loop = {g.loop!r} / "
                        f"generation.mode = {g.mode!r} / deepspeed.sequence_parallel_size = "
                        f"{cfg.deepspeed.sequence_parallel_size}: set generation.loop=own, "
                        "generation.mode=gathered (or tensor_parallel) and "
                        "deepspeed.sequence_parallel_size=1, or ppo.router_replay=false")
    problems += _tensor_parallel_problems(cfg)
    if g.batch_invariant and g.loop == "hf":
        problems.append("generation.batch_invariant = true makes the sampler's log-probs equal "
                        "the trainer's, but generation.loop = 'hf' (HF generate) keeps none to "
                        "compare: set generation.loop=own (or auto), or "
                        "generation.batch_invariant=false")
    elif g.batch_invariant and (g.mode in ("tensor_parallel", "zero3")
                              or cfg.policy.attn_implementation not in ("sdpa", "eager")):
        problems.append(f"generation.batch_invariant = true replaces the sdpa / eager attention "
                        f"of whole replicas, but generation.mode = {g.mode!r} / "
                        f"policy.attn_implementation = {cfg.policy.attn_implementation!r}: set "
                        "generation.mode=gathered and policy.attn_implementation=sdpa, or "
                        "generation.batch_invariant=false")
    if g.loop == "own" and cfg.policy.attn_implementation not in ("sdpa", "eager"):
        problems.append(f"generation.loop = 'own' supports the sdpa and eager attention kernels, "
                        f"not policy.attn_implementation = {cfg.policy.attn_implementation!r}: "
                        "set generation.loop=auto (HF generate for this kernel)")
    return problems


def _tracking_problems(cfg: Config, world_size: int) -> list[str]:
    """Model registry needs, the watchdog's limit and the resume target."""
    problems = []
    t, c = cfg.tracking, cfg.checkpoint
    if t.register_model is not None and not (t.enabled and c.export_at_end):
        problems.append(f"tracking.register_model = {t.register_model!r} registers the export "
                        "at the end: it needs tracking.enabled=true and "
                        "checkpoint.export_at_end=true")
    if t.register_every and (t.register_model is None or not c.every or not c.save_hf_weights
                             or t.register_every % c.every):
        problems.append(f"tracking.register_every = {t.register_every} registers checkpoints: "
                        "it needs tracking.register_model, checkpoint.save_hf_weights=true and a "
                        f"multiple of checkpoint.every = {c.every}")
    limit = watchdog_limit_s(cfg)
    if limit is not None and limit >= 60 * cfg.dist_timeout_minutes:
        problems.append(f"watchdog_minutes = {cfg.watchdog_minutes:g} must be below "
                        f"dist_timeout_minutes = {cfg.dist_timeout_minutes:g} (else a stuck "
                        "collective times out before the watchdog names the missing ranks): "
                        "lower it, or leave it null")
    return problems + _resume_problems(cfg)


def _resume_problems(cfg: Config) -> list[str]:
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).exists():
        return [f"resume = {cfg.resume!r}: must be auto, never or an existing checkpoint "
                "directory"]
    return []


def _recipe_problems(cfg: Config, world_size: int) -> list[str]:
    """The RLHF recipe's extras: the critic warm-up, the policy's EMA and PPO-ptx."""
    p, problems = cfg.ppo, []
    if p.critic_warmup_iterations >= cfg.iterations:
        problems.append(f"ppo.critic_warmup_iterations = {p.critic_warmup_iterations} must be "
                        f"less than iterations = {cfg.iterations}, or the policy never trains")
    if cfg.policy.ema_decay is not None and cfg.policy.lora is not None:
        problems.append(f"policy.ema_decay = {cfg.policy.ema_decay} with policy.lora: an EMA of "
                        "LoRA adapters is not supported; drop one of them")
    if p.ptx_coef > 0 and cfg.data.ptx_path is None:
        problems.append(f"ppo.ptx_coef = {p.ptx_coef} needs data.ptx_path (a file of `text` "
                        "rows, or prompt + `completion` rows), or set ppo.ptx_coef=0")
    return problems


def validate_job(cfg: Config, job: str, world_size: int) -> None:
    """Cross-field checks of a supervised job (`job`: sft, rm or dpo), before any model loads; raises
    ConfigError listing every problem with the key and a value that works."""
    j, problems = getattr(cfg, job), []
    if j.batch_size % (j.micro_batch_size * world_size):
        problems.append(
            f"{job}.batch_size = {j.batch_size} must be a multiple of {job}.micro_batch_size * "
            f"world size = {j.micro_batch_size} * {world_size} (e.g. {job}.batch_size="
            f"{j.micro_batch_size * world_size * max(1, j.batch_size // (j.micro_batch_size * world_size))})")
    pairs = isinstance(j, PairJob)
    if cfg.data.path is None:
        columns = (f"{job}.chosen_key + {job}.rejected_key (and data.prompt_key)" if pairs
                   else "data.prompt_key + sft.completion_key, or data.messages_key")
        example = "examples/pairs.jsonl" if pairs else "examples/demos.jsonl"
        problems.append(f"data.path = None: ds-ppo {job} trains on a dataset file with columns "
                        f"{columns}; set data.path (e.g. data.path={example}, with "
                        "--config examples/my_run.yaml)")
    if pairs and j.chosen_key == j.rejected_key:
        problems.append(f"{job}.chosen_key = {job}.rejected_key = {j.chosen_key!r}: name two "
                        "columns")
    problems += j.problems()
    problems += source_problems(cfg, ("policy",))
    problems += cfg.deepspeed.problems(roles=("policy",)) + _resume_problems(cfg)
    problems += [p for p in expert_parallel_problems(cfg, world_size)
                 if p.startswith("deepspeed.policy.")]
    problems += metric_problems(cfg, job)
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def _env_problems(cfg: Config, world_size: int) -> list[str]:
    """The env section against the rest (multi-turn rollouts)."""
    e, out = cfg.env, []
    if not e.enabled:
        return out
    if e.max_total_tokens < cfg.generation.max_new_tokens:
        out.append(f"env.max_total_tokens = {e.max_total_tokens} is less than one turn "
                   f"(generation.max_new_tokens = {cfg.generation.max_new_tokens}); raise it")
    if cfg.data.eval_split is not None:
        out.append(f"data.eval_split = {cfg.data.eval_split!r}: evaluation runs single-turn "
                   "and is not available with an env yet; set data.eval_split=null")
    return out


def config_warnings(cfg: Config, world_size: int = 1) -> list[str]:
    """Settings that are valid but do nothing for this config, or that can hang a multi-rank job
    (printed, never fatal)."""
    out = []
    p = cfg.ppo
    r = cfg.reward
    if r.url is not None and r.timeout_s is not None and world_size > 1:
        worst = worst_request_s(r.timeout_s, r.retries)
        deadline = call_deadline(cfg.dist_timeout_minutes, world_size)
        if worst > deadline:
            out.append(f"reward.url: a request that never answers would be given up after "
                       f"{worst:.0f} s (reward.timeout_s = {r.timeout_s:g} x {r.retries + 1} "
                       f"attempts + back-off), but each call stops at its deadline of "
                       f"{deadline:.0f} s (dist_timeout_minutes = {cfg.dist_timeout_minutes:g} "
                       "less a margin: the other ranks wait for the scores in a collective), so "
                       "the last attempts are cut short. Lower reward.timeout_s / reward.retries "
                       "or raise dist_timeout_minutes")
    limit = watchdog_limit_s(cfg)
    if (limit is not None and r.timeout_s is not None and r.model is None
            and r.timeout_s >= limit):  # each reward.url attempt counts as progress
        out.append(f"a reward call (or one reward.url attempt) may take reward.timeout_s = "
                   f"{r.timeout_s:g} s, but the watchdog stops a rank after {limit:.0f} s "
                   "without progress: raise watchdog_minutes (and dist_timeout_minutes) or "
                   "lower reward.timeout_s")
    if p.placement == "colocated" and "generation_ranks" in p.model_fields_set:
        out.append(f"ppo.generation_ranks = {p.generation_ranks} is ignored: ppo.placement = "
                   "'colocated' generates on every rank (set ppo.placement=split to give it "
                   "ranks of its own)")
    if p.schedule != "async" and "max_staleness" in p.model_fields_set:
        out.append(f"ppo.max_staleness = {p.max_staleness} is ignored: ppo.schedule = "
                   f"{p.schedule!r} " + ("generates each rollout after the previous update"
                                         if p.schedule == "sync" else
                                         "generates every sample one update old")
                   + " (set ppo.schedule=async to bound the lag by ppo.max_staleness)")
    if not p.dynamic_sampling and "dynamic_sampling_max_rounds" in p.model_fields_set:
        out.append(f"ppo.dynamic_sampling_max_rounds = {p.dynamic_sampling_max_rounds} is "
                   "ignored: ppo.dynamic_sampling = false generates one round per iteration "
                   "(set ppo.dynamic_sampling=true to refill the batch)")
    a = cfg.tracking.alarms
    if not a.enabled and a.watch:
        out.append(f"tracking.alarms.watch = {a.watch} is ignored: tracking.alarms.enabled = "
                   "false checks no metric (set it to true to watch them)")
    ignored = p.ignored_policy_loss_settings()
    if ignored:
        out.append(f"{', '.join('ppo.' + k for k in ignored)}: read by another policy loss, "
                   f"ignored with ppo.policy_loss = {p.policy_loss!r} (which reads "
                   + ", ".join("ppo." + k for k in POLICY_LOSSES[p.policy_loss].settings) + ")")
    if cfg.data.ptx_path is not None and p.ptx_coef == 0:
        out.append(f"data.ptx_path = {cfg.data.ptx_path!r} is ignored: ppo.ptx_coef = 0 (set "
                   "e.g. ppo.ptx_coef=0.1 to add its language-modelling loss)")
    if not p.uses_critic:
        given = [f"value.{k}" for k in sorted(cfg.value.model_fields_set)] + \
            [f"deepspeed.value.{k}" for k in sorted(cfg.deepspeed.value.model_fields_set)]
        if given:
            out.append(f"ppo.advantage_estimator = {p.advantage_estimator!r} trains no value "
                       f"model: {', '.join(given)} ignored (drop the value section, or use "
                       "ppo.advantage_estimator=gae)")
        gae_only = sorted({"vf_coef", "value_clip_eps", "lam"} & p.model_fields_set)
        if gae_only:
            out.append(f"{', '.join('ppo.' + k for k in gae_only)}: used by gae only, ignored "
                       f"with ppo.advantage_estimator = {p.advantage_estimator!r}")
    from ds_ppo.algo.choices import ESTIMATORS

    distilling = ESTIMATORS[p.advantage_estimator].teacher
    given = [f"distill.{k}" for k in sorted(cfg.distill.model_fields_set)] + \
        [f"deepspeed.teacher.{k}" for k in sorted(cfg.deepspeed.teacher.model_fields_set)]
    if given and not distilling:
        out.append(f"{', '.join(given)}: read by on-policy distillation only, ignored with "
                   f"ppo.advantage_estimator = {p.advantage_estimator!r} (set "
                   "ppo.advantage_estimator=distill and teacher.path to distil)")
    if distilling and "kl_coef" in p.model_fields_set and p.kl_loss_coef == 0:
        out.append(f"ppo.kl_coef = {p.kl_coef:g} is ignored: ppo.advantage_estimator = "
                   f"{p.advantage_estimator!r} puts no KL in the reward (set ppo.kl_loss_coef "
                   "for a KL loss toward the reference)")
    return out


def _schedule_problems(cfg: Config, world_size: int) -> list[str]:
    """ppo.schedule other than sync: generation runs in a background worker on a whole replica
    with no collective (only our decoding loop, whole replicas, one response per prompt draw),
    and off-policy samples need a correction to stay sound (docs/ASYNC.md, Soundness)."""
    p, g = cfg.ppo, cfg.generation
    if p.schedule == "sync":
        return []
    problems, fix = [], "or ppo.schedule=sync"
    where = f"ppo.schedule = {p.schedule!r} generates in a background worker"
    if g.loop == "hf" or g.mode in ("tensor_parallel", "zero3"):
        problems.append(f"{where} on a whole replica with our decoding loop, but generation.loop"
                        f" = {g.loop!r} / generation.mode = {g.mode!r}: set generation.loop=own "
                        f"and generation.mode=gathered (or auto), {fix}")
    for key, on in (("ppo.dynamic_sampling", p.dynamic_sampling),
                    ("generation.batch_invariant", g.batch_invariant),
                    ("generation.require_exact", g.require_exact)):
        if on:
            problems.append(f"{where}, which {key} = true does not support yet: set "
                            f"{key}=false, {fix}")
    if cfg.deepspeed.sequence_parallel_size > 1:
        problems.append(f"{where}, which deepspeed.sequence_parallel_size > 1 does not support "
                        f"yet: set deepspeed.sequence_parallel_size=1, {fix}")
    if p.partial_rollouts and cfg.env.enabled:
        problems.append("ppo.partial_rollouts = true with an env section: multi-turn episodes "
                        "are played whole (not supported yet); set ppo.partial_rollouts=false")
    if p.partial_rollouts and g.max_new_tokens < p.max_staleness:
        problems.append(f"ppo.partial_rollouts = true decodes each response in "
                        f"ppo.max_staleness = {p.max_staleness} segments, but "
                        f"generation.max_new_tokens = {g.max_new_tokens} leaves some empty: set "
                        f"generation.max_new_tokens >= {p.max_staleness}, or a smaller "
                        "ppo.max_staleness")
    lag = p.max_lag
    if lag > 0 and p.rollout_correction == "none" and p.old_logprobs == "training":
        problems.append(f"{where} from weights up to {lag} update(s) old, but "
                        "ppo.rollout_correction = 'none' with ppo.old_logprobs = 'training' "
                        "would train on them as if they were on-policy (the PPO ratio starts "
                        "at 1, the sampler's weights are ignored): set "
                        "ppo.rollout_correction=tis (or mis), or ppo.old_logprobs=rollout, "
                        "or ppo.schedule=async with ppo.max_staleness=0")
    return problems


def placement_problems(cfg: Config, world_size: int) -> list[str]:
    """ppo.placement = split: the last ppo.generation_ranks ranks only generate, each one for
    whole training ranks (their rows and random streams), so at least one rank trains and no
    generation rank is left without a training rank to serve."""
    p = cfg.ppo
    if p.placement != "split":
        return []
    k, trainers = p.generation_ranks, world_size - p.generation_ranks
    if trainers < 1:
        return [f"ppo.placement = 'split' with ppo.generation_ranks = {k} leaves no training "
                f"rank in a world of {world_size}: launch more ranks, set "
                f"ppo.generation_ranks <= {max(world_size - 1, 1)}"
                + (" (with at least 2 ranks)" if world_size < 2 else "")
                + ", or ppo.placement=colocated"]
    if k > trainers:
        return [f"ppo.placement = 'split': ppo.generation_ranks = {k} exceeds the {trainers} "
                f"training rank(s) of a world of {world_size} (each generation rank generates "
                f"the rows of whole training ranks): set ppo.generation_ranks <= "
                f"{world_size // 2}, or ppo.placement=colocated"]
    ep = [r for r in ("policy", "value")
          if getattr(cfg.deepspeed, r).expert_parallel_size > 1]
    if ep:
        return [f"ppo.placement = 'split' with deepspeed.{ep[0]}.expert_parallel_size > 1: the "
                "generation ranks' weight sync does not gather expert-parallel experts yet; set "
                "ppo.placement=colocated"]
    if cfg.env.enabled:
        return ["ppo.placement = 'split' with an env section: the generation ranks do not play "
                "multi-turn episodes yet; set ppo.placement=colocated (episodes run in the "
                "background worker of every rank)"]
    return []


def _old_logprob_problems(cfg: Config) -> list[str]:
    """ppo.old_logprobs = rollout: the sampler's log-probs stand for the policy's. They are of
    the distribution the trainer computes whatever the sampling settings (the trainer shapes its
    logits as the sampler did, `ds_ppo.algo.distribution.shape_logits`); that our decoding loop
    keeps them: the caller. generation.require_exact compares the two, so needs both."""
    p, problems = cfg.ppo, []
    if cfg.generation.require_exact and p.old_logprobs == "rollout":
        problems.append("generation.require_exact = true compares the sampler's log-probs with "
                        "the trainer's scoring forward, which ppo.old_logprobs = 'rollout' "
                        "skips: set ppo.old_logprobs=training, or generation.require_exact="
                        "false")
    return problems
