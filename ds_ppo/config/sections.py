"""The sections of the one typed configuration tree: every knob of ds_ppo, documented once
(the descriptions become ``ds-ppo config --describe`` output and docs/CONFIG.md).

Each field's type, default and range are checked while parsing; rules that join several
fields live in ``ds_ppo.config.checks``. The tree is frozen: nothing changes it mid-run.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ds_ppo.algo.choices import (ESTIMATORS, EstimatorName, KLEstimator, LossAggregation,
                                 RolloutCorrection, describe_estimators)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are frozen."""

    # coerce_numbers_to_str: `tracking.run_name=2024` or `tags: {version: 2}` are strings;
    # allow_inf_nan=False: `.nan` / `.inf` (YAML) are refused for every number, with the key
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True,
                              coerce_numbers_to_str=True, allow_inf_nan=False)


# ----------------------------------------------------------------------------- models
class ModelSource(Section):
    path: str | None = Field(
        None, description="Hugging Face model directory or hub name to load the weights from.")
    arch: dict[str, Any] | None = Field(
        None,
        description="Instead of `path`: fields of a Hugging Face config (with `model_type`) for "
        "a randomly initialised model, e.g. {model_type: llama, hidden_size: 64, ...}. "
        "Built once on rank 0 and saved under output_dir/init_models, so every role that "
        "starts from it starts from the same weights.")
    tokenizer: str | None = Field(
        None,
        description="Tokenizer directory or hub name; defaults to `path`. `builtin:tiny` trains "
        "(once, cached in output_dir) a SentencePiece tokenizer on the corpus shipped with ds_ppo.")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="Compute dtype: auto = bf16 on a GPU that has it, else fp32.")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="Attention kernel passed to transformers.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward (trainable roles only).")
    tiled_mlp: bool = Field(
        False, description="Run each gated MLP (Llama-style gate/up/down) of the update's "
        "forwards on slices of about hidden_size tokens, recomputed in backward (DeepSpeed ALST's "
        "TiledMLP; trainable roles only): for long rows, one slice's MLP intermediates at a time "
        "instead of the row's, for one more MLP forward per layer.")
    disable_dropout: bool = Field(
        True, description="Set every dropout probability of the model's config to 0 before "
        "loading (as DeepSpeed-Chat does for RLHF): with dropout, old and new log-probs (and "
        "values) come from different masks and the PPO ratio is noise. Exports and checkpoints "
        "write the model's own probabilities back into their config.json.")


class Optim(Section):
    lr: float = Field(1e-6, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1).")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    warmup_steps: int = Field(0, ge=0, description="Linear LR warm-up, in optimizer steps.")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="LR after warm-up: constant, or decaying (linearly / by a cosine) "
        "to min_lr_ratio x lr at the last optimizer step of the run.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final LR of a decaying schedule, "
                                "as a fraction of lr.")
    max_grad_norm: float | None = Field(
        1.0, description="Gradient clipping by global norm (> 0); null disables it.")


class LoraConfig(Section):
    """Low-rank adapters (LoRA, Hu et al. 2021, built with peft) trained on a frozen base."""

    r: int = Field(8, gt=0, description="Adapter rank.")
    alpha: float = Field(16.0, gt=0, description="The adapter's update is alpha / r x B A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names that get adapters, or all-linear (peft's "
        "spelling: every linear layer but the output head).")
    output_head: Literal["auto"] | bool = Field(
        "auto", description="The policy's output head (lm_head) gets an adapter too. auto = "
        "yes for a random-init policy.arch with an untied head (its small random weights bound "
        "the logits whatever the adapters below it learn: the tiny default does not learn "
        "without), and for a model from a local path whose saved head still looks random-init "
        "(std ~ initializer_range, rows of equal norm); no for other models from a path. "
        "Policy only: a value model's scalar head is always fully trained.")


_LORA_DOC = ("Train low-rank adapters on the frozen base instead of all weights (null: full "
             "fine-tuning): {{r (default 8), alpha (16; the update is alpha / r x B A), dropout "
             "(0), target_modules (all-linear, or a list of module names), output_head (auto: "
             "adapt the output head too for a random-init policy.arch, or a loaded head that still "
             "looks random-init)}}, e.g. "
             "{role}.lora.r=8. Only the adapters{head} have gradients and optimizer state.")


