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

Sequence parallelism (deepspeed.sequence_parallel_size = N): the N ranks of a group hold the same
rows (one data-parallel rank). DeepSpeed is not told of the groups (no `mpu`): it averages the
gradients over all W ranks, as without SP, so the scale stays W x accumulation steps. A row of
at least deepspeed.sequence_parallel_min_tokens runs alone, split across the group
(`sequence_parallel.row_logprobs`): each rank's backward gives its shard's piece of the row's
gradient, and the pieces sum to it. Shorter rows run whole on every rank of the group, each
rank's loss weighted 1/N, so the group's copies sum to one row's gradient. The counts (divisors)
are summed over the data-parallel group: each row once. Split rows make the number of
micro-batches differ between groups: as packed, every rank runs the most, the step placed
explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ds_ppo import watchdog
from ds_ppo.algo import (entropy_bonus, kl_loss, lm_loss, loss_divisor, loss_token_weights,
                         masked_mean, value_loss)
from ds_ppo.algo.choices import KLEstimator, LossAggregation
from ds_ppo.algo.policy_losses import PolicyLossInputs, PolicyLossSettings, policy_loss_for
from ds_ppo.config import (Config, PPOConfig, critic_warmup, grad_accum_steps,
                           max_model_tokens)
from ds_ppo.containers import Experience
from ds_ppo.data.ptx import PtxStream
from ds_ppo.engine import dist
from ds_ppo.metrics import Accumulator
from ds_ppo.ppo.batching import (Batching, batching, is_split, plan_micro_batches,
                                 varying_counts)
from ds_ppo.role_names import TRAINED_ROLES


@dataclass(frozen=True)
class UpdateSettings:
    """Everything step 4 reads from the config."""

    ppo_epochs: int
    mini_batch_size: int  # ppo.mini_batch_size: rows of a global mini-batch (one optimizer step)
    plan: Batching  # micro-batches (ppo.micro_batch_size, ppo.micro_batch_tokens)
    grad_accum_steps: int  # DeepSpeed's gradient_accumulation_steps at this world size
    seed: int
    warmup_iterations: int  # ppo.critic_warmup_iterations with a value model, else 0
    temperature: float  # generation.temperature: the log-probs' softmax
    tiled_logits: bool | str  # ppo.tiled_logits (auto, true, false)
    logits_tile_tokens: int  # ppo.logits_tile_tokens
    loss_aggregation: LossAggregation
    max_model_tokens: int  # the L_max of seq_mean_token_sum_norm (config.max_model_tokens)
    policy_loss: str  # ppo.policy_loss (algo/choices.POLICY_LOSSES)
    clips: PolicyLossSettings  # every policy loss's clip or gate settings
    kl_loss_coef: float
    kl_estimator: KLEstimator
    kl_clip: float | None
    entropy_coef: float  # ppo.entropy_coef: the bonus without an entropy controller
    entropy_floor: float | None  # ppo.entropy_target with entropy_target_scope=token, else None
    vf_coef: float
    value_clip_eps: float | None
    ptx_coef: float


def update_settings(cfg: Config, world_size: int | None = None) -> UpdateSettings:
    """Step 4's settings from the config, for `world_size` ranks (default: this run's)."""
    p = cfg.ppo
    world = dist.world_size() if world_size is None else world_size
    return UpdateSettings(
        p.ppo_epochs, p.mini_batch_size, batching(cfg), grad_accum_steps(cfg, world), cfg.seed,
        p.critic_warmup_iterations if critic_warmup(cfg, 1) else 0,
        cfg.generation.temperature, p.tiled_logits, p.logits_tile_tokens, p.loss_aggregation,
        max_model_tokens(cfg), p.policy_loss, policy_loss_settings(p), p.kl_loss_coef,
        p.kl_estimator, p.kl_clip, p.entropy_coef, entropy_floor(p), p.vf_coef,
        p.value_clip_eps, p.ptx_coef)


def policy_loss_settings(p: PPOConfig) -> PolicyLossSettings:
    """The clip and gate settings of the policy losses, from their ppo.* keys of the same names."""
    return PolicyLossSettings(**{f.name: getattr(p, f.name) for f in fields(PolicyLossSettings)})


def entropy_floor(p: PPOConfig) -> float | None:
    """The per-token entropy floor of the bonus (nats), or None: ppo.entropy_target when
    ppo.entropy_target_scope is token (with scope mean the target steers the coefficient)."""
    return p.entropy_target if p.entropy_target_scope == "token" else None


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


