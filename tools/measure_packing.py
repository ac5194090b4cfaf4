"""CPU measurement of packed micro-batches (ppo.micro_batch_tokens) against row micro-batches:
the real `score` and `ppo_update` on one rollout of variable-length rows, with plain torch
modules standing in for the DeepSpeed engines (forwards and backwards; no optimizer step, the
same in both). Prints the positions computed and the seconds of each mode (best of --repeats,
the modes alternating). Used for docs/RESULTS.md:

    PYTHONPATH=. python tools/measure_packing.py
    PYTHONPATH=. python tools/measure_packing.py --device cuda --attn flash_attention_2 --threads 4
"""
from __future__ import annotations

import argparse
import time
import types
from dataclasses import fields, replace

import torch

from ds_ppo.bench.stand_ins import OneProcessEngine as FakeEngine
from ds_ppo.config import load_config
from ds_ppo.containers import Rollout
from ds_ppo.metrics import Accumulator
from ds_ppo.ppo.advantages import add_advantages, advantage_settings
from ds_ppo.ppo.scoring import (
    reward_settings,
    score,
    scoring_settings,
    timed_reward_scores,
)
from ds_ppo.ppo.update import ppo_update, update_settings


def lognormal_lengths(n: int, median: float, cap: int, g: torch.Generator) -> list[int]:
    x = torch.exp(torch.randn(n, generator=g) * 0.8) * median
    return x.round().clamp(1, cap).long().tolist()


def make_rollout(rows: int, vocab: int, seed: int) -> Rollout:
    """Prompts median 55 tokens (max 256), responses median 74 (max 256), log-normal; left- and
    right-padded to the longest, as generation leaves them."""
    g = torch.Generator().manual_seed(seed)
    plens, rlens = lognormal_lengths(rows, 55, 256, g), lognormal_lengths(rows, 74, 256, g)
    P, T = max(plens), max(rlens)
    prompt_ids = torch.zeros(rows, P, dtype=torch.long)
    prompt_mask = torch.zeros(rows, P, dtype=torch.bool)
    response_ids = torch.zeros(rows, T, dtype=torch.long)
    mask = torch.zeros(rows, T, dtype=torch.bool)
    for b, (p, r) in enumerate(zip(plens, rlens)):
        prompt_ids[b, P - p:] = torch.randint(3, vocab, (p,), generator=g)
        prompt_mask[b, P - p:] = True
        response_ids[b, :r] = torch.randint(3, vocab, (r,), generator=g)
        mask[b, :r] = True
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                   mask=mask, ended=torch.ones(rows, dtype=torch.bool), prompts=[""] * rows,
                   responses=[""] * rows, prompt_lens=plens, response_lens=rlens,
                   extras=[{}] * rows)


def engines_for(layers: int, hidden: int, vocab: int, attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

    def config(**kw):
        return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                           num_hidden_layers=layers, num_attention_heads=hidden // 64,
                           num_key_value_heads=hidden // 64, attn_implementation=attn, **kw)

    from ds_ppo.engine.role_objects import PolicyRole, ReferenceRole, ValueRole

    torch.manual_seed(0)
    return types.SimpleNamespace(
        policy=PolicyRole(FakeEngine(LlamaForCausalLM(config()))),
        reference=ReferenceRole(FakeEngine(LlamaForCausalLM(config()))),
        value=ValueRole(FakeEngine(LlamaForTokenClassification(
            config(num_labels=1, classifier_dropout=0.0)))),
        teacher=None, reward=None,
        reward_fn=lambda prompts, responses: [0.0] * len(responses))


def sync(rollout: Rollout) -> None:
    if rollout.prompt_ids.is_cuda:
        torch.cuda.synchronize()


def run(rollout: Rollout, engines, overrides: list[str]) -> tuple[float, dict]:
    rows = len(rollout)
    cfg = load_config(None, [f"ppo.rollout_batch_size={rows}", f"ppo.mini_batch_size={rows}",
                             "ppo.samples_per_prompt=1", "ppo.advantage_estimator=gae",
                             "ppo.ppo_epochs=1", *overrides])
    for role in (engines.policy, engines.value):
        role.module.zero_grad(set_to_none=True)
    sync(rollout)
    t0 = time.perf_counter()
    with torch.no_grad():
        exp = add_advantages(score(rollout, engines, scoring_settings(cfg),
                                   lambda: timed_reward_scores(rollout, engines,
                                                               reward_settings(cfg), None)),
                             advantage_settings(cfg, 0.1))
    sync(rollout)
    scored = time.perf_counter() - t0
    acc = Accumulator()
    ppo_update(exp, engines, update_settings(cfg), 1, acc)
    sync(rollout)
    total = time.perf_counter() - t0
    metrics = acc.reduce()
    return total, {"score_s": scored, "update_s": total - scored,
                   "scoring_positions": exp.scoring_positions,
                   "update_positions_per_token": metrics["padding/update_positions_per_token"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--micro", type=int, default=8, help="ppo.micro_batch_size (rows)")
    parser.add_argument("--tokens", default="512,1024,2048",
                        help="ppo.micro_batch_tokens values, comma-separated")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attn", default="sdpa", help="attn_implementation of the models")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="the models' dtype (default float32; bfloat16 for flash-attention)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier "
                        "timings on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rollout = make_rollout(args.rows, args.vocab, seed=0)
    rollout = replace(rollout, **{f.name: getattr(rollout, f.name).to(args.device)
                                  for f in fields(rollout)
                                  if isinstance(getattr(rollout, f.name), torch.Tensor)})
    engines = engines_for(args.layers, args.hidden, args.vocab, args.attn)
    dtype = args.dtype or ("bfloat16" if args.attn.startswith("flash") else "float32")
    for role in ("policy", "reference", "value"):
        getattr(engines, role).engine.to(args.device, getattr(torch, dtype))
    modes = {"rows": [f"ppo.micro_batch_size={args.micro}"]}
    for budget in args.tokens.split(","):
        modes[f"packed {budget}"] = [f"ppo.micro_batch_size={args.micro}",
                                     f"ppo.micro_batch_tokens={budget}"]
    best: dict[str, tuple[float, dict]] = {}
    for _ in range(args.repeats):
        for name, overrides in modes.items():
            seconds, info = run(rollout, engines, overrides)
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, info)
    real = sum(rollout.prompt_lens) + sum(rollout.response_lens)
    print(f"{args.rows} rows, {real} real tokens; {args.device}, {args.attn}, {dtype}, "
          f"torch threads {torch.get_num_threads()}")
    for name, (seconds, info) in best.items():
        print(f"{name:12s} score+update {seconds:6.2f} s (score {info['score_s']:.2f}, update "
              f"{info['update_s']:.2f}); scoring positions {info['scoring_positions'][0]}, "
              f"update positions/token {info['update_positions_per_token']:.3f}; "
              f"/ rows {seconds / best['rows'][0]:.2f}")


if __name__ == "__main__":
    main()