class PolicyConfig(ModelSource, Optim):
    """The trained policy (actor)."""

    lora: LoraConfig | None = Field(None, description=_LORA_DOC.format(role="policy", head=""))
    ema_decay: float | None = Field(
        None, gt=0, lt=1, description="Keep an exponential moving average of the policy's "
        "weights (DeepSpeed-Chat's --enable_ema), updated after every policy optimizer step: "
        "ema = d x ema + (1 - d) x weights (e.g. 0.992). Each rank keeps the float32 EMA of its "
        "own ZeRO-3 partition (4 bytes per parameter / ZeRO group, on the device of the "
        "partition: CPU with deepspeed.policy.offload_param); checkpointed and resumed exactly, "
        "evaluated next to the policy (eval_ema/* metrics), exported as output_dir/final_ema. "
        "null: no EMA. Not with policy.lora.")


class ValueConfig(ModelSource, Optim):
    """The trained value model (critic): a backbone with a scalar head per token."""

    lr: float = Field(5e-6, gt=0, description="Peak learning rate (AdamW).")
    init_from: Literal["auto", "reward", "policy", "path"] = Field(
        "auto",
        description="Where the value model's weights come from: `reward` = the reward model "
        "(backbone and score head, as DeepSpeed-Chat does), `policy` = the policy's backbone with "
        "a new head, `path` = this section's own path/arch (value.path may be a reward model's "
        "export, an AutoModelForSequenceClassification directory with num_labels 1: its score "
        "head becomes the value head, as DeepSpeed-Chat and OpenRLHF start the critic); auto = "
        "path when value.path or value.arch is set, else reward when reward.model is set, else "
        "policy.")
    lora: LoraConfig | None = Field(None, description=_LORA_DOC.format(
        role="value", head=" and the scalar head (always fully trained)"))


class ReferenceConfig(Section):
    """The frozen reference policy for the KL penalty."""

    path: str | None = Field(
        None, description="Weights of the reference; default: the initial policy's.")
    from_policy_base: Literal["auto"] | bool = Field(
        "auto", description="With policy.lora: true = the reference log-probs come from the "
        "policy engine with its adapters switched off (no reference engine is built, no second "
        "copy of the base); false = a separate reference engine; auto = true unless "
        "reference.path names another model.")


class RewardConfig(Section):
    function: str | None = Field(
        None,
        description="A Python reward function `module:function` called as "
        "f(prompts: list[str], responses: list[str]) -> list[float] (batched), plus one "
        "keyword list per data.reward_keys column. `ds_ppo.rewards:positive_words` is the tiny "
        "default's task.")
    model: str | None = Field(
        None, description="A Hugging Face sequence-classification reward model (num_labels=1).")
    tokenizer: str | None = Field(
        None, description="The reward model's tokenizer; default: its `model` path. When it "
        "differs from the policy's, responses are decoded and re-encoded for it.")
    max_len: int = Field(1024, gt=0, description="Longest reward-model input in tokens; longer "
                         "inputs keep their end (the response) and lose the prompt's start "
                         "(counted: metric reward/input_cut_rate, and a warning).")
    score_clip: float | None = Field(
        5.0, description="Clip sequence scores to +-score_clip (> 0) before adding them (null: "
        "no clip).")
    missing_eos_penalty: float | None = Field(
        None, ge=0, description="Subtracted (>= 0) from the score of a response that hit "
        "max_new_tokens without an EOS (null: none).")
    url: str | None = Field(
        None, description="A reward service: POST {prompts, responses, <data.reward_keys "
        "columns>} as JSON, answer {scores: [one float per response]} (README: reward service). "
        "Each rank posts its own share, reward.batch_size responses per request.")
    batch_size: int = Field(64, gt=0, description="reward.url: responses per request.")
    concurrency: int = Field(4, gt=0, description="reward.url: requests in flight at once, "
                             "per rank.")
    timeout_s: float | None = Field(
        600.0, gt=0, description="Time limit of one reward call in seconds. reward.function: "
        "the call runs in a worker thread; a call still running then stops the run with a "
        "message, after a checkpoint of the last completed iteration (exit 2); null: call it in "
        "the main thread (for functions that need it, e.g. signal-based timeouts), never stopped. "
        "reward.url: the limit of one whole request, from connecting to the answer's last byte "
        "(then retried; an answer over 16 MiB stops the run); null: no limit.")
    retries: int = Field(3, ge=0, description="reward.url: retries of a request after a "
                         "connection error, a timeout or a 5xx answer (back-off 1, 2, 4... s), "
                         "before the run stops.")


