"""Peak memory and time of one scoring + update pass over one long row, through the real stage
code (ds_ppo.ppo.scoring.score, add_advantages, ppo_update) on CPU: docs/RESULTS.md, "One long
row".

    python tools/measure_long_context.py --grid 4096,8192,16384,32768
    python tools/measure_long_context.py --tokens 8192 --mode tiled   # one process

Each (length, mode) runs in a fresh process, since peak RSS (ru_maxrss) is a process maximum.
Modes: untiled (ppo.tiled_logits=false: the (1, T, V) logits of today), tiled
(ppo.tiled_logits=true), tiled_ckpt (tiled + the policy's gradient checkpointing, as
policy.gradient_checkpointing enables it), tiled_ckpt_mlp (also policy.tiled_mlp). The model: a Llama shape with a 32k vocabulary and a
small body (hidden 64, 2 layers, 4 heads, MLP 128; ~4.2M parameters, 98% of them the embedding
and output head), fp32, policy and reference; the row is a 64-token prompt plus T - 64 response
tokens, critic-free (reinforce_pp: no value model, whose scalar head has no vocabulary term).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import types

VOCAB, PROMPT = 32000, 64


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def one(tokens: int, mode: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ds_ppo.config import load_config
    from ds_ppo.containers import Rollout
    from ds_ppo.engine.role_objects import PolicyRole, ReferenceRole
    from ds_ppo.metrics import Accumulator
    from ds_ppo.ppo.advantages import add_advantages, advantage_settings
    from ds_ppo.ppo.scoring import (reward_settings, score, scoring_settings,
                                    timed_reward_scores)
    from ds_ppo.ppo.update import ppo_update, update_settings

    from ds_ppo.bench.stand_ins import OneProcessEngine as FakeEngine

    torch.manual_seed(0)
    shape = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                        attn_implementation="sdpa")
    policy, reference = LlamaForCausalLM(shape), LlamaForCausalLM(shape).eval()
    if mode.startswith("tiled_ckpt"):  # as engine/roles.py enables policy.gradient_checkpointing
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "tiled_ckpt_mlp":  # and policy.tiled_mlp
        from ds_ppo.engine.tiled_mlp import tile_mlps

        tile_mlps(policy)
    T = tokens - PROMPT
    g = torch.Generator().manual_seed(1)
    rollout = Rollout(
        prompt_ids=torch.randint(3, VOCAB, (1, PROMPT), generator=g),
        prompt_mask=torch.ones(1, PROMPT, dtype=torch.bool),
        response_ids=torch.randint(3, VOCAB, (1, T), generator=g),
        mask=torch.ones(1, T, dtype=torch.bool), ended=torch.ones(1, dtype=torch.bool),
        prompts=[""], responses=[""], prompt_lens=[PROMPT], response_lens=[T], extras=[{}])
    engines = types.SimpleNamespace(
        policy=PolicyRole(FakeEngine(policy)), reference=ReferenceRole(FakeEngine(reference)),
        value=None, teacher=None, reward=None, reward_fn=lambda prompts, responses: [1.0])
    cfg = load_config(None, [
        "ppo.rollout_batch_size=1", "ppo.mini_batch_size=1", "ppo.micro_batch_size=1",
        "ppo.advantage_estimator=reinforce_pp", f"generation.max_new_tokens={T}",
        f"ppo.tiled_logits={'false' if mode == 'untiled' else 'true'}"])
    base = _rss_mib()
    t0 = time.perf_counter()
    rewards = reward_settings(cfg)
    with torch.no_grad():
        exp = add_advantages(score(rollout, engines, scoring_settings(cfg),
                                   lambda: timed_reward_scores(rollout, engines, rewards, None)),
                             advantage_settings(cfg, cfg.ppo.kl_coef))
    t1 = time.perf_counter()
    ppo_update(exp, engines, update_settings(cfg), 1, Accumulator())
    t2 = time.perf_counter()
    return {"tokens": tokens, "mode": mode, "peak_rss_mib": round(_rss_mib()),
            "rss_before_mib": round(base), "score_s": round(t1 - t0, 2),
            "update_s": round(t2 - t1, 2),
            "logprob_sum": float(exp.old_logprobs.sum())}


def grid(lengths: list[int], modes: list[str], skip: set[tuple[int, str]]) -> list[dict]:
    """Every (length, mode) in a fresh process, modes interleaved at each length."""
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for n in lengths:
        for mode in modes:
            if (n, mode) in skip:
                continue
            out = subprocess.run([sys.executable, __file__, "--tokens", str(n), "--mode", mode],
                                 capture_output=True, text=True, env=env)
            if out.returncode != 0:
                rows.append({"tokens": n, "mode": mode, "error": out.stderr[-500:]})
            else:
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--mode", choices=["untiled", "tiled", "tiled_ckpt", "tiled_ckpt_mlp"])
    ap.add_argument("--grid", help="comma-separated row lengths: every mode at each")
    ap.add_argument("--modes", default="untiled,tiled,tiled_ckpt")
    ap.add_argument("--skip", default="", help="length:mode pairs to leave out, comma-separated")
    args = ap.parse_args()
    if args.grid:
        skip = {(int(a), b) for a, b in (p.split(":") for p in args.skip.split(",") if p)}
        grid([int(x) for x in args.grid.split(",")], args.modes.split(","), skip)
    else:
        print(json.dumps(one(args.tokens, args.mode)))


if __name__ == "__main__":
    main()
