"""`ds-ppo bench --peer trl`: ds_ppo beside Hugging Face TRL's GRPOTrainer, from one starting point.

    ds-ppo bench --peer trl                       # the tiny default, 40 iterations (CPU, minutes)
    ds-ppo bench --peer trl --iterations 3 --runs trl,ppo   # a quick look
    python -m ds_ppo.bench.peer --help

Step 1 prepares one starting point in `--out-dir/shared` from ds_ppo's own config (the tiny default
plus any `key=value` overrides): the random-init policy and tokenizer built by ds_ppo's
`materialize_arch`, or with `policy.path=DIR` the pretrained policy in DIR (a local
save_pretrained directory, which both sides load; its tokenizer as ds_ppo loads it is saved
beside the prompts), ds_ppo's prompts in ds_ppo's sampling order, and the numbers the peer mirrors
(reward function, lr, warm-up, AdamW betas/eps, clip, kl_coef, max_new_tokens, batch sizes,
gradient checkpointing: TRL's GRPOConfig turns it on by default, ds_ppo's policy off).
Step 2 runs, each in a child process: TRL GRPO (`ds_ppo.bench.peer_trl`, `--schedule ppo`:
ds_ppo's 2 epochs x mini-batches), ds_ppo PPO (the config as given) and, where this ds_ppo has it, ds_ppo
GRPO (`ppo.advantage_estimator=grpo ppo.samples_per_prompt=G`, mini/micro-batches x G, TRL's
beta as `ppo.kl_loss_coef`). Every ds_ppo run checks that it
started from byte-identical policy weights. Step 3 prints one table: seconds per iteration per
phase, sequences/s, the score's first 5 -> last 5 iterations, and each run's ratio to TRL.
Needs `pip install -e ".[peer]"` (trl) for the TRL run. CPU times on a shared machine are noisy:
compare ratios within one run of this command only.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ds_ppo.errors import UserError
from ds_ppo.role_names import ROLES

# `ppo-z3`: every role on ZeRO-3 with the reference offloaded (the tiny preset before zero_stage auto)
ZERO3 = tuple(f"deepspeed.{r}.zero_stage=3" for r in ROLES) \
    + ("deepspeed.reference.offload_param=true",)
# `grpo-rollout`: ds_ppo GRPO with ppo.old_logprobs=rollout (no scoring forward of the policy)
RUNS = ("trl", "ppo", "grpo", "grpo-rollout", "ppo-z3")
PHASES = ("generation_s", "scoring_s", "update_s")


def prepare(shared: Path, overrides: list[str]) -> dict:
    """Write policy/, prompts.jsonl and meta.json for the config (tiny default + overrides)."""
    from ds_ppo.config import load_config
    from ds_ppo.data.prompts import PromptSampler, load_prompts
    from ds_ppo.data.tokenizer import load_tokenizer
    from ds_ppo.engine.roles import materialize_arch

    cfg = load_config(None, overrides)
    shared.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(cfg.policy.tokenizer or cfg.policy.path, shared)
    prompts = load_prompts(cfg.data, tok)
    if cfg.policy.arch is not None:
        policy = tokenizer = shared / "policy"
        materialize_arch(cfg.policy.arch, tok, policy, cfg.seed)
    else:  # a pretrained policy: both sides load the directory itself
        policy, tokenizer = Path(cfg.policy.path).resolve(), shared / "tokenizer"
        if not list(policy.glob("*.safetensors")):
            raise UserError(f"bench --peer: policy.path = {cfg.policy.path!r} must be a local "
                            "directory with safetensors weights (save_pretrained's), so that "
                            "both runs can be checked to start from the same bytes")
        tok.save_pretrained(tokenizer)  # as ds_ppo loads it (a pad token added, left padding)
    p = cfg.ppo
    sampler = PromptSampler(len(prompts.input_ids), p.rollout_batch_size, 0, 1, cfg.seed,
                            shuffle=cfg.data.shuffle, group_size=p.mini_batch_size)
    with open(shared / "prompts.jsonl", "w") as f:
        for it in range(cfg.iterations):
            for i in sampler.global_indices(it):
                f.write(json.dumps({"prompt": prompts.texts[i],
                                    "prompt_ids": prompts.input_ids[i]}) + "\n")
    g = cfg.generation
    meta = {"iterations": cfg.iterations, "rollout_batch_size": p.rollout_batch_size,
            "mini_batch_size": p.mini_batch_size, "micro_batch_size": p.micro_batch_size,
            "ppo_epochs": p.ppo_epochs, "kl_coef": p.kl_coef, "max_new_tokens": g.max_new_tokens,
            "temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k,
            "lr": cfg.policy.lr, "warmup_steps": cfg.policy.warmup_steps,
            "betas": list(cfg.policy.betas), "eps": cfg.policy.eps,
            "weight_decay": cfg.policy.weight_decay, "grad_clip": cfg.policy.max_grad_norm,
            "gradient_checkpointing": cfg.policy.gradient_checkpointing,
            "seed": cfg.seed, "reward": cfg.reward.function, "pad_token_id": tok.pad_token_id,
            "policy": str(policy), "tokenizer": str(tokenizer),
            "from_path": cfg.policy.arch is None, "policy_sha256": _weights_hash(policy)}
    if meta["reward"] is None:
        raise UserError("bench --peer: TRL needs reward.function (a python reward); this config "
                        "uses a reward model. Set reward.function.")
    (shared / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _weights_hash(model_dir: Path) -> str:
    """sha256 over the directory's safetensors files (one, or the shards in name order)."""
    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def grpo_overrides(overrides: list[str], g: int) -> list[str] | None:
    """ds_ppo GRPO in TRL's shape: the same prompts, g responses each, mini- and micro-batches of
    the same prompts' responses (mini_batch_size counts responses), the KL in the loss with TRL's
    beta = kl_coef. None where this ds_ppo has no critic-free estimator."""
    from ds_ppo.config import load_config

    p = load_config(None, overrides).ppo
    keys = ["ppo.advantage_estimator=grpo", f"ppo.samples_per_prompt={g}",
            f"ppo.mini_batch_size={p.mini_batch_size * g}",
            f"ppo.micro_batch_size={p.micro_batch_size * g}", f"ppo.kl_loss_coef={p.kl_coef}"]
    try:
        load_config(None, overrides + keys)
    except Exception:  # noqa: BLE001 - unknown key or value: not on this version
        return None
    return overrides + keys


