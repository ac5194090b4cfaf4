"""The model roles, each its own DeepSpeed engine (pattern: DeepSpeed-Chat's rlhf_engine.py,
one `_init_<role>` per role).

- policy:    causal LM, trained (ZeRO-3 by default), AdamW + warm-up schedule, grad clipping.
- value:     HF backbone + per-token scalar head (AutoModelForTokenClassification, 1 label),
             trained; initialised from the reward model or the policy. Only for
             ppo.advantage_estimator = gae: critic-free estimators build none.
- reference: the initial policy, frozen, inference engine with parameters offloaded to CPU; with
             LoRA, the policy engine with its adapters switched off (`engine/lora.py`).
- teacher:   on-policy distillation's teacher (ppo.advantage_estimator = distill): a frozen
             causal LM with the student's vocabulary, an inference engine like the reference.
- reward:    an HF sequence-classification model wrapped so that its engine's forward returns
             the score at the last real token (inference engine), a Python function or an HTTP
             service (ds_ppo.rewards.service).

Models load with `from_pretrained` while a `HfDeepSpeedConfig` for their role is alive, so under
ZeRO-3 transformers builds them inside `deepspeed.zero.Init`: a large model is never whole on one
rank. A random-init `arch` is built once on rank 0, saved, and loaded the same way (building from a
config under zero.Init fails in transformers 5 when the config has a pad_token_id).
"""
from __future__ import annotations

import gc
import logging
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ds_ppo.config import (Config, optimizer_steps, reference_from_policy_base,
                           uses_reference, value_init_source)
from ds_ppo.engine import dist, lora, moe, sequence_parallel
from ds_ppo.engine.forward import causal_lm
from ds_ppo.engine.ds_config import build_ds_config, describe_stages, resolve_dtype
from ds_ppo.engine.tiled_mlp import tile_mlps
from ds_ppo.engine.role_objects import (PolicyRole, ReferenceRole, RewardRole, TeacherRole,
                                        ValueRole)

log = logging.getLogger("ds_ppo")

RewardFn = Callable[[list[str], list[str]], list[float]]


@dataclass
class Engines:
    """Everything the PPO loop calls into: each model role behind the operations the stages
    use (engine/role_objects.py). `reward_fn` is set when the reward is a function (or a
    `RewardService` for reward.url), `reward` when it is a model."""

    policy: PolicyRole  # a DeepSpeedEngine around AutoModelForCausalLM
    value: ValueRole | None  # around AutoModelForTokenClassification (num_labels=1);
    # None with a critic-free estimator (ppo.advantage_estimator other than gae)
    reference: ReferenceRole | None  # an inference engine around AutoModelForCausalLM, or
    # lora.AdaptersOff (the LoRA policy's engine with its adapters off); None when nothing reads
    # it (distillation without a KL loss: config.uses_reference)
    reward: RewardRole | None  # an inference engine around forward.LastTokenScorer
    reward_fn: RewardFn | None
    ds_configs: dict[str, dict]  # role -> the filled DeepSpeed config (for tracking artifacts)
    policy_path: str  # where the initial policy weights came from (HF dir)
    device: torch.device
    dtype: torch.dtype
    replica: Any | None = None  # the kept generation replica (generation.keep_replica)
    teacher: TeacherRole | None = None  # on-policy distillation's teacher (teacher section)
    lora_bases: dict[str, str] = field(default_factory=dict)  # LoRA role -> its frozen base's path


# ----------------------------------------------------------------------------- helpers
def _freeze_imported_objects() -> None:
    """Once per process, before the engines load: collect, then move every object that exists
    now (the imported libraries' modules, classes and functions, ~400k) out of the garbage
    collector's view (`gc.freeze`). Each full collection after a load (`_zero_init_for`) then
    scans only the run's own objects: milliseconds instead of 0.1-0.4 s."""
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()


@contextmanager
def _zero_init_for(ds_config: dict):
    """Keep a HfDeepSpeedConfig alive while loading, so transformers partitions at load time
    (ZeRO-3) — and drop it afterwards so later plain models (the generation replica) are not."""
    from transformers.integrations import HfDeepSpeedConfig

    _freeze_imported_objects()
    hf_ds = HfDeepSpeedConfig(ds_config)  # noqa: F841  (kept alive through a weakref)
    try:
        yield
    finally:
        del hf_ds
        gc.collect()


