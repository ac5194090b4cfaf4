"""When a plan does not fit: the config levers that lower its peak, searched greedily, and the
node count at which it fits as configured; `plan` puts the numbers and the advice together."""
from __future__ import annotations

from dataclasses import replace

from pydantic import ValidationError

from ds_ppo.config import Config, apply_overrides, validate
from ds_ppo.errors import ConfigError
from ds_ppo.plan.phases import Cluster, Lever, LeverEffect, Plan, compute_plan
from ds_ppo.plan.shapes import RoleShapes, resolve_shapes


def candidate_levers(cfg: Config, plan: Plan) -> list[Lever]:
    """Config changes that lower the GPU peak, each as the overrides that make it."""
    levers = []
    for role in plan.roles:
        rp, d = plan.roles[role], getattr(cfg.deepspeed, role)
        if rp.shape is None:
            continue
        if rp.zero_stage < 3:
            levers.append(Lever(f"ZeRO-3 for the {role}", (f"deepspeed.{role}.zero_stage=3",)))
        elif rp.trained and not d.offload_optimizer:
            levers.append(Lever(f"offload the {role}'s optimizer to CPU",
                                (f"deepspeed.{role}.offload_optimizer=true",)))
        elif not d.offload_param:
            levers.append(Lever(f"offload the {role}'s parameters to CPU",
                                (f"deepspeed.{role}.offload_param=true",)))
        if rp.trained and not getattr(cfg, role).gradient_checkpointing:
            levers.append(Lever(f"gradient checkpointing for the {role}",
                                (f"{role}.gradient_checkpointing=true",)))
    if cfg.ppo.tiled_logits is False:
        levers.append(Lever("tile the logits (the head 1024 positions at a time)",
                            ("ppo.tiled_logits=auto",)))
    levers += _placement_levers(cfg, plan)
    # an off-policy schedule's worker decodes on a whole replica of its own
    whole = cfg.ppo.max_lag > 0
    if plan.generation_mode == "gathered" and plan.tp_unsupported is None and not whole:
        levers.append(Lever("split the generation replica over the GPUs of a node",
                            ("generation.mode=tensor_parallel",)))
    if plan.generation_mode in ("gathered", "tensor_parallel") and not whole:
        levers.append(Lever("generate through ZeRO-3 layer gathering instead of a replica",
                            ("generation.mode=zero3",)))
    if plan.micro_batch_tokens is not None:  # packed: the budget sets the micro-batch's size
        seq = plan.seq_prompt + plan.seq_response
        if plan.micro_batch_tokens > seq:  # below the longest row, rows run alone anyway
            levers.append(Lever("halve the packed micro-batch's token budget", (
                f"ppo.micro_batch_tokens={max(plan.micro_batch_tokens // 2, seq)}",)))
    elif plan.micro_batch > 1:
        levers.append(Lever("halve the training micro batch",
                            (f"ppo.micro_batch_size={plan.micro_batch // 2}",)))
    if plan.score_micro_batch > 1:
        levers.append(Lever("halve the scoring micro batch",
                            (f"ppo.score_micro_batch_size={plan.score_micro_batch // 2}",)))
    # prompts per decoding call: a rank's own, or a tensor-parallel group's together
    group = ((cfg.generation.tp_size or plan.cluster.gpus_per_node)
             if plan.generation_mode == "tensor_parallel" else 1)
    decode_batch = min(cfg.generation.batch_size or group * plan.gen_batch,
                       group * plan.gen_batch)
    if decode_batch > 1:
        levers.append(Lever("halve the generation batch",
                            (f"generation.batch_size={decode_batch // 2}",)))
    return levers


