"""The one typed configuration tree of ds_ppo.

Every knob lives here, documented once (the descriptions become ``ds-ppo config --help``
output). A run's config is loaded from YAML (or a packaged preset name), then dotted
``key=value`` overrides are applied, then it is validated once, before any model loads.
The tree is frozen: nothing changes it mid-run.

The parts: ``sections`` (the typed tree: one class per section, in one module per job:
``role_sections``, ``rollout_sections``, ``algorithm``, ``data``, ``run_sections``, ``engines``,
``jobs``), ``load``
(YAML, presets, overrides, the key reference), ``checks`` (cross-field validation and
warnings; its batch-size rules in ``batches``, the models' in ``model_checks``) and
``derived`` (values resolved from several keys). Import what you need from ``ds_ppo.config``:
it re-exports every public name.
"""
from ds_ppo.config.batches import (grad_accum_steps, job_accum_steps, optimizer_steps,
                                   steps_per_iteration)
from ds_ppo.config.checks import (config_warnings, placement_problems, validate,
                                  validate_job)
from ds_ppo.config.derived import (critic_warmup, job_config, lora_output_head, max_model_tokens,
                                   max_response_tokens, reference_from_policy_base,
                                   uses_reference, value_init_source, watchdog_limit_s, world_size_from_env)
from ds_ppo.config.load import (MAX_YAML_VALUES, PRESETS_DIR, apply_overrides, describe,
                                load_config, preset_names, preset_path, yaml_value)
from ds_ppo.config.sections import (CheckpointConfig, Config, DataConfig, DeepSpeedConfig,
                                    DistillConfig, DPOConfig, EnvConfig, PairJob,
                                    GenerationConfig, LoraConfig, ModelSource, Optim, PolicyConfig,
                                    PPOConfig, ReferenceConfig, ReferenceDeepSpeed, RewardConfig,
                                    RMConfig, RoleDeepSpeed, Section, SFTConfig,
                                    SupervisedJob, TeacherConfig, TrackingConfig, ValueConfig)

__all__ = [
    "MAX_YAML_VALUES", "PRESETS_DIR", "CheckpointConfig", "Config", "DataConfig",
    "DeepSpeedConfig", "DistillConfig", "DPOConfig", "EnvConfig", "PairJob", "GenerationConfig",
    "LoraConfig", "ModelSource", "Optim",
    "PPOConfig", "PolicyConfig", "ReferenceConfig", "ReferenceDeepSpeed", "RewardConfig",
    "RMConfig", "RoleDeepSpeed", "SFTConfig", "Section", "SupervisedJob", "TeacherConfig",
    "TrackingConfig", "ValueConfig", "apply_overrides", "config_warnings", "critic_warmup", "describe",
    "grad_accum_steps", "job_accum_steps", "job_config", "load_config", "lora_output_head", "max_model_tokens",
    "max_response_tokens", "optimizer_steps", "placement_problems", "preset_names", "preset_path",
    "reference_from_policy_base", "steps_per_iteration", "uses_reference", "validate", "validate_job",
    "value_init_source", "watchdog_limit_s", "world_size_from_env", "yaml_value",
]
