"""Cross-field rules of a parsed config that need the world size (``validate``, fatal, every
problem listed with the key and the fix), warnings for settings that do nothing, and the
numbers derived from several keys (optimizer steps, gradient accumulation).
"""
from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

from ds_ppo.algo.choices import ESTIMATORS
from ds_ppo.config.sections import Config, PPOConfig
from ds_ppo.errors import ConfigError
from ds_ppo.rewards.service import call_deadline, worst_request_s
from ds_ppo.role_names import ROLES, TRAINED_ROLES


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


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


def reference_from_policy_base(cfg: Config) -> bool:
    """Whether the reference log-probs come from the LoRA policy's base (adapters off)."""
    from_base = cfg.reference.from_policy_base
    if cfg.policy.lora is None:
        return False
    return from_base is True or (from_base == "auto" and cfg.reference.path is None)


def grad_accum_steps(cfg: Config, world_size: int) -> int:
    """Micro-batches accumulated per optimizer step on each rank (of world / N data-parallel
    ranks with deepspeed.sequence_parallel_size = N: a sequence-parallel group shares its rows)."""
    return cfg.ppo.mini_batch_size // (cfg.ppo.micro_batch_size
                                       * data_parallel_size(cfg, world_size))


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


def validate(cfg: Config, world_size: int) -> None:
    """Cross-field checks that need the world size; raises ConfigError listing every problem
    (one checker per part of the config, each returning its problems). The batch rules hold per
    data-parallel rank: with deepspeed.sequence_parallel_size = N the N ranks of a
    sequence-parallel group share their rows (world / N data-parallel ranks)."""
    problems = _batch_problems(cfg, data_parallel_size(cfg, world_size))
    for check in (_reward_problems, _env_problems, _model_problems, _generation_problems,
                  _deepspeed_problems, _tracking_problems, _recipe_problems,
                  sequence_parallel_problems):
        problems += check(cfg, world_size)
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def data_parallel_size(cfg: Config, world_size: int) -> int:
    """Ranks with rows of their own: world / deepspeed.sequence_parallel_size (the world when
    it does not divide: that problem is reported on its own)."""
    sp = cfg.deepspeed.sequence_parallel_size
    return world_size // sp if world_size % sp == 0 else world_size


def _batch_problems(cfg: Config, world_size: int) -> list[str]:
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
    if r.url is not None and not r.url.startswith(("http://", "https://")):
        problems.append(f"reward.url = {redact_url(r.url)!r} must start with http:// or https://")
    if r.function is not None and ":" not in r.function:
        problems.append(f"reward.function = {r.function!r} must look like module:function")
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
    if r.score_clip is not None and r.score_clip <= 0:
        problems.append(f"reward.score_clip = {r.score_clip} must be > 0 or null")
    return problems


def _source_problems(cfg: Config, roles) -> list[str]:
    """The trained roles' model sources and clipping (PPO: policy and value; the supervised
    jobs: the policy section, their one trained model)."""
    problems = []
    for name in roles:
        m = getattr(cfg, name)
        if m.path is not None and m.arch is not None:
            problems.append(f"{name}.path = {m.path!r} and {name}.arch are both set: keep one "
                            "(path loads weights, arch builds a randomly initialised model)")
        if m.max_grad_norm is not None and m.max_grad_norm <= 0:
            problems.append(f"{name}.max_grad_norm = {m.max_grad_norm} must be > 0 or null")
        if not all(0 <= b < 1 for b in m.betas):
            problems.append(f"{name}.betas = {list(m.betas)}: each must be in [0, 1) (AdamW's "
                            f"moment decay rates, e.g. {name}.betas=[0.9,0.95])")
        bad = _non_finite(m.arch or {}, f"{name}.arch")
        if bad:
            problems.append(f"{bad}: must be a finite number")
        if m.arch is not None and "model_type" not in m.arch:
            problems.append(f"{name}.arch = {m.arch!r} needs a model_type key (e.g. "
                            f"{name}.arch.model_type=llama)")
    if cfg.policy.path is None and cfg.policy.arch is None:
        problems.append("policy.path = None and policy.arch = None: set policy.path (a model) "
                        "or policy.arch (a random-init shape)")
    return problems


