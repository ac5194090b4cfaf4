"""The PPO update: `ppo_epochs` passes over mini-batches, each an optimizer step of the policy and
the value model with gradient accumulation over micro-batches.

Loss normalisation: every micro-batch loss is a masked SUM divided by the number of valid tokens in
the whole global mini-batch (all micro-batches, all ranks), then multiplied by
(world size x accumulation steps) to undo DeepSpeed's averaging over both. The gradient of an
optimizer step is therefore exactly the gradient of the token-mean loss over the global
mini-batch, whatever the micro-batch size or the number of ranks (tested).
"""
from __future__ import annotations

import torch

from ds_ppo.algo import policy_loss, value_loss
from ds_ppo.config import Config, grad_accum_steps
from ds_ppo.containers import Experience
from ds_ppo.engine import dist
from ds_ppo.engine.roles import backward_step, global_grad_norm
from ds_ppo.forward import response_logprobs, response_values
from ds_ppo.metrics import Accumulator


def minibatch_rows(n: int, per_rank_mini: int, rank: int, epoch: int, seed: int,
                   iteration: int) -> list[list[int]]:
    """This rank's rows (of its n) in each PPO mini-batch of one epoch.

    The sampler lays the rollout out so that row i of rank r sits in mini-batch i // m at slot
    r*m + i % m of the global mini-batch (m = per_rank_mini). Epoch 0 keeps that layout. Later
    epochs re-mix the mini-batches without moving a row to another rank: the row in slot s of
    mini-batch j goes to slot s of mini-batch pi_s(j), pi_s a permutation drawn from
    (seed, iteration, epoch, s). A slot's rank depends only on s, and pi_s does not depend on
    the world size, so every mini-batch of every epoch holds the same samples at any world size.
    """
    m, count = per_rank_mini, n // per_rank_mini
    rows = [list(range(j * m, (j + 1) * m)) for j in range(count)]
    if epoch == 0 or count == 1:
        return rows
    for q in range(m):
        slot = rank * m + q
        key = ((seed * 1_000_003 + iteration) * 1_009 + epoch) * 100_003 + slot
        g = torch.Generator().manual_seed(key % 2**63)  # any seed, negative or large
        for j, to in enumerate(torch.randperm(count, generator=g).tolist()):
            rows[to][q] = j * m + q
    return rows


def ppo_update(exp: Experience, engines, cfg: Config, iteration: int, acc: Accumulator) -> None:
    """Train policy and value on one rollout's experience; adds loss statistics to `acc`."""
    p = cfg.ppo
    world = dist.world_size()
    accum = grad_accum_steps(cfg, world)
    per_rank_mini = p.mini_batch_size // world
    scale = float(world * accum)
    lens = exp.rollout.response_lens  # host: token counts without a device read
    engines.policy.train()
    engines.value.train()
    for epoch in range(p.ppo_epochs):
        minibatches = minibatch_rows(len(exp), per_rank_mini, dist.rank(), epoch, cfg.seed,
                                     iteration)
        # valid tokens of each global mini-batch (sum over ranks): one all-reduce per epoch
        counts = dist.all_reduce_sum(torch.tensor([float(sum(lens[i] for i in rows))
                                                   for rows in minibatches], dtype=torch.float64))
        for rows, n_tok in zip(minibatches, counts.tolist()):
            n_tok = max(n_tok, 1.0)
            # device tensors, read once per mini-batch: no host sync between micro-batches
            losses, stats = [], {}
            # longest rows first; the order within a mini-batch does not change its gradient
            # (each micro-batch loss is normalised by the whole mini-batch's tokens)
            micro = exp.rollout.micro_batches(p.micro_batch_size, rows)
            acc.add_mean("padding/update_positions_per_token", *exp.rollout.positions(micro))
            for mb_rows in micro:
                mb = exp.slice(mb_rows)
                logprobs, _ = response_logprobs(engines.policy, mb.rollout,
                                                cfg.generation.temperature)
                pg_loss, pg_stats = policy_loss(logprobs, mb.old_logprobs, mb.advantages,
                                                mb.mask, clip_eps=p.clip_eps, num_tokens=n_tok)
                backward_step(engines.policy, pg_loss * scale)

                values = response_values(engines.value, mb.rollout)
                vf_loss, vf_stats = value_loss(values, mb.old_values, mb.returns, mb.mask,
                                               clip_eps=p.value_clip_eps, num_tokens=n_tok)
                backward_step(engines.value, p.vf_coef * vf_loss * scale)

                losses.append(torch.stack([pg_loss.detach(), vf_loss.detach()]).double())
                # stats are per-micro-batch token means: weight them by tokens for a global mean
                n_valid = mb.mask.sum().double()
                named = {**{f"policy/{k}": v for k, v in pg_stats.items()},
                         **{f"value/{k}": v for k, v in vf_stats.items()}}
                for k, v in named.items():
                    stats.setdefault(k, []).append(torch.stack([v.double() * n_valid, n_valid]))
            sums = torch.stack([torch.stack(parts).sum(dim=0) for parts in stats.values()])
            for k, (total, count) in zip(stats, sums.tolist()):  # one read for all statistics
                acc.add_mean(k, total, count)
            # summed over ranks, this step's losses are token means over the global mini-batch
            pg, vf = dist.all_reduce_sum(torch.stack(losses).sum(dim=0)).tolist()
            acc.add_replicated("loss/policy", pg)
            acc.add_replicated("loss/value", vf)
            # global gradient norms of the step just taken (before clipping; identical on ranks)
            for role in ("policy", "value"):
                norm = global_grad_norm(getattr(engines, role))
                if norm is not None:
                    acc.add_replicated(f"{role}/grad_norm", norm)
