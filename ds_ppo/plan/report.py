"""The plan as a table or as JSON, and the `ds-ppo plan` command."""
from __future__ import annotations

import argparse
import json
from typing import Any

from ds_ppo.config import load_config
from ds_ppo.errors import UserError
from ds_ppo.plan.levers import plan
from ds_ppo.plan.phases import RUNTIME_OVERHEAD_BYTES, Cluster, LeverEffect, Plan
from ds_ppo.plan.shapes import _params
from ds_ppo.plan.states import GiB


def to_json(p: Plan) -> dict[str, Any]:
    def lever(e: LeverEffect) -> dict[str, Any]:
        return {"description": e.lever.description, "overrides": list(e.lever.overrides),
                "saves_bytes": e.saves_bytes, "peak_after_bytes": e.peak_after_bytes,
                "cpu_after_bytes": e.cpu_after_bytes, "fits_after": e.fits_after}

    roles = {}
    for name, rp in p.roles.items():
        s = rp.shape
        roles[name] = {
            "model": s.model_class if s else None, "shape_source": s.source if s else None,
            "params": s.params if s else 0,
            "largest_layer_params": s.largest_layer_params if s else 0,
            # a mixture-of-experts model: parameters a token uses, experts per layer, top-k
            "active_params": s.active_params if s else 0,
            "experts": s.experts if s else 0, "top_k": s.top_k if s else 0,
            "expert_parallel_size": rp.expert_parallel_size,
            "trained": rp.trained, "zero_stage": rp.zero_stage,
            "offload_optimizer": rp.offload_optimizer, "offload_param": rp.offload_param,
            "gpu_bytes_per_rank": rp.states.gpu_bytes_per_rank,
            "gpu_resident_bytes_per_rank": rp.states.resident_bytes,
            "gather_bytes": rp.states.gather_bytes,
            "cpu_bytes_per_node": rp.states.cpu_bytes_per_node,
        }
    c = p.cluster
    return {
        "world_size": c.world_size, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
        "gpu_mem_bytes": c.gpu_mem_bytes, "cpu_mem_bytes": c.cpu_mem_bytes,
        "tokens": {"prompt": p.seq_prompt, "response": p.seq_response,
                   "total": p.seq_prompt + p.seq_response},
        "batch_per_rank": {"train_micro": p.micro_batch, "score_micro": p.score_micro_batch,
                           "micro_batch_tokens": p.micro_batch_tokens,
                           "generation": p.gen_batch},
        "generation_mode": p.generation_mode,
        "placement": {"name": p.placement, "generation_ranks": p.generation_ranks,
                      "training_ranks": c.world_size - p.generation_ranks,
                      "peak_training_rank_bytes": p.rank_peak(False),
                      "peak_generation_rank_bytes": p.rank_peak(True)},
        "zero_stages": None if p.stage_choice is None else {
            "stages": p.stage_choice.stages, "auto": sorted(p.stage_choice.auto),
            "reason": p.stage_choice.reason},
        "roles": roles,
        "resident_bytes_per_rank": p.resident_bytes,
        "runtime_overhead_bytes": RUNTIME_OVERHEAD_BYTES,
        "phases": [{"name": ph.name, "transient_bytes": ph.transient,
                    "total_bytes": ph.total(p.resident_bytes)} for ph in p.phases],
        "peak_gpu_bytes": p.peak_gpu_bytes, "peak_phase": p.peak_phase,
        "gpu_bytes_per_node": p.peak_gpu_bytes * c.gpus_per_node,
        "cpu_bytes_per_node": p.cpu_bytes_per_node,
        "fits_gpu": p.fits_gpu, "fits_cpu": p.fits_cpu, "fits": p.fits,
        "biggest_lever": lever(p.biggest_lever) if p.biggest_lever else None,
        "lever_path": [lever(e) for e in p.lever_path],
        "min_nodes": p.min_nodes,
        "notes": p.notes,
    }


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _placement_line(p: Plan) -> str:
    """Where generation runs (ppo.placement) and each side's peak."""
    c = p.cluster
    if not p.generation_ranks:
        worker = any(k.startswith("generation worker") for ph in p.phases for k in ph.transient)
        return ("placement: colocated, every rank trains and generates"
                + (" (the background worker's 16-bit replica and its decoding counted beside "
                   "each scoring and training phase)" if worker else ""))
    t = p.training_cluster
    exact = t.world_size == c.world_size - p.generation_ranks
    return (f"placement: split, {p.generation_ranks} generation rank(s) (16-bit replica, no ZeRO "
            f"engine) peak {_gib(p.rank_peak(True))} GiB; {c.world_size - p.generation_ranks} "
            f"training rank(s) (ZeRO states over "
            + (f"{t.world_size} ranks" if exact else
               f"{t.world_size} ranks of whole nodes, a bound from above")
            + f") peak {_gib(p.rank_peak(False))} GiB")


