"""The supervised jobs' sections: `sft` (ds-ppo sft), `rm` (ds-ppo rm) and `dpo` (ds-ppo dpo),
on one shared base of run length, batch sizes and evaluation; rm and dpo read the same
preference-pair columns."""
from __future__ import annotations

from pydantic import Field

from ds_ppo.algo.choices import PreferenceLossName, describe_preference_losses, \
    preference_loss_spec
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
                            "together (sft: sequences, rm and dpo: preference pairs).")
    micro_batch_size: int = Field(
        8, gt=0, description="Rows per forward/backward on one rank; gradient accumulation = "
        "batch_size / (micro_batch_size x world size).")
    max_len: int = Field(
        512, gt=0, description="Longest row in tokens (prompt + completion; rm: prompt + the "
        "longer answer, as for dpo); longer rows are dropped and counted (the data summary line).")
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


class PairJob(SupervisedJob):
    """A job on preference pairs (`ds-ppo rm`, `ds-ppo dpo`): the columns of a pair."""

    chosen_key: str = Field(
        "chosen", description="Column holding the preferred answer: text after the prompt "
        "(data.prompt_key), or, without a prompt column, a whole chat (messages) or text.")
    rejected_key: str = Field("rejected", description="Column holding the other answer, in the "
                              "same form as chosen_key; a row where it equals chosen_key's is a "
                              "bad row (data.on_bad_row).")


class RMConfig(PairJob):
    """`ds-ppo rm`: a reward model (AutoModelForSequenceClassification, one label) from
    preference pairs with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin)."""

    margin_key: str | None = Field(
        None, description="Optional column of a number per pair: the loss becomes "
        "-log sigmoid(r_chosen - r_rejected - margin) (Llama 2's margin loss); null: no margin.")
    center_coef: float = Field(
        0.0, ge=0, description="Weight of the centring loss mean((r_chosen + r_rejected)^2) "
        "added to the Bradley-Terry loss (Eisenstein et al. 2023; TRL's "
        "center_rewards_coefficient): scores near 0 for every prompt, so PPO's reward carries "
        "no prompt-dependent offset for the critic to learn away; 0: off.")


class DPOConfig(PairJob):
    """`ds-ppo dpo`: the policy trained on preference pairs directly (no reward model, no
    generation), against a frozen reference: policy.path's weights (or dpo.reference_path; with
    policy.lora, the policy's base with its adapters off)."""

    loss: PreferenceLossName = Field(
        "sigmoid", description="The preference loss: " + describe_preference_losses() + ".")
    beta: float = Field(
        0.1, gt=0, description="Inverse temperature of the implicit reward beta x log(pi / "
        "ref): larger keeps the policy closer to the reference (sigmoid: 0.1 is usual; ipo: "
        "the target gap is 1 / (2 beta); simpo: 2 to 10).")
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="sigmoid and simpo: the probability eps that a pair's "
        "label is wrong (conservative DPO): the loss becomes (1 - eps) of the pair's and eps of "
        "the flipped pair's; 0: off.")
    simpo_gamma: float = Field(
        0.5, ge=0, description="simpo: the target reward margin gamma between the chosen and "
        "the rejected answer, in the units of beta x mean log-prob (SimPO suggests about beta "
        "/ 2).")
    reference_path: str | None = Field(
        None, description="The frozen reference (a Hugging Face model directory or hub name); "
        "null: policy.path's weights (with policy.lora: the policy's base, adapters off, no "
        "second model). Unused by loss = simpo.")

    def problems(self) -> list[str]:
        out = []
        if self.label_smoothing and "label_smoothing" not in preference_loss_spec(
                self.loss).settings:
            out.append(f"dpo.label_smoothing = {self.label_smoothing} does not apply to dpo.loss "
                       f"= {self.loss!r} (a squared loss has no label to flip): set "
                       "dpo.label_smoothing=0, or dpo.loss=sigmoid")
        return out

    def warnings(self) -> list[str]:
        """Settings that are valid but do nothing with this loss (printed, never fatal)."""
        if self.reference_path is not None and not preference_loss_spec(self.loss).reference:
            return [f"dpo.reference_path = {self.reference_path!r} is unused: dpo.loss = "
                    f"{self.loss!r} has no reference model (none is loaded)"]
        return []
