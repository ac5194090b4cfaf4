"""The PPO update: `ppo_epochs` passes over mini-batches, each an optimizer step of the policy and
(with ppo.advantage_estimator = gae) the value model, with gradient accumulation over
micro-batches.

Loss normalisation: every micro-batch loss is a (weighted) masked SUM divided by one count of the
whole global mini-batch (all micro-batches, all ranks): its valid tokens, or for the sequence
modes of ppo.loss_aggregation its sequences (ds_ppo.algo.aggregation); then multiplied by
(world size x accumulation steps) to undo DeepSpeed's averaging over both. The gradient of an
optimizer step is therefore exactly the gradient of the aggregated loss over the global
mini-batch, whatever the micro-batch size or the number of ranks (tested).

Packed micro-batches (ppo.micro_batch_tokens): their number per mini-batch depends on the rows'
lengths, so it differs between ranks and from DeepSpeed's gradient_accumulation_steps. Every rank
runs the most micro-batches any rank has (ZeRO forwards and gradient reductions are collective),
the extra ones idle (a repeat of its shortest row with zero loss weight), and the optimizer step
is placed explicitly on each mini-batch's last micro-batch (`backward_step`'s boundary). DeepSpeed
still divides each loss by its configured accumulation steps, which the scale above undoes, so
the gradient is the same sum as without packing.
"""
from __future__ import annotations

import torch

from ds_ppo.algo import kl_loss, loss_divisor, loss_token_weights, policy_loss, value_loss
from ds_ppo.config import Config, grad_accum_steps
from ds_ppo.containers import Experience
from ds_ppo.engine import dist
from ds_ppo.metrics import Accumulator
from ds_ppo.role_names import TRAINED_ROLES


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
    """Train the policy (and the value model, if the estimator has one) on one rollout's
    experience; adds loss statistics to `acc`."""
    p = cfg.ppo
    world = dist.world_size()
    accum = grad_accum_steps(cfg, world)
    per_rank_mini = p.mini_batch_size // world
    scale = float(world * accum)
    critic = engines.value  # None with a critic-free estimator
    lens = exp.rollout.response_lens  # host: token counts without a device read
    kept = exp.train_rows or [True] * len(exp)  # ppo.filter_zero_std_groups
    packed = p.micro_batch_tokens is not None
    engines.policy.train()
    if critic is not None:
        critic.train()
    for epoch in range(p.ppo_epochs):
        minibatches = minibatch_rows(len(exp), per_rank_mini, dist.rank(), epoch, cfg.seed,
                                     iteration)
        # per global mini-batch (sum over ranks), one all-reduce per epoch: its valid tokens
        # (the value loss's divisor) and the policy loss's divisor (ppo.loss_aggregation)
        counts = dist.all_reduce_sum(torch.tensor(
            [[float(sum(lens[i] for i in rows)),
              loss_divisor([lens[i] for i in rows if kept[i]], p.loss_aggregation)]
             for rows in minibatches], dtype=torch.float64))
        # longest rows first; the order within a mini-batch does not change its gradient
        # (each micro-batch loss is normalised by the whole mini-batch's count)
        micro = [exp.rollout.token_micro_batches(p.micro_batch_tokens, rows) if packed
                 else exp.rollout.micro_batches(p.micro_batch_size, rows) for rows in minibatches]
        steps = [len(m) for m in micro]
        if packed:  # per mini-batch, the most micro-batches of any rank (one all-reduce)
            steps = dist.all_reduce_max(torch.tensor(steps, dtype=torch.float64)).long().tolist()
        for mine, n_steps, (n_tok, pg_div) in zip(micro, steps, counts.tolist()):
            n_tok, pg_div = max(n_tok, 1.0), max(pg_div, 1.0)
            # device tensors, read once per mini-batch: no host sync between micro-batches
            losses, stats = [], {}
            batches = exp.rollout.with_idle(mine, n_steps)  # then zero-weight repeats
            acc.add_mean("padding/update_positions_per_token",
                         *exp.rollout.positions(batches, packed, len(mine)))
            for step, mb_rows in enumerate(batches):
                idle = step >= len(mine)  # idle: no gradient, no statistics
                boundary = (step == n_steps - 1) if packed else None  # the optimizer step
                mb = exp.slice(mb_rows)
                step_losses, named = micro_batch_step(
                    mb, engines, cfg, weight=0.0 if idle else scale, boundary=boundary,
                    pg_div=pg_div, n_tok=n_tok, packed=packed, filtered=exp.train_rows is not None)
                if idle:
                    continue
                losses.append(torch.stack(list(step_losses.values())).double())
                # stats are per-micro-batch token means: weight them by tokens for a global mean
                n_valid = mb.mask.sum().double()
                for k, v in named.items():
                    stats.setdefault(k, []).append(torch.stack([v.double() * n_valid, n_valid]))
            sums = torch.stack([torch.stack(parts).sum(dim=0) for parts in stats.values()])
            for k, (total, count) in zip(stats, sums.tolist()):  # one read for all statistics
                acc.add_mean(k, total, count)
            # summed over ranks, this step's losses are the global mini-batch's aggregates
            totals = dist.all_reduce_sum(torch.stack(losses).sum(dim=0)).tolist()
            for name, total in zip(step_losses, totals):
                acc.add_replicated(name, total)
            # global gradient norms of the step just taken (before clipping; identical on ranks)
            for role in TRAINED_ROLES:
                engine = getattr(engines, role)
                norm = engine.grad_norm() if engine is not None else None
                if norm is not None:
                    acc.add_replicated(f"{role}/grad_norm", norm)


