"""Each role's DeepSpeed config: a JSON template from ds_configs/ with every batch-size,
precision and clipping key filled from the one ds_ppo config (no number lives in two places)."""
from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import torch

from ds_ppo.config import Config, grad_accum_steps
from ds_ppo.errors import ConfigError
from ds_ppo.role_names import TRAINED_ROLES, Role

log = logging.getLogger("ds_ppo")


def resolve_dtype(name: str) -> torch.dtype:
    """`auto` = bf16 on an accelerator that supports it, else fp32 (CPU runs are fp32)."""
    if name == "auto":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _resolve_auto(zero: dict[str, Any], hidden_size: int) -> None:
    # The usual hidden-size heuristics (as HF's Trainer integration fills them).
    auto = {
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
    }
    for key, value in auto.items():
        if zero.get(key) == "auto":
            zero[key] = value
    for key in [k for k, v in zero.items() if v == "auto"]:
        del zero[key]  # DeepSpeed's own default


def template_path(cfg: Config, role: Role, world_size: int = 1, load_universal: bool = False
                  ) -> Path:
    from ds_ppo.engine.ds_templates import default_template

    d = getattr(cfg.deepspeed, role)
    if d.config is not None:
        return Path(d.config)
    return default_template(role, d.stage(world_size, load_universal), d.offload_optimizer,
                            d.offload_param)


def build_ds_config(cfg: Config, role: Role, world_size: int, dtype: torch.dtype,
                    hidden_size: int, load_universal: bool = False,
                    batch: tuple[int, int] | None = None, autoep: bool = False) -> dict[str, Any]:
    """The filled DeepSpeed config dict for `role` (train roles get optimizer-step batch sizes,
    inference roles the scoring micro-batch). `batch`: (micro-batch size, accumulation steps)
    of a trained role that is not PPO's (`ds-ppo sft` / `ds-ppo rm`: their section's).
    `autoep`: a trained role gets AutoEP's layers even at expert_parallel_size 1 (it resumes a
    checkpoint saved with them: their parameter names are not the Hugging Face model's)."""
    path = template_path(cfg, role, world_size, load_universal)
    try:
        ds = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"deepspeed.{role}.config = {str(path)!r}: cannot read it: {e}") from None
    ds = copy.deepcopy(ds)
    d = getattr(cfg.deepspeed, role)
    if role in TRAINED_ROLES:
        micro, accum = batch or (cfg.ppo.micro_batch_size, grad_accum_steps(cfg, world_size))
        clip = getattr(cfg, role).max_grad_norm
        ds["gradient_clipping"] = float(clip) if clip is not None else 0.0
    else:
        micro, accum = cfg.ppo.score_micro_batch_size or cfg.ppo.micro_batch_size, 1
        ds.pop("gradient_clipping", None)
    ds["train_micro_batch_size_per_gpu"] = micro
    ds["gradient_accumulation_steps"] = accum
    ds["train_batch_size"] = micro * accum * world_size
    ds["bf16"] = {"enabled": dtype == torch.bfloat16}
    ds["fp16"] = {"enabled": dtype == torch.float16}
    zero = ds.setdefault("zero_optimization", {})
    # a frozen role under ZeRO 1/2 has nothing to partition: it runs as a plain replica (stage 0)
    stage = d.stage(world_size, load_universal)
    zero["stage"] = stage if role in TRAINED_ROLES or stage == 3 else 0
    if d.offload_optimizer and role in TRAINED_ROLES:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    elif "offload_optimizer" in zero and not d.offload_optimizer and d.config is None:
        zero.pop("offload_optimizer")
    if d.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    elif "offload_param" in zero and d.config is None:
        zero.pop("offload_param")
    if zero["stage"] == 3:  # deepspeed.<role>.zero3: the config's knobs win over the file's
        zero.update(d.zero3.ds_keys())
    _resolve_auto(zero, hidden_size)
    if load_universal and role in TRAINED_ROLES:
        ds.setdefault("checkpoint", {})["load_universal"] = True
    if (d.expert_parallel_size > 1 or autoep) and role in TRAINED_ROLES:  # AutoEP (engine/moe.py)
        ds["expert_parallel"] = {"enabled": True, "autoep_size": d.expert_parallel_size}
    ds.setdefault("zero_allow_untested_optimizer", True)
    ds.setdefault("steps_per_print", 10**9)
    ds.setdefault("wall_clock_breakdown", False)
    from ds_ppo.engine.ds_templates import auto_keys

    if left := auto_keys(ds):  # DeepSpeed reads some "auto" strings silently ("auto" is truthy)
        raise ConfigError(f"deepspeed.{role}.config = {str(path)!r}: {', '.join(left)} "
                          "still \"auto\" after ds_ppo filled the keys it knows (batch sizes, "
                          "precision, clipping, ZeRO bucket sizes): give them values in the "
                          "file, or remove them for DeepSpeed's defaults")
    return ds


def describe_stages(ds_configs: dict[str, dict], world_size: int, choice,
                    load_universal: bool = False) -> str:
    """One line: the ZeRO stage each role's engine runs, `(auto)` where zero_stage auto chose it,
    and why (`ZeRO stage per role (world size 1): policy 0 (auto), value 0 (auto), ...; auto:
    <reason>`). `choice`: the run's StageChoice (plan/fit.py's zero_stages)."""
    parts = [f"{role} {ds.get('zero_optimization', {}).get('stage', 0)}"
             + (" (auto)" if role in choice.auto else "")
             for role, ds in ds_configs.items()]
    return (f"ZeRO stage per role (world size {world_size}"
            + (", universal checkpoint" if load_universal else "") + "): " + ", ".join(parts)
            + (f"; auto: {choice.reason}" if choice.auto else ""))
