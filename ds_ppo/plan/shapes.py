"""Each role's model shape for the plan, read off a meta-device build (no weights, no download)
of its `arch` or the config.json under its `path`, and the parameter counts derived from it."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ds_ppo.config import Config, reference_from_policy_base, value_init_source
from ds_ppo.errors import ConfigError
from ds_ppo.engine.generation.choice import decoder_linears

Head = Literal["causal", "token", "sequence"]


@dataclass(frozen=True)
class ModelShape:
    """What the memory formulas need from one model, read off a meta-device build."""

    model_class: str  # e.g. LlamaForCausalLM
    params: int  # tied weights counted once
    largest_layer_params: int  # params owned by the largest single module (DeepSpeed's measure)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    source: str  # where the shape came from, for the table
    decoder_linears: frozenset[str] = frozenset()  # engine.generation.choice.decoder_linears
    tied: bool = False  # output head tied to the input embeddings
    # a mixture-of-experts model (else 0): routed experts per MoE layer, experts per token,
    # MoE layers, and the routed experts' parameters over all layers
    experts: int = 0
    top_k: int = 0
    moe_layers: int = 0
    expert_params: int = 0

    @property
    def active_params(self) -> int:
        """Parameters a token's forward uses: all but the routed experts it is not sent to."""
        if not self.experts:
            return self.params
        return self.params - self.expert_params * (self.experts - self.top_k) // self.experts

    @property
    def layer_expert_params(self) -> int:
        """One MoE layer's routed experts' parameters (0 for a dense model)."""
        return self.expert_params // self.moe_layers if self.moe_layers else 0


def _hf_config(path: str | None, arch: dict[str, Any] | None):
    """A transformers config from an `arch` dict or a local/cached config.json; None if neither
    can be read (never downloads)."""
    from transformers import AutoConfig

    if arch is not None:
        fields = {k: v for k, v in arch.items() if k != "model_type"}
        return AutoConfig.for_model(arch["model_type"], **fields)
    if path is None:
        return None
    try:
        if (Path(path) / "config.json").is_file():
            return AutoConfig.from_pretrained(path)
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return None


_COUNTS: dict[tuple[str, str], tuple] = {}


def _meta_counts(hf_config, head: Head) -> tuple:
    """(class name, params, largest-layer params, decoder linear layers, (experts, top-k, MoE
    layers, routed expert params)) of a model built on the meta device; cached per config and
    head, since the greedy lever search replans many times."""
    key = (hf_config.to_json_string(use_diff=False), head)
    if key in _COUNTS:
        return _COUNTS[key]
    import torch
    import transformers
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification,
                              AutoModelForTokenClassification)

    hf = copy.deepcopy(hf_config)
    if head != "causal":
        hf.num_labels = 1
    cls = {"causal": AutoModelForCausalLM, "token": AutoModelForTokenClassification,
           "sequence": AutoModelForSequenceClassification}[head]
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            model = cls.from_config(hf)
    finally:
        transformers.logging.set_verbosity(verbosity)
    params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    _COUNTS[key] = (type(model).__name__, params, largest, decoder_linears(model),
                    _moe_counts(model))
    return _COUNTS[key]


def _moe_counts(model) -> tuple[int, int, int, int]:
    """(routed experts per layer, experts per token, MoE layers, the routed experts' params)
    of a mixture-of-experts model (engine/moe.py finds its routers), zeros for a dense one."""
    from ds_ppo.engine.moe import routers

    found = routers(model)
    if not found:
        return 0, 0, 0, 0
    experts = [m.experts for m in model.modules()
               if getattr(m, "gate", None) in found and hasattr(m, "experts")]
    n = sum(p.numel() for e in experts for p in e.parameters())
    return int(found[0].num_experts), int(found[0].top_k), len(found), n


def model_shape(hf_config, head: Head, source: str) -> ModelShape:
    """Count a model's parameters on the meta device and read its layer dimensions."""
    cls, params, largest, linears, (experts, top_k, moe_layers, expert_params) = \
        _meta_counts(hf_config, head)
    text = hf_config.get_text_config()
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    inter = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    return ModelShape(cls, params, largest, hidden, int(text.num_hidden_layers), heads, kv_heads,
                      head_dim, int(inter), int(text.vocab_size), source, linears,
                      bool(getattr(hf_config, "tie_word_embeddings", False)), experts, top_k,
                      moe_layers, expert_params)


@dataclass(frozen=True)
class RoleShapes:
    shapes: dict[str, ModelShape | None]  # role -> shape; reward None when it is a function
    notes: tuple[str, ...] = ()
    policy_config: Any = None  # the policy's HF config as the engine loads it (attention kernel)