def _hidden_size(path: str) -> int:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path)
    return int(getattr(c.get_text_config(), "hidden_size", 1024))


def without_dropout(config) -> dict[str, float]:
    """Set every dropout probability of a Hugging Face config (and its sub-configs, e.g. a
    multimodal model's text config) to 0 in place: the fields named *dropout* or *pdrop*
    (attention_dropout, hidden_dropout_prob, resid_pdrop, classifier_dropout, ...). Returns the
    fields that were not 0 with their values (sub-config fields as `text_config.name`)."""
    from transformers import PretrainedConfig

    changed = {}
    for name, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            changed.update({f"{name}.{c}": v for c, v in without_dropout(value).items()})
        elif (("dropout" in name or name.endswith("pdrop")) and not isinstance(value, bool)
              and isinstance(value, (int, float))):
            if value:
                changed[name] = value
            setattr(config, name, 0.0)
    return changed


def _model_config(path: str, disable_dropout: bool, **kwargs):
    """The HF config a trained role loads with: dropout off unless the role's
    `disable_dropout` is false; and the dropout probabilities it switched off (restored in the
    configs that checkpoints and exports write: `hf_writer.saved_config`)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, **kwargs)
    return config, (without_dropout(config) if disable_dropout else {})


def _load_kwargs(cfg_dtype: torch.dtype, attn: str) -> dict:
    return {"dtype": cfg_dtype, "attn_implementation": attn}


def _lr_schedule(optimizer, section, total_steps: int):
    """Linear warm-up, then constant or a linear / cosine decay to min_lr_ratio at the last
    optimizer step (a LambdaLR: its step count is saved and restored with the checkpoint)."""
    from torch.optim.lr_scheduler import LambdaLR

    warmup, kind, floor = section.warmup_steps, section.schedule, section.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        decay = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * decay

    return LambdaLR(optimizer, factor)


def _optimizer(params, section, device: torch.device, offload: bool):
    kw = dict(lr=section.lr, betas=tuple(section.betas), eps=section.eps,
              weight_decay=section.weight_decay)
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **kw)
    if device.type == "cuda":
        return torch.optim.AdamW(params, fused=True, **kw)
    return torch.optim.AdamW(params, foreach=True, **kw)


def _initialize(model, ds_config: dict, optimizer=None, scheduler=None):
    import deepspeed

    expert_parallel = ds_config.get("expert_parallel", {}).get("enabled", False)
    if expert_parallel:  # AutoEP replaces each MoE block inside deepspeed.initialize
        moe.autoep_compat()
    elif ds_config.get("zero_optimization", {}).get("stage") == 3:
        # a mixture-of-experts block is one ZeRO-3 leaf: its parameters are gathered at its
        # entry, whichever experts this rank's tokens reach (no hang when a rank skips some)
        dist.set_zero3_leaf_modules(model, moe.moe_blocks(model))
    # AutoEP builds its layers from random-init modules before copying the weights in: with a
    # stream of its own, the roles built after this one (the value head's init) draw what
    # they draw without expert parallelism
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices) if expert_parallel else nullcontext():
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          lr_scheduler=scheduler, config=ds_config)
    return engine


def _ready_to_train(model, dropped: dict[str, float], section, tile: bool = True):
    """A loaded model made ready to train as its section says: the dropout probabilities
    switched off recorded (exports write them back), gradient checkpointing, TiledMLP (with
    `tile`), no KV cache."""
    model.ds_ppo_dropout = dropped
    if section.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if tile and section.tiled_mlp:
        tile_mlps(model)
    model.config.use_cache = False
    return model


def _trained_engine(module, model, ds_config: dict, section, device: torch.device,
                    offload: bool, total_steps: int):
    """(The DeepSpeed engine that trains `module`, ds_config): AdamW over `model`'s trainable
    parameters (all, or its LoRA adapters and fully trained heads) with the section's LR
    schedule over `total_steps` optimizer steps."""
    opt = _optimizer(lora.trainable(model), section, device, offload)
    return _initialize(module, ds_config, opt, _lr_schedule(opt, section, total_steps)), ds_config


# ------------------------------------------------------------------ initial weights
def materialize_arch(arch: dict, tokenizer, out_dir: Path, seed: int, key: str = "policy.arch"
                     ) -> str:
    """Build a random-init causal LM from `arch` on rank 0 and save it (with the tokenizer) so every
    role loads identical starting weights with from_pretrained. Returns the directory.

    Every rank first builds the HF config itself, so a bad `arch` fails on all ranks alike
    (a rank-0-only error would leave the others waiting at the barrier)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_ppo.errors import ConfigError

    fields = dict(arch)
    model_type = fields.pop("model_type")
    fields.setdefault("vocab_size", len(tokenizer))
    fields.update(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"{key} = {arch!r}: transformers cannot build this config: {e}") \
            from None
    out_dir = Path(out_dir)

    def build():  # rank 0 alone; a large arch takes long, the others wait without a timeout
        if (out_dir / "config.json").exists():
            return
        # a stream of its own: what follows (the value head's init) must not depend on whether
        # this process built the model or found it on disk (a restart), nor on the rank
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out_dir)
        log.info("built random-init %s model (%.2fM params) at %s", model_type,
                 sum(p.numel() for p in model.parameters()) / 1e6, out_dir)
    dist.main_does(build, out_dir.parent, f"building the random-init {key} model")
    return str(out_dir)