def _policy_mask_and_weights(mb: Experience, s: UpdateSettings, filtered: bool):
    """A micro-batch's policy-loss mask ((B, T) bool: counted tokens of the rows that train,
    minus those ppo.rollout_correction=mis drops), the ppo.loss_aggregation token weights
    ((B, T) or None; the KL loss term's too) and the policy loss's token weights (those times
    the rollout-correction importance weights)."""
    pg_mask = mb.mask
    if filtered:  # rows of dropped groups (ppo.filter_zero_std_groups): no loss, no gradient
        pg_mask = pg_mask & torch.tensor(mb.train_rows, device=pg_mask.device)[:, None]
    if mb.is_kept is not None:
        pg_mask = pg_mask & mb.is_kept
    agg = s.loss_aggregation
    weights = None if agg == "token_mean" else loss_token_weights(pg_mask, agg, s.max_model_tokens)
    if mb.is_weights is None:
        return pg_mask, weights, weights
    return pg_mask, weights, mb.is_weights if weights is None else weights * mb.is_weights


@dataclass
class _Step:
    """What every micro-batch of one optimizer step shares (host values, ranks alike)."""

    n_tok: float  # valid response tokens of the global mini-batch (value loss divisor)
    pg_div: float  # the policy loss's divisor (ppo.loss_aggregation)
    n_steps: int  # micro-batches every rank runs (packed: the most any rank has)
    train_policy: bool  # False in the critic warm-up (ppo.critic_warmup_iterations)
    ptx_rows: list[int] | None  # this rank's PPO-ptx rows of this step (None: off)
    ptx_tok: float  # ptx target tokens of the global mini-batch (the LM loss's divisor)
    entropy: bool = False  # measure policy/entropy here (ppo.old_logprobs=rollout, epoch 0)
    entropy_coef: float = 0.0  # the entropy bonus's coefficient (0: no bonus)


def ppo_update(exp: Experience, engines, s: UpdateSettings, iteration: int, acc: Accumulator,
               ptx: PtxStream | None = None, entropy_coef: float | None = None) -> None:
    """Train the policy (and the value model, if the estimator has one) on one rollout's
    experience; adds loss statistics to `acc`. In the critic warm-up (`critic_warmup`) only the
    value model trains. `ptx`: the PPO-ptx rows, whose LM loss (x ppo.ptx_coef) joins each
    policy step. `entropy_coef`: the entropy bonus's coefficient (None: ppo.entropy_coef; the
    entropy controller's with ppo.entropy_target)."""
    if entropy_coef is None:
        entropy_coef = s.entropy_coef
    per_rank_mini = s.mini_batch_size // dist.dp_world_size()  # rows of a data-parallel rank
    plan = s.plan
    critic = engines.value  # None with a critic-free estimator
    lens = exp.rollout.counted_lens  # host: model-token counts without a device read
    kept = exp.train_rows or [True] * len(exp)  # ppo.filter_zero_std_groups
    pg_lens = exp.is_kept_lens or lens  # ppo.rollout_correction=mis drops tokens
    train_policy = s.warmup_iterations == 0 or iteration > s.warmup_iterations  # critic_warmup
    ptx = ptx if train_policy and s.ptx_coef > 0 else None
    if s.warmup_iterations:  # a run with a warm-up says which iterations are
        acc.add_replicated("value/warmup", 0.0 if train_policy else 1.0)
    engines.policy.train()
    if critic is not None:
        critic.train()
    for epoch in range(s.ppo_epochs):
        minibatches = minibatch_rows(len(exp), per_rank_mini, dist.dp_rank(), epoch, s.seed,
                                     iteration)
        ptx_rows = [ptx.minibatch(iteration, epoch * len(minibatches) + j) if ptx else None
                    for j in range(len(minibatches))]
        # per global mini-batch (sum over data-parallel ranks), one all-reduce per epoch: its
        # valid tokens
        # (the value loss's divisor), the policy loss's divisor (ppo.loss_aggregation) and
        # its PPO-ptx target tokens
        counts = dist.all_reduce_sum(torch.tensor(
            [[float(sum(lens[i] for i in rows)),
              loss_divisor([pg_lens[i] for i in rows if kept[i]], s.loss_aggregation),
              float(ptx.tokens(mine)) if ptx else 0.0]
             for rows, mine in zip(minibatches, ptx_rows)], dtype=torch.float64))
        # longest rows first, split rows last; the order within a mini-batch does not change
        # its gradient (each micro-batch loss is normalised by the whole mini-batch's count)
        micro = [plan_micro_batches(exp.rollout, plan, plan.micro_batch_size, rows)
                 for rows in minibatches]
        steps = [len(m) for m in micro]
        if varying_counts(plan):  # per mini-batch, the most micro-batches of any rank
            steps = dist.all_reduce_max(torch.tensor(steps, dtype=torch.float64)).long().tolist()
        for mine, n_steps, (n_tok, pg_div, ptx_tok), rows in zip(micro, steps, counts.tolist(),
                                                                  ptx_rows):
            # no scoring forward (ppo.old_logprobs=rollout): the first epoch's forwards, which
            # see each row once, give policy/entropy
            step = _Step(max(n_tok, 1.0), max(pg_div, 1.0), n_steps, train_policy, rows,
                         max(ptx_tok, 1.0), entropy=exp.entropy is None and epoch == 0,
                         entropy_coef=entropy_coef)
            _optimizer_step(exp, mine, step, engines, s, acc, ptx)