def _model_problems(cfg: Config, world_size: int) -> list[str]:
    """Each model role: path or arch, clipping, LoRA and the reference's source."""
    problems = _source_problems(cfg, TRAINED_ROLES)
    if cfg.value.init_from == "path" and cfg.value.path is None and cfg.value.arch is None:
        problems.append("value.init_from = 'path' needs value.path or value.arch")
    if cfg.value.init_from == "reward" and cfg.reward.model is None:
        problems.append("value.init_from = 'reward' needs reward.model")
    ref = cfg.reference
    if ref.from_policy_base is True and cfg.policy.lora is None:
        problems.append("reference.from_policy_base = True needs policy.lora (a full fine-tuned "
                        "policy has no frozen base to read): set policy.lora.r, or "
                        "reference.from_policy_base=auto")
    if ref.from_policy_base is True and ref.path is not None:
        problems.append(f"reference.from_policy_base = True and reference.path = {ref.path!r}: "
                        "the reference is either the policy's base or another model; drop one")
    if cfg.value.lora is not None and cfg.value.lora.output_head is True:
        problems.append("value.lora.output_head = True: the value model's scalar head is always "
                        "fully trained, never adapted; leave value.lora.output_head=auto")
    return problems


def _generation_problems(cfg: Config, world_size: int) -> list[str]:
    """Generation lengths, tensor parallelism and the decoding loop's options."""
    problems = []
    g = cfg.generation
    if g.min_new_tokens > g.max_new_tokens:
        problems.append(f"generation.min_new_tokens = {g.min_new_tokens} must be <= "
                        f"generation.max_new_tokens = {g.max_new_tokens}")
    if g.tp_size is not None and world_size % g.tp_size:
        problems.append(f"generation.tp_size = {g.tp_size} must divide the world size "
                        f"{world_size}: set generation.tp_size to the GPUs per node")
    if g.loop == "own" and g.mode == "zero3":
        problems.append("generation.loop = 'own' runs on the gathered replica, but "
                        "generation.mode = 'zero3' generates through the ZeRO-3 hooks: set "
                        "generation.loop=auto (or hf), or generation.mode=gathered")
    if g.loop == "own" and (g.cache_implementation != "dynamic" or g.compile):
        problems.append("generation.cache_implementation / generation.compile are options of "
                        "HF generate (generation.loop=hf); generation.loop = 'own' always uses "
                        "a static cache and CUDA graphs (generation.cuda_graph): drop them or "
                        "set generation.loop=hf")
    hf_only = g.loop == "hf" or g.mode == "zero3"
    if hf_only and g.continuous is True:
        problems.append("generation.continuous = true needs our decoding loop, but "
                        f"generation.loop = {g.loop!r} / generation.mode = {g.mode!r} use HF "
                        "generate: set generation.continuous=auto, or generation.loop=own")
    if hf_only and cfg.ppo.rollout_correction != "none":
        problems.append(f"ppo.rollout_correction = {cfg.ppo.rollout_correction!r} needs the "
                        "rollout log-probs of our decoding loop, but generation.loop = "
                        f"{g.loop!r} / generation.mode = {g.mode!r} use HF generate: set "
                        "generation.loop=own (mode gathered or tensor_parallel), or "
                        "ppo.rollout_correction=none")
    if g.loop == "own" and cfg.policy.attn_implementation not in ("sdpa", "eager"):
        problems.append(f"generation.loop = 'own' supports the sdpa and eager attention kernels, "
                        f"not policy.attn_implementation = {cfg.policy.attn_implementation!r}: "
                        "set generation.loop=auto (HF generate for this kernel)")
    return problems


def _deepspeed_problems(cfg: Config, world_size: int) -> list[str]:
    """Offload needs ZeRO-3; a DeepSpeed config file must exist."""
    problems = []
    for role in ROLES:
        d = getattr(cfg.deepspeed, role)
        if d.offload_param and d.zero_stage not in (3, "auto"):
            problems.append(f"deepspeed.{role}.offload_param = True needs "
                            f"deepspeed.{role}.zero_stage = 3 (got {d.zero_stage}); or set "
                            f"deepspeed.{role}.offload_param=false")
        if d.config is not None and not Path(d.config).exists():
            problems.append(f"deepspeed.{role}.config = {d.config!r}: file does not exist")
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
    if t.register_every and not t.register_copy:
        problems.append(f"tracking.register_every = {t.register_every} with "
                        "tracking.register_copy=false would register checkpoint directories by "
                        "reference, which checkpoint.keep_last pruning deletes later: set "
                        "tracking.register_copy=true, or tracking.register_every=0 (the final "
                        "export, never pruned, is registered either way)")
    limit = watchdog_limit_s(cfg)
    if limit is not None and limit >= 60 * cfg.dist_timeout_minutes:
        problems.append(f"watchdog_minutes = {cfg.watchdog_minutes:g} must be below "
                        f"dist_timeout_minutes = {cfg.dist_timeout_minutes:g} (else a stuck "
                        "collective times out before the watchdog names the missing ranks): "
                        "lower it, or leave it null")
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).exists():
        problems.append(f"resume = {cfg.resume!r}: must be auto, never or an existing checkpoint "
                        "directory")
    return problems


