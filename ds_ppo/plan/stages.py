"""`deepspeed.<role>.zero_stage: auto`: each role's ZeRO stage, chosen by fit. The engine (at
start-up, on its own GPU's memory) and `ds-ppo plan` (on the cluster it is given) both call
`plan.phases.choose_zero_stages` (`plan.job.choose_job_stage` for `ds-ppo sft` / `rm`), which
run the rule here on the plan's peaks, so the stage a run gets is the stage its plan shows.

The rule: every `auto` role starts at its least-sharded stage and, while the plan's peak per GPU
is over the budget, the role whose next stage lowers the peak most moves up one rung. The rungs:

- a frozen role (reference, reward): 0 (a plain replica), then 3;
- a trained role: 2, then 3. ZeRO-2 never holds more than stage 0 and communicates as much
  (reduce-scatter + all-gather = one all-reduce); on one GPU it partitions nothing but runs the
  update as fast (docs/PERFORMANCE.md, H200) and, unlike stage 0, saves checkpoints that
  DeepSpeed converts for another world size;
- an offload allows only the stages that can offload: offload_param 3, offload_optimizer 2 then
  3 (ZeRO-Offload); a trained role loading a universal checkpoint 3 (the resume across world
  sizes is tested on ZeRO-3).

Offloads are never switched on by `auto`: when nothing fits with ZeRO-3, the plan's levers name
them. The budget keeps `AUTO_HEADROOM` of the GPU free, for what the estimate leaves out
(allocator fragmentation beyond the runtime allowance, a longer row than planned).

Without an accelerator (a CPU run: the tiny default, the tests' gloo ranks) there is no device
memory to fit: `auto` is 0 on one rank and 3 on several, as `RoleDeepSpeed.stage` says, so CPU
multi-rank runs exercise the partitioned path a GPU cluster runs.
"""
from __future__ import annotations

from dataclasses import dataclass

from ds_ppo.config import Config
from ds_ppo.plan.states import GiB
from ds_ppo.role_names import ROLES, TRAINED_ROLES

AUTO_HEADROOM = 0.10  # share of each GPU's memory `auto` leaves free


@dataclass(frozen=True)
class StageChoice:
    """Each role's ZeRO stage, which roles were `auto`, and why (one line for logs and plans)."""

    stages: dict[str, int]  # role -> ZeRO stage (every role with a deepspeed section)
    auto: frozenset[str]  # roles whose zero_stage is auto
    reason: str

    def apply(self, cfg: Config) -> Config:
        """`cfg` with each auto role's zero_stage set to the chosen stage (the engine builds its
        DeepSpeed configs from this copy; the run's own config keeps `auto`)."""
        ds = cfg.deepspeed.model_copy(update={
            role: getattr(cfg.deepspeed, role).model_copy(update={"zero_stage": stage})
            for role, stage in self.stages.items() if role in self.auto})
        return cfg.model_copy(update={"deepspeed": ds})

    def describe(self) -> str:
        """`policy 0 (auto), value 2 (auto), reference 3, reward 0 (auto)`."""
        return ", ".join(f"{role} {stage}" + (" (auto)" if role in self.auto else "")
                         for role, stage in self.stages.items())


def rungs(role: str, d, load_universal: bool = False) -> tuple[int, ...]:
    """The stages `auto` may give `role`, least sharded first (`d`: its deepspeed section)."""
    trained = role in TRAINED_ROLES
    if d.offload_param or (trained and load_universal):
        return (3,)
    return (2, 3) if trained else (0, 3)


def model_roles(cfg: Config) -> list[str]:
    """The roles that build a model (and so a DeepSpeed engine) under `cfg`."""
    from ds_ppo.config import reference_from_policy_base, uses_reference

    return [r for r in ROLES if (r != "value" or cfg.ppo.uses_critic)
            and (r != "reference" or (uses_reference(cfg) and not reference_from_policy_base(cfg)))
            and (r != "teacher" or cfg.teacher.enabled)
            and (r != "reward" or cfg.reward.model is not None)]


def resolve_stages(cfg: Config, cluster, peak, load_universal: bool = False) -> StageChoice:
    """Each role's ZeRO stage on `cluster` (a plan.Cluster; `gpu_mem_bytes` None: no GPU).
    `peak(stages)`: the plan's peak bytes per GPU with those stages (role -> stage), or None
    when the models' shapes cannot be read; `load_universal`: the trained roles load a universal
    checkpoint. `plan.phases.choose_zero_stages` gives it the plan's peak."""
    ws = cluster.world_size
    sections = {role: getattr(cfg.deepspeed, role) for role in model_roles(cfg)}
    auto = frozenset(r for r, d in sections.items() if d.zero_stage == "auto")
    fixed = {r: d.zero_stage for r, d in sections.items() if r not in auto}
    if not auto:
        return StageChoice(fixed, auto, "every stage is set")

    def by_world_size(why: str) -> StageChoice:
        stages = {r: d.stage(ws, load_universal) for r, d in sections.items()}
        return StageChoice(stages, auto, f"{why}: 0 on one rank, 3 on several, with an offload "
                           "or with a universal checkpoint")

    if cluster.gpu_mem_bytes is None:
        return by_world_size("no GPU, no memory to fit")
    if peak is None:
        return by_world_size("the models' shapes cannot be read before loading")
    return _by_fit(cluster, peak, load_universal, sections, auto, fixed)