# ------------------------------------------------------------------------ the roles
def _init_policy(cfg: Config, path: str, world: int, device, dtype, universal: bool,
                 batch: tuple[int, int] | None = None, total_steps: int | None = None,
                 autoep: bool = False):
    """The policy's engine; `batch` (micro-batch, accumulation) and `total_steps` (of the LR
    schedule) for a job other than PPO (`ds-ppo sft`), else from the ppo section; `autoep`:
    AutoEP's layers even at expert_parallel_size 1 (`build_ds_config`)."""
    from transformers import AutoModelForCausalLM

    ds = build_ds_config(cfg, "policy", world, dtype, _hidden_size(path), universal, batch,
                         autoep)
    config, dropped = _model_config(path, cfg.policy.disable_dropout)
    with _zero_init_for(ds):
        model = AutoModelForCausalLM.from_pretrained(
            path, config=config, **_load_kwargs(dtype, cfg.policy.attn_implementation))
    model = _ready_to_train(model, dropped, cfg.policy)
    if cfg.policy.lora is not None:
        head = lora.adapts_output_head(cfg.policy.lora, cfg.policy.arch is not None, model,
                                       None if cfg.policy.arch is not None else path)
        model = lora.add_adapters(model, cfg.policy.lora, cfg.seed, output_head=head)
    steps = total_steps if total_steps is not None else optimizer_steps(cfg, "policy")
    return _trained_engine(model, model, ds, cfg.policy, device,
                           cfg.deepspeed.policy.offload_optimizer, steps)


def _value_source(cfg: Config, policy_path: str, value_arch_path: str | None,
                  reward_shares_tokenizer: bool) -> str:
    """The value model's weights (`config.value_init_source`). It reads the policy's token ids,
    so it can start from the reward model only when the two share a tokenizer (auto then falls
    back to the policy)."""
    mode = value_init_source(cfg)
    if mode == "reward" and not reward_shares_tokenizer:
        if cfg.value.init_from == "auto":
            mode = "policy"
        else:
            from ds_ppo.errors import ConfigError

            raise ConfigError("value.init_from = 'reward' needs the reward model to share the "
                              "policy's tokenizer (the value model reads policy token ids); use "
                              "value.init_from=policy")
    if mode == "reward":
        return cfg.reward.model
    if mode == "path":
        return value_arch_path or cfg.value.path
    return policy_path


def value_head_mapping(config) -> dict[str, str] | None:
    """Checkpoint key renames that carry a sequence-classification export's `score` head (a
    reward model: AutoModelForSequenceClassification, num_labels 1) into the per-token head of
    the AutoModelForTokenClassification built from `config`: None when that head is `score`
    too (Llama, Qwen, Mistral, ...: loaded as is), else score -> its head (e.g. GPT-2's
    `classifier`). Decided on an empty (meta) model, before any weight loads."""
    from transformers import AutoModelForTokenClassification

    if not any(a.endswith("ForSequenceClassification") for a in config.architectures or ()):
        return None
    with torch.device("meta"):
        probe = AutoModelForTokenClassification.from_config(config)
    if hasattr(probe, "score"):
        return None
    return {r"^score\.": "classifier."}


