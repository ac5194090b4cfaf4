"""Which DeepSpeed JSON template in ds_configs/ a role starts from.

The templates hold everything about ZeRO and offload; the keys that depend on the run
(batch sizes, precision, clipping) are the string "auto" in every template and are filled in
by the engine from the one config, so no number lives in two places. ``auto_keys`` lists
what is still "auto"; the engine (``build_ds_config``) refuses a config in which anything is
left after filling (a key of the user's own ``deepspeed.<role>.config`` that ds_ppo does not
fill), because DeepSpeed itself accepts some "auto" strings silently (``bf16.enabled =
"auto"`` reads as true).

Imports only the standard library.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ds_ppo.errors import ConfigError
from ds_ppo.role_names import INFERENCE_ROLES, TRAINED_ROLES



def templates_dir() -> Path:
    """The repository's ds_configs/ directory (ds_ppo/ds_configs/ in an installed wheel)."""
    repo = Path(__file__).resolve().parents[2] / "ds_configs"
    if repo.is_dir():
        return repo
    return Path(__file__).resolve().parent / "ds_configs"


def template_name(role: str, zero_stage: int, offload_optimizer: bool = False,
                  offload_param: bool = False) -> str:
    """File name of the default template for a role's ZeRO stage and offload choice.

    Trained roles (policy, value) get a ``zero{stage}_train*.json``; frozen roles (reference,
    reward) a ``zero{0,3}_inference*.json`` (ZeRO 1 and 2 only partition optimizer state and
    gradients, so a frozen role under them is a plain replica: the stage-0 template).
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"deepspeed.{role}.zero_stage = {zero_stage!r} must be 0, 1, 2 or 3")
    if offload_param and zero_stage != 3:
        raise ConfigError(f"deepspeed.{role}.offload_param needs zero_stage 3 (got {zero_stage})")
    if role in INFERENCE_ROLES:
        # offload_optimizer means nothing without an optimizer; it is ignored here.
        if zero_stage < 3:
            return "zero0_inference.json"
        return "zero3_inference_offload_param.json" if offload_param else "zero3_inference.json"
    if role not in TRAINED_ROLES:
        raise ValueError(f"unknown role {role!r} (roles: {TRAINED_ROLES + INFERENCE_ROLES})")
    if offload_optimizer and zero_stage < 2:
        raise ConfigError(
            f"deepspeed.{role}.offload_optimizer: ds_ppo ships optimizer offload templates for "
            f"ZeRO stage 2 and 3 only (got {zero_stage}); set deepspeed.{role}.zero_stage=2 or 3, "
            f"or point deepspeed.{role}.config to your own JSON")
    suffix = {(False, False): "", (True, False): "_offload_optimizer",
              (False, True): "_offload_param", (True, True): "_offload_all"}
    return f"zero{zero_stage}_train{suffix[(offload_optimizer, offload_param)]}.json"


def default_template(role: str, zero_stage: int, offload_optimizer: bool = False,
                     offload_param: bool = False) -> Path:
    """Path of the ds_configs/ template for `role` under the given ZeRO stage and offload.

    role: policy | value (trained) or reference | reward (inference only).
    """
    path = templates_dir() / template_name(role, zero_stage, offload_optimizer, offload_param)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed template {path} is missing from {templates_dir()}")
    return path


def load_template(path: str | Path) -> dict[str, Any]:
    """Read a DeepSpeed JSON template; the error names the file when it is not valid JSON."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config {path} must hold a JSON object")
    return data


def auto_keys(ds_config: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose value is still the string "auto" (e.g. ["bf16.enabled"])."""
    found = []
    for key, value in ds_config.items():
        if isinstance(value, dict):
            found.extend(auto_keys(value, f"{prefix}{key}."))
        elif value == "auto":
            found.append(f"{prefix}{key}")
    return found
