"""The `deepspeed` section: each role's DeepSpeed engine (template, ZeRO stage, offloads) and
sequence parallelism."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from ds_ppo.config.section_base import Section


class ZeRO3Knobs(Section):
    """ZeRO-3's speed knobs of one role, applied where it runs ZeRO-3 (None: the template's
    value). Each trades GPU memory for fewer or larger gathers; `ds-ppo plan` lists them for
    every ZeRO-3 role, and docs/PERFORMANCE.md has what they did on an H200."""

    persistence_threshold: int | None = Field(
        None, ge=0, description="stage3_param_persistence_threshold: parameters with fewer "
        "elements than this stay whole on every GPU (never gathered or released); the "
        "template's default is 10 x hidden (norms and biases). 1e9 on one GPU keeps every "
        "parameter whole (no gathers at all, the memory of stage 0).")
    prefetch_bucket_size: int | None = Field(
        None, ge=0, description="stage3_prefetch_bucket_size: elements of the parameters "
        "gathered ahead of the layer that needs them (template: 0.9 x hidden^2).")
    max_live_parameters: int | None = Field(
        None, ge=0, description="stage3_max_live_parameters: gathered elements kept on a GPU "
        "before released ones are freed (template: 1e9).")
    max_reuse_distance: int | None = Field(
        None, ge=0, description="stage3_max_reuse_distance: a parameter used again within this "
        "many elements of gathers is kept, not released (template: 1e9).")

    def ds_keys(self) -> dict[str, int]:
        """The zero_optimization keys of the knobs that are set."""
        names = {"persistence_threshold": "stage3_param_persistence_threshold"}
        return {names.get(name, f"stage3_{name}"): value
                for name, value in self.model_dump().items() if value is not None}


class RoleDeepSpeed(Section):
    config: str | None = Field(
        None, description="Path to the role's DeepSpeed JSON template (default: the one in "
        "ds_configs/ for its zero_stage/offload); batch-size keys are filled in by ds_ppo.")
    zero_stage: Literal[0, 1, 2, 3, "auto"] = Field(
        "auto", description="ZeRO stage. auto: chosen by fit, the same way in the engine and in "
        "`ds-ppo plan`: each auto role starts at its least-sharded stage (a frozen role 0, a "
        "trained role 2) and moves to 3 while the plan's peak exceeds 90% of the GPU's memory, "
        "the role that saves most first; an offload or a universal checkpoint (another world "
        "size) allows only the stages that support it. Offloads are never switched on by auto "
        "(the plan names them). Without a GPU: 0 on one rank, 3 on several. The start-up line "
        "and the plan say which stage each role got and why. A stage-0 checkpoint resumes on "
        "the same world size only.")
    offload_optimizer: bool = Field(False, description="Optimizer states on CPU (trained roles).")
    offload_param: bool = Field(False, description="Parameters on CPU (ZeRO-3 only).")
    zero3: ZeRO3Knobs = Field(default_factory=ZeRO3Knobs,
                              description="ZeRO-3's speed knobs, where the role runs ZeRO-3.")
    expert_parallel_size: int = Field(
        1, ge=1, description="Expert parallelism of a mixture-of-experts model (DeepSpeed "
        "AutoEP, its `expert_parallel.autoep_size`): each MoE layer's experts are split over "
        "groups of this many ranks, a token travels to its experts' ranks and back "
        "(all-to-all), and each rank holds and trains 1/N of the experts; the rest of the "
        "model is data-parallel over all ranks. 1: off. Trained roles (policy, value) of a "
        "Qwen3-MoE or Mixtral model; N divides the world size and the experts per layer. Not "
        "with LoRA, policy.ema_decay, sequence parallelism or generation.mode=zero3. A "
        "checkpoint saved with it resumes at any world size and N, 1 included (through the "
        "universal checkpoint; docs/SCALING.md, Expert parallelism).")

    def stage(self, world_size: int, load_universal: bool = False) -> int:
        """The ZeRO stage where no device memory is known (a CPU run, plan/stages.py); `auto`:
        3 where it partitions something (several ranks), where an offload needs it, or where a
        universal checkpoint is loaded (DeepSpeed converts ZeRO 1-3 checkpoints only); else 0."""
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
    teacher: ReferenceDeepSpeed = Field(
        default_factory=ReferenceDeepSpeed, description="The distillation teacher's engine "
        "(teacher section): inference only, parameters offloaded to CPU by default, as the "
        "reference.")
    sequence_parallel_size: int = Field(
        1, gt=0, description="Ranks that share one long row (DeepSpeed Ulysses sequence "
        "parallelism, ALST): its tokens are split across N consecutive ranks, attention "
        "exchanges them for heads (all-to-all), so each rank holds 1/N of the row's activations. "
        "For the policy, reference and value forwards of rows longer than "
        "sequence_parallel_min_tokens; the data-parallel group is world / N. N must divide the "
        "world size and the models' attention heads (KV heads: divide or be divided by N); "
        "sdpa or flash attention. The N ranks of a group are one data-parallel rank (the same "
        "prompts and rollout); planned by `ds-ppo plan` (docs/PERFORMANCE.md, Long context).")
    sequence_parallel_min_tokens: int = Field(
        8192, gt=0, description="With sequence_parallel_size > 1: rows of at least this many "
        "tokens (prompt + response) are split across the sequence-parallel group; shorter ones "
        "run whole on each rank.")

    def problems(self, roles: tuple[str, ...] = ("policy", "value", "reference", "reward",
                                                 "teacher")) -> list[str]:
        """Offload needs ZeRO-3; a role's DeepSpeed template file must exist."""
        from pathlib import Path

        out = []
        for role in roles:
            d = getattr(self, role)
            if d.offload_param and d.zero_stage not in (3, "auto"):
                out.append(f"deepspeed.{role}.offload_param = True needs "
                           f"deepspeed.{role}.zero_stage = 3 (got {d.zero_stage}); or set "
                           f"deepspeed.{role}.offload_param=false")
            if d.expert_parallel_size > 1 and role not in ("policy", "value"):
                out.append(f"deepspeed.{role}.expert_parallel_size = {d.expert_parallel_size}: "
                           "expert parallelism is for the trained roles (policy, value); set "
                           f"deepspeed.{role}.expert_parallel_size=1")
            if d.config is not None and not Path(d.config).exists():
                out.append(f"deepspeed.{role}.config = {d.config!r}: file does not exist")
        return out