# ------------------------------------------------------------------------- generation
class GenerationConfig(Section):
    mode: Literal["auto", "gathered", "tensor_parallel", "zero3"] = Field(
        "auto",
        description="gathered: copy the policy's 16-bit weights once per rollout into a hook-free "
        "replica on each rank (fast); tensor_parallel: generation.tp_size ranks hold one replica "
        "between them (attention heads and MLP columns split, for policies whose 16-bit copy does "
        "not fit one device); zero3: generate through the ZeRO-3 hooks, gathering layer by layer "
        "for every token (slow; the last resort); auto: gathered when the replica fits in "
        "generation.replica_memory_fraction of free device memory, else tensor_parallel when a "
        "1/tp_size shard does, else zero3.")
    replica_memory_fraction: float = Field(
        0.5, gt=0, le=1, description="auto mode: share of free device memory the replica (or "
        "its tensor-parallel shard) may use.")
    tp_size: int | None = Field(
        None, gt=0, description="tensor_parallel mode: consecutive ranks sharing one replica; "
        "default: the ranks of one node. Must divide the world size and the policy's attention "
        "heads, KV heads and MLP width.")
    max_new_tokens: int = Field(128, gt=0, description="Longest response in tokens.")
    min_new_tokens: int = Field(0, ge=0, description="EOS is suppressed before this many tokens.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature; 0 = greedy. Scoring "
                               "and the update divide the logits by it too.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass. Log-probs are "
                         "computed over the full softmax, so top_p < 1 makes the update "
                         "slightly off-policy (a warning at start-up).")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 = off. As with top_p, log-probs "
                       "ignore the filter (a warning at start-up).")
    stop_tokens: list[str] = Field(
        default_factory=list,
        description="Extra tokens (each one vocabulary entry) that end a response like EOS.")
    batch_size: int | None = Field(
        None, gt=0, description="Rows decoded at once on each rank (a prompt counts "
        "ppo.samples_per_prompt times: one row per response); default: the rank's whole share "
        "of the rollout batch. With continuous batching these are slots that take the next "
        "prompt when their response ends; otherwise each generate call takes this many.")
    continuous: Literal["auto"] | bool = Field(
        "auto", description="Continuous batching in our decoding loop (loop=own): the "
        "generation.batch_size rows decoding at once are slots; every stop_check_every steps "
        "the slots whose responses ended take the next prompts (prefilled into the slot), so "
        "short responses do not wait for the longest one of their call. Rows come back in "
        "prompt order; greedy outputs equal HF generate's. auto: on when the rank has more "
        "rows than batch_size and the loop is own; false: one generate call per batch_size "
        "rows, each until its longest response ends; true: as auto, and an error when the "
        "loop is hf.")
    loop: Literal["auto", "own", "hf"] = Field(
        "auto", description="Decoding loop on the gathered replica. own: ds_ppo's loop (static "
        "KV cache, sampling on the device, one CUDA graph per token on CUDA, no per-token host "
        "sync); hf: HF generate (cache_implementation and compile apply to it only); auto: own "
        "unless the model is not supported by it (an attention kernel other than sdpa/eager, "
        "sliding-window layers) or cache_implementation/compile ask for HF generate. zero3 mode "
        "always uses HF generate.")
    cuda_graph: bool = Field(
        True, description="loop=own on CUDA: capture the decoding step once per generate call "
        "as a CUDA graph and replay it for every token. In tensor_parallel mode the graph "
        "holds the step's all-reduces and the group's ranks capture together; if capture "
        "fails on any of them, all decode eagerly (the reason is logged once).")
    stop_check_every: int = Field(
        16, gt=0, description="loop=own: decoding steps between checks whether every response "
        "has ended, and with continuous batching between refills of the ended rows' slots "
        "(each check waits for the device; a slot idles up to this many steps minus one).")
    cache_implementation: Literal["dynamic", "static"] = Field(
        "dynamic", description="loop=hf: KV cache of the gathered replica; static enables "
        "transformers' compiled decoding.")
    compile: bool = Field(False, description="loop=hf: torch.compile the replica's decoding step.")
    keep_replica: bool = Field(
        False, description="Keep the gathered replica between rollouts and refresh its weights "
        "in place: no re-allocation and no recompilation, at the cost of its 16-bit weights "
        "staying in device memory during training.")


