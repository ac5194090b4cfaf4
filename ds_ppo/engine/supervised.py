"""The one trained model of a supervised job, built like the PPO roles (engine/roles.py: the same
loading under ZeRO-3's `zero.Init`, dropout switch, LoRA, optimizer, LR schedule, DeepSpeed config
template) with the job's batch sizes and length:

- `ds-ppo sft`: the policy, a causal LM (`PolicyRole`);
- `ds-ppo rm`:  a reward model, AutoModelForSequenceClassification (num_labels 1) built from the
  policy section's path or arch (its backbone; a new scalar head) and read at each row's last
  real token by `forward.LastTokenScorer`, as the reward role of `ds-ppo train` reads it
  (`ScorerRole`);
- `ds-ppo dpo`: the policy, as for sft, and beside it (`add_reference`) a frozen reference built
  as `ds-ppo train`'s reference role is (deepspeed.reference: an inference engine, parameters
  offloaded), or with LoRA the policy's base with its adapters off.

All use the policy section (model, optimizer, lora) and deepspeed.policy. The result is held in
`JobEngines`, shaped like `Engines` where checkpoints and exports read it (a `policy`, no
`value`), so engine/checkpoint/save_load.py saves and resumes it unchanged.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ds_ppo.config import Config, job_accum_steps
from ds_ppo.engine import dist, lora, moe
from ds_ppo.engine.ds_config import build_ds_config, resolve_dtype
from ds_ppo.engine.role_objects import PolicyRole, ReferenceRole, ScorerRole
from ds_ppo.engine.roles import (_hidden_size, _init_policy, _init_reference, _load_kwargs,
                                 _model_config, _ready_to_train, _trained_engine, _zero_init_for,
                                 materialize_arch)

log = logging.getLogger("ds_ppo")


@dataclass
class JobEngines:
    """The trained model of a supervised job (as `policy`: the name checkpoints and exports use)."""

    policy: PolicyRole | ScorerRole
    ds_configs: dict[str, dict]
    device: torch.device
    dtype: torch.dtype
    value: None = None  # no second trained model (checkpoint.py skips a missing role)
    lora_bases: dict[str, str] = field(default_factory=dict)
    policy_path: str = ""  # where the policy's initial weights came from (HF dir)
    reference: ReferenceRole | None = None  # frozen, never saved (`add_reference`)


def init_job_engines(cfg: Config, job: str, tokenizer, device: torch.device,
                     total_steps: int, stage, load_universal: bool = False,
                     autoep: bool = False, scorer: bool = False) -> JobEngines:
    """Build the job's model (`job`: its section's name; `scorer`: a reward model, else a causal
    LM) with an LR schedule of `total_steps` optimizer steps; a random-init policy.arch is
    materialised on rank 0 first (under output_dir). `load_universal`: it will load a
    checkpoint saved at another world size; `autoep`: with AutoEP's layers even at
    expert_parallel_size 1 (`build_ds_config`)."""
    world = dist.world_size()
    dtype = resolve_dtype(cfg.policy.dtype)
    cfg = stage.apply(cfg)  # the ZeRO stage (plan/fit.py: auto by fit, as `ds-ppo plan --job`)
    if dist.is_main():
        log.info("ZeRO stage (world size %d): %s%s", world, stage.describe(),
                 f"; auto: {stage.reason}" if stage.auto else "")
    if cfg.policy.arch is not None:
        path = materialize_arch(cfg.policy.arch, tokenizer,
                                Path(cfg.output_dir) / "init_models" / "policy", cfg.seed)
    else:
        path = cfg.policy.path
    section = getattr(cfg, job)
    batch = (section.micro_batch_size, job_accum_steps(cfg, job, world))
    if not scorer:
        engine, ds = _init_policy(cfg, path, world, device, dtype, load_universal, batch,
                                  total_steps, autoep)
        role = PolicyRole(engine)
    else:
        engine, ds = _init_scorer(cfg, path, world, device, dtype, batch, total_steps,
                                  load_universal, autoep)
        role = ScorerRole(engine)
    role.aux_coef = moe.aux_coef(role.module.config, cfg.policy.moe_aux_loss_coef)
    lora_bases = {"policy": path} if cfg.policy.lora is not None else {}
    if lora_bases and dist.is_main():
        log.info("LoRA %s", lora.describe_trainable(job, role.module))
    return JobEngines(policy=role, ds_configs={job: ds}, device=device, dtype=dtype,
                      lora_bases=lora_bases, policy_path=path)


def add_reference(cfg: Config, engines: JobEngines, path: str | None) -> None:
    """The frozen reference beside a job's causal-LM policy, in `engines.reference`: the model at
    `path` (None: the policy's initial weights) as an inference engine under deepspeed.reference
    (`engine.roles._init_reference`, as `ds-ppo train` builds its reference); with policy.lora
    and no `path`, the policy's base with its adapters off (no second model)."""
    if path is None and cfg.policy.lora is not None:
        engines.reference = ReferenceRole(lora.AdaptersOff(engines.policy.engine))
        return
    engine, ds = _init_reference(cfg, path or engines.policy_path, dist.world_size(),
                                 engines.dtype)
    engines.ds_configs["reference"] = ds
    engines.reference = ReferenceRole(engine)


def _init_scorer(cfg: Config, path: str, world: int, device, dtype, batch: tuple[int, int],
                 total_steps: int, load_universal: bool = False, autoep: bool = False):
    """A sequence-classification model (one label, no bias, as a reward model and the value
    head built from it are) from `path`'s backbone, inside a `LastTokenScorer`, trained."""
    from transformers import AutoModelForSequenceClassification

    from ds_ppo.engine.forward import LastTokenScorer

    config, dropped = _model_config(path, cfg.policy.disable_dropout, num_labels=1)
    ds = build_ds_config(cfg, "policy", world, dtype, _hidden_size(path), load_universal, batch,
                         autoep)
    with _zero_init_for(ds):
        model = AutoModelForSequenceClassification.from_pretrained(
            path, config=config, **_load_kwargs(dtype, cfg.policy.attn_implementation))
    model = _ready_to_train(model, dropped, cfg.policy, tile=False)  # rm tiles no MLP
    if cfg.policy.lora is not None:  # the scalar head is trained fully
        model = lora.add_adapters(model, cfg.policy.lora, cfg.seed, head="score", causal_lm=False)
    return _trained_engine(LastTokenScorer(model), model, ds, cfg.policy, device,
                           cfg.deepspeed.policy.offload_optimizer, total_steps)
