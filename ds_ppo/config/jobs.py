"""The supervised jobs' sections: `sft` (ds-ppo sft) and `rm` (ds-ppo rm), on one shared
base of run length, batch sizes and evaluation."""
from __future__ import annotations

from pydantic import Field

from ds_ppo.config.section_base import Section


class SupervisedJob(Section):
    """What `ds-ppo sft` and `ds-ppo rm` share: the length of the run, the batch sizes of one
    optimizer step and the evaluation. The trained model is the `policy` section's (path or
    arch, tokenizer, optimizer, LR schedule, lora, dtype, gradient_checkpointing) on the
    deepspeed.policy engine; data.* name the files, splits and columns; checkpoint.every counts
    optimizer steps."""

    epochs: int = Field(1, gt=0, description="Passes over the training rows (when steps is "
                        "null).")
    steps: int | None = Field(
        None, gt=0, description="Optimizer steps in total; null: epochs x (training rows // "
        "batch_size).")
    batch_size: int = Field(32, gt=0, description="Rows per optimizer step over all ranks "
                            "together (sft: sequences, rm: preference pairs).")
    micro_batch_size: int = Field(
        8, gt=0, description="Rows per forward/backward on one rank; gradient accumulation = "
        "batch_size / (micro_batch_size x world size).")
    max_len: int = Field(
        512, gt=0, description="Longest row in tokens (prompt + completion; rm: prompt + the "
        "longer answer); longer rows are dropped and counted (the data summary line).")
    lr: float | None = Field(
        None, gt=0, description="Peak learning rate of this job; null: policy.lr. A config "
        "for the whole recipe keeps its RL learning rate in policy.lr and each supervised "
        "job's here.")
    eval_every: int = Field(
        0, ge=0, description="Evaluate on data.eval_split (at most data.eval_size rows) every N "
        "optimizer steps; 0: only after the last step. No data.eval_split: never.")


class SFTConfig(SupervisedJob):
    """`ds-ppo sft`: supervised fine-tuning of the policy on prompt + completion rows (or chat
    rows in data.messages_key: the loss covers the assistant turns only)."""

    completion_key: str = Field(
        "completion", description="Column holding the completion (text after the prompt; an "
        "EOS is appended). The prompt is data.prompt_key (text, or chat messages rendered with "
        "the generation prompt); rows with neither prompt_key nor completion_key use "
        "data.messages_key (a whole chat).")
    micro_batch_tokens: int | None = Field(
        None, gt=0, description="Token budget of a packed micro-batch (null: micro_batch_size "
        "rows, padded). Set: each rank's rows of an optimizer step are packed, longest first, "
        "into micro-batches of at most this many tokens (a longer row alone), each one sequence "
        "without padding (algo/packing.py); ranks with fewer micro-batches run zero-weight ones.")


class RMConfig(SupervisedJob):
    """`ds-ppo rm`: a reward model (AutoModelForSequenceClassification, one label) from
    preference pairs with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin)."""

    chosen_key: str = Field(
        "chosen", description="Column holding the preferred answer: text after the prompt "
        "(data.prompt_key), or, without a prompt column, a whole chat (messages) or text.")
    rejected_key: str = Field("rejected", description="Column holding the other answer, in the "
                              "same form as chosen_key; a row where it equals chosen_key's is a "
                              "bad row (data.on_bad_row).")
    margin_key: str | None = Field(
        None, description="Optional column of a number per pair: the loss becomes "
        "-log sigmoid(r_chosen - r_rejected - margin) (Llama 2's margin loss); null: no margin.")
    center_coef: float = Field(
        0.0, ge=0, description="Weight of the centring loss mean((r_chosen + r_rejected)^2) "
        "added to the Bradley-Terry loss (Eisenstein et al. 2023; TRL's "
        "center_rewards_coefficient): scores near 0 for every prompt, so PPO's reward carries "
        "no prompt-dependent offset for the critic to learn away; 0: off.")