THREADS: int | None = None  # --threads: OMP/torch threads of every child (None: their default)


def _child_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if THREADS:
        env["OMP_NUM_THREADS"] = str(THREADS)
    root = str(Path(__file__).resolve().parent.parent)  # this copy of ds_ppo in the children too
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _run(cmd: list[str], log: Path) -> float:
    t = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_child_env()).returncode
    if rc:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise UserError(f"bench --peer: {' '.join(cmd[:4])}... exited {rc}; log {log}:\n{tail}")
    return time.perf_counter() - t


def run_trl(shared: Path, out: Path, meta: dict, g: int, tag: str = "") -> dict:
    rows_file = out / f"trl{tag}.jsonl"
    wall = _run([sys.executable, "-m", "ds_ppo.bench.peer_trl", "--shared", str(shared), "--out",
                 str(rows_file), "--num-generations", str(g)], out / f"trl{tag}.log")
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    steps = [r for r in rows if not r.get("summary")]
    return _summary(f"TRL {rows[-1]['trl']} GRPOTrainer, G={g}", steps, "seconds", wall,
                    rows[-1]["optimizer_steps_per_step"])


def run_dsppo(name: str, label: str, overrides: list[str], out: Path, meta: dict) -> dict:
    run_dir = out / name
    cmd = [sys.executable, "-m", "ds_ppo", "train", f"output_dir={run_dir}",
           "tracking.enabled=false", "checkpoint.every=0", "checkpoint.save_at_end=false",
           "checkpoint.export_at_end=false", *overrides]
    wall = _run(cmd, out / f"{name}.log")
    init = Path(meta["policy"]) if meta["from_path"] else run_dir / "init_models" / "policy"
    if _weights_hash(init) != meta["policy_sha256"]:
        raise UserError(f"bench --peer: {init} is not the prepared starting point "
                        f"({meta['policy_sha256'][:12]}): the comparison would be unfair")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/iteration_s" in r]
    steps = [{"score": r["score/mean"], "iteration_s": r["time/iteration_s"],
              "sequences": r.get("rollout/sequences", None),
              **{k: r[f"time/{k}"] for k in PHASES}} for r in rows]
    seqs = _sequences(overrides)
    for s in steps:
        s["sequences"] = s["sequences"] or seqs
    opt_steps = _opt_steps(overrides)
    return _summary(label, steps, "iteration_s", wall, opt_steps)


