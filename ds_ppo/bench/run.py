"""One `ds-ppo bench` run: build the four roles, run warm-up and timed PPO iterations through the
trainer's own `run_iteration` (ds_ppo/ppo/iteration.py), then the greedy generation baselines; the
result dict that results.py formats."""
from __future__ import annotations

import argparse
import datetime as _dt
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ds_ppo.bench.flops import flop_model
from ds_ppo.bench.measure import (compiled_graphs, device_info, measure_peak_tflops, measured,
                                  versions)
from ds_ppo.bench.results import summarize
from ds_ppo.bench.workload import (LATENCY_ENV, BenchTokenizer, build_config, random_prompts,
                                   resolve, run_dir_for, settings_from)

log = logging.getLogger("ds_ppo.bench")


def run(args: argparse.Namespace) -> dict:
    """Build the roles, run the iterations and baselines; the result dict (see format_table)."""
    import torch

    from ds_ppo.engine.dist import init_distributed
    from ds_ppo.ppo.train_job import ppo_engines

    t_start = time.perf_counter()
    device = init_distributed()
    s = resolve(args, device.type == "cuda")
    if args.reward_latency:
        os.environ[LATENCY_ENV] = str(args.reward_latency)
    root = Path(args.output_dir) if args.output_dir else Path(
        tempfile.mkdtemp(prefix="ds_ppo_bench_"))
    try:
        if args.schedule:
            return _schedule_compare(args, device, s, root, t_start)
        run_dir = run_dir_for(root, s)
        cfg = build_config(s, run_dir)
        s.update(settings_from(cfg))  # --set overrides count too
        torch.manual_seed(s["seed"])
        tok = BenchTokenizer(s["arch"]["vocab_size"])
        log.info("building 4 roles of shape %s in %s ...", s["shape"], run_dir)
        engines = ppo_engines(cfg, tok, device)
        s["zero_stages"] = {role: ds.get("zero_optimization", {}).get("stage", 0)
                            for role, ds in engines.ds_configs.items()}
        fm = flop_model(engines.policy.module)
        dtype_name = str(engines.dtype).replace("torch.", "")
        if args.device_peak_tflops:
            peak, peak_source = args.device_peak_tflops, "--device-peak-tflops"
        else:
            peak = measure_peak_tflops(device, engines.dtype)
            size = 8192 if device.type == "cuda" else 1024
            peak_source = f"measured: {dtype_name} {size}^3 matmul"
        t_ready = time.perf_counter()
        records = _ppo_iterations(cfg, engines, tok, s)
        compare = None if args.skip_baselines else _generation_compare(cfg, engines, tok, s)
        result = {
            "date": _dt.datetime.now().isoformat(timespec="seconds"),
            "command": "ds-ppo bench " + " ".join(args._argv),
            "device": device_info(device), "versions": versions(), "dtype": dtype_name,
            "settings": {k: v for k, v in s.items() if k != "arch"},
            "model": {"arch": s["arch"], "params_total": engines.policy.num_params(),
                      "body_params": fm.body_params},
            "peak_tflops": peak, "peak_source": peak_source,
            "iterations": records,
            **summarize(s, fm, records, compare, peak),
            "setup_s": t_ready - t_start, "total_s": time.perf_counter() - t_start,
        }
        if device.type != "cuda":
            import resource

            result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        # what the bench path imported: neither may be needed (the GPU image has neither)
        result["imported_mlflow"] = "mlflow" in sys.modules
        result["imported_datasets"] = "datasets" in sys.modules
        return result
    finally:
        if not args.output_dir:
            shutil.rmtree(root, ignore_errors=True)


# the bench's record of each phase of run_iteration (its table says "training" for the update)
_RECORD = {"generation": "generation", "scoring": "scoring", "advantages": "advantages",
           "update": "training"}