# -------------------------------------------------------------------------------- ppo
class PPOConfig(Section):
    rollout_batch_size: int = Field(
        64, gt=0, description="Prompts per iteration, over all data-parallel ranks together.")
    mini_batch_size: int = Field(
        16, gt=0, description="Sequences (responses, not prompts) per optimizer step, over all "
        "ranks together.")
    micro_batch_size: int = Field(
        4, gt=0, description="Sequences per forward/backward on one rank; gradient accumulation "
        "= mini_batch_size / (micro_batch_size * world size).")
    score_micro_batch_size: int | None = Field(
        None, gt=0, description="Sequences per scoring forward on one rank; default micro_batch_size.")
    micro_batch_tokens: int | None = Field(
        None, gt=0, description="Token budget of a packed micro-batch (null: micro-batches of "
        "micro_batch_size / score_micro_batch_size rows, padded). Set: the policy, reference and "
        "value forwards of scoring and the update pack each mini-batch's rows, longest first, "
        "into micro-batches of at most this many real tokens (prompt + response; a longer row "
        "runs alone), each one sequence without padding; ranks with fewer micro-batches run "
        "zero-weight ones. micro_batch_size then only sets DeepSpeed's bookkeeping, and "
        "score_micro_batch_size only the reward model's micro-batches.")
    tiled_logits: Literal["auto"] | bool = Field(
        "auto", description="Log-probs and entropies of the policy and reference from the final "
        "hidden states, the output head applied logits_tile_tokens positions at a time (its "
        "backward recomputes each tile): no (B, T, V) logits tensor (16 GiB in fp32 for one "
        "32k-token response of a 128k vocabulary), the same numbers. auto: tiled when a "
        "forward's response logits would exceed 2^26 elements (positions x vocabulary; "
        "docs/PERFORMANCE.md, Long context).")
    logits_tile_tokens: int = Field(
        1024, gt=0, description="Positions per tile of tiled_logits: the tile's logits (tile x "
        "vocabulary, in fp32 about 4 bytes each, x2-3 while reduced) are the only vocabulary-wide "
        "tensors alive.")
    ppo_epochs: int = Field(1, gt=0, description="Passes over each rollout; later passes re-mix "
                            "the mini-batches (the same samples in each at any world size).")
    clip_eps: float = Field(0.2, gt=0, description="Policy ratio clip range.")
    value_clip_eps: float | None = Field(
        0.2, description="Value clip range around the old values (null: unclipped).")
    vf_coef: float = Field(0.5, gt=0, description="Value loss coefficient.")
    kl_coef: float = Field(0.1, ge=0, description="KL penalty coefficient in the reward "
                           "(the initial value when kl_controller=adaptive).")
    kl_estimator: KLEstimator = Field("k1", description="Per-token KL estimator (k1, k2, k3: "
                                      "Schulman 2020).")
    kl_clip: float | None = Field(
        10.0, gt=0, description="Cap on the per-token KL estimate, +-kl_clip nats, in the reward "
        "and in the KL loss (null: none). The log-ratio is clamped to +-20 nats first, so one "
        "tail token's k3 could reach e^20 = 4.9e8 (a reward of -2.4e7 at kl_coef 0.05); "
        "OpenRLHF caps every estimator at +-10, verl caps k3 at 10. A capped token carries no "
        "KL gradient; their share: metric kl/clamped_frac.")
    kl_controller: Literal["fixed", "adaptive"] = Field(
        "fixed", description="adaptive: Ziegler et al. 2019 controller towards kl_target.")
    kl_target: float = Field(6.0, gt=0, description="Adaptive controller: target KL per sequence.")
    kl_horizon: int = Field(10000, gt=0, description="Adaptive controller: horizon in sequences.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    whiten_advantages: bool = Field(True, description="Whiten advantages over valid tokens "
                                    "(gae; reinforce_pp always whitens, grpo/dr_grpo/rloo never).")
    whiten_across_ranks: bool = Field(
        True, description="Whitening statistics over all ranks' tokens (else per rank).")
    advantage_estimator: EstimatorName = Field(
        "gae", description="How a response's tokens get their advantages (the table "
        "ds_ppo/algo/choices.py): " + describe_estimators() + ". Every estimator but gae is "
        "critic-free: no value model at all.")
    samples_per_prompt: int = Field(
        1, gt=0, description="Responses sampled per prompt (n); an iteration has "
        "rollout_batch_size x n responses, a prompt's n next to each other on one rank. "
        "mini_batch_size counts responses and must be a multiple of n.")
    kl_in_reward: bool = Field(
        True, description="KL penalty (kl_coef x per-token KL) in the reward. Default: true for "
        + ", ".join(n for n, s in ESTIMATORS.items() if s.kl_in_reward) + "; false for "
        + " and ".join(n for n, s in ESTIMATORS.items() if not s.kl_in_reward)
        + " (GRPO puts the KL in the loss: kl_loss_coef).")
    kl_loss_coef: float = Field(
        0.0, description="Weight of a KL(policy || reference) loss term (estimator kl_estimator; "
        "k3 is GRPO's), aggregated like the policy loss; 0 = off. Must be >= 0.")
    clip_eps_high: float | None = Field(
        None, description="Upper ratio clip 1 + clip_eps_high (DAPO's clip-higher, Yu et al. "
        "2025); null = clip_eps.")
    dual_clip: float | None = Field(
        None, description="Dual clip c > 1 (Ye et al. 2020): the loss of a token with negative "
        "advantage is at most -A x c; null = off.")
    rollout_correction: RolloutCorrection = Field(
        "none", description="Correct the policy loss for the gap between the distribution "
        "responses were sampled from (the generation replica: its kernels, dtype and batch "
        "shapes) and the trainer's (Yao et al. 2025, \"Your efficient RL framework secretly "
        "brings you off-policy RL training\"), with each token's ratio r = pi_old / "
        "pi_rollout: tis multiplies its policy loss by min(r, rollout_is_cap) (truncated "
        "importance sampling); mis drops the tokens whose r leaves [1/cap, cap] from the loss "
        "and weights the rest by r (masked importance sampling); none: off (the gap is still "
        "measured: metrics rollout/*). Needs the rollout log-probs of generation.loop=own.")
    rollout_is_cap: float = Field(
        2.0, gt=1, description="ppo.rollout_correction: the cap C of the importance weights "
        "(tis: min(r, C); mis: the band [1/C, C]).")
    loss_aggregation: LossAggregation = \
        Field("token_mean", description="Policy (and KL) loss over a mini-batch: token_mean = "
              "mean over all its tokens; seq_mean_token_mean = mean over sequences of each "
              "one's token mean (GRPO); seq_mean_token_sum_norm = mean over sequences of each "
              "one's token sum / generation.max_new_tokens (Dr. GRPO). The value loss is always "
              "a token mean.")
    critic_warmup_iterations: int = Field(
        0, ge=0, description="The first N iterations train the value model only (gae): the "
        "policy generates but takes no optimizer step (OpenRLHF's freezing_actor_steps, verl's "
        "critic_warmup), so a critic started from a reward model or the policy learns the "
        "returns before its advantages steer the policy. They count towards `iterations` and "
        "use prompts like any other; metric value/warmup is 1 in them.")
    ptx_coef: float = Field(
        0.0, ge=0, description="PPO-ptx (InstructGPT, Ouyang et al. 2022, eq. 2): weight of a "
        "language-modelling loss on data.ptx_path's rows added to the policy loss in every "
        "mini-batch (each optimizer step takes mini_batch_size ptx rows, split over the ranks; "
        "the loss is a token mean over the whole global mini-batch's ptx tokens). 0 = off.")
    filter_zero_std_groups: bool = Field(
        False, description="Leave groups whose n scores are all equal out of the update (DAPO's "
        "dynamic sampling, simplest form; their share: metric group/zero_std_frac).")

    @model_validator(mode="before")
    @classmethod
    def _estimator_defaults(cls, data: Any) -> Any:
        # kl_in_reward's default depends on the estimator (GRPO and Dr. GRPO: KL in the loss)
        spec = ESTIMATORS.get(data.get("advantage_estimator")) if isinstance(data, dict) else None
        if spec is not None and "kl_in_reward" not in data and not spec.kl_in_reward:
            data = {**data, "kl_in_reward": False}
        return data

    @property
    def uses_critic(self) -> bool:
        """True when the estimator needs a value model (gae; algo/choices.ESTIMATORS)."""
        return ESTIMATORS[self.advantage_estimator].critic