def heads_problem(heads: int, kv_heads: int, size: int, where: str) -> str | None:
    """Ulysses' head split (engine/sequence_parallel.py asks here too): the attention heads
    divide by the SP size, the KV heads divide by it or it by them (then replicated)."""
    if heads % size:
        return (f"deepspeed.sequence_parallel_size = {size}: {where} has {heads} attention "
                f"heads, not divisible by {size}; use a size that divides {heads}")
    if kv_heads % size and size % kv_heads:
        return (f"deepspeed.sequence_parallel_size = {size}: {where} has {kv_heads} KV heads; "
                f"the size must divide them or be a multiple of them")
    return None


def _model_heads(path: str | None, arch: dict | None) -> tuple[int, int] | None:
    """(attention heads, KV heads) from an arch dict or a local config.json (plain json: the
    dry run loads no transformers); None when neither says."""
    import json

    fields = arch
    if fields is None and path is not None and (Path(path) / "config.json").is_file():
        fields = json.loads((Path(path) / "config.json").read_text())
    fields = (fields or {}).get("text_config", fields) or {}
    heads = fields.get("num_attention_heads")
    if heads is None:
        return None
    return int(heads), int(fields.get("num_key_value_heads") or heads)


def sequence_parallel_problems(cfg: Config, world_size: int) -> list[str]:
    """deepspeed.sequence_parallel_size: divides the world size and every sharded model's heads
    (those whose shape can be read without loading them), with an attention kernel Ulysses
    takes."""
    n, problems = cfg.deepspeed.sequence_parallel_size, []
    if n == 1:
        return problems
    if world_size % n:
        problems.append(f"deepspeed.sequence_parallel_size = {n} must divide the world size "
                        f"{world_size} (the data-parallel group is world / {n})")
    models = [("policy", cfg.policy.path, cfg.policy.arch, cfg.policy.attn_implementation)]
    if cfg.reference.path is not None:
        models.append(("reference", cfg.reference.path, None, cfg.policy.attn_implementation))
    if cfg.ppo.uses_critic and (cfg.value.path or cfg.value.arch):
        models.append(("value", cfg.value.path, cfg.value.arch, cfg.value.attn_implementation))
    for role, path, arch, attn in models:
        if attn == "eager":
            problems.append(f"deepspeed.sequence_parallel_size = {n}: {role}.attn_implementation "
                            "= eager needs the full L x L mask Ulysses drops; use sdpa or "
                            "flash_attention_2")
        heads = _model_heads(path, arch)
        problem = heads and heads_problem(*heads, n, f"the {role} model")
        if problem:
            problems.append(problem)
    return problems