def _ppo_iterations(cfg, engines, tok, s: dict) -> list[dict]:
    """Warm-up + timed iterations through the trainer's run_iteration; one record each."""
    from ds_ppo.ppo.iteration import IterationInputs, run_iteration
    from ds_ppo.rewards.encode import reward_encoder
    from ds_ppo.metrics import Accumulator
    from ds_ppo.ppo.rollout import stop_token_ids

    prompts = random_prompts(s["prompts"], s["prompt_len"], len(tok), s["seed"])
    indices = list(range(len(prompts)))
    # one tokenizer for all roles: the reward model reads the rollout's own ids
    reward_encode = None if cfg.reward.model is None else reward_encoder(cfg, tok, tok)
    inputs = IterationInputs(cfg, engines, tok, prompts, "gathered", stop_token_ids(tok, cfg.generation.stop_tokens),
                             reward_encode)
    if cfg.ppo.schedule != "sync":  # the trainer's own schedule, over the same prompts each time
        from dataclasses import replace

        from ds_ppo.ppo.train_job import rollout_schedule

        inputs = replace(inputs, schedule=rollout_schedule(inputs, lambda iteration: indices))
    records = []
    for it in range(s["warmup"] + s["iterations"]):
        rec = {"warmup": it < s["warmup"], "graphs_before": compiled_graphs()}

        def timed(phase, rec=rec):
            return measured(engines.device, rec.setdefault(_RECORD[phase], {}))

        t0 = time.perf_counter()
        acc = Accumulator()
        exp, gen = run_iteration(inputs, it + 1, indices, cfg.ppo.kl_coef, acc, timed)
        rec["seconds"] = time.perf_counter() - t0
        if cfg.ppo.schedule != "sync":  # every rank reduces (the same metrics on each)
            rec["token_staleness"] = acc.reduce().get("async/token_staleness_mean", 0.0)
        rec["generation"].update(_loop_info(gen))
        rec["generation"]["new_tokens"] = int(exp.rollout.mask.sum())
        rec["generation"]["width"] = int(exp.rollout.response_ids.shape[1])
        rec["graphs_built"] = compiled_graphs() - rec.pop("graphs_before")
        records.append(rec)
        log.info("iteration %d%s: generation %.3fs, scoring %.3fs, training %.3fs%s", it + 1,
                 " (warm-up)" if rec["warmup"] else "", rec["generation"]["seconds"],
                 rec["scoring"]["seconds"], rec["training"]["seconds"],
                 f", {rec['graphs_built']} graphs compiled" if rec["graphs_built"] else "")
    return records


def _schedule_compare(args, device, s: dict, root: Path, t_start: float) -> dict:
    """`--schedule a,b,...`: the timed iterations of each ppo.schedule (with its own `+key=value`
    overrides, if any) on fresh engines (the same initial weights, prompts and settings;
    ppo.rollout_correction=tis for all), in one process; iterations per hour of each and
    against the first."""
    import torch

    from ds_ppo.ppo.train_job import ppo_engines

    rows = []
    for name in args.schedule.split(","):
        head, *overrides = name.split("+")  # sync+reward.stream=false: that schedule with those
        schedule, _, staleness = head.partition(":")
        extra = [f"ppo.schedule={schedule}", "ppo.rollout_correction=tis", *overrides]
        if staleness:
            extra.append(f"ppo.max_staleness={staleness}")
        run_s = {**s, "overrides": [*s["overrides"], *extra]}
        run_dir = run_dir_for(root, run_s)
        cfg = build_config(run_s, run_dir)
        torch.manual_seed(s["seed"])
        tok = BenchTokenizer(s["arch"]["vocab_size"])
        log.info("schedule %s: building 4 roles of shape %s ...", name, s["shape"])
        engines = ppo_engines(cfg, tok, device)
        records = _ppo_iterations(cfg, engines, tok, run_s)
        timed = [r["seconds"] for r in records if not r["warmup"]]
        rows.append({"schedule": name, "iterations": len(timed), "seconds": sum(timed),
                     "iterations_per_hour": 3600 * len(timed) / sum(timed),
                     "generation_s": sum(r["generation"]["seconds"] for r in records
                                         if not r["warmup"]) / len(timed),
                     "scoring_s": sum(r["scoring"]["seconds"] for r in records
                                      if not r["warmup"]) / len(timed),
                     "training_s": sum(r["training"]["seconds"] for r in records
                                       if not r["warmup"]) / len(timed),
                     # response tokens' mean staleness over the timed iterations (sync: 0)
                     "token_staleness": sum(r.get("token_staleness", 0.0) for r in records
                                            if not r["warmup"]) / len(timed)})
        del engines
    for r in rows:
        r["vs_first"] = r["iterations_per_hour"] / rows[0]["iterations_per_hour"]
    return {"date": _dt.datetime.now().isoformat(timespec="seconds"),
            "command": "ds-ppo bench " + " ".join(args._argv),
            "device": device_info(device), "versions": versions(),
            "settings": {k: v for k, v in s.items() if k != "arch"}, "schedules": rows,
            "total_s": time.perf_counter() - t_start}


def _loop_info(gen) -> dict:
    """Which decoding loop ran and whether its steps were CUDA-graph replays."""
    errors = [st.graph_error for st in gen.decode_stats if st.graph_error]
    return {"loop": gen.loop,
            "cuda_graph": bool(gen.decode_stats) and all(st.graph for st in gen.decode_stats),
            "graph_error": errors[0] if errors else None}