# ------------------------------------------------------------------------------- data
class DataConfig(Section):
    path: str | None = Field(
        None, description="Prompt dataset: a JSON/JSONL/CSV/Parquet file, a save_to_disk "
        "directory or a hub name; null = the prompts shipped with the tiny default.")
    format: Literal["auto", "json", "jsonl", "csv", "parquet", "disk", "hub"] = Field(
        "auto", description="How to read `path`; auto decides by file ending.")
    prompt_key: str = Field("prompt", description="Column holding plain-text prompts.")
    messages_key: str = Field(
        "messages", description="Column holding chat messages (list of {role, content}), rendered "
        "with the tokenizer's chat template; used when prompt_key is absent.")
    split: str = Field("train", description="Dataset split for training prompts.")
    eval_split: str | None = Field(
        None, description="Optional evaluation prompts: a split spec (test, train[90%:]) or a "
        "file; scored with greedy responses every data.eval_every iterations.")
    eval_every: int = Field(10, ge=0, description="Evaluate every N iterations (0: never).")
    eval_size: int = Field(64, gt=0, description="Evaluation prompts used (at most; rounded down "
                           "to a multiple of the world size).")
    max_prompt_len: int = Field(256, gt=0, description="Longest prompt in tokens.")
    truncation: Literal["left", "drop"] = Field(
        "left", description="Prompts over max_prompt_len: keep their end (left) or drop them.")
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="A malformed row stops before training (error) or is counted and "
        "skipped (skip).")
    shuffle: bool = Field(True, description="Shuffle prompts each epoch with the run's seed.")
    ptx_path: str | None = Field(
        None, description="PPO-ptx rows (ppo.ptx_coef): a JSON/JSONL/CSV/Parquet file (read as "
        "data.path is) whose rows hold `text` (pretraining text: the loss on every token after "
        "the first) or data.prompt_key + `completion` (SFT rows: the loss on the completion and "
        "its EOS).")
    ptx_format: Literal["auto", "json", "jsonl", "csv", "parquet", "disk", "hub"] = Field(
        "auto", description="How to read data.ptx_path; auto decides by file ending.")
    ptx_max_len: int = Field(512, gt=1, description="Longest ptx row in tokens: a text keeps "
                             "its start, a prompt its end, a completion its start.")
    reward_keys: list[str] = Field(
        default_factory=list, description="Dataset columns passed to reward.function as keyword "
        "arguments (to reward.url as JSON lists), one value per response, e.g. [answer] for a "
        "reference answer: f(prompts, responses, answer=[...]). Every row must have them.")


