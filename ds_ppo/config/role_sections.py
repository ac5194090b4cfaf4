"""The model roles' sections: where each model's weights come from, its optimizer and
adapters (policy, value, reference), and the reward (a function, a model or a service)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ds_ppo.config.section_base import Section


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
    moe_aux_loss_coef: float | None = Field(
        None, ge=0, le=1, description="A mixture-of-experts model's auxiliary load-balancing "
        "loss (Switch Transformer's, as transformers computes it for each forward over its real "
        "tokens) joins each training micro-batch's loss with this coefficient; null = the "
        "model config's router_aux_loss_coef (0.001 for Qwen3-MoE and Mixtral), 0 = off. "
        "Logged as <role>/moe_aux_loss. Dense models: ignored.")


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


class TeacherConfig(Section):
    """The teacher of on-policy distillation (ppo.advantage_estimator = distill): a frozen
    causal LM that scores every token the student samples. Built like the reference: an
    inference engine (deepspeed.teacher: ZeRO-3 sharded, parameters offloadable), no LoRA, in
    policy.dtype with policy.attn_implementation."""

    path: str | None = Field(
        None, description="Hugging Face directory or hub name of the teacher: any causal LM "
        "whose tokenizer has the student's vocabulary (the same token for every id; refused "
        "at --dry-run otherwise). null: no teacher (ppo.advantage_estimator=distill needs one).")
    arch: dict[str, Any] | None = Field(
        None, description="Instead of `path`: a random-init teacher of this Hugging Face "
        "config (as policy.arch, with the student's tokenizer; seeded seed + 2). For tests "
        "and examples: a real teacher is a trained model.")
    tokenizer: str | None = Field(
        None, description="The teacher's tokenizer, compared with the student's at --dry-run "
        "and at start-up; default: teacher.path.")

    @property
    def enabled(self) -> bool:
        return self.path is not None or self.arch is not None

    def problems(self) -> list[str]:
        if self.path is not None and self.arch is not None:
            return [f"teacher.path = {self.path!r} and teacher.arch are both set: keep one "
                    "(path loads a trained teacher, arch builds a random-init one)"]
        if self.arch is not None and "model_type" not in self.arch:
            return [f"teacher.arch = {self.arch!r} needs a model_type key (e.g. "
                    "teacher.arch.model_type=llama)"]
        return []


class RewardConfig(Section):
    function: str | None = Field(
        None,
        description="A Python reward function `module:function` called as "
        "f(prompts: list[str], responses: list[str]) -> list[float] (batched), plus one "
        "keyword list per data.reward_keys column, and messages=[each prompt's chat, None for "
        "plain text] when it names a `messages` parameter. `ds_ppo.rewards:positive_words` is "
        "the tiny default's task.")
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
        "columns>} as JSON, answer {scores: [one float per response]} (docs/GUIDE.md: A reward "
        "service). Each rank posts its own share, reward.batch_size responses per request.")
    batch_size: int = Field(64, gt=0, description="reward.url: responses per request.")
    concurrency: int = Field(4, gt=0, description="reward.url: requests in flight at once, "
                             "per rank. reward.stream: also the reward calls in flight at once "
                             "per rank.")
    timeout_s: float | None = Field(
        600.0, gt=0, description="Time limit of one reward call in seconds. reward.function: "
        "the call runs in a worker thread; a call still running then stops the run with a "
        "message, after a checkpoint of the last completed iteration (exit 2); null: call it in "
        "the main thread (for functions that need it, e.g. signal-based timeouts), never stopped "
        "(a SIGTERM waits for it too). "
        "reward.url: the limit of one whole request, from connecting to the answer's last byte "
        "(then retried; an answer over 16 MiB stops the run); null: no limit.")
    stream: bool = Field(True, description="reward.function / reward.url: call the reward on "
                         "responses as the decoding loop finishes them (the rows found ended at "
                         "one check go in one call), while the others still decode and while "
                         "scoring runs; reward.concurrency calls in flight at once, responses "
                         "finished meanwhile go together in the next call. The function must "
                         "then score each response on its own (not relative to the others of "
                         "its call). false: one call on the rank's rollout after generation. "
                         "Our decoding loop only (generation.loop own, mode gathered), not with "
                         "reward.timeout_s null or sequence parallelism.")
    retries: int = Field(3, ge=0, le=1000, description="reward.url: retries of a request after a "
                         "connection error, a timeout or a 5xx answer (back-off 1, 2, 4... s), "
                         "before the run stops.")

    def problems(self) -> list[str]:
        from ds_ppo.redaction import redact_url  # stdlib only: no heavy import

        out = []
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            out.append(f"reward.url = {redact_url(self.url)!r} must start with http:// or "
                       "https://")
        if self.function is not None and ":" not in self.function:
            out.append(f"reward.function = {self.function!r} must look like module:function")
        if self.score_clip is not None and self.score_clip <= 0:
            out.append(f"reward.score_clip = {self.score_clip} must be > 0 or null")
        return out
