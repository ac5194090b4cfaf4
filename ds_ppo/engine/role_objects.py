"""What the stages may do with each model role: one small object per role around its DeepSpeed
engine (`Engines` in engine/roles.py holds them). Scoring, the update, the rollout, metrics,
checkpoints and exports call these methods, never the engine's attributes, so what a stage
needs from DeepSpeed is written down here.

- `PolicyRole`:    log-probs (and entropy) of responses, backward + optimizer step, lr, grad norm.
- `ValueRole`:     per-token values, backward + optimizer step, lr, grad norm.
- `ReferenceRole`: log-probs (an inference engine, or the LoRA policy with its adapters off).
- `TeacherRole`:   on-policy distillation's teacher: log-probs and top-1 matches of the samples.
- `RewardRole`:    sequence scores (an inference engine around `forward.LastTokenScorer`).
- `ScorerRole`:    a reward model in training (`ds-ppo rm`): sequence scores, backward + step.

The forward math stays in ds_ppo/engine/forward.py; every forward runs through the engine's own
`forward` (ZeRO-3's root-module hooks).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ds_ppo.containers import Rollout
from ds_ppo.engine import dist, moe
from ds_ppo.engine.forward import (causal_lm, response_logprobs, response_values,
                                   sequence_scores, teacher_logprobs)
from ds_ppo.engine.sequence_parallel import row_logprobs, row_values


class Role:
    """A model role around its engine (a `deepspeed.DeepSpeedEngine`, or for a LoRA reference
    `lora.AdaptersOff`)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        # a mixture-of-experts model's router hooks (engine/moe.py); None for a dense model
        self.routers = moe.tap(self.module if hasattr(engine, "module") else causal_lm(engine))

    @property
    def module(self) -> torch.nn.Module:
        """The model inside the engine (the HF model, or its peft wrapper with LoRA; its
        parameters ZeRO-3-partitioned): what the generation replica and exports are built
        from, what parameter counts read."""
        return self.engine.module

    def num_params(self) -> int:
        """The model's parameter count, full sizes (ZeRO-3 partitions counted whole)."""
        from ds_ppo.engine.lora import count_params

        return count_params(self.module.parameters())

    def eval(self) -> None:
        self.engine.eval()

    def train(self) -> None:
        self.engine.train()


