"""On 2 CPU ranks (a scenario of dist_checks.py, or run alone under torchrun): one row's log-probs,
PPO loss and gradients with sequence parallelism (SP = 2, DeepSpeed Ulysses,
engine/sequence_parallel.py) against SP = 1 on the same row, computed on each rank. `compare`
returns the largest differences over both ranks (tests/dist/test_engine.py asserts them)."""
from __future__ import annotations

import contextlib
import json
import sys

import torch


def compare() -> dict:
    """Collective on a world of 2 ranks (the process group initialised)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ds_ppo.algo import LogitShape, policy_loss
    from ds_ppo.containers import Rollout
    from ds_ppo.engine import sequence_parallel as sp
    from ds_ppo.engine.forward import response_logprobs

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    P, R, T = 6, 31, 34  # 37 real tokens: the 2 shards are 19 + 18 and one pad
    rollout = Rollout(
        prompt_ids=torch.cat([torch.zeros(1, 2, dtype=torch.long),
                              torch.randint(3, 300, (1, P), generator=g)], 1),
        prompt_mask=torch.tensor([[False] * 2 + [True] * P]),
        response_ids=torch.randint(3, 300, (1, T), generator=g),
        mask=torch.tensor([[True] * R + [False] * (T - R)]), ended=torch.ones(1, dtype=torch.bool),
        prompts=[""], responses=[""], prompt_lens=[P], response_lens=[R], extras=[{}],
        # sampled with a shaped distribution: EOS (1, 2) blocked for the first 5 tokens, the
        # pad suppressed, top-k; the split row must map each position's shape as the whole does
        sampling=LogitShape(temperature=0.7, top_k=50, suppress_ids=(0,), eos_ids=(1, 2),
                            min_new_tokens=5))
    old = torch.randn(1, T, generator=g) - 5
    adv = torch.randn(1, T, generator=g)

    def loss_and_grads(logprobs):
        loss, _ = policy_loss(logprobs, old, adv, rollout.mask, clip_eps=0.2, num_tokens=R)
        model.zero_grad()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref, ref_ent = response_logprobs(model, rollout, 0.7, with_entropy=True)
    ref_loss, ref_grads = loss_and_grads(ref)
    group = sp.new_group(2)
    sp.register(model.config, group)
    # Ulysses layers made before (dist_checks' sp_train scenario registers its own shape)
    shapes_before = set(sp._REGISTERED["sdpa"]["ulysses"])
    lp, ent = sp.row_logprobs(model, rollout, 0.7, group, tile_tokens=8, with_entropy=True)
    loss, grads = loss_and_grads(lp)
    lp = lp.detach()
    summed = {}
    for n, grad in grads.items():  # the group's gradients sum to the row's
        torch.distributed.all_reduce(grad, group=group)
        summed[n] = grad
    # outside sharded(): the same process's plain forwards are untouched by the registration
    again, _ = response_logprobs(model, rollout, 0.7)
    # the check can fail: without the Ulysses exchange each shard attends to itself only
    sharded, sp.sharded = sp.sharded, contextlib.nullcontext
    try:
        with torch.no_grad():
            alone, _ = sp.row_logprobs(model, rollout, 0.7, group, tile_tokens=8)
    finally:
        sp.sharded = sharded
    diffs = {
        "logprobs": float((lp - ref).abs().max()),
        "entropy": float((ent - ref_ent).abs().max()),
        "loss": float((loss - ref_loss).abs()),
        "grads": max(float((summed[n] - ref_grads[n]).abs().max()) for n in ref_grads),
        "grad_scale": max(float(ref_grads[n].abs().max()) for n in ref_grads),
        "unsharded_after": float((again - ref).abs().max()),
        "masked_nonzero": float(lp[~rollout.mask].abs().max()),
        "ulysses_shapes": float(len(set(sp._REGISTERED["sdpa"]["ulysses"]) - shapes_before)),
        "without_exchange": -float((alone - ref).abs().max()),  # negated: the max is the least
    }
    worst = torch.tensor(list(diffs.values()), dtype=torch.float64)
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)  # over both ranks
    out = dict(zip(diffs, worst.tolist()))
    out["without_exchange"] = -out["without_exchange"]
    return out


def main() -> None:
    from ds_ppo.engine.dist import init_distributed, rank

    init_distributed()
    print(json.dumps({"rank": rank(), **compare()}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
