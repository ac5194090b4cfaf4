"""The one typed configuration tree: every knob of ds_ppo, documented once (the descriptions
become ``ds-ppo config --describe`` output and docs/CONFIG.md). ``Config`` is the root; its
sections live in one module per job and are re-exported here:

- ``section_base``: ``Section``, the base of every section (unknown keys are errors, values frozen);
- ``role_sections``: the models (``policy``, ``value``, ``reference``, ``teacher``) and the
  ``reward``;
- ``rollout_sections``: ``generation`` and the multi-turn ``env``;
- ``algorithm``: ``ppo`` and ``distill``;
- ``data``: ``data``;
- ``run_sections``: ``tracking`` and ``checkpoint``;
- ``engines``: ``deepspeed``;
- ``jobs``: ``sft``, ``rm`` and ``dpo``.

Each field's type, default and range are checked while parsing; the rules among a section's
own fields are its ``problems()`` method, next to the fields; rules that join sections or need
the world size live in ``ds_ppo.config.checks``. The tree is frozen: nothing changes it mid-run.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ds_ppo.config.algorithm import DistillConfig, PPOConfig
from ds_ppo.config.section_base import Section
from ds_ppo.config.data import DataConfig
from ds_ppo.config.engines import DeepSpeedConfig, ReferenceDeepSpeed, RoleDeepSpeed
from ds_ppo.config.jobs import DPOConfig, PairJob, RMConfig, SFTConfig, SupervisedJob
from ds_ppo.config.role_sections import (LoraConfig, ModelSource, Optim, PolicyConfig,
                                         ReferenceConfig,
                                 RewardConfig, TeacherConfig, ValueConfig)
from ds_ppo.config.rollout_sections import EnvConfig, GenerationConfig
from ds_ppo.config.run_sections import CheckpointConfig, TrackingConfig

__all__ = [
    "CheckpointConfig", "Config", "DataConfig", "DeepSpeedConfig", "DistillConfig", "DPOConfig",
    "EnvConfig", "GenerationConfig", "LoraConfig", "ModelSource", "Optim", "PairJob",
    "PPOConfig", "PolicyConfig",
    "ReferenceConfig", "ReferenceDeepSpeed", "RewardConfig", "RMConfig", "RoleDeepSpeed",
    "SFTConfig", "Section", "SupervisedJob", "TeacherConfig", "TrackingConfig", "ValueConfig",
]


class Config(Section):
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    value: ValueConfig = Field(default_factory=ValueConfig)
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rm: RMConfig = Field(default_factory=RMConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    output_dir: str = Field("outputs/ds_ppo", description="Where checkpoints, exports, the local "
                            "MLflow store and logs go.")
    seed: int = Field(42, description="Seed of data order, initialisation and sampling.")
    iterations: int = Field(100, gt=0, description="PPO iterations (rollout + update) in total.")
    resume: str = Field(
        "auto", description="auto: continue from output_dir's latest complete checkpoint if any; "
        "never: start fresh (refuses a non-empty checkpoint dir); or a checkpoint directory.")
    log_every: int = Field(1, gt=0, description="Print a progress line every N iterations.")
    log_level: Literal["info", "debug"] = Field(
        "info", description="debug: also DeepSpeed's and transformers' start-up messages and "
        "progress bars (e.g. one per checkpoint save), and ds_ppo's debug lines.")
    dist_timeout_minutes: float = Field(
        30.0, gt=0, description="A collective (all-reduce, barrier, ZeRO gather) waiting longer "
        "than this fails the job with an error instead of hanging it. Rank 0's solitary file work "
        "(a universal-checkpoint conversion) is waited for without it; exports are streamed by "
        "all ranks together. On several ranks a reward.url call stops at this less a margin "
        "(10%, 30 s to 5 min), so a failing service is reported before a collective times out.")

    watchdog_minutes: float | None = Field(
        None, ge=0, description="A rank that makes no progress for this long (one generate "
        "call, scoring or update micro-batch, reward call, save or export; or waiting in a "
        "collective for a rank that never comes) stops the job: every rank that can still act "
        "prints one line naming its phase and the ranks that did not arrive, writes its Python "
        "stacks to output_dir/hang-<rank>.txt and exits 4 (run the same command again to "
        "resume). A rank past it waits while any other rank still makes progress. null: "
        "dist_timeout_minutes less 5% (15 s to 2.5 min, at most a quarter): after a reward.url "
        "call's own deadline, before the collective timeout; 0: off. Must be below "
        "dist_timeout_minutes.")

    def sections(self) -> list[Section]:
        """The top-level sections, in the order above (each checks its own rules: `problems`)."""
        return [v for v in (getattr(self, k) for k in type(self).model_fields)
                if isinstance(v, Section)]

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