# --------------------------------------------------------------------------- tracking
class TrackingConfig(Section):
    enabled: bool = Field(True, description="Log to MLflow (false: mlflow is never imported).")
    uri: str | None = Field(
        None, description="Tracking URI; default $MLFLOW_TRACKING_URI, else a local store in "
        "output_dir/mlruns.")
    experiment: str = Field("ds_ppo", description="MLflow experiment name.")
    run_name: str | None = Field(None, description="MLflow run name; default output_dir's name.")
    tags: dict[str, str] = Field(default_factory=dict, description="Extra run tags.")
    required: bool = Field(
        True, description="Fail at start when the tracking server cannot be reached "
        "(false: warn and train without it).")
    log_samples_every: int = Field(
        10, ge=0, description="Log a table of sample prompts/responses/scores every N iterations "
        "(0: never).")
    num_samples: int = Field(8, gt=0, description="Rows in each sample table.")
    log_system_metrics: bool = Field(False, description="MLflow system metrics (CPU/GPU).")
    register_model: str | None = Field(
        None, description="Register the exported policy (output_dir/final) as a new version of "
        "this MLflow registered model at the end of training, tagged with run_id, iteration, "
        "eval_score (the last evaluation's, if any) and config_hash.")
    register_every: int = Field(
        0, ge=0, description="Also register the policy of every checkpoint whose iteration is a "
        "multiple of N (its safetensors copy: checkpoint.save_hf_weights); 0: only at the end.")
    parent_run_id: str | None = Field(
        None, description="An MLflow run id (in the same tracking store): this run is created "
        "as its child (tag mlflow.parentRunId), so a pipeline's steps (SFT, reward model, RL) "
        "show as one parent run with a child run per step.")
    register_copy: bool = Field(
        True, description="Copy the model into the run's artifacts as an MLflow transformers "
        "model; false: register a reference to the directory (for very large models; the "
        "version's export_dir tag names it, and it must stay where it is).")


# ------------------------------------------------------------------ supervised jobs
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
                              "same form as chosen_key.")
    margin_key: str | None = Field(
        None, description="Optional column of a number per pair: the loss becomes "
        "-log sigmoid(r_chosen - r_rejected - margin) (Llama 2's margin loss); null: no margin.")
    center_coef: float = Field(
        0.0, ge=0, description="Weight of the centring loss mean((r_chosen + r_rejected)^2) "
        "added to the Bradley-Terry loss (Eisenstein et al. 2023; TRL's "
        "center_rewards_coefficient): scores near 0 for every prompt, so PPO's reward carries "
        "no prompt-dependent offset for the critic to learn away; 0: off.")


