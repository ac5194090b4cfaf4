"""The numbers and tables of `ds-ppo bench`: per-phase rates, TFLOP/s and MFU against the
performance targets, the markdown table of one run and the one-row-per-run summary of several."""
from __future__ import annotations

import math

from ds_ppo.bench.flops import FlopModel

# The performance targets on the H200 (ratios: ours / baseline tok/s; MFU: fraction of peak).
TARGETS = {"generation_vs_hooks": 20.0, "generation_vs_plain": 5.0, "training_mfu": 0.35,
           "end_to_end_mfu": 0.25}


def _phase_summary(records: list[dict], name: str, tokens: float, flops: float,
                   peak_tflops: float) -> dict:
    timed = [r for r in records if not r["warmup"]] or records
    per_it = [r[name]["seconds"] for r in timed]
    seconds = sum(per_it) / len(per_it)
    mems = [r[name]["peak_mem_gib"] for r in timed if r[name]["peak_mem_gib"] is not None]
    return _rates({"seconds": seconds, "per_iteration_s": per_it,
                   "peak_mem_gib": max(mems) if mems else None}, tokens, flops, peak_tflops)


def _rates(rec: dict, tokens: float, flops: float, peak_tflops: float) -> dict:
    s = max(rec["seconds"], 1e-12)
    rec.update(tokens=tokens, tokens_per_s=tokens / s, tflop=flops / 1e12,
               tflops=flops / 1e12 / s)
    rec["mfu"] = rec["tflops"] / peak_tflops if peak_tflops > 0 else math.nan
    return rec


def summarize(s: dict, fm: FlopModel, records: list[dict], compare: dict | None,
              peak_tflops: float) -> dict:
    """Per-phase seconds, tokens/s, TFLOP/s and MFU (mean over the timed iterations)."""
    B, P = s["prompts"], s["prompt_len"]
    T = records[-1]["generation"]["width"]
    S = P + T
    reward_model = s["reward"] == "model"
    flops = {"generation": B * fm.generate(P, T),
             "scoring": B * fm.scoring(P, T, reward_model),
             "advantages": 0.0,
             "training": B * fm.training(P, T, s["ppo_epochs"])}
    tokens = {"generation": float(records[-1]["generation"]["new_tokens"]),
              "scoring": float(B * S), "advantages": float(B * S),
              "training": float(B * S * s["ppo_epochs"])}
    phases = {name: _phase_summary(records, name, tokens[name], flops[name], peak_tflops)
              for name in flops}
    total_s = sum(p["seconds"] for p in phases.values())
    mems = [p["peak_mem_gib"] for p in phases.values() if p["peak_mem_gib"] is not None]
    phases["end_to_end"] = _rates(
        {"seconds": total_s, "peak_mem_gib": max(mems) if mems else None},
        tokens["generation"], sum(flops.values()), peak_tflops)
    out = {"phases": phases}
    if compare is not None:
        for key in ("hooks", "plain", "ours"):
            r = compare[key]
            _rates(r, float(r["new_tokens"]), B * fm.generate(P, r["width"]), peak_tflops)
        ours = compare["ours"]["tokens_per_s"]
        compare["ratio_vs_hooks"] = ours / compare["hooks"]["tokens_per_s"]
        compare["ratio_vs_plain"] = ours / compare["plain"]["tokens_per_s"]
        out["generation_compare"] = compare
    out["targets"] = {
        "generation_vs_hooks": {"target": TARGETS["generation_vs_hooks"],
                                "value": compare["ratio_vs_hooks"] if compare else None},
        "generation_vs_plain": {"target": TARGETS["generation_vs_plain"],
                                "value": compare["ratio_vs_plain"] if compare else None},
        "training_mfu": {"target": TARGETS["training_mfu"], "value": phases["training"]["mfu"]},
        "end_to_end_mfu": {"target": TARGETS["end_to_end_mfu"],
                           "value": phases["end_to_end"]["mfu"]},
    }
    for t in out["targets"].values():
        t["met"] = None if t["value"] is None else bool(t["value"] >= t["target"])
    return out


def _loop_label(s: dict, info: dict) -> str:
    """What our generation ran: the loop, its cache, and CUDA graph or compile."""
    if info.get("loop") == "own":
        return "own loop, static cache" + (" + CUDA graph" if info.get("cuda_graph") else "")
    return "HF generate, " + s["gen_cache"] + (" cache + compile" if s["compile"] else " cache")