def format_plan(p: Plan, title: str) -> str:
    c = p.cluster
    out = [
        f"ds-ppo plan: {title} on {c.nodes} node(s) x {c.gpus_per_node} GPU(s) = world size "
        f"{c.world_size}, {c.gpu_mem_bytes / GiB:.1f} GiB per GPU",
        f"tokens: {p.seq_prompt} prompt + {p.seq_response} response = "
        f"{p.seq_prompt + p.seq_response}; per rank: " + (
            f"training micro-batch {p.micro_batch}, scoring micro-batch {p.score_micro_batch}"
            if p.micro_batch_tokens is None else
            f"packed micro-batches of {p.micro_batch_tokens} tokens (reward model: "
            f"{p.score_micro_batch})") + f", generation batch {p.gen_batch} (sequences)",
    ]
    if p.stage_choice is not None:
        out.append(f"ZeRO stages: {p.stage_choice.describe()} ({p.stage_choice.reason})")
    out.append(_placement_line(p))
    trainers = "every training rank" if p.generation_ranks else "every rank"
    out += [
        "",
        f"Model states (GiB; {trainers} holds the same: ZeRO data parallelism)",
        f"{'role':<10} {'model':<31} {'params':>9} {'ZeRO':>4}  {'offload':<10} "
        f"{'GPU/rank':>8} {'resident':>8} {'gather':>7} {'CPU/node':>9}  shape from",
    ]
    for name, rp in p.roles.items():
        s = rp.shape
        if s is None:
            what = "(policy base, adapters off)" if name == "reference" else \
                "(reward function, no model)"
            out.append(f"{name:<10} {what:<31}")
            continue
        off = "+".join(x for x, on in (("optimizer", rp.offload_optimizer),
                                       ("params", rp.offload_param)) if on) or "-"
        st = rp.states
        out.append(f"{name:<10} {s.model_class:<31} {_params(s.params):>9} {rp.zero_stage:>4}  "
                   f"{off:<10} {_gib(st.gpu_bytes_per_rank):>8} {_gib(st.resident_bytes):>8} "
                   f"{_gib(st.gather_bytes):>7} {_gib(st.cpu_bytes_per_node):>9}  {s.source}")
    out += [
        "",
        "Peak per GPU by phase (GiB) = resident states of all roles + runtime overhead + the "
        "phase's own",
        f"{'phase':<28} {'resident':>8} {'overhead':>8} {'phase':>7} {'total':>7}  phase terms",
    ]
    for ph in p.phases:
        own = sum(ph.transient.values())
        terms = ", ".join(f"{k} {_gib(v)}" for k, v in ph.transient.items() if v)
        mark = "  <- peak" if ph.name == p.peak_phase else ""
        resident = 0 if ph.generation_ranks else p.resident_bytes
        out.append(f"{ph.name:<28} {_gib(resident):>8} "
                   f"{_gib(RUNTIME_OVERHEAD_BYTES):>8} {_gib(own):>7} "
                   f"{_gib(ph.total(p.resident_bytes)):>7}  {terms}{mark}")
    headroom = c.gpu_mem_bytes - p.peak_gpu_bytes
    verdict = "FITS" if p.fits else "DOES NOT FIT"
    out += ["", f"Verdict: {verdict}. Peak {_gib(p.peak_gpu_bytes)} GiB of "
                f"{c.gpu_mem_bytes / GiB:.1f} GiB per GPU ({p.peak_phase}), "
                + (f"{_gib(headroom)} GiB headroom." if headroom >= 0
                   else f"{_gib(-headroom)} GiB over.")]
    cpu = f"CPU {_gib(p.cpu_bytes_per_node)} GiB"
    if c.cpu_mem_bytes is None:
        cpu += " (not checked: pass --cpu-mem-gib)"
    else:
        cpu += f" of {c.cpu_mem_bytes / GiB:.1f} GiB" + ("" if p.fits_cpu else " -- DOES NOT FIT")
    if p.generation_ranks:  # the two sides' peaks differ
        out.append(f"Per node: GPU at most {c.gpus_per_node} x {_gib(p.rank_peak(False))} GiB "
                   f"(training ranks), {_gib(p.rank_peak(True))} GiB per generation rank; {cpu}.")
    else:
        out.append(f"Per node: GPU {c.gpus_per_node} x {_gib(p.peak_gpu_bytes)} = "
                   f"{_gib(p.peak_gpu_bytes * c.gpus_per_node)} GiB; {cpu}.")
    if not p.fits:
        fits_word = "fits" if c.cpu_mem_bytes is not None else "fits the GPUs (CPU unchecked)"
        if p.biggest_lever:
            e = p.biggest_lever
            out.append(f"Biggest lever: {e.lever.description} ({' '.join(e.lever.overrides)}): "
                       f"saves {_gib(e.saves_bytes)} GiB per GPU -> peak "
                       f"{_gib(e.peak_after_bytes)} GiB per GPU, CPU {_gib(e.cpu_after_bytes)} GiB "
                       f"per node{'; then it ' + fits_word if e.fits_after else ''}.")
        else:
            out.append("No config lever lowers the peak.")
        if len(p.lever_path) > 1:
            last = p.lever_path[-1]
            out.append("Levers in order (greedy): "
                       + " ".join(o for e in p.lever_path for o in e.lever.overrides)
                       + f" -> peak {_gib(last.peak_after_bytes)} GiB per GPU, CPU "
                       + f"{_gib(last.cpu_after_bytes)} GiB per node; "
                       + (f"then it {fits_word}." if last.fits_after else "still does not fit."))
        if p.min_nodes:
            out.append(f"Or scale out: as configured it fits on {p.min_nodes} nodes of "
                       f"{c.gpus_per_node} GPUs (the fewest whose world size the ppo batch sizes "
                       "divide).")
    if p.notes:
        out += ["", "Notes:"] + [f"- {n}" for n in p.notes]
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    """`ds-ppo plan`: print the plan as a table, or one JSON object with --json."""
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise UserError(f"--nodes ({args.nodes}) and --gpus-per-node ({args.gpus_per_node}) "
                        "must be at least 1")
    if args.gpu_mem_gib <= 0:
        raise UserError(f"--gpu-mem-gib must be > 0 (got {args.gpu_mem_gib})")
    cfg = load_config(args.config, args.overrides)
    cpu = None if args.cpu_mem_gib is None else int(args.cpu_mem_gib * GiB)
    cluster = Cluster(args.nodes, args.gpus_per_node, int(args.gpu_mem_gib * GiB), cpu)
    if getattr(args, "job", "train") != "train":  # ds-ppo sft / ds-ppo rm: one trained model
        from ds_ppo.plan.job import format_job_plan, job_plan

        p = job_plan(cfg, args.job, cluster)
        print(json.dumps(p, indent=2) if args.json else format_job_plan(p, cluster))
        return 0
    result = plan(cfg, cluster)
    if args.json:
        print(json.dumps(to_json(result), indent=2))
    else:
        print(format_plan(result, str(args.config or "tiny")))
    return 0
