"""What `ds-ppo sft` adds to the supervised job (jobs/supervised/training.py): its rows
(data/supervised_rows.py), its micro-batches (padded, or packed by sft.micro_batch_tokens) and its
loss, the negative log-likelihood of the completion tokens summed per micro-batch. The loop
divides it by the global step's count of completion tokens (`count`), so a step's gradient is
that of the token-mean loss over the whole global batch at any world size or micro-batch split.

Forward: rows right-padded into (B, L), or packed into one (1, N) sequence through
`engine.forward.packed_call` (the PPO update's packed path: position ids restarting per row,
attention confined to each row); only the positions predicting counted tokens get logits when
packed.
"""
from __future__ import annotations

import torch

from ds_ppo.algo import logprobs_from_logits, nll_sum, packed_layout, token_budget_batches
from ds_ppo.containers import longest_first
from ds_ppo.data.supervised_rows import SFTSet, load_sft
from ds_ppo.engine.forward import packed_call, position_ids


def right_padded(data: SFTSet, rows: list[int], pad_id: int, device: torch.device):
    """(ids (B, L) long, attention mask (B, L) long, loss mask (B, L) bool) of `rows`,
    right-padded to the longest."""
    L = max(len(data.ids[i]) for i in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    am = torch.zeros((len(rows), L), dtype=torch.long)
    lm = torch.zeros((len(rows), L), dtype=torch.bool)
    for b, i in enumerate(rows):
        n = len(data.ids[i])
        ids[b, :n] = torch.tensor(data.ids[i])
        am[b, :n] = 1
        lm[b, :n] = torch.tensor(data.loss_mask[i])
    return ids.to(device), am.to(device), lm.to(device)


def counted_logprobs(model, ids: torch.Tensor, am: torch.Tensor, lm: torch.Tensor,
                     packed: bool = False, lengths: list[int] | None = None) -> torch.Tensor:
    """(n,) float32 log-probs of the counted tokens (lm True; never a row's first token), in
    row-major order. packed: the rows' real tokens in one sequence (`lengths`: each row's, host)."""
    labels = lm[:, 1:]
    targets = ids[:, 1:][labels]
    if packed:
        layout = packed_layout(am.bool())
        pred = layout.place[:, 1:][labels] - 1  # the packed position predicting each target
        out = packed_call(model, ids[am.bool()][None], layout, lengths, logits_to_keep=pred)
        return logprobs_from_logits(out.logits, targets[None])[0]
    out = model(input_ids=ids, attention_mask=am, position_ids=position_ids(am), use_cache=False)
    return logprobs_from_logits(out.logits[:, :-1], ids[:, 1:])[labels]


class SFTTask:
    """The SFT task of jobs/supervised/training.py."""

    name = "sft"  # the config section and the command
    model_class = "AutoModelForCausalLM"  # what the export loads with

    def load(self, cfg, tokenizer, split: str | None = None) -> SFTSet:
        return load_sft(cfg, tokenizer, split)

    def add_frozen(self, cfg, engines) -> None:
        pass  # no model beside the trained one

    def packed(self, cfg) -> bool:
        return cfg.sft.micro_batch_tokens is not None

    def micro_batches(self, cfg, data: SFTSet, rows: list[int], packed: bool) -> list[list[int]]:
        """This rank's rows of a step cut into micro-batches, longest first (similar lengths
        share a padded forward), or by the token budget when packed."""
        if packed:
            return token_budget_batches(data.lengths(), cfg.sft.micro_batch_tokens, rows)
        return longest_first(data.lengths(), cfg.sft.micro_batch_size, rows)

    def count(self, data: SFTSet, rows: list[int]) -> float:
        """The loss's divisor contribution of these rows: their counted tokens."""
        return float(data.counted(rows))

    def loss(self, cfg, role, data: SFTSet, rows: list[int], pad_id: int,
             packed: bool = False):
        """(summed NLL of the micro-batch's counted tokens, {name: (sum, count)} statistics)."""
        ids, am, lm = right_padded(data, rows, pad_id, role_device(role))
        logprobs = counted_logprobs(role.engine, ids, am, lm, packed,
                                    [len(data.ids[i]) for i in rows])
        loss = nll_sum(logprobs)
        return loss, {"loss": (loss.detach().double(), float(logprobs.numel()))}

    def eval_metrics(self, m: dict[str, float]) -> dict[str, float]:
        """Derived evaluation metrics: the perplexity of the token-mean loss."""
        return {"eval/perplexity": float(torch.tensor(m["eval/loss"]).exp())}

    def progress(self, m: dict[str, float]) -> str:
        return f"loss {m['loss/sft']:.4f}"


def role_device(role) -> torch.device:
    return next(role.engine.module.parameters()).device