def load_value_model(source: str, config, ds_config: dict | None = None, **kwargs):
    """The value model: AutoModelForTokenClassification (one label) from `source`, a causal LM,
    a token-classification model or a reward model's export (its score head becomes the value
    head: `value_head_mapping`); with `ds_config`, loaded as that DeepSpeed config partitions it
    (ZeRO-3: inside zero.Init)."""
    from transformers import AutoModelForTokenClassification

    mapping = value_head_mapping(config)  # before zero.Init: the probe is an empty model
    if mapping is not None:
        kwargs["key_mapping"] = mapping
    with _zero_init_for(ds_config) if ds_config is not None else nullcontext():
        return AutoModelForTokenClassification.from_pretrained(source, config=config, **kwargs)


def _init_value(cfg: Config, source: str, world: int, device, dtype, universal: bool,
                autoep: bool = False):
    config, dropped = _model_config(source, cfg.value.disable_dropout, num_labels=1)
    dropped.pop("classifier_dropout", None)  # the value head stays deterministic
    # A value model must be deterministic (no dropout) and match the reward model's head (no bias)
    # so that initialising from a reward model copies its score head exactly.
    config.classifier_dropout = 0.0
    config.token_classification_bias = False
    ds = build_ds_config(cfg, "value", world, dtype, _hidden_size(source), universal,
                         autoep=autoep)
    model = load_value_model(source, config, ds,
                             **_load_kwargs(dtype, cfg.value.attn_implementation))
    model = _ready_to_train(model, dropped, cfg.value)
    if cfg.value.lora is not None:  # the scalar head (score or classifier) is trained fully
        head = "score" if hasattr(model, "score") else "classifier"
        model = lora.add_adapters(model, cfg.value.lora, cfg.seed + 1, head=head, causal_lm=False)
    return _trained_engine(model, model, ds, cfg.value, device,
                           cfg.deepspeed.value.offload_optimizer, optimizer_steps(cfg))


def _init_reference(cfg: Config, path: str, world: int, dtype, role: str = "reference"):
    """A frozen causal LM's inference engine: the reference, or (`role` teacher) the
    distillation teacher, each with its own deepspeed.<role> section."""
    from transformers import AutoModelForCausalLM

    ds = build_ds_config(cfg, role, world, dtype, _hidden_size(path))
    with _zero_init_for(ds):
        model = AutoModelForCausalLM.from_pretrained(
            path, **_load_kwargs(dtype, cfg.policy.attn_implementation))
    model.requires_grad_(False)
    model.eval()
    return _initialize(model, ds), ds


def _init_reward(cfg: Config, world: int, dtype):
    from transformers import AutoModelForSequenceClassification

    from ds_ppo.engine.forward import LastTokenScorer

    path = cfg.reward.model
    ds = build_ds_config(cfg, "reward", world, dtype, _hidden_size(path))
    with _zero_init_for(ds):
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype)
    model.requires_grad_(False)
    model.eval()
    # the engine's root module reads the score at the last real token: every scoring call goes
    # through engine.forward (and ZeRO-3's root hooks)
    return _initialize(LastTokenScorer(model).eval(), ds), ds