def _by_fit(cluster, plan_peak, load_universal, sections, auto, fixed) -> StageChoice:
    """The greedy search of the module's docstring over the plan's peaks."""
    ladders = {r: rungs(r, sections[r], load_universal) for r in auto}
    at = {r: 0 for r in auto}  # index into each ladder
    budget = int(cluster.gpu_mem_bytes * (1 - AUTO_HEADROOM))

    def peak(index: dict[str, int]) -> int:
        return plan_peak({**fixed, **{r: ladders[r][i] for r, i in index.items()}})

    current = first = peak(at)
    moved = []
    while current > budget:
        best = None
        for r in sorted(auto, key=ROLES.index):
            if at[r] + 1 < len(ladders[r]):
                after = peak({**at, r: at[r] + 1})
                if after < current and (best is None or after < best[1]):
                    best = (r, after)
        if best is None:
            break
        at[best[0]] += 1
        current = best[1]
        moved.append(best[0])
    # a role moved early may not be needed once later ones moved: back it off where that fits
    for r in reversed(moved):
        if current <= budget and at[r] > 0:
            after = peak({**at, r: at[r] - 1})
            if after <= budget:
                at[r] -= 1
                current = after
    moved = [r for r in dict.fromkeys(moved) if at[r] > 0]
    stages = {r: fixed[r] if r in fixed else ladders[r][at[r]] for r in sections}
    gib = lambda n: f"{n / GiB:.1f} GiB"  # noqa: E731
    budget_txt = (f"{gib(budget)} ({100 - round(100 * AUTO_HEADROOM)}% of "
                  f"{gib(cluster.gpu_mem_bytes)} per GPU)")
    if not moved:  # nothing sharded beyond its first rung
        reason = f"the least-sharded stages fit: peak {gib(first)} of {budget_txt}"
    else:
        least = ", ".join(f"{r} {ladders[r][0]}" for r in sorted(auto, key=ROLES.index))
        reason = (f"the least-sharded stages ({least}) peak at {gib(first)}, over {budget_txt}; "
                  + ", ".join(moved) + f" sharded further: peak {gib(current)}")
        if current > budget:
            reason += " (still over: see the plan's levers)"
    return StageChoice(stages, auto, reason)



def resolve_job_stage(cfg: Config, cluster, peak, load_universal: bool = False) -> StageChoice:
    """The ZeRO stage of a supervised job's one trained model (`ds-ppo sft` / `ds-ppo rm`,
    deepspeed.policy), by the same rule: without a GPU by the world size, else the first rung
    whose peak (`peak(stage)`: the job plan's bytes per GPU) fits the budget, else ZeRO-3.
    `plan.job.choose_job_stage` gives it the job plan's peak. `load_universal`: it will load a
    checkpoint of another world size or stage (DeepSpeed converts those for ZeRO-3 only)."""
    d = cfg.deepspeed.policy
    if d.zero_stage != "auto":
        return StageChoice({"policy": d.zero_stage}, frozenset(), "the stage is set")
    auto = frozenset({"policy"})
    if cluster.gpu_mem_bytes is None:
        return StageChoice({"policy": d.stage(cluster.world_size, load_universal)}, auto,
                           "no GPU, no memory to fit: 0 on one rank, 3 on several or with an "
                           "offload")
    budget = int(cluster.gpu_mem_bytes * (1 - AUTO_HEADROOM))
    ladder = rungs("policy", d, load_universal)
    for stage in ladder:
        bytes_ = peak(stage)
        if bytes_ <= budget or stage == ladder[-1]:
            fits = "fits" if bytes_ <= budget else "is over, the most sharded"
            return StageChoice({"policy": stage}, auto,
                               f"ZeRO-{stage} {fits}: peak {bytes_ / GiB:.1f} GiB of "
                               f"{budget / GiB:.1f} GiB ({100 - round(100 * AUTO_HEADROOM)}% of "
                               f"{cluster.gpu_mem_bytes / GiB:.1f} GiB per GPU)")
    raise AssertionError("unreachable: a ladder is never empty")
