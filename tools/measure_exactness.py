"""The sampler's log-probs against the trainer's, with and without generation.batch_invariant,
and what the batch-invariant kernels cost (docs/SAMPLING.md).

A random-weight Llama in the given dtype samples responses to random prompts through the
trainer's own `generate` (mode gathered, our decoding loop, CUDA graphs on a GPU); the
trainer's forward (`response_logprobs`, micro-batches of --micro-batch rows) then scores the
same tokens. For each mode: the gap (mean and max of |sampler - trainer| over the counted
tokens, the k3 KL estimate) and the seconds of generation and of scoring. One markdown table
and one JSON line (also written to --json). Run from the repository root:

    python tools/measure_exactness.py --device cuda --dtype bf16      # a GPU
    python tools/measure_exactness.py --device cpu --dtype fp32 --tiny  # CPU, seconds

(launch/gpu_checks.sh runs the first; its CPU test runs the second.)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import torch


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--tiny", action="store_true", help="a 2-layer 64-wide model, 8 prompts of "
                   "8 tokens, 12 new tokens (CPU)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4, help="rows per scoring forward")
    p.add_argument("--json", default=None, help="also write the JSON line here")
    args = p.parse_args(argv)
    if args.tiny:
        args.hidden, args.layers, args.vocab = 64, 2, 300
        args.prompts, args.prompt_len, args.new_tokens, args.micro_batch = 8, 8, 12, 3
    return args


def _model(args, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(2, args.hidden // 64)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                      max_position_embeddings=args.prompt_len + args.new_tokens + 8,
                      attn_implementation="sdpa")
    with torch.device(device):
        return LlamaForCausalLM(cfg).to(dtype).eval()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args, exact: bool) -> dict:
    """One mode: sample, score, compare."""
    from ds_ppo.algo import rollout_mismatch
    from ds_ppo.config import load_config
    from ds_ppo.containers import Rollout
    from ds_ppo.engine.batch_invariant import batch_invariant
    from ds_ppo.engine.forward import response_logprobs
    from ds_ppo.engine.generation import generate

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    model = _model(args, device, dtype)
    engine = types.SimpleNamespace(module=model, empty_partition_cache=lambda: None)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, args.vocab, (args.prompts, args.prompt_len), generator=g).to(device)
    mask = torch.ones_like(ids, dtype=torch.bool)
    cfg = load_config(None, [f"generation.max_new_tokens={args.new_tokens}",
                             "generation.loop=own", "generation.mode=gathered"]).generation
    eos, pad = [1], 0
    with batch_invariant(exact), torch.no_grad():
        torch.manual_seed(0)
        _sync(device)
        t0 = time.perf_counter()
        gen = generate(engine, ids, mask, cfg, "gathered", eos, pad, dtype)
        _sync(device)
        gen_s = time.perf_counter() - t0
        m = gen.mask
        n = ids.shape[0]
        rollout = Rollout(prompt_ids=ids, prompt_mask=mask, response_ids=gen.response_ids,
                          mask=m, ended=gen.ended, prompts=[""] * n, responses=[""] * n,
                          prompt_lens=[args.prompt_len] * n, response_lens=m.sum(-1).tolist(),
                          extras=[{}] * n, rollout_logprobs=gen.logprobs,
                          sampling=gen.sampling)
        t0 = time.perf_counter()
        parts = [response_logprobs(model, rollout.slice(rows), cfg.temperature)[0]
                 for rows in rollout.micro_batches(args.micro_batch)]
        _sync(device)
        score_s = time.perf_counter() - t0
    order = [i for rows in rollout.micro_batches(args.micro_batch) for i in rows]
    trained = torch.empty_like(gen.logprobs)
    trained[torch.tensor(order, device=device)] = torch.cat(
        [torch.nn.functional.pad(p, (0, trained.shape[1] - p.shape[1])) for p in parts])
    diff, kl = rollout_mismatch(trained, gen.logprobs, m)
    tokens = int(m.sum())
    return {"batch_invariant": exact, "tokens": tokens,
            "logprob_abs_diff_mean": float(diff.sum()) / max(tokens, 1),
            "logprob_abs_diff_max": float(diff.max()), "kl_k3": float(kl.sum()) / max(tokens, 1),
            "generation_s": round(gen_s, 4), "scoring_s": round(score_s, 4),
            "graph": bool(gen.decode_stats and gen.decode_stats[0].graph)}


def main(argv=None) -> int:
    args = parse_args(argv)
    measure(args, False)  # warm-up, untimed: imports, the allocator, kernel selection
    rows = [measure(args, exact) for exact in (False, True)]
    plain, exact = rows
    out = {"device": args.device, "dtype": args.dtype,
           "model": f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}",
           "batch": f"{args.prompts} x ({args.prompt_len} + {args.new_tokens})",
           "plain": plain, "batch_invariant": exact,
           "generation_cost": round(exact["generation_s"] / max(plain["generation_s"], 1e-9), 2),
           "scoring_cost": round(exact["scoring_s"] / max(plain["scoring_s"], 1e-9), 2)}
    print(f"| {args.device} {args.dtype}, {out['model']}, {out['batch']} | diff mean | diff max "
          "| kl_k3 | generation s | scoring s |\n|---|---|---|---|---|---|")
    for name, r in (("plain", plain), ("batch_invariant", exact)):
        print(f"| {name} | {r['logprob_abs_diff_mean']:.3g} | {r['logprob_abs_diff_max']:.3g} | "
              f"{r['kl_k3']:.3g} | {r['generation_s']:.3f} | {r['scoring_s']:.3f} |")
    line = json.dumps(out)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