def _replica_build_seconds(engines) -> float:
    """Seconds to gather the policy into a generation replica (the replica is dropped)."""
    from ds_ppo.engine.generation import build_replica

    rec: dict[str, Any] = {}
    with measured(engines.device, rec):
        build_replica(engines.policy.module, engines.dtype, engines.device)
    return rec["seconds"]


def _generation_compare(cfg, engines, tok, s: dict) -> dict:
    """Greedy generation of the same prompts by the hooks path, plain HF generate (dynamic
    cache) and ours; each timed as the trainer pays it (a gathered run includes the replica
    build, timed once on its own as well)."""
    import torch

    from ds_ppo.data.prompts import left_pad
    from ds_ppo.engine.generation import generate
    from ds_ppo.ppo.rollout import stop_token_ids

    device, dtype = engines.device, engines.dtype
    prompts = random_prompts(s["prompts"], s["prompt_len"], len(tok), s["seed"])
    ids, am = left_pad(prompts.input_ids, tok.pad_token_id)
    ids, am = ids.to(device), am.to(device).bool()
    eos_ids = stop_token_ids(tok, cfg.generation.stop_tokens)
    greedy = cfg.generation.model_copy(update={"temperature": 0.0})
    plain = greedy.model_copy(update={"loop": "hf", "cache_implementation": "dynamic",
                                      "compile": False, "keep_replica": False})
    bn = s["baseline_new_tokens"]
    hooks = plain.model_copy(update={"max_new_tokens": bn, "min_new_tokens": bn})

    def run(gen_cfg, mode: str, run_dtype=dtype, n: int | None = None) -> tuple[dict, Any]:
        rec: dict[str, Any] = {}
        with measured(device, rec):
            out = generate(engines.policy, ids[:n], am[:n], gen_cfg, mode, eos_ids,
                           tok.pad_token_id, run_dtype,
                           kept_replica=engines.replica if gen_cfg.keep_replica else None)
        if gen_cfg.keep_replica:
            engines.replica = out.replica
        rec.update(_loop_info(out))
        rec["new_tokens"] = int(out.mask.sum())
        rec["width"] = int(out.response_ids.shape[1])
        return rec, out.response_ids

    res: dict[str, Any] = {"replica_build_s": _replica_build_seconds(engines)}
    log.info("generation baselines: plain HF generate, dynamic cache ...")
    res["plain"], plain_ids = run(plain, "gathered")
    log.info("generation: ours, greedy (loop %s) ...", greedy.loop)
    first, ours_ids = run(greedy, "gathered")  # any compile for greedy decoding happens here
    res["ours"], ours_ids2 = run(greedy, "gathered")
    res["ours"]["first_call_s"] = first["seconds"]
    # Last: HF generate through the hooks leaves prefetched parameters in flight, and a
    # GatheredParameters (build_replica) on them afterwards fails ("Cannot partition a param in
    # flight"); empty_partition_cache waits for them and releases them.
    log.info("generation baselines: hooks path (%d new tokens) ...", bn)
    res["hooks"], _ = run(hooks, "zero3")
    engines.policy.empty_partition_cache()
    res.update(_greedy_agreement(plain_ids, ours_ids, ours_ids2))
    # In 16-bit with random weights the top logits of a step differ by less than the rounding
    # of two kernels' sums, so greedy paths of two correct implementations can fork. Whether
    # ours computes the same thing is checked in fp32, on a few prompts and tokens:
    n, t = min(8, len(ids)), min(s["new_tokens"], 32)
    exact = {"max_new_tokens": t, "min_new_tokens": t, "keep_replica": False}
    log.info("generation: greedy check in float32 (%d prompts x %d tokens) ...", n, t)
    _, plain32 = run(plain.model_copy(update=exact), "gathered", torch.float32, n)
    _, ours32 = run(greedy.model_copy(update=exact), "gathered", torch.float32, n)
    res["greedy_fp32"] = {"prompts": n, "new_tokens": t,
                          **_greedy_agreement(plain32, ours32, ours32)}
    return res


def _greedy_agreement(plain, ours, ours_again) -> dict:
    """Token agreement of two greedy outputs (B, T): all equal (and ours reproducible), the
    share of equal tokens and the mean length of the common prefix."""
    import torch

    if plain.shape != ours.shape:
        return {"greedy_match": False, "greedy_match_fraction": 0.0, "common_prefix": 0.0}
    equal = plain == ours
    prefix = equal.long().cumprod(dim=-1).sum(dim=-1).float().mean()
    return {"greedy_match": bool(equal.all() and torch.equal(ours, ours_again)),
            "greedy_match_fraction": float(equal.float().mean()),
            "common_prefix": float(prefix)}