def _zero_label(s: dict, short: bool = False) -> str:
    """`ZeRO-3`, or for --zero-stage auto the stages it chose (`ZeRO auto: 2/2/0/0`)."""
    if s["zero_stage"] != "auto":
        return f"ZeRO-{s['zero_stage']}"
    stages = s.get("zero_stages") or {}
    if short:
        return "ZeRO auto " + "/".join(str(v) for v in stages.values())
    return "ZeRO auto (" + ", ".join(f"{r} {v}" for r, v in stages.items()) + ")"


def _fmt(x, kind: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if kind == "s":
        return f"{x:.3f}" if x < 100 else f"{x:.0f}"
    if kind == "int":
        return f"{x:,.0f}"
    if kind == "tflops":
        return f"{x:.1f}" if x >= 10 else f"{x:.3g}"
    if kind == "pct":
        return f"{100 * x:.1f}%" if x >= 0.001 else f"{100 * x:.2g}%"
    if kind == "gib":
        return f"{x:.1f}"
    if kind == "x":
        return f"{x:.2f}x"
    return str(x)


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def format_table(result: dict) -> str:
    """The one markdown table (phases, end-to-end, generation baselines and ratios) and the
    lines that say what it was run on; with --schedule, the schedules' table."""
    if "schedules" in result:
        return _schedule_table(result)
    s, ph, cmp_ = result["settings"], result["phases"], result.get("generation_compare")
    gen_kind = _loop_label(s, result["iterations"][-1]["generation"])
    lines = [
        f"ds-ppo bench, {result['date']}, {result['device']['name']}: shape {s['shape']} "
        f"({_params(result['model']['params_total'])} params x 4 roles, {result['dtype']}), "
        f"{s['prompts']} prompts x {s['prompt_len']} prompt + {s['new_tokens']} new tokens, "
        f"micro-batch {s['micro_batch']} (scoring {s['score_micro_batch']}), "
        f"{_zero_label(s)}, "
        f"mean of {s['iterations']} iteration(s) after {s['warmup']} warm-up",
        f"peak {result['peak_tflops']:.4g} TFLOP/s ({result['peak_source']})",
        "",
        "| phase | seconds | tokens | tok/s | TFLOP/s | MFU | peak mem GiB | vs hooks | vs plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def row(label, r, vs_hooks=None, vs_plain=None):
        lines.append(
            f"| {label} | {_fmt(r['seconds'], 's')} | {_fmt(r['tokens'], 'int')} | "
            f"{_fmt(r['tokens_per_s'], 'int')} | {_fmt(r['tflops'], 'tflops')} | "
            f"{_fmt(r['mfu'], 'pct')} | {_fmt(r.get('peak_mem_gib'), 'gib')} | "
            f"{_fmt(vs_hooks, 'x')} | {_fmt(vs_plain, 'x')} |")

    reward = "+reward" if s["reward"] == "model" else ""
    row(f"generation (gathered, {gen_kind}, sampled)", ph["generation"])
    row(f"scoring (policy+ref+value{reward} fwd)", ph["scoring"])
    epochs = f"{s['ppo_epochs']} epoch" + ("s" if s["ppo_epochs"] > 1 else "")
    row(f"training (policy+value fwd+bwd, {epochs})", ph["training"])
    row("end-to-end iteration (incl. advantages)", ph["end_to_end"])
    if cmp_ is not None:
        row(f"greedy gen: hooks path (ZeRO-3 HF generate, {cmp_['hooks']['width']} new)",
            cmp_["hooks"])
        row("greedy gen: plain HF generate (dynamic cache)", cmp_["plain"])
        row(f"greedy gen: ours (gathered, {_loop_label(s, cmp_['ours'])})", cmp_["ours"],
            cmp_["ratio_vs_hooks"], cmp_["ratio_vs_plain"])
    lines.append("")
    if cmp_ is not None:
        lines.append(
            f"greedy outputs ours == plain: {'yes' if cmp_['greedy_match'] else 'NO'} "
            f"({100 * cmp_['greedy_match_fraction']:.1f}% of tokens, common prefix "
            f"{cmp_['common_prefix']:.1f} tokens); in float32 ({cmp_['greedy_fp32']['prompts']} "
            f"prompts x {cmp_['greedy_fp32']['new_tokens']} tokens): "
            f"{'yes' if cmp_['greedy_fp32']['greedy_match'] else 'NO'}; replica build "
            f"{cmp_['replica_build_s']:.3f}s (inside every gathered row); ours' first call "
            f"{cmp_['ours']['first_call_s']:.3f}s")
        if cmp_["ours"].get("graph_error"):
            lines.append(f"CUDA graph capture FAILED, decoding ran eagerly: "
                         f"{cmp_['ours']['graph_error']}")
    else:
        lines.append("generation baselines skipped (--skip-baselines)")
    if result.get("peak_rss_gib") is not None:
        lines.append(f"peak RSS {result['peak_rss_gib']:.2f} GiB (CPU run: per-phase memory is "
                     "measured on CUDA only)")
    targets = ", ".join(
        f"{k} {_fmt(t['value'], 'x' if 'vs' in k else 'pct')} (target "
        f"{_fmt(t['target'], 'x' if 'vs' in k else 'pct')})" for k, t in result["targets"].items())
    lines.append(f"targets (H200): {targets}")
    return "\n".join(lines)


def summary_table(results: list[tuple[str, dict]]) -> str:
    """One row per bench result (name, JSON dict): the numbers the targets are about."""
    lines = ["| run | settings | gen tok/s (sampled) | ours greedy tok/s | vs hooks | vs plain "
             "| greedy == plain (fp32) | training MFU | end-to-end MFU | peak mem GiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results:
        s, ph, c = r["settings"], r["phases"], r.get("generation_compare")
        gen = r["iterations"][-1]["generation"]
        knobs = "".join(f", {label} {s[key]:.0e}" for key, label in (
            ("persistence_threshold", "persistence"), ("prefetch_bucket_size", "prefetch"),
            ("max_live_parameters", "live")) if s.get(key) is not None)
        settings = (f"{_zero_label(s, short=True)}, micro {s['micro_batch']}, "
                    f"{_loop_label(s, gen)}" + (", compiled step" if s.get("compile_step")
                                                else "") + knobs
                    + (", checkpointing" if s.get("gradient_checkpointing") else "")
                    + (f", {s['prompts']} prompts" if s.get("prompts") else ""))
        match = "-"
        if c is not None:
            yes = {True: "yes", False: "no"}
            match = f"{yes[c['greedy_match']]} ({yes[c['greedy_fp32']['greedy_match']]})"
        lines.append(
            f"| {name} | {settings} | {_fmt(ph['generation']['tokens_per_s'], 'int')} | "
            f"{_fmt(c['ours']['tokens_per_s'] if c else None, 'int')} | "
            f"{_fmt(c['ratio_vs_hooks'] if c else None, 'x')} | "
            f"{_fmt(c['ratio_vs_plain'] if c else None, 'x')} | {match} | "
            f"{_fmt(ph['training']['mfu'], 'pct')} | {_fmt(ph['end_to_end']['mfu'], 'pct')} | "
            f"{_fmt(ph['end_to_end'].get('peak_mem_gib'), 'gib')} |")
    return "\n".join(lines)


def _schedule_table(result: dict) -> str:
    """`--schedule`: iterations per hour of each ppo.schedule, against the first."""
    s = result["settings"]
    lines = [f"ds-ppo bench --schedule, {result['date']}, {result['device']['name']}: shape "
             f"{s['shape']}, {s['prompts']} prompts x {s['prompt_len']} prompt + "
             f"{s['new_tokens']} new tokens, reward {s['reward']}"
             + (f" answering after {s['reward_latency']:g} s" if s.get("reward_latency") else "")
             + f", {s['iterations']} timed iteration(s) after {s['warmup']} warm-up", "",
             "| schedule | iterations/hour | vs first | step 1 wait s | scoring s | update s "
             "| token staleness |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["schedules"]:
        lines.append(f"| {r['schedule']} | {r['iterations_per_hour']:.0f} | "
                     f"{r['vs_first']:.2f}x | {r['generation_s']:.2f} | "
                     f"{r.get('scoring_s', float('nan')):.2f} | {r['training_s']:.2f} | "
                     f"{r.get('token_staleness', float('nan')):.2f} |")
    return "\n".join(lines)
