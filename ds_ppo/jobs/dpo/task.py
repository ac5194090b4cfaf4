"""What `ds-ppo dpo` adds to the supervised job (jobs/supervised/training.py): the preference
pairs of `ds-ppo rm` (data/supervised_rows.py, read through the dpo section's columns), a frozen
reference beside the policy, and the preference loss of `dpo.loss` (algo/preference.py) summed
per micro-batch. The loop divides it by the global step's pair count, so the gradient is that of
the pair-mean loss over the whole global batch at any world size or micro-batch split.

One micro-batch: its chosen and rejected answers as 2 x pairs right-padded rows; the reference
scores them once, without gradients, then the policy scores the same rows in one forward with
gradients. Each answer's log-prob covers its own tokens (the answer and its EOS, or a chat's
assistant turns): summed, or the per-token mean for a length-normalised loss (ipo, simpo). The
reference's log-probs are computed once per pair and step and never stored: a resumed run
recomputes them from the same frozen weights on the same rows, so it continues exactly. simpo
has no reference (none is built).
"""
from __future__ import annotations

import torch

from ds_ppo.algo import logprobs_from_logits
from ds_ppo.algo.choices import preference_loss_spec
from ds_ppo.algo.preference import (PairLogps, PreferenceSettings, preference_loss_for,
                                    reward_stats, sequence_logps)
from ds_ppo.containers import longest_first
from ds_ppo.data.supervised_rows import PairSet, load_pairs
from ds_ppo.engine.forward import position_ids


def pair_rows(data: PairSet, rows: list[int], pad_id: int, device: torch.device):
    """(ids (2P, L) long, attention mask (2P, L) long, answer mask (2P, L - 1) bool on the
    positions predicting an answer token) of `rows`' chosen answers then their rejected ones,
    right-padded to the longest."""
    seqs = [data.chosen[i] for i in rows] + [data.rejected[i] for i in rows]
    masks = [data.chosen_mask[i] for i in rows] + [data.rejected_mask[i] for i in rows]
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    am = torch.zeros((len(seqs), L), dtype=torch.long)
    lm = torch.zeros((len(seqs), L), dtype=torch.bool)
    for b, (s, m) in enumerate(zip(seqs, masks)):
        ids[b, :len(s)] = torch.tensor(s)
        am[b, :len(s)] = 1
        lm[b, :len(s)] = torch.tensor(m)
    return ids.to(device), am.to(device), lm[:, 1:].to(device)


def token_logprobs(model, ids: torch.Tensor, am: torch.Tensor) -> torch.Tensor:
    """(B, L - 1) float32 log-prob of each next token under `model` (an engine, or the LoRA
    policy with its adapters off)."""
    out = model(input_ids=ids, attention_mask=am, position_ids=position_ids(am), use_cache=False)
    return logprobs_from_logits(out.logits[:, :-1], ids[:, 1:])


class DPOTask:
    """The DPO task of jobs/supervised/training.py."""

    name = "dpo"  # its row's name (jobs/dpo/__init__.py): the config section and the command
    model_class = "AutoModelForCausalLM"  # what the export loads with

    def __init__(self) -> None:
        self.reference = None  # the frozen reference's role, once built (None: simpo)

    def add_frozen(self, cfg, engines) -> None:
        from ds_ppo.engine.supervised import add_reference

        if preference_loss_spec(cfg.dpo.loss).reference:
            add_reference(cfg, engines, cfg.dpo.reference_path)
            self.reference = engines.reference

    def load(self, cfg, tokenizer, split: str | None = None) -> PairSet:
        return load_pairs(cfg, tokenizer, split, job=self.name)

    def packed(self, cfg) -> bool:
        return False

    def micro_batches(self, cfg, data: PairSet, rows: list[int], packed: bool) -> list[list[int]]:
        return longest_first(data.lengths(), cfg.dpo.micro_batch_size, rows)

    def count(self, data: PairSet, rows: list[int]) -> float:
        return float(len(rows))

    def loss(self, cfg, role, data: PairSet, rows: list[int], pad_id: int,
             packed: bool = False):
        """(summed preference loss of the micro-batch's pairs, {name: (sum, count)}: loss,
        reward_accuracy, reward_margin, chosen_reward, rejected_reward, chosen_logp,
        rejected_logp; docs/METRICS.md)."""
        d = cfg.dpo
        mean = preference_loss_spec(d.loss).length_normalised
        device = next(role.engine.module.parameters()).device
        ids, am, mask = pair_rows(data, rows, pad_id, device)
        n = len(rows)
        ref = (None, None)
        if self.reference is not None:
            with torch.no_grad():
                r = sequence_logps(token_logprobs(self.reference.engine, ids, am), mask, mean)
            ref = (r[:n], r[n:])
        logps = sequence_logps(token_logprobs(role.engine, ids, am), mask, mean)
        out = preference_loss_for(d.loss, PairLogps(logps[:n], logps[n:], *ref),
                                  PreferenceSettings(d.beta, d.label_smoothing, d.simpo_gamma))
        loss = out.losses.sum()
        stats = reward_stats(out)
        seq = logps.detach().double()
        return loss, {"loss": (loss.detach().double(), float(n)),
                      "reward_accuracy": (stats["correct"], float(n)),
                      "reward_margin": (stats["margin"], float(n)),
                      "chosen_reward": (stats["chosen"], float(n)),
                      "rejected_reward": (stats["rejected"], float(n)),
                      "chosen_logp": (seq[:n].sum(), float(n)),
                      "rejected_logp": (seq[n:].sum(), float(n))}

    def eval_metrics(self, m: dict[str, float]) -> dict[str, float]:
        return {}

    def progress(self, m: dict[str, float]) -> str:
        return (f"loss {m['loss/dpo']:.4f} | acc {m['dpo/reward_accuracy']:.3f} | margin "
                f"{m['dpo/reward_margin']:+.3f}")
