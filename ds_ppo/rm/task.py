"""What `ds-ppo rm` adds to the supervised job (jobs/supervised/training.py): its preference pairs
(data/supervised_rows.py), micro-batches of pairs (longest first), and the Bradley-Terry loss
-log sigmoid(r_chosen - r_rejected - margin) summed per micro-batch; the loop divides it by the
global step's pair count, so the gradient is that of the pair-mean loss over the whole global
batch at any world size or micro-batch split. A micro-batch's chosen and rejected rows go through
one forward (2 x pairs rows, left-padded), scored at each row's last real token as the reward
role of `ds-ppo train` scores them (`forward.LastTokenScorer`).
"""
from __future__ import annotations

import torch

from ds_ppo.algo import bradley_terry, pair_stats, reward_centering
from ds_ppo.containers import longest_first
from ds_ppo.data.sampler import left_pad
from ds_ppo.data.supervised_rows import PairSet, load_pairs


class RMTask:
    """The reward-model task of jobs/supervised/training.py."""

    name = "rm"
    model_class = "AutoModelForSequenceClassification"

    def load(self, cfg, tokenizer, split: str | None = None) -> PairSet:
        return load_pairs(cfg, tokenizer, split)

    def add_frozen(self, cfg, engines) -> None:
        pass  # no model beside the trained one

    def packed(self, cfg) -> bool:
        return False

    def micro_batches(self, cfg, data: PairSet, rows: list[int], packed: bool) -> list[list[int]]:
        return longest_first(data.lengths(), cfg.rm.micro_batch_size, rows)

    def count(self, data: PairSet, rows: list[int]) -> float:
        return float(len(rows))

    def loss(self, cfg, role, data: PairSet, rows: list[int], pad_id: int,
             packed: bool = False):
        """(summed pair loss of the micro-batch: Bradley-Terry + rm.center_coef x centring,
        {name: (sum, count)}: loss, center ((r_chosen + r_rejected)^2), accuracy (chosen scored
        higher), ties (scored equal: counted in neither accuracy nor its complement's errors),
        margin_mean (r_chosen - r_rejected), chosen_mean, rejected_mean)."""
        device = next(role.engine.module.parameters()).device
        ids, am = left_pad([data.chosen[i] for i in rows] + [data.rejected[i] for i in rows],
                           pad_id)
        scores = role.scores(ids.to(device), am.to(device))
        n = len(rows)
        chosen, rejected = scores[:n], scores[n:]
        margin = (torch.tensor([data.margin[i] for i in rows], device=device)
                  if data.margin is not None else None)
        losses = bradley_terry(chosen, rejected, margin)
        loss = losses.sum()
        center = reward_centering(chosen, rejected).sum()
        if cfg.rm.center_coef:
            loss = loss + cfg.rm.center_coef * center
        stats = pair_stats(chosen, rejected)
        return loss, {"loss": (loss.detach().double(), float(n)),
                      "center": (center.detach().double(), float(n)),
                      "accuracy": (stats["correct"], float(n)),
                      "ties": (stats["ties"], float(n)),
                      "margin_mean": (stats["margin"], float(n)),
                      "chosen_mean": (chosen.detach().double().sum(), float(n)),
                      "rejected_mean": (rejected.detach().double().sum(), float(n))}

    def eval_metrics(self, m: dict[str, float]) -> dict[str, float]:
        return {}

    def progress(self, m: dict[str, float]) -> str:
        return f"loss {m['loss/rm']:.4f} | acc {m['rm/accuracy']:.3f} | margin {m['rm/margin_mean']:+.3f}"
