"""The run's ZeRO stage per role, chosen by fit on this run's ranks: the cluster measured (ranks,
ranks per node, the smallest GPU memory of the world's ranks) and handed to the plan's own choice
(`choose_zero_stages`, or `choose_job_stage` for a supervised job), so a run and `ds-ppo plan`
decide alike. A job calls it before it builds its engines and hands the choice to the engine
builders, which only apply it."""
from __future__ import annotations

import torch

from ds_ppo.config import Config
from ds_ppo.engine import dist
from ds_ppo.plan.job import choose_job_stage
from ds_ppo.plan.phases import Cluster, choose_zero_stages
from ds_ppo.plan.stages import StageChoice


def zero_stages(cfg: Config, device: torch.device, load_universal: bool = False,
                job: str | None = None) -> StageChoice:
    """Each role's ZeRO stage for this run (`job` sft or rm: the one trained model's, as
    `ds-ppo plan --job`): on a GPU against the smallest GPU memory of the world's ranks (every
    rank then chooses the same), on CPU by the world size. A collective on a GPU: every rank
    calls it."""
    world = dist.world_size()
    memory = None
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        memory = -int(dist.all_reduce_max(torch.tensor([-total], dtype=torch.int64)).item())
    per_node = dist.local_world_size()
    if per_node < 1 or world % per_node:
        per_node = world
    cluster = Cluster(world // per_node, per_node, memory)
    if job is not None:
        return choose_job_stage(cfg, job, cluster, load_universal)
    return choose_zero_stages(cfg, cluster, load_universal=load_universal)
