"""On 2 CPU ranks (a scenario of dist_checks.py, or run alone under torchrun): one row's log-probs,
PPO loss (and every other ppo.policy_loss) and gradients with sequence parallelism (SP = 2,
DeepSpeed Ulysses, engine/sequence_parallel.py) against SP = 1 on the same row, computed on each
rank. `compare` returns the largest differences over both ranks (tests/dist/test_engine.py
asserts them)."""
from __future__ import annotations

import contextlib
import json
import sys

import torch


def _settings():
    from ds_ppo.algo.policy_losses import PolicyLossSettings

    # clips wide enough for these random log-ratios to pass some tokens and responses
    return PolicyLossSettings(clip_eps=0.2, clip_eps_high=None, dual_clip=None,
                              gspo_clip_eps=0.2, gspo_clip_eps_high=0.3, cispo_eps_low=None,
                              cispo_eps_high=0.3, gmpo_clip_eps=0.4, sapo_tau_pos=1.0,
                              sapo_tau_neg=1.05)


def compare() -> dict:
    """Collective on a world of 2 ranks (the process group initialised)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ds_ppo.algo import LogitShape, loss_divisor, loss_token_weights, policy_loss
    from ds_ppo.algo.choices import POLICY_LOSSES
    from ds_ppo.algo.policy_losses import PolicyLossInputs, policy_loss_for
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
    SETTINGS = _settings()
    adv = torch.randn(1, T, generator=g)

    def loss_and_grads(logprobs):
        loss, _ = policy_loss(logprobs, old, adv, rollout.mask, clip_eps=0.2, num_tokens=R)
        model.zero_grad()
        loss.backward(retain_graph=True)  # then every ppo.policy_loss on the same forward
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    def each_loss(logprobs):
        """Every other ppo.policy_loss's loss and gradients on `logprobs` (its aggregation's
        weights; one advantage per response where the loss needs it)."""
        out = {}
        for name, spec in POLICY_LOSSES.items():
            if name == "ppo":
                continue
            mode = spec.aggregations[0]
            a = adv[:, :1].expand_as(adv) if spec.per_response else adv
            x = PolicyLossInputs(logprobs, old, a, rollout.mask,
                                 num_tokens=loss_divisor([R], mode),
                                 token_weights=loss_token_weights(rollout.mask, mode, T))
            loss = policy_loss_for(name, x, SETTINGS).loss
            model.zero_grad()
            loss.backward(retain_graph=True)
            out[name] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
        return out

    ref, ref_ent = response_logprobs(model, rollout, 0.7, with_entropy=True)
    ref_loss, ref_grads = loss_and_grads(ref)
    ref_each = each_loss(ref)
    group = sp.new_group(2)
    sp.register(model.config, group)
    # Ulysses layers made before (dist_checks' sp_train scenario registers its own shape)
    shapes_before = set(sp._REGISTERED["sdpa"]["ulysses"])
    lp, ent = sp.row_logprobs(model, rollout, 0.7, group, tile_tokens=8, with_entropy=True)
    loss, grads = loss_and_grads(lp)
    each = each_loss(lp)
    lp = lp.detach()

    def summed_over_group(grads):  # the group's gradients sum to the row's
        for grad in grads.values():
            torch.distributed.all_reduce(grad, group=group)
        return grads

    summed = summed_over_group(grads)
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
    for name, (l_sp, g_sp) in each.items():  # every policy loss, split as PPO's
        l_ref, g_ref = ref_each[name]
        g_sp = summed_over_group(g_sp)
        diffs[f"loss_{name}"] = float((l_sp - l_ref).abs())
        diffs[f"grads_{name}"] = max(float((g_sp[n] - g_ref[n]).abs().max()) for n in g_ref)
        diffs[f"grad_scale_{name}"] = max(float(g_ref[n].abs().max()) for n in g_ref)
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