def init_engines(cfg: Config, tokenizer, device: torch.device, stages,
                 reward_fn: RewardFn | None, load_universal: bool = False,
                 reward_shares_tokenizer: bool = True,
                 autoep: frozenset[str] = frozenset()) -> Engines:
    """Build all roles. Rank 0 first materialises random-init `arch` models under output_dir.
    `stages`: each role's ZeRO stage (plan/fit.py's zero_stages, a StageChoice), applied here;
    `reward_fn`: the reward callable the config names (rewards/source.py), held in Engines.
    `load_universal`: the trained roles will load a universal checkpoint (world size, ZeRO
    stage or expert-parallel size changed); `autoep`: trained roles built with AutoEP's layers
    even at expert_parallel_size 1 (they resume a checkpoint that holds them so)."""
    # the SP groups of deepspeed.sequence_parallel_size consecutive ranks and the data-parallel
    # groups across them (engine/dist.py); size 1 resets them (a process that builds twice)
    sp_group = sequence_parallel.new_group(cfg.deepspeed.sequence_parallel_size)
    world = dist.world_size()
    dtype = resolve_dtype(cfg.policy.dtype)
    init_dir = Path(cfg.output_dir) / "init_models"
    if cfg.policy.arch is not None:
        policy_path = materialize_arch(cfg.policy.arch, tokenizer, init_dir / "policy", cfg.seed)
    else:
        policy_path = cfg.policy.path
    value_arch = None
    if cfg.value.arch is not None and cfg.ppo.uses_critic:
        value_arch = materialize_arch(cfg.value.arch, tokenizer, init_dir / "value", cfg.seed + 1,
                                      key="value.arch")

    # the engines are built from a copy of the config with each role's ZeRO stage filled in
    cfg = stages.apply(cfg)
    ds_configs = {}
    policy, ds_configs["policy"] = _init_policy(cfg, policy_path, world, device, dtype,
                                                load_universal, autoep="policy" in autoep)
    value, value_src = None, None  # a critic-free estimator has no value model at all
    if cfg.ppo.uses_critic:
        value_src = _value_source(cfg, policy_path, value_arch, reward_shares_tokenizer)
        if dist.is_main():
            log.info("value model starts from %s", value_src)
        value, ds_configs["value"] = _init_value(cfg, value_src, world, device,
                                                 resolve_dtype(cfg.value.dtype), load_universal,
                                                 "value" in autoep)
    if not uses_reference(cfg):  # distillation without a KL loss reads no reference
        reference = None
    elif reference_from_policy_base(cfg):  # no reference engine: the policy without adapters
        reference = lora.AdaptersOff(policy)
    else:
        reference, ds_configs["reference"] = _init_reference(
            cfg, cfg.reference.path or policy_path, world, dtype)
    lora_bases = {role: path for role, path, section in
                  (("policy", policy_path, cfg.policy), ("value", value_src, cfg.value))
                  if section.lora is not None and path is not None}
    for role in lora_bases:
        if dist.is_main():
            engine = policy if role == "policy" else value
            log.info("LoRA %s", lora.describe_trainable(role, engine.module))
    teacher = None
    if cfg.teacher.enabled:  # on-policy distillation: frozen, like the reference
        teacher_path = cfg.teacher.path or materialize_arch(
            cfg.teacher.arch, tokenizer, init_dir / "teacher", cfg.seed + 2, key="teacher.arch")
        teacher, ds_configs["teacher"] = _init_reference(cfg, teacher_path, world, dtype,
                                                         role="teacher")
    reward = None
    if cfg.reward.model is not None:
        reward, ds_configs["reward"] = _init_reward(cfg, world, dtype)
    ema = None
    if cfg.policy.ema_decay is not None:  # engine/ema.py: each rank its own partitions
        from ds_ppo.engine.ema import ParamEMA

        ema = ParamEMA(policy.module, cfg.policy.ema_decay)
    if sp_group is not None:  # Ulysses attention for the split rows' forwards
        for engine in (policy, value, reference, teacher):
            if engine is not None and not isinstance(engine, lora.AdaptersOff):
                sequence_parallel.register(causal_lm(engine).config, sp_group)
        if dist.is_main():
            log.info("sequence parallelism: groups of %d ranks, %d data-parallel ranks; rows of "
                     "at least %d tokens split across a group (policy, reference, value, teacher)",
                     dist.sp_size(), dist.dp_world_size(),
                     cfg.deepspeed.sequence_parallel_min_tokens)
    if dist.is_main():
        log.info("%s", describe_stages(ds_configs, world, stages, load_universal))
    policy_role = PolicyRole(policy, ema, router_replay=cfg.ppo.router_replay)
    policy_role.aux_coef = moe.aux_coef(causal_lm(policy).config, cfg.policy.moe_aux_loss_coef)
    value_role = ValueRole(value) if value is not None else None
    if value_role is not None:
        value_role.aux_coef = moe.aux_coef(causal_lm(value).config, cfg.value.moe_aux_loss_coef)
    return Engines(policy=policy_role, value=value_role,
                   reference=ReferenceRole(reference) if reference is not None else None,
                   teacher=TeacherRole(teacher) if teacher is not None else None,
                   reward=RewardRole(reward) if reward is not None else None,
                   reward_fn=reward_fn, ds_configs=ds_configs, policy_path=policy_path,
                   device=device, dtype=dtype, lora_bases=lora_bases)