def resolve_shapes(cfg: Config) -> RoleShapes:
    """Each role's model shape: its own config.json when readable, else the policy's (noted)."""
    notes: list[str] = []
    policy_hf = _hf_config(cfg.policy.path, cfg.policy.arch)
    if policy_hf is None:
        raise ConfigError(
            f"plan: cannot read the policy's shape from policy.path = {cfg.policy.path!r} "
            "(no config.json there or in the Hugging Face cache); set policy.arch to its "
            "config fields or point policy.path to a local model directory")
    policy_src = "arch" if cfg.policy.arch is not None else f"path {cfg.policy.path}"
    if cfg.policy.arch is not None and "vocab_size" not in cfg.policy.arch:
        notes.append(f"policy.arch has no vocab_size: planned with transformers' default "
                     f"{policy_hf.get_text_config().vocab_size} (training takes the tokenizer's)")

    def other(what: str, path: str | None, arch: dict | None = None):
        hf = _hf_config(path, arch)
        if hf is None:
            notes.append(f"{what} = {path!r} has no readable config.json: assuming the policy's "
                         "shape")
            return policy_hf, "policy's shape (assumed)"
        return hf, "arch" if arch is not None else f"path {path}"

    reward_hf, reward_src = None, None
    if cfg.reward.model is not None:
        reward_hf, reward_src = other("reward.model", cfg.reward.model)
    ref_hf, ref_src = (policy_hf, policy_src) if cfg.reference.path is None else \
        other("reference.path", cfg.reference.path)

    init = value_init_source(cfg)  # as the engine decides
    if init == "reward" and reward_hf is not None:
        value_hf, value_src = reward_hf, reward_src
    elif init == "path":
        value_hf, value_src = other("value.path", cfg.value.path, cfg.value.arch)
    else:
        value_hf, value_src = policy_hf, policy_src

    from_base = reference_from_policy_base(cfg)  # LoRA: the policy engine, adapters off
    teacher = None  # on-policy distillation's teacher (teacher section)
    if cfg.teacher.enabled:
        teacher_hf, teacher_src = other("teacher.path", cfg.teacher.path, cfg.teacher.arch)
        teacher = model_shape(teacher_hf, "causal", teacher_src)
    shapes = {
        "policy": model_shape(policy_hf, "causal", policy_src),
        "value": model_shape(value_hf, "token", value_src),
        "reference": None if from_base else model_shape(ref_hf, "causal", ref_src),
        "reward": model_shape(reward_hf, "sequence", reward_src) if reward_hf is not None else None,
        "teacher": teacher,
    }
    policy_config = copy.deepcopy(policy_hf)
    policy_config._attn_implementation = cfg.policy.attn_implementation  # as roles.py loads it
    return RoleShapes(shapes, tuple(notes), policy_config)


def lora_params(shape: ModelShape, lora, output_head: bool = False) -> int:
    """Adapter parameters of a Llama-layout model: r x (in + out) for each adapted projection
    (all-linear = q, k, v, o, gate, up, down of every layer; a mixture-of-experts model's
    fused experts are not linear layers, so there q, k, v, o), plus r x (hidden + vocab) for the
    output head when it is adapted (`output_head`: config.lora_output_head)."""
    h, q, kv, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, \
        shape.intermediate
    sizes = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h,
             "gate_proj": h + i, "up_proj": h + i, "down_proj": i + h}
    names = sizes if lora.target_modules == "all-linear" else lora.target_modules
    if shape.experts and shape.decoder_linears:  # fused experts are no linear layers: peft
        names = [n for n in names if n in shape.decoder_linears]  # adapts attention only
    head = lora.r * (h + shape.vocab) if output_head else 0
    return shape.layers * lora.r * sum(sizes.get(n, 0) for n in names) + head


def lora_base_params(shape: ModelShape, lora, output_head: bool = False) -> int:
    """Frozen weights (in x out) of the layers `lora_params` adapts: what a LoRA policy's
    generation replica keeps a second copy of, so that a weight sync after the first merges
    the new adapters without gathering the base again."""
    h, q, kv, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, \
        shape.intermediate
    sizes = {"q_proj": h * q, "k_proj": h * kv, "v_proj": h * kv, "o_proj": q * h,
             "gate_proj": h * i, "up_proj": h * i, "down_proj": i * h}
    names = sizes if lora.target_modules == "all-linear" else lora.target_modules
    if shape.experts and shape.decoder_linears:
        names = [n for n in names if n in shape.decoder_linears]
    head = h * shape.vocab if output_head else 0
    return shape.layers * sum(sizes.get(n, 0) for n in names) + head


def tp_shard_params(shape: ModelShape, tp: int) -> int:
    """Parameters of one rank's tensor-parallel replica (engine/generation/tensor_parallel.py):
    of every layer the query and output projections split tp ways, the key and value
    projections min(tp, KV heads) ways (with fewer KV heads than ranks each rank keeps one),
    a dense MLP's gate, up and down projections tp ways, a MoE layer's routed experts tp ways
    (E / tp experts per rank); the rest whole (embeddings, output head, norms, routers)."""
    qo = 2 * shape.hidden * shape.head_dim * shape.heads
    kv = 2 * shape.hidden * shape.head_dim * shape.kv_heads
    dense_mlp = (shape.layers - shape.moe_layers) * 3 * shape.hidden * shape.intermediate
    split = shape.layers * qo + dense_mlp + shape.expert_params
    whole = shape.params - split - shape.layers * kv
    return whole + split // tp + shape.layers * kv // min(tp, shape.kv_heads)


def kv_shards(shape: ModelShape, tp: int) -> int:
    """Into how many parts a tensor-parallel group splits the KV cache: its KV heads'."""
    return min(tp, shape.kv_heads)


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"