def micro_batch_step(mb: Experience, engines, cfg: Config, weight: float, boundary: bool | None,
                     pg_div: float, n_tok: float, packed: bool, filtered: bool
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Forward, loss and backward of one micro-batch for the policy (and the critic, if any).

    `weight` scales the losses for the backward (world size x accumulation steps; 0 for an idle
    micro-batch, which still runs the collectives); `pg_div` / `n_tok` are the global
    mini-batch's divisors of the policy and value losses; `boundary` marks the optimizer step
    of a packed mini-batch. Returns (this micro-batch's losses, its named statistics), detached
    0-dim device tensors."""
    p = cfg.ppo
    logprobs, _ = engines.policy.logprobs(mb.rollout, cfg.generation.temperature, packed=packed,
                                          tiled=p.tiled_logits, tile_tokens=p.logits_tile_tokens)
    pg_mask = mb.mask
    if filtered:  # rows of dropped groups (ppo.filter_zero_std_groups): no loss, no gradient
        pg_mask = pg_mask & torch.tensor(mb.train_rows, device=pg_mask.device)[:, None]
    weights = None if p.loss_aggregation == "token_mean" else loss_token_weights(
        pg_mask, p.loss_aggregation, cfg.generation.max_new_tokens)
    pg_loss, pg_stats = policy_loss(logprobs, mb.old_logprobs, mb.advantages, pg_mask,
                                    clip_eps=p.clip_eps, num_tokens=pg_div,
                                    clip_eps_high=p.clip_eps_high, dual_clip=p.dual_clip,
                                    token_weights=weights)
    step_losses = {"loss/policy": pg_loss.detach()}
    if p.kl_loss_coef > 0:
        kl_term = kl_loss(logprobs, mb.ref_logprobs, pg_mask, p.kl_estimator, pg_div, weights)
        step_losses["loss/kl"] = kl_term.detach()
        pg_loss = pg_loss + p.kl_loss_coef * kl_term
    engines.policy.backward_step(pg_loss * weight, boundary=boundary)
    named = {f"policy/{k}": v for k, v in pg_stats.items()}
    critic = engines.value  # None with a critic-free estimator
    if critic is not None:
        values = critic.values(mb.rollout, packed=packed)
        vf_loss, vf_stats = value_loss(values, mb.old_values, mb.returns, mb.mask,
                                       clip_eps=p.value_clip_eps, num_tokens=n_tok)
        critic.backward_step(p.vf_coef * vf_loss * weight, boundary=boundary)
        step_losses["loss/value"] = vf_loss.detach()
        named.update({f"value/{k}": v for k, v in vf_stats.items()})
    return step_losses, named