class TrainedRole(Role):
    """A role with an optimizer (policy, value): DeepSpeed's engine with its optimizer and LR
    schedule."""

    aux_coef = 0.0  # a mixture-of-experts model's load-balancing loss coefficient (roles.py)

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._aux: list[torch.Tensor] = []  # this step's load-balancing losses (detached)

    def backward_step(self, loss: torch.Tensor, boundary: bool | None = None,
                      aux: bool = True) -> None:
        """One micro-batch backward; DeepSpeed steps the optimizer at accumulation boundaries:
        every gradient_accumulation_steps micro-batches, or, given `boundary`, exactly when it is
        True (a caller whose number of micro-batches per step varies: ppo.micro_batch_tokens).

        A mixture-of-experts model's load-balancing loss of the forward just run (`aux`; an
        idle micro-batch passes False) joins the loss x aux_coef, unscaled: DeepSpeed's average
        over ranks and accumulation steps makes it the mean over the step's micro-batches."""
        lb = self.routers.take_aux() if self.routers is not None else None
        if lb is not None and aux:
            self._aux.append(lb.detach())
            if self.aux_coef:
                loss = loss + self.aux_coef * lb
        if boundary is not None:
            self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss)
        self.engine.step()

    def take_aux_loss(self) -> tuple[float, float]:
        """(sum, count) of this rank's load-balancing losses since the last call (0, 0 for a
        dense model): the metric <role>/moe_aux_loss."""
        if not self._aux:
            return 0.0, 0.0
        losses, self._aux = self._aux, []
        return float(torch.stack(losses).double().sum()), float(len(losses))

    def lr(self) -> float:
        """The learning rate of the next optimizer step (nan without an optimizer)."""
        if not self.engine.optimizer:
            return math.nan
        return float(self.engine.optimizer.param_groups[0]["lr"])

    def grad_norm(self) -> float | None:
        """The global gradient norm of the step just taken (before clipping), None if DeepSpeed
        did not compute one."""
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else None

    def apply_optimizer_config(self, section) -> list[str]:
        """After a checkpoint load: the config's lr, betas, eps and weight decay replace those the
        checkpoint restored (its param groups and the scheduler's base lr), so a resumed run can
        lower the learning rate; the schedule keeps its step count and uses the current config's
        shape. Returns `key: old -> new` for each setting that changed."""
        sched, groups = self.engine.lr_scheduler, self.engine.optimizer.param_groups
        new = {"lr": section.lr, "betas": tuple(section.betas), "eps": section.eps,
               "weight_decay": section.weight_decay}
        old = {"lr": sched.base_lrs[0], **{k: groups[0][k] for k in new if k != "lr"}}
        old["betas"] = tuple(old["betas"])
        for group, factor in zip(groups, sched.lr_lambdas):
            group.update(betas=new["betas"], eps=new["eps"], weight_decay=new["weight_decay"],
                         initial_lr=new["lr"], lr=new["lr"] * factor(sched.last_epoch))
        sched.base_lrs = [new["lr"]] * len(groups)
        sched._last_lr = [g["lr"] for g in groups]
        return [f"{k}: {old[k]} -> {new[k]}" for k in new if old[k] != new[k]]

    def save_checkpoint(self, directory: Path, tag: str) -> None:
        """Collective: the engine's weights, optimizer and LR schedule into directory/tag. A LoRA
        role's frozen base is left out (it is rebuilt from its path on resume)."""
        self.engine.save_checkpoint(str(directory), tag=tag, save_latest=False,
                                    exclude_frozen_parameters=True)

    def load_checkpoint(self, directory: Path, tag: str, strict: bool = True) -> str | None:
        """Collective: restore weights, optimizer and LR schedule from directory/tag (`strict`
        False: the files may lack frozen parameters, a LoRA role's base). Returns the path
        loaded, None when DeepSpeed found no checkpoint there."""
        loaded, _ = self.engine.load_checkpoint(str(directory), tag=tag,
                                                load_module_strict=strict,
                                                load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
        return loaded


class _LogProbs:
    """A causal LM role: log-probs of the response tokens."""

    def logprobs(self, rollout: Rollout, temperature: float, with_entropy: bool = False,
                 split: bool = False, **kwargs):
        """`forward.response_logprobs` through this role's engine: (B, T) float32 log-probs and
        (B, T) entropy (None unless `with_entropy`; differentiable with `entropy_grad`), under
        the distribution the rollout was sampled from (`truncate=False`: without top-k / top-p).
        `split`: one row split across this rank's sequence-parallel group
        (`sequence_parallel.row_logprobs`, always tiled; collective in the group)."""
        if split:
            return row_logprobs(self.engine, rollout, temperature, dist.sp_group(),
                                kwargs.get("tile_tokens", 1024), with_entropy,
                                kwargs.get("truncate", True), kwargs.get("entropy_grad", False))
        # the policy replays (ppo.router_replay) or compares the rollout's expert choices; the
        # reference (also the LoRA policy with its adapters off) routes by itself
        return response_logprobs(self.engine, rollout, temperature, with_entropy,
                                 routers=self.routers,
                                 replay=getattr(self, "router_replay", None), **kwargs)


class PolicyRole(_LogProbs, TrainedRole):
    """The policy: a causal LM, trained; with policy.ema_decay, the moving average of its
    weights (`engine/ema.py`)."""

    def __init__(self, engine, ema=None, router_replay: bool = False) -> None:
        super().__init__(engine)
        self.ema = ema  # engine.ema.ParamEMA, or None
        self.router_replay = router_replay  # ppo.router_replay: forwards replay rollout routes

    def update_ema(self) -> None:
        """After an optimizer step: the EMA takes its share of the new weights (no-op without
        policy.ema_decay; local to each rank, no communication)."""
        if self.ema is not None:
            self.ema.update()

    def ema_distance(self) -> float | None:
        """||EMA - weights||_2 over the trained parameters, all ranks' partitions (collective
        under ZeRO-3); None without an EMA."""
        return self.ema.distance() if self.ema is not None else None

    def take_route_flips(self) -> tuple[float, float]:
        """(tokens the policy's forwards routed otherwise than the sampler, tokens with a
        recorded route) since the last call; (0, 0) for a dense policy."""
        return self.routers.take_flips() if self.routers is not None else (0.0, 0.0)

    def empty_partition_cache(self) -> None:
        """Release ZeRO-3 parameters a forward outside the engine's step left gathered."""
        self.engine.empty_partition_cache()


class ValueRole(TrainedRole):
    """The value model: an HF backbone with a per-token scalar head, trained."""

    def values(self, rollout: Rollout, split: bool = False, **kwargs) -> torch.Tensor:
        """`forward.response_values` through this role's engine: (B, T) float32. `split`: one
        row split across this rank's sequence-parallel group (`sequence_parallel.row_values`)."""
        if split:
            return row_values(self.engine, rollout, dist.sp_group())
        return response_values(self.engine, rollout, **kwargs)


class ReferenceRole(_LogProbs, Role):
    """The frozen initial policy (an inference engine, or `lora.AdaptersOff`)."""


class TeacherRole(Role):
    """On-policy distillation's teacher: a frozen causal LM (an inference engine, as the
    reference)."""

    def scores(self, rollout: Rollout, temperature: float, split: bool = False, **kwargs):
        """(B, T) float32 log-probs of the sampled tokens (`forward.teacher_logprobs`: the
        tempered softmax without top-k / top-p) and (B, T) float32 top-1 matches, None when
        the row is split across a sequence-parallel group (`split`: the reference's
        `sequence_parallel.row_logprobs`, collective in the group)."""
        if split:
            return row_logprobs(self.engine, rollout, temperature, dist.sp_group(),
                                kwargs.get("tile_tokens", 1024), False, False)[0], None
        return teacher_logprobs(self.engine, rollout, temperature, **kwargs)


class RewardRole(Role):
    """The reward model: an inference engine around `forward.LastTokenScorer`."""

    def scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """`forward.sequence_scores` through this role's engine: (B,) float32, from (B, L) ids
        and mask (any padding side)."""
        return sequence_scores(self.engine, input_ids, attention_mask)


class ScorerRole(TrainedRole):
    """A reward model in training (`ds-ppo rm`): an engine around `forward.LastTokenScorer`, with
    an optimizer. `module` is the HF sequence-classification model inside, which checkpoints'
    safetensors copies and exports write (it loads as `reward.model`)."""

    ema = None  # no moving average of a reward model (policy.ema_decay is the PPO policy's)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module.model

    def scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B,) float32 scores at each row's last real token, differentiable (any padding)."""
        return sequence_scores(self.engine, input_ids, attention_mask)