def _optimizer_step(exp: Experience, mine: list[list[int]], step: _Step, engines,
                    s: UpdateSettings, acc: Accumulator, ptx: PtxStream | None) -> None:
    """One optimizer step of each trained role over this rank's micro-batches `mine` of a
    mini-batch (then idle ones up to step.n_steps), and its statistics into `acc`."""
    plan = s.plan
    world = dist.world_size()  # DeepSpeed averages over every rank (module docstring)
    scale = float(world * s.grad_accum_steps)
    copies = dist.sp_size()  # ranks that compute a whole row's gradient (module docstring)
    critic = engines.value
    packed = plan.micro_batch_tokens is not None
    explicit = varying_counts(plan)  # the optimizer step placed on the last micro-batch
    # device tensors, read once per mini-batch: no host sync between micro-batches
    losses, stats = [], {}
    batches = exp.rollout.with_idle(mine, step.n_steps)  # then zero-weight repeats
    acc.add_mean("padding/update_positions_per_token",
                 *exp.rollout.positions(batches, packed, len(mine)))
    for k, mb_rows in enumerate(batches):
        watchdog.progress(k)
        split = is_split(exp.rollout, plan, mb_rows)  # one row across the SP group
        # idle: no gradient, no statistics
        weight = 0.0 if k >= len(mine) else scale if split else scale / copies
        boundary = (k == step.n_steps - 1) if explicit else None  # the optimizer step
        mb = exp.slice(mb_rows)
        step_losses, named, per_row = {}, {}, None
        if step.train_policy:
            # with PPO-ptx the ptx micro-batches follow: the policy's step comes after them
            policy_boundary = False if step.ptx_rows is not None else boundary
            pg_loss, pg_stats, per_row, extra = _policy_loss(mb, engines, s, step, packed,
                                                             split)
            engines.policy.backward_step(pg_loss * weight, boundary=policy_boundary,
                                         aux=weight > 0)
            step_losses.update(extra)
            named.update({f"policy/{k}": v for k, v in pg_stats.items()})
        if critic is not None:
            values = critic.values(mb.rollout, packed=packed, split=split)
            vf_loss, vf_stats = value_loss(values, mb.old_values, mb.returns, mb.mask,
                                           clip_eps=s.value_clip_eps, num_tokens=step.n_tok)
            critic.backward_step(s.vf_coef * vf_loss * weight, boundary=boundary, aux=weight > 0)
            step_losses["loss/value"] = vf_loss.detach()
            named.update({f"value/{k}": v for k, v in vf_stats.items()})
        if k >= len(mine):
            continue
        losses.append(torch.stack(list(step_losses.values())).double())
        # stats are per-micro-batch token means: weight them by tokens for a global mean
        n_valid = mb.mask.sum().double()
        for name, v in named.items():
            stats.setdefault(name, []).append(torch.stack([v.double() * n_valid, n_valid]))
        if per_row is not None:  # per-response statistics: means over the trained responses
            seq_stats, n_rows = per_row
            for name, v in seq_stats.items():
                stats.setdefault(f"policy/{name}", []).append(
                    torch.stack([v.double() * n_rows, n_rows]))
    names = list(step_losses)
    total = torch.stack(losses).sum(dim=0)
    if step.ptx_rows is not None:  # PPO-ptx: its micro-batches, then the policy's step
        names.append("loss/ptx")
        # every rank of an SP group runs the same ptx rows whole
        total = torch.cat([total, _ptx_backward(ptx, step, engines, s,
                                                scale / copies)[None]])
    if step.train_policy:
        engines.policy.update_ema()  # policy.ema_decay: after the optimizer step
    for role in TRAINED_ROLES:  # a mixture-of-experts model's load-balancing loss (mean)
        engine = getattr(engines, role)
        aux_sum, aux_count = engine.take_aux_loss() if engine is not None else (0.0, 0.0)
        if aux_count:
            acc.add_mean(f"{role}/moe_aux_loss", aux_sum, aux_count)
    sums = torch.stack([torch.stack(parts).sum(dim=0) for parts in stats.values()])
    for name, (tot, count) in zip(stats, sums.tolist()):  # one read for all statistics
        acc.add_mean(name, tot, count)
    # summed over data-parallel ranks, this step's losses are the global mini-batch's
    for name, value in zip(names, dist.all_reduce_sum(total).tolist()):
        acc.add_replicated(name, value)
    # global gradient norms of the step just taken (before clipping; identical on ranks)
    for role in TRAINED_ROLES if step.train_policy else ("value",):
        engine = getattr(engines, role)
        norm = engine.grad_norm() if engine is not None else None
        if norm is not None:
            acc.add_replicated(f"{role}/grad_norm", norm)