def _placement_levers(cfg: Config, plan: Plan) -> list[Lever]:
    """ppo.placement's levers: colocated with an off-policy schedule keeps the worker's replica
    and decoding beside the training states, which ranks of their own would take away; under
    split, more generation ranks share the rows to decode and fewer leave more ranks to share
    the ZeRO partitions."""
    p, levers = cfg.ppo, []
    if p.placement == "colocated" and p.max_lag > 0 \
            and plan.cluster.world_size >= 2:
        levers.append(Lever("generate on a rank of its own (the others train without the "
                            "worker's replica)", ("ppo.placement=split", "ppo.generation_ranks=1")))
    if p.placement == "split":
        if p.generation_ranks > 1:
            levers.append(Lever("one generation rank fewer (one more rank shares the ZeRO "
                                "partitions)", (f"ppo.generation_ranks={p.generation_ranks - 1}",)))
    return levers


def _with_overrides(cfg: Config, overrides: tuple[str, ...], world: int | None = None
                    ) -> Config | None:
    """`cfg` with a lever's overrides, None where they make it invalid; with `world`, also
    where they break an expert-parallel rule that held (e.g. generation.mode=zero3)."""
    from ds_ppo.config.model_checks import expert_parallel_problems

    try:
        changed = Config.model_validate(apply_overrides(cfg.to_dict(), list(overrides)))
    except (ConfigError, ValidationError):  # a lever that makes the config invalid is none
        return None
    if world is not None and len(expert_parallel_problems(changed, world)) > len(
            expert_parallel_problems(cfg, world)):
        return None
    return changed


def _excess(plan: Plan) -> int:
    """How far a plan is from fitting: bytes over the GPU and CPU budgets."""
    c = plan.cluster
    over = max(0, plan.peak_gpu_bytes - c.gpu_mem_bytes)
    if c.cpu_mem_bytes is not None:
        over += max(0, plan.cpu_bytes_per_node - c.cpu_mem_bytes)
    return over


def find_levers(cfg: Config, shapes: RoleShapes, cluster: Cluster, plan: Plan,
                max_steps: int = 12) -> list[LeverEffect]:
    """Greedy: apply the lever that brings the plan closest to fitting, until it fits or no
    lever helps. The first entry is the biggest single lever."""
    steps: list[LeverEffect] = []
    current, current_plan = cfg, plan
    for _ in range(max_steps):
        if current_plan.fits:
            break
        best = None
        for lever in candidate_levers(current, current_plan):
            changed = _with_overrides(current, lever.overrides, cluster.world_size)
            if changed is None:
                continue
            after = compute_plan(changed, shapes, cluster)
            gain = _excess(current_plan) - _excess(after)
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, lever, changed, after)
        if best is None:
            break
        _, lever, current, after = best
        steps.append(LeverEffect(lever, current_plan.peak_gpu_bytes - after.peak_gpu_bytes,
                                 after.peak_gpu_bytes, after.cpu_bytes_per_node, after.fits))
        current_plan = after
    return steps


def min_nodes_that_fit(cfg: Config, shapes: RoleShapes, cluster: Cluster,
                       limit: int = 1024) -> int | None:
    """Smallest node count (same GPUs per node) at which the config fits as it is and its
    batch sizes divide the world size (config.validate), so the advice can be followed."""
    for nodes in range(cluster.nodes + 1, limit + 1):
        try:
            validate(cfg, nodes * cluster.gpus_per_node)
        except ConfigError:
            continue
        if compute_plan(cfg, shapes, replace(cluster, nodes=nodes)).fits:
            return nodes
    return None


def plan(cfg: Config, cluster: Cluster, shapes: RoleShapes | None = None) -> Plan:
    """The full plan: numbers, verdict, and when it does not fit, the levers."""
    shapes = shapes or resolve_shapes(cfg)
    result = compute_plan(cfg, shapes, cluster)
    if result.fits:
        return result
    steps = find_levers(cfg, shapes, cluster, result)
    notes = result.notes
    if result.tp_unsupported and result.tp_size > 1:  # why the lever list lacks it
        notes = notes + [f"generation.mode=tensor_parallel (tp_size {result.tp_size}) is no "
                         f"option for this policy: {result.tp_unsupported}"]
    return replace(result, biggest_lever=steps[0] if steps else None, lever_path=steps,
                   min_nodes=min_nodes_that_fit(cfg, shapes, cluster), notes=notes)