def _sequences(overrides: list[str]) -> int:
    from ds_ppo.config import load_config

    cfg = load_config(None, overrides)
    return cfg.ppo.rollout_batch_size * getattr(cfg.ppo, "samples_per_prompt", 1)


def _opt_steps(overrides: list[str]) -> int:
    from ds_ppo.config import load_config

    p = load_config(None, overrides).ppo
    return p.ppo_epochs * (p.rollout_batch_size * getattr(p, "samples_per_prompt", 1)
                           // p.mini_batch_size)


def _summary(label: str, steps: list[dict], total_key: str, wall: float, opt_steps: int) -> dict:
    """Means over the iterations after the first (the first pays one-off warm-up costs)."""
    if not steps:
        raise UserError(f"bench --peer: {label} recorded no iterations")
    timed = steps[1:] or steps
    secs = statistics.fmean(s[total_key] for s in timed)
    k = min(5, len(steps))
    return {"label": label, "iterations": len(steps), "s_per_iter": secs,
            **{k_: statistics.fmean(s[k_] for s in timed) for k_ in PHASES},
            "sequences": steps[0]["sequences"], "seq_per_s": steps[0]["sequences"] / secs,
            "optimizer_steps": opt_steps,
            "score_first5": statistics.fmean(s["score"] for s in steps[:k]),
            "score_last5": statistics.fmean(s["score"] for s in steps[-k:]), "wall_s": wall}


def table(results: list[dict]) -> str:
    """One markdown table; ratios are each run's s/iteration and sequences/s over the TRL run of
    its own pair (`pair`; one pair when absent)."""
    refs = {r.get("pair", 0): r for r in results if r["label"].startswith("TRL")}
    pairs = len({r.get("pair", 0) for r in results}) > 1
    head = ("| run | seqs/iter | opt steps/iter | generation s | scoring s | update s | s/iter "
            "| seqs/s | score first 5 -> last 5 | s/iter vs TRL | seqs/s vs TRL | process s |")
    lines = [head, "|" + "---|" * 12]
    for r in results:
        ref = refs.get(r.get("pair", 0))
        ratio = (f"{r['s_per_iter'] / ref['s_per_iter']:.2f}x", f"{r['seq_per_s'] / ref['seq_per_s']:.2f}x") \
            if ref else ("-", "-")
        label = f"{r['label']} (pair {r['pair'] + 1})" if pairs else r["label"]
        lines.append(f"| {label} | {r['sequences']} | {r['optimizer_steps']} "
                     f"| {r['generation_s']:.3f} | {r['scoring_s']:.3f} | {r['update_s']:.3f} "
                     f"| {r['s_per_iter']:.3f} | {r['seq_per_s']:.0f} "
                     f"| {r['score_first5']:.3f} -> {r['score_last5']:.3f} | {ratio[0]} "
                     f"| {ratio[1]} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def pair_ratios(results: list[dict]) -> dict[str, list[float]]:
    """Per ds_ppo run label: its s/iteration over its own pair's TRL run, pair by pair (runs
    without a TRL run in their pair are left out)."""
    refs = {r.get("pair", 0): r for r in results if r["label"].startswith("TRL")}
    ratios: dict[str, list[float]] = {}
    for r in results:
        ref = refs.get(r.get("pair", 0))
        if ref is not None and r is not ref:
            ratios.setdefault(r["label"], []).append(r["s_per_iter"] / ref["s_per_iter"])
    return ratios


def _run_pair(runs: list[str], shared: Path, out: Path, meta: dict, g: int,
              overrides: list[str], pair: int, notes: list[str]) -> list[dict]:
    """One run of each of `runs`, in --runs order (pair 0 keeps the unsuffixed file names)."""
    tag = f"_{pair + 1}" if pair else ""
    results = []
    for name in runs:
        if name == "trl":
            results.append(run_trl(shared, out, meta, g, tag))
        elif name == "ppo":
            results.append(run_dsppo(f"dsppo_ppo{tag}", "ds_ppo PPO (config as given)",
                                     overrides, out, meta))
        elif name in ("grpo", "grpo-rollout"):
            grpo = grpo_overrides(overrides, g)
            if grpo is None:
                if not pair:
                    notes.append("ds_ppo grpo: skipped, this ds_ppo has no "
                                 "ppo.advantage_estimator=grpo")
            elif name == "grpo":
                results.append(run_dsppo(f"dsppo_grpo{tag}", f"ds_ppo GRPO, G={g}", grpo, out,
                                         meta))
            else:
                results.append(run_dsppo(f"dsppo_grpo_rollout{tag}",
                                         f"ds_ppo GRPO, G={g}, old log-probs from the rollout",
                                         grpo + ["ppo.old_logprobs=rollout"], out, meta))
        elif name == "ppo-z3":
            results.append(run_dsppo(f"dsppo_ppo_z3{tag}", "ds_ppo PPO, every role ZeRO-3",
                                     overrides + list(ZERO3), out, meta))
    return [dict(r, pair=pair) for r in results]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="ds-ppo bench --peer trl",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--peer", choices=("trl",), default="trl")
    ap.add_argument("--runs", default="trl,ppo,grpo",
                    help="comma-separated, run in this order: trl, ppo, grpo (skipped where "
                    "ds_ppo lacks it), grpo-rollout (grpo with ppo.old_logprobs=rollout: no "
                    "scoring forward of the policy), ppo-z3 (PPO with every role on ZeRO-3, "
                    "the reference offloaded)")
    ap.add_argument("--pairs", type=int, default=1,
                    help="run --runs this many times, interleaved (trl, grpo, trl, grpo, ...); "
                    "each ratio is to the TRL run of its own pair, so a load change on a "
                    "shared machine shows as spread between pairs instead of bias")
    ap.add_argument("--iterations", type=int, default=None,
                    help="iterations of every run (default: the config's, 40 for the tiny one)")
    ap.add_argument("--num-generations", type=int, default=4,
                    help="completions per prompt for TRL and ds_ppo grpo")
    ap.add_argument("--threads", type=int, default=1,
                    help="OMP_NUM_THREADS of every run (0: their default). 1 keeps runs comparable "
                    "on a shared machine")
    ap.add_argument("--out-dir", default="outputs/bench_peer")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("overrides", nargs="*", help="ds_ppo key=value overrides (both sides)")
    args = ap.parse_args(argv)
    args.run_list = [r.strip() for r in args.runs.split(",") if r.strip()]
    bad = set(args.run_list) - set(RUNS)
    if bad:
        raise UserError(f"bench --peer: --runs has {sorted(bad)}; choose from {', '.join(RUNS)}")
    if args.pairs < 1:
        raise UserError(f"bench --peer: --pairs must be >= 1, got {args.pairs}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    global THREADS
    THREADS = args.threads or None
    overrides = list(args.overrides)
    if args.iterations:
        overrides.append(f"iterations={args.iterations}")
    runs = args.run_list
    if "trl" in runs:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise UserError('bench --peer trl: trl is not installed; pip install -e ".[peer]" '
                            "(or drop trl from --runs)") from None
    out = Path(args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    meta = prepare(out / "shared", overrides)
    results, notes = [], []
    for pair in range(args.pairs):
        results += _run_pair(runs, out / "shared", out, meta, args.num_generations, overrides,
                             pair, notes)
    print(f"starting point {out / 'shared'} (policy sha256 {meta['policy_sha256'][:12]}); "
          f"threads {THREADS or 'default'}; means over iterations 2..N; overrides: {' '.join(overrides) or '(none)'}")
    print(table(results))
    ratios = pair_ratios(results)
    if args.pairs > 1:
        for label, rs in ratios.items():
            print(f"{label}: s/iter vs TRL by pair {', '.join(f'{r:.2f}x' for r in rs)}; "
                  f"median {statistics.median(rs):.2f}x")
    for n in notes:
        print(n)
    if args.json:
        Path(args.json).write_text(json.dumps({"overrides": overrides, "results": results,
                                               "pairs": args.pairs, "ratios": ratios,
                                               "notes": notes}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"ds-ppo: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