def _non_finite(tree, key: str) -> str | None:
    """The dotted key of the first NaN or infinite number in a free-form map (policy.arch)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            bad = _non_finite(v, f"{key}.{k}")
            if bad:
                return bad
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            bad = _non_finite(v, f"{key}[{i}]")
            if bad:
                return bad
    elif isinstance(tree, float) and not math.isfinite(tree):
        return f"{key} = {tree}"
    return None


def watchdog_limit_s(cfg: Config) -> float | None:
    """Seconds without progress after which the watchdog stops a rank (None: off): the
    configured watchdog_minutes, or by default the collective timeout less half the reward
    service's margin (`call_deadline`), so that a reward call's own deadline comes first, then
    the watchdog, then the collective timeout."""
    if cfg.watchdog_minutes is not None:
        return 60.0 * cfg.watchdog_minutes if cfg.watchdog_minutes > 0 else None
    timeout_s = 60.0 * cfg.dist_timeout_minutes
    return timeout_s - 0.5 * (timeout_s - call_deadline(cfg.dist_timeout_minutes, 2))


def _recipe_problems(cfg: Config, world_size: int) -> list[str]:
    """The RLHF recipe's extras: the critic warm-up, the policy's EMA and PPO-ptx."""
    p, problems = cfg.ppo, []
    if p.critic_warmup_iterations and not p.uses_critic:
        problems.append(f"ppo.critic_warmup_iterations = {p.critic_warmup_iterations} warms up "
                        f"a value model, but ppo.advantage_estimator = "
                        f"{p.advantage_estimator!r} has none: set it to 0, or use "
                        "ppo.advantage_estimator=gae")
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


def job_accum_steps(cfg: Config, job: str, world_size: int) -> int:
    """Micro-batches accumulated per optimizer step on each rank of `ds-ppo sft` / `ds-ppo rm`
    (`job`: the section's name)."""
    j = getattr(cfg, job)
    return max(1, j.batch_size // (j.micro_batch_size * world_size))


def validate_job(cfg: Config, job: str, world_size: int) -> None:
    """Cross-field checks of a supervised job (`job`: sft or rm), before any model loads; raises
    ConfigError listing every problem with the key and a value that works."""
    j, problems = getattr(cfg, job), []
    if j.batch_size % (j.micro_batch_size * world_size):
        problems.append(
            f"{job}.batch_size = {j.batch_size} must be a multiple of {job}.micro_batch_size * "
            f"world size = {j.micro_batch_size} * {world_size} (e.g. {job}.batch_size="
            f"{j.micro_batch_size * world_size * max(1, j.batch_size // (j.micro_batch_size * world_size))})")
    if cfg.data.path is None:
        columns = ("data.prompt_key + sft.completion_key, or data.messages_key" if job == "sft"
                   else "rm.chosen_key + rm.rejected_key (and data.prompt_key)")
        problems.append(f"data.path = None: ds-ppo {job} trains on a dataset file with columns "
                        f"{columns}; set data.path")
    if job == "rm" and j.chosen_key == j.rejected_key:
        problems.append(f"rm.chosen_key = rm.rejected_key = {j.chosen_key!r}: name two columns")
    problems += _source_problems(cfg, ("policy",))
    d = cfg.deepspeed.policy
    if d.offload_param and d.zero_stage not in (3, "auto"):
        problems.append(f"deepspeed.policy.offload_param = True needs deepspeed.policy."
                        f"zero_stage = 3 (got {d.zero_stage}); or set "
                        "deepspeed.policy.offload_param=false")
    if d.config is not None and not Path(d.config).exists():
        problems.append(f"deepspeed.policy.config = {d.config!r}: file does not exist")
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).exists():
        problems.append(f"resume = {cfg.resume!r}: must be auto, never or an existing checkpoint "
                        "directory")
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def _env_problems(cfg: Config, world_size: int) -> list[str]:
    """The env section against the rest (multi-turn rollouts)."""
    from ds_ppo.redaction import redact_url

    e, out = cfg.env, []
    if e.function is not None and e.url is not None:
        out.append(f"env: set one of env.function ({e.function!r}) and env.url "
                   f"({redact_url(e.url)!r}), not both")
    if e.url is not None and not e.url.startswith(("http://", "https://")):
        out.append(f"env.url = {redact_url(e.url)!r} must start with http:// or https://")
    if e.function is not None and ":" not in e.function:
        out.append(f"env.function = {e.function!r} must look like module:Name")
    if not e.enabled:
        return out
    if e.max_total_tokens < cfg.generation.max_new_tokens:
        out.append(f"env.max_total_tokens = {e.max_total_tokens} is less than one turn "
                   f"(generation.max_new_tokens = {cfg.generation.max_new_tokens}); raise it")
    if cfg.data.eval_split is not None:
        out.append(f"data.eval_split = {cfg.data.eval_split!r}: evaluation runs single-turn "
                   "and is not available with an env yet; set data.eval_split=null")
    if any(not s for s in e.stop):
        out.append(f"env.stop = {e.stop}: an empty string would end every turn at once")
    return out


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
    if p.filter_zero_std_groups and n < 2:
        problems.append("ppo.filter_zero_std_groups = true needs groups: set "
                        "ppo.samples_per_prompt >= 2")
    return problems


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
    if cfg.data.ptx_path is not None and p.ptx_coef == 0:
        out.append(f"data.ptx_path = {cfg.data.ptx_path!r} is ignored: ppo.ptx_coef = 0 (set "
                   "e.g. ppo.ptx_coef=0.1 to add its language-modelling loss)")
    if cfg.deepspeed.sequence_parallel_size > 1:
        out.append(f"deepspeed.sequence_parallel_size = {cfg.deepspeed.sequence_parallel_size}: "
                   "checked and planned, but training refuses it in this version (the loop "
                   "does not split its data-parallel group yet; docs/PERFORMANCE.md)")
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
    return out


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
