"""The `deepspeed` section: each role's DeepSpeed engine (template, ZeRO stage, offloads) and
sequence parallelism."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from ds_ppo.config.base import Section


class RoleDeepSpeed(Section):
    config: str | None = Field(
        None, description="Path to the role's DeepSpeed JSON template (default: the one in "
        "ds_configs/ for its zero_stage/offload); batch-size keys are filled in by ds_ppo.")
    zero_stage: Literal[0, 1, 2, 3, "auto"] = Field(
        3, description="ZeRO stage. auto: 3 on several ranks, with an offload, or when a universal "
        "checkpoint (another world size) is loaded; else 0 (one rank: ZeRO-3's partitioning hooks "
        "only cost time, docs/PERFORMANCE.md). The choice is logged. A stage-0 checkpoint resumes "
        "on the same world size only.")
    offload_optimizer: bool = Field(False, description="Optimizer states on CPU (trained roles).")
    offload_param: bool = Field(False, description="Parameters on CPU (ZeRO-3 only).")

    def stage(self, world_size: int, load_universal: bool = False) -> int:
        """The ZeRO stage; `auto`: 3 where it partitions something (several ranks), where an
        offload needs it, or where a universal checkpoint is loaded (DeepSpeed converts ZeRO 1-3
        checkpoints only); else 0: on one rank ZeRO-3's gather/release hooks and partitioned
        optimizer only cost time (docs/PERFORMANCE.md)."""
        if self.zero_stage != "auto":
            return self.zero_stage
        if world_size > 1 or self.offload_param or self.offload_optimizer or load_universal:
            return 3
        return 0


class ReferenceDeepSpeed(RoleDeepSpeed):
    """The reference: inference only, parameters offloaded to CPU by default. A class of its
    own, so the default holds when a YAML file sets only some of the section's other keys."""

    offload_param: bool = Field(True, description="Parameters on CPU (ZeRO-3 only); the "
                                "reference streams its frozen weights in for scoring.")


class DeepSpeedConfig(Section):
    policy: RoleDeepSpeed = Field(default_factory=RoleDeepSpeed)
    value: RoleDeepSpeed = Field(default_factory=RoleDeepSpeed)
    reference: ReferenceDeepSpeed = Field(default_factory=ReferenceDeepSpeed)
    reward: RoleDeepSpeed = Field(default_factory=RoleDeepSpeed)
    sequence_parallel_size: int = Field(
        1, gt=0, description="Ranks that share one long row (DeepSpeed Ulysses sequence "
        "parallelism, ALST): its tokens are split across N consecutive ranks, attention "
        "exchanges them for heads (all-to-all), so each rank holds 1/N of the row's activations. "
        "For the policy, reference and value forwards of rows longer than "
        "sequence_parallel_min_tokens; the data-parallel group is world / N. N must divide the "
        "world size and the models' attention heads (KV heads: divide or be divided by N); "
        "sdpa or flash attention. Planned by `ds-ppo plan`; the training loop does not split "
        "its data-parallel group yet and refuses N > 1 (docs/PERFORMANCE.md, Long context).")
    sequence_parallel_min_tokens: int = Field(
        8192, gt=0, description="With sequence_parallel_size > 1: rows of at least this many "
        "tokens (prompt + response) are split across the sequence-parallel group; shorter ones "
        "run whole on each rank.")
