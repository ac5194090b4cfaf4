"""Checks of the models a config names: path or arch, optimizer clipping and betas, LoRA and
the reference's source, and the attention heads and kernel sequence parallelism needs (read
from an arch or a local config.json, without loading any model)."""
from __future__ import annotations

import math
from pathlib import Path

from ds_ppo.config.sections import Config
from ds_ppo.role_names import TRAINED_ROLES


def source_problems(cfg: Config, roles) -> list[str]:
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


def model_problems(cfg: Config, world_size: int) -> list[str]:
    """Each model role: path or arch, clipping, LoRA and the reference's source."""
    problems = source_problems(cfg, TRAINED_ROLES)
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


def model_fields(path: str | None, arch: dict | None) -> dict:
    """A model's config fields from an arch dict or a local config.json (plain json: the dry run
    loads no transformers), a multimodal config's text part; {} when neither is readable."""
    import json

    fields = arch
    if fields is None and path is not None and (Path(path) / "config.json").is_file():
        fields = json.loads((Path(path) / "config.json").read_text())
    fields = fields or {}
    return {"model_type": fields.get("model_type"), **(fields.get("text_config") or fields)}


def _model_heads(path: str | None, arch: dict | None) -> tuple[int, int] | None:
    """(attention heads, KV heads) from an arch dict or a local config.json; None when neither
    says."""
    fields = model_fields(path, arch)
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


# the model types whose AutoEP layers ds_ppo maps back to Hugging Face weights (generation
# replica, export: engine/moe.py, `ep_weights`): fused gate_up_proj / down_proj experts, a
# top-k softmax router, no shared expert
EP_MODEL_TYPES = ("qwen3_moe", "mixtral")


def expert_parallel_problems(cfg: Config, world_size: int,
                             resumed: frozenset[str] = frozenset()) -> list[str]:
    """deepspeed.<role>.expert_parallel_size (DeepSpeed AutoEP) of the trained roles: divides
    the world size and the experts of a layer, on a model type AutoEP and ds_ppo's weight
    mapping cover, without the features it does not combine with. `resumed`: roles that keep
    AutoEP's layers at size 1 too (they resume a checkpoint saved with them)."""
    problems = []
    roles = ["policy"] + (["value"] if cfg.ppo.uses_critic else [])
    for role in roles:
        n = getattr(cfg.deepspeed, role).expert_parallel_size
        if n == 1 and role not in resumed:
            continue
        key = (f"deepspeed.{role}.expert_parallel_size = {n}" if n > 1 else
               f"the {role} resumed from an expert-parallel checkpoint (AutoEP's layers, N = 1)")
        fix = (f"set deepspeed.{role}.expert_parallel_size=1" if n > 1 else
               "start a new run from the checkpoint's export, its hf directory")
        if world_size % n:
            problems.append(f"{key} must divide the world size {world_size} (each group of {n} "
                            f"ranks holds one copy of the experts); use a divisor of {world_size}")
        path, arch = getattr(cfg, role).path, getattr(cfg, role).arch
        if role == "value" and path is None and arch is None:  # it starts from another model
            path, arch = ((cfg.reward.model, None) if cfg.value.init_from == "reward"
                          else (cfg.policy.path, cfg.policy.arch))
        fields = model_fields(path, arch)
        model_type = fields.get("model_type")
        experts = fields.get("num_experts") or fields.get("num_local_experts")
        if model_type is not None and model_type not in EP_MODEL_TYPES:
            problems.append(f"{key}: the {role} model is {model_type!r}; expert parallelism "
                            f"runs on {', '.join(EP_MODEL_TYPES)} mixture-of-experts models; "
                            f"set deepspeed.{role}.expert_parallel_size=1")
        elif experts and int(experts) % n:
            problems.append(f"{key} must divide the {role} model's {experts} experts per "
                            "layer; use one of "
                            f"{[d for d in range(1, int(experts) + 1) if int(experts) % d == 0]}")
        for what, on in ((f"{role}.lora", getattr(cfg, role).lora is not None),
                         ("policy.ema_decay", role == "policy" and cfg.policy.ema_decay),
                         ("deepspeed.sequence_parallel_size > 1",
                          cfg.deepspeed.sequence_parallel_size > 1),
                         ("generation.mode = zero3",
                          role == "policy" and cfg.generation.mode == "zero3")):
            if on:
                problems.append(f"{key} does not combine with {what}: drop one (expert "
                                f"parallelism: {fix})")
    return problems
