"""`ds-ppo plan --job sft|rm|dpo`: the memory of a supervised job's one trained model per GPU, with the
formulas of a PPO plan (plan/states.py, plan/activations.py): its model states under
deepspeed.policy (ZeRO stage, offloads, LoRA) plus one micro-batch's forward and backward
(`<job>.micro_batch_size` rows of `<job>.max_len` tokens, or with sft.micro_batch_tokens one packed
sequence; a pair job's micro-batch (rm, dpo) holds the chosen and the rejected rows of its pairs;
a causal LM's fp32 logits over the vocabulary (sft, dpo), a reward model's one score per row). A
dpo reference's inference engine is not counted.
"""
from __future__ import annotations

from typing import Any

from ds_ppo.config import Config, PairJob, RMConfig, lora_output_head
from ds_ppo.plan.activations import logits_bytes, train_activation_bytes
from ds_ppo.plan.phases import RUNTIME_OVERHEAD_BYTES, Cluster, _lora_states
from ds_ppo.plan.shapes import _hf_config, lora_params, model_shape
from ds_ppo.plan.stages import StageChoice, resolve_job_stage
from ds_ppo.plan.states import GiB, train_states


def job_plan(cfg: Config, job: str, cluster: Cluster, stage: int | None = None
             ) -> dict[str, Any]:
    """The plan of `ds-ppo <job>` (sft or rm) on `cluster`: bytes per GPU by term, the peak, the
    CPU bytes per node and whether it fits. `stage`: the ZeRO stage to plan (None: as the
    engine chooses it, plan/stages.choose_job_stage)."""
    from ds_ppo.errors import ConfigError

    hf = _hf_config(cfg.policy.path, cfg.policy.arch)
    if hf is None:
        raise ConfigError(f"plan: cannot read the model's shape from policy.path = "
                          f"{cfg.policy.path!r}; set policy.arch or a local policy.path")
    section = getattr(cfg, job)
    scorer = isinstance(section, RMConfig)  # a scalar head: no logits over the vocabulary
    shape = model_shape(hf, "sequence" if scorer else "causal",
                        "arch" if cfg.policy.arch is not None else f"path {cfg.policy.path}")
    reason = None
    if stage is None:
        choice = choose_job_stage(cfg, job, cluster)
        stage, reason = choice.stages["policy"], choice.reason
    d = cfg.deepspeed.policy
    d = d.model_copy(update={"zero_stage": stage})
    lora = cfg.policy.lora
    if lora is not None:
        head = not scorer and lora_output_head(lora, cfg.policy.arch is not None,
                                                 bool(getattr(hf, "tie_word_embeddings", False)))
        states = _lora_states(shape, lora_params(shape, lora, head)
                              + (shape.hidden if scorer else 0), cluster, d)
    else:
        states = train_states(shape.params, shape.largest_layer_params, cluster.gpus_per_node,
                              cluster.nodes, d.zero_stage, d.offload_optimizer, d.offload_param)
    budget = getattr(section, "micro_batch_tokens", None)
    rows = section.micro_batch_size * (2 if isinstance(section, PairJob) else 1)
    tokens, rows = (section.max_len, rows) if budget is None else (max(budget, section.max_len), 1)
    terms = {
        "model states (weights, grads, optimizer)": states.resident_bytes,
        "layer gather (weights + grads)": states.gather_bytes,
        "activations" + (" (checkpointed)" if cfg.policy.gradient_checkpointing else ""):
            train_activation_bytes(shape, tokens, rows, cfg.policy.gradient_checkpointing,
                                   cfg.policy.attn_implementation == "eager"),
        "logits": 4 * rows if scorer else logits_bytes(shape, tokens, rows),
        "runtime overhead": RUNTIME_OVERHEAD_BYTES,
    }
    peak = sum(terms.values())
    cpu = states.cpu_bytes_per_node
    return {"job": job, "model": shape.source, "params": shape.params,
            "zero_stage": d.zero_stage, "zero_stage_reason": reason,
            "world_size": cluster.world_size,
            "micro_batch": {"rows": rows, "tokens": tokens}, "terms_bytes": terms,
            "peak_gpu_bytes": peak, "cpu_bytes_per_node": cpu,
            "fits_gpu": peak <= cluster.gpu_mem_bytes,
            "fits_cpu": None if cluster.cpu_mem_bytes is None else cpu <= cluster.cpu_mem_bytes}


def choose_job_stage(cfg: Config, job: str, cluster: Cluster,
                     load_universal: bool = False) -> StageChoice:
    """The ZeRO stage of `ds-ppo <job>`'s trained model on `cluster`, `auto` chosen by fit on
    this job plan's peaks (plan/stages.py); the engine calls it at start-up."""
    return resolve_job_stage(cfg, cluster, lambda stage: job_plan(
        cfg, job, cluster, stage=stage)["peak_gpu_bytes"], load_universal)


def format_job_plan(p: dict[str, Any], cluster: Cluster) -> str:
    gib = lambda n: f"{n / GiB:8.2f} GiB"  # noqa: E731
    mb = p["micro_batch"]
    out = [f"ds-ppo {p['job']} plan: {p['params'] / 1e6:.2f}M-parameter model ({p['model']}), "
           f"ZeRO-{p['zero_stage']}, world size {p['world_size']}, micro-batch {mb['rows']} "
           f"row(s) x {mb['tokens']} tokens"]
    if p.get("zero_stage_reason"):
        out.append(f"ZeRO stage: {p['zero_stage']} ({p['zero_stage_reason']})")
    out += ["", "per GPU:"]
    out += [f"  {gib(v)}  {k}" for k, v in p["terms_bytes"].items()]
    verdict = "fits" if p["fits_gpu"] else "does NOT fit"
    out += [f"  {gib(p['peak_gpu_bytes'])}  peak: {verdict} in {cluster.gpu_mem_bytes / GiB:.0f} "
            "GiB", f"CPU per node: {gib(p['cpu_bytes_per_node']).strip()}"
            + ("" if p["fits_cpu"] is None else " (fits)" if p["fits_cpu"] else " (does NOT fit)")]
    return "\n".join(out)
