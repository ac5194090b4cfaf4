"""Router replay on CPU: how many tokens a perturbed sampler routes otherwise than the trainer,
and the sampler-trainer log-prob gap with and without replay (docs/RESULTS.md, "Router
replay"). The sampler is the trainer's model in bf16 (a bf16 generation replica), or with noise
on its gate weights; both decode through our loop (routes recorded) and the float32 trainer
scores the rollout through `forward.response_logprobs`, the forward scoring and the update use.

    OMP_NUM_THREADS=1 python tools/measure_router_replay.py
"""
from __future__ import annotations

import torch

from ds_ppo.algo.masks import response_mask
from ds_ppo.bench.stand_ins import small_moe
from ds_ppo.containers import Rollout
from ds_ppo.engine import moe
from ds_ppo.engine.forward import response_logprobs
from ds_ppo.engine.generation.loop import decode

PAD, EOS = 0, 1
SIZES = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=128,
             max_position_embeddings=256)


def model(kind: str):
    extra = dict(num_experts=8, moe_intermediate_size=64) if kind == "qwen3_moe" else \
        dict(num_local_experts=8)
    return small_moe(kind, **{**SIZES, **extra})


def rollout(sampler, B: int = 32, P: int = 16, T: int = 32) -> Rollout:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 256, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.bool)
    torch.manual_seed(0)
    out = decode(sampler, ids, mask, max_new_tokens=T, eos_ids=[EOS], pad_id=PAD,
                 temperature=1.0, routes=True)
    keep = response_mask(out.response_ids, [EOS])
    return Rollout(prompt_ids=ids, prompt_mask=mask, response_ids=out.response_ids.masked_fill(
        ~keep, PAD), mask=keep, ended=torch.ones(B, dtype=torch.bool), prompts=[""] * B,
        responses=[""] * B, prompt_lens=[P] * B, response_lens=keep.sum(1).tolist(),
        extras=[{}] * B, rollout_logprobs=out.logprobs.float().masked_fill(~keep, 0.0),
        prompt_routes=out.prompt_routes, response_routes=out.response_routes)


def measure(trainer, r: Rollout) -> dict:
    tap = moe.tap(trainer)
    row = {}
    for replay in (False, True):
        tap.take_flips()
        with torch.no_grad():
            lp, _ = response_logprobs(trainer, r, 1.0, routers=tap, replay=replay)
        flipped, total = tap.take_flips()
        diff = (lp - r.rollout_logprobs).abs()[r.mask]
        name = "replay" if replay else "own"
        row[f"{name}_diff_mean"], row[f"{name}_diff_max"] = float(diff.mean()), float(diff.max())
        row["flip_frac"] = flipped / total
    return row


def main() -> None:
    print("| model | sampler | tokens flipped | abs diff mean without / with replay | "
          "abs diff max without / with replay |")
    print("|---|---|---|---|---|")
    for kind in ("qwen3_moe", "mixtral"):
        trainer = model(kind)
        samplers = {"bf16 copy": model(kind).to(torch.bfloat16)}
        for scale in (0.05, 0.2):
            s = model(kind)
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for router in moe.routers(s):
                    router.weight.add_(torch.randn(router.weight.shape, generator=g) * scale
                                       * router.weight.std())
            samplers[f"gate noise {scale} x std"] = s
        for name, sampler in samplers.items():
            m = measure(trainer, rollout(sampler))
            print(f"| {kind} | {name} | {m['flip_frac']:.2%} | {m['own_diff_mean']:.2e} / "
                  f"{m['replay_diff_mean']:.2e} | {m['own_diff_max']:.2e} / "
                  f"{m['replay_diff_max']:.2e} |")


if __name__ == "__main__":
    main()