def _policy_loss(mb: Experience, engines, s: UpdateSettings, step: _Step, packed: bool,
                 split: bool = False):
    """The policy's loss on micro-batch `mb` (ppo.policy_loss, plus ppo.kl_loss_coef x the KL
    loss, minus the entropy bonus's coefficient x the entropy bonus), its token and
    per-response statistics, and the detached terms as metrics. `split`: one row split across
    the sequence-parallel group."""
    bonus = step.entropy_coef > 0
    logprobs, entropy = engines.policy.logprobs(
        mb.rollout, s.temperature, with_entropy=step.entropy or bonus,
        packed=packed, tiled=s.tiled_logits, tile_tokens=s.logits_tile_tokens, split=split,
        entropy_grad=bonus)
    pg_mask, weights, pg_weights = _policy_mask_and_weights(mb, s, mb.train_rows is not None)
    out = policy_loss_for(s.policy_loss, PolicyLossInputs(
        logprobs, mb.old_logprobs, mb.advantages, pg_mask, num_tokens=step.pg_div,
        token_weights=pg_weights), s.clips)
    pg_loss, pg_stats = out.loss, out.token_stats
    if step.entropy:  # a token mean over the micro-batch, as the other statistics
        pg_stats["entropy"] = masked_mean(entropy.detach(), mb.mask)
    terms = {"loss/policy": pg_loss.detach()}
    if s.kl_loss_coef > 0:
        kl_term = kl_loss(logprobs, mb.ref_logprobs, pg_mask, s.kl_estimator, step.pg_div,
                          weights, clip=s.kl_clip)
        terms["loss/kl"] = kl_term.detach()
        pg_loss = pg_loss + s.kl_loss_coef * kl_term
    if bonus:  # the tokens and weights of the KL term (the policy's, without rollout correction)
        ent_term = entropy_bonus(entropy, pg_mask, step.pg_div, weights, s.entropy_floor)
        terms["loss/entropy"] = ent_term.detach()
        if s.entropy_floor is not None:  # a token mean over the micro-batch: the bonus's reach
            pg_stats["entropy_below_target"] = masked_mean(
                (entropy.detach() < s.entropy_floor).float(), mb.mask)
        pg_loss = pg_loss - step.entropy_coef * ent_term
    # per-response statistics with their count (responses with a token in the loss)
    per_row = (out.seq_stats, pg_mask.any(dim=-1).sum().double()) if out.seq_stats else None
    return pg_loss, pg_stats, per_row, terms


def _ptx_backward(ptx: PtxStream, step: _Step, engines, s: UpdateSettings,
                  scale: float) -> torch.Tensor:
    """PPO-ptx (InstructGPT eq. 2): backward of ppo.ptx_coef x the LM loss on this rank's ptx
    rows of the step, in micro-batches of ppo.micro_batch_size (the same count on every rank),
    each normalised by the global mini-batch's ptx tokens; the policy's optimizer step on the
    last. Returns this rank's share of the LM loss (detached)."""
    rows, size = step.ptx_rows, s.plan.micro_batch_size
    chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
    total = torch.zeros((), dtype=torch.float64, device=engines.device)
    for k, chunk in enumerate(chunks):
        batch = ptx.batch(chunk, engines.device)
        logprobs, _ = engines.policy.logprobs(batch, 1.0)  # the model's own distribution
        loss = lm_loss(logprobs, batch.mask, num_tokens=step.ptx_tok)
        engines.policy.backward_step(s.ptx_coef * loss * scale, boundary=k == len(chunks) - 1)
        total = total + loss.detach().double()
    return total