# ------------------------------------------------------------------------- checkpoint
class CheckpointConfig(Section):
    every: int = Field(50, ge=0, description="Save every N iterations (0: only at the end).")
    keep_last: int = Field(2, gt=0, description="Complete checkpoints kept on disk.")
    save_at_end: bool = Field(True, description="Save a checkpoint after the last iteration.")
    export_at_end: bool = Field(
        True, description="Export the policy as a Hugging Face directory at output_dir/final.")
    save_hf_weights: bool = Field(
        True, description="Also write the policy's and value's weights as safetensors into each "
        "checkpoint (streamed a parameter group at a time by the ranks of node 0), so that "
        "`ds-ppo export` reads no pickle.")
    export_dtype: Literal["bf16", "fp16", "fp32"] = Field(
        "bf16", description="Weight dtype of exported models (safetensors).")
    save_on_signal: bool = Field(
        True, description="On SIGTERM or SIGUSR1 (a scheduler's preemption notice, e.g. sbatch "
        "--signal=USR1@300) or Ctrl-C: finish the iteration, save a checkpoint, exit 128 + the "
        "signal (a second Ctrl-C aborts at once).")
    verify: bool = Field(
        True, description="Write a manifest (every file's size and CRC-32) into each checkpoint "
        "and check it on resume and in `ds-ppo export`: a damaged, cut or missing file is named, "
        "with the newest checkpoint that verifies. Costs one read of the checkpoint's files at "
        "each save and resume, spread over the ranks (docs/CHECKPOINTS.md); false skips both, "
        "for very large checkpoints on slow storage.")


# ------------------------------------------------------------------------ environment
class EnvConfig(Section):
    """Multi-turn rollouts: each response is an episode of model turns and environment
    observations (README "Environments and tools", docs/ENVIRONMENTS.md). Unset (no function,
    no url): one prompt -> one response."""

    function: str | None = Field(
        None, description="module:Name of a Python environment, importable like "
        "reward.function: a class (one instance per episode: reset(prompt, **keys), then "
        "step(action) -> Step per model turn) or a stateless step function "
        "f(prompt, actions, **keys) -> Step (actions: the model's turns so far). keys: the "
        "row's data.reward_keys columns.")
    url: str | None = Field(
        None, description="An environment served over HTTP (the stateless step contract of "
        "docs/ENVIRONMENTS.md), with reward.url's conventions: env.batch_size episodes per "
        "request, env.concurrency in flight, env.retries, user:password@ sent as basic auth and "
        "never shown.")
    max_turns: int = Field(4, gt=0, description="Model turns per episode at most; an episode "
                           "still going after them ends (metric env/out_of_turns_frac).")
    max_total_tokens: int = Field(
        512, gt=0, description="Response tokens per episode (model turns and observations "
        "together) at most; a turn or observation that would pass it ends the episode there "
        "(metric env/truncated_frac). generation.max_new_tokens limits each turn.")
    stop: list[str] = Field(
        default_factory=list, description="Strings that end a model turn (e.g. </call>): the "
        "turn is cut after the token that completes the first of them. Single tokens can also "
        "go in generation.stop_tokens, which stop the decoding itself.")
    observation_role: str = Field(
        "tool", description="Chat prompts: the role of an observation given as text (a Step "
        "may give a whole message instead).")
    timeout_s: float | None = Field(
        60.0, gt=0, description="Limit of one environment call (a reset or step of one episode; "
        "env.url: one request, then retried). A call that raises or hangs stops the run with "
        "its name after a checkpoint of the last completed iteration; null: no limit.")
    concurrency: int = Field(16, gt=0, description="Environment calls in flight at once on "
                             "each rank (Python: worker threads; env.url: requests).")
    batch_size: int = Field(64, gt=0, description="env.url: episodes per request.")
    retries: int = Field(3, ge=0, description="env.url: retries of a request after a connection "
                         "error, a timeout or a 5xx answer (back-off 1, 2, 4... s).")

    @property
    def enabled(self) -> bool:
        return self.function is not None or self.url is not None


# -------------------------------------------------------------------------- deepspeed
class RoleDeepSpeed(Section):
    config: str | None = Field(
        None, description="Path to the role's DeepSpeed JSON template (default: the one in "
        "ds_configs/ for its zero_stage/offload); batch-size keys are filled in by ds_ppo.")
    zero_stage: Literal[0, 1, 2, 3, "auto"] = Field(
        3, description="ZeRO stage. auto: 3 on several ranks, with an offload, or when a universal "
        "checkpoint (another world size) is loaded; else 0 (one rank: ZeRO-3's partitioning hooks "
        "only cost time, docs/PERFORMANCE.md). The choice is logged. A stage-0 checkpoint resumes "
        "on the same world size only.")
    offload_optimizer: bool = Field(False, description="Optimizer states on CPU (trained roles).")
    offload_param: bool = Field(False, description="Parameters on CPU (ZeRO-3 only).")

    def stage(self, world_size: int, load_universal: bool = False) -> int:
        """The ZeRO stage; `auto`: 3 where it partitions something (several ranks), where an
        offload needs it, or where a universal checkpoint is loaded (DeepSpeed converts ZeRO 1-3
        checkpoints only); else 0: on one rank ZeRO-3's gather/release hooks and partitioned
        optimizer only cost time (docs/PERFORMANCE.md)."""
        if self.zero_stage != "auto":
            return self.zero_stage
        if world_size > 1 or self.offload_param or self.offload_optimizer or load_universal:
            return 3
        return 0


