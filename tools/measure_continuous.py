"""CPU measurement of continuous batching (generation.continuous) against one decode call per
generation.batch_size rows: slot utilisation (counted tokens / slot-steps) and tokens per
second of our decoding loop, both modes alternating, on a ~4.5M-parameter Llama policy (hidden
256) at temperature 1. Response lengths are forced (ds_ppo/bench/forced_lengths.py: the model
runs as usual, then a countdown picks the tokens) to a log-normal draw, so both modes decode
exactly the same tokens. Used for docs/RESULTS.md:

    PYTHONPATH=. python tools/measure_continuous.py
    PYTHONPATH=. python tools/measure_continuous.py --check-every 4 --slots 8 16 32
"""
from __future__ import annotations

import argparse
import time

import torch

from ds_ppo.algo import response_mask
from ds_ppo.bench.forced_lengths import ForcedLengths, forced_prompts, lognormal_lengths
from ds_ppo.engine.generation.loop import decode

PAD, EOS = 0, 2


def policy(vocab: int, hidden: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 32,
                      num_key_value_heads=hidden // 64, max_position_embeddings=4096,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def run(model, ids, mask, T: int, slots: int, continuous: bool, check: int) -> dict:
    """Decode every row in `slots` slots: one call (continuous) or one call per `slots` rows."""
    calls = [(0, len(ids))] if continuous else [(k, k + slots) for k in range(0, len(ids), slots)]
    tokens = slot_steps = 0
    t0 = time.perf_counter()
    for a, b in calls:
        out = decode(model, ids[a:b], mask[a:b], max_new_tokens=T, eos_ids=[EOS], pad_id=PAD,
                     temperature=1.0, stop_check_every=check,
                     slots=slots if continuous else None)
        tokens += int(response_mask(out.response_ids, [EOS]).sum())
        slot_steps += out.stats.slot_steps
    return {"seconds": time.perf_counter() - t0, "tokens": tokens, "slot_steps": slot_steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--median", type=float, default=25)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--slots", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--check-every", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    inner = policy(args.vocab, args.hidden, args.layers)
    model = ForcedLengths(inner, EOS).eval()
    lengths = lognormal_lengths(args.prompts, args.median, args.max_new, args.sigma)
    ids, mask = forced_prompts(lengths, args.prompt_len, args.vocab, PAD)
    params = sum(p.numel() for p in inner.parameters())
    print(f"policy {params / 1e6:.2f}M params; {args.prompts} prompts of {args.prompt_len} "
          f"tokens; response lengths log-normal median {args.median:g} sigma {args.sigma:g}, "
          f"max_new_tokens {args.max_new}: median {sorted(lengths)[len(lengths) // 2]}, "
          f"max {max(lengths)}, total {sum(lengths)}; stop_check_every {args.check_every}; "
          f"{args.threads} thread(s)")
    print("| slots | mode | utilisation | slot-steps | tokens | s (best) | tokens/s "
          "| cont. vs static |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for slots in args.slots:
        best: dict[bool, dict] = {}
        for _ in range(args.repeats):
            for continuous in (False, True):  # alternating
                r = run(model, ids, mask, args.max_new, slots, continuous, args.check_every)
                assert r["tokens"] == sum(lengths), (r, sum(lengths))
                if continuous not in best or r["seconds"] < best[continuous]["seconds"]:
                    best[continuous] = r
        for continuous in (False, True):
            r = best[continuous]
            speed = r["tokens"] / r["seconds"]
            ratio = speed / (best[False]["tokens"] / best[False]["seconds"])
            print(f"| {slots} | {'continuous' if continuous else 'static'} | "
                  f"{r['tokens'] / r['slot_steps']:.1%} | {r['slot_steps']} | {r['tokens']} | "
                  f"{r['seconds']:.2f} | {speed:.0f} | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