class ReferenceDeepSpeed(RoleDeepSpeed):
    """The reference: inference only, parameters offloaded to CPU by default. A class of its
    own, so the default holds when a YAML file sets only some of the section's other keys."""

    offload_param: bool = Field(True, description="Parameters on CPU (ZeRO-3 only); the "
                                "reference streams its frozen weights in for scoring.")


class DeepSpeedConfig(Section):
    policy: RoleDeepSpeed = Field(default_factory=RoleDeepSpeed)
    value: RoleDeepSpeed = Field(default_factory=RoleDeepSpeed)
    reference: ReferenceDeepSpeed = Field(default_factory=ReferenceDeepSpeed)
    reward: RoleDeepSpeed = Field(default_factory=RoleDeepSpeed)
    sequence_parallel_size: int = Field(
        1, gt=0, description="Ranks that share one long row (DeepSpeed Ulysses sequence "
        "parallelism, ALST): its tokens are split across N consecutive ranks, attention "
        "exchanges them for heads (all-to-all), so each rank holds 1/N of the row's activations. "
        "For the policy, reference and value forwards of rows longer than "
        "sequence_parallel_min_tokens; the data-parallel group is world / N. N must divide the "
        "world size and the models' attention heads (KV heads: divide or be divided by N); "
        "sdpa or flash attention. Planned by `ds-ppo plan`; the training loop does not split "
        "its data-parallel group yet and refuses N > 1 (docs/PERFORMANCE.md, Long context).")
    sequence_parallel_min_tokens: int = Field(
        8192, gt=0, description="With sequence_parallel_size > 1: rows of at least this many "
        "tokens (prompt + response) are split across the sequence-parallel group; shorter ones "
        "run whole on each rank.")


# ------------------------------------------------------------------------------- root
class Config(Section):
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    value: ValueConfig = Field(default_factory=ValueConfig)
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rm: RMConfig = Field(default_factory=RMConfig)
    output_dir: str = Field("outputs/ds_ppo", description="Where checkpoints, exports, the local "
                            "MLflow store and logs go.")
    seed: int = Field(42, description="Seed of data order, initialisation and sampling.")
    iterations: int = Field(100, gt=0, description="PPO iterations (rollout + update) in total.")
    resume: str = Field(
        "auto", description="auto: continue from output_dir's latest complete checkpoint if any; "
        "never: start fresh (refuses a non-empty checkpoint dir); or a checkpoint directory.")
    log_every: int = Field(1, gt=0, description="Print a progress line every N iterations.")
    log_level: Literal["info", "debug"] = Field(
        "info", description="debug: also DeepSpeed's and transformers' start-up messages and "
        "progress bars (e.g. one per checkpoint save), and ds_ppo's debug lines.")
    dist_timeout_minutes: float = Field(
        30.0, gt=0, description="A collective (all-reduce, barrier, ZeRO gather) waiting longer "
        "than this fails the job with an error instead of hanging it. Rank 0's solitary file work "
        "(a universal-checkpoint conversion) is waited for without it; exports are streamed by "
        "all ranks together. On several ranks a reward.url call stops at this less a margin "
        "(10%, 30 s to 5 min), so a failing service is reported before a collective times out.")

    watchdog_minutes: float | None = Field(
        None, ge=0, description="A rank that makes no progress for this long (one generate "
        "call, scoring or update micro-batch, reward call, save or export; or waiting in a "
        "collective for a rank that never comes) stops the job: every rank that can still act "
        "prints one line naming its phase and the ranks that did not arrive, writes its Python "
        "stacks to output_dir/hang-<rank>.txt and exits 4 (run the same command again to "
        "resume). A rank past it waits while any other rank still makes progress. null: "
        "dist_timeout_minutes less 5% (15 s to 2.5 min, at most a quarter): after a reward.url "
        "call's own deadline, before the collective timeout; 0: off. Must be below "
        "dist_timeout_minutes.")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
