"""`ds-ppo plan`: GPU and CPU memory of a PPO run, per role, per rank and per phase, before any
GPU is touched.

Each role's model is built on the meta device (no weights, no download) from its `arch` or from
the config.json under its `path`, to count parameters and find the largest layer. Everything
below is arithmetic on those counts; every rank holds the same amounts (ZeRO data parallelism,
no pipeline or tensor parallelism), so "per rank" means any rank.

Sources of the formulas:
- Model states of trained roles: DeepSpeed's own estimators,
  ``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs`` (ZeRO-3) and
  ``stage_1_and_2.estimate_zero2_model_states_mem_needs`` (ZeRO-2), reproduced term by term:
  2 bytes/param of 16-bit weights plus 16 bytes/param of fp32 master weights, gradients and
  Adam moments, partitioned over the data-parallel ranks, a largest-layer gather buffer of
  4 bytes/param, and CPU memory scaled by DeepSpeed's additional_buffer_factor 1.5.
- Activations: the per-layer accounting of Korthikanti et al. 2022 ("Reducing Activation
  Recomputation in Large Transformer Models", sec. 4.1, 34*s*b*h + 5*a*s^2*b bytes for GPT),
  redone for a Llama-style layer (see `layer_activation_bytes`).
- KV cache: 2 (K and V) * layers * kv_heads * head_dim * tokens * batch * 2 bytes.
- LoRA (policy.lora / value.lora): the frozen base as a frozen role's 16-bit weights, and the
  trained-role formulas above applied to the adapter parameters (r x (in + out) per adapted
  Llama projection) plus a value model's head; with the reference read from the policy's base
  there is no reference role.

Besides ds_ppo.config it imports only torch and transformers (lazily), never deepspeed.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from ds_ppo.config import (Config, apply_overrides, load_config, reference_from_policy_base,
                           validate)
from ds_ppo.errors import ConfigError, UserError
from ds_ppo.generation_choice import choose_generation, decoder_linears
from ds_ppo.role_names import ROLES, TRAINED_ROLES

GiB = 2**30
BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor for CPU memory
# CUDA context, NCCL communicators, DeepSpeed's bucket buffers and allocator fragmentation: a
# fixed per-GPU allowance, since none of them scale with the model in a way worth modelling.
RUNTIME_OVERHEAD_BYTES = 2 * GiB
Head = Literal["causal", "token", "sequence"]


# ------------------------------------------------------------------------------- shapes
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
    decoder_linears: frozenset[str] = frozenset()  # generation_choice.decoder_linears


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


_COUNTS: dict[tuple[str, str], tuple[str, int, int, frozenset[str]]] = {}


def _meta_counts(hf_config, head: Head) -> tuple[str, int, int, frozenset[str]]:
    """(class name, params, largest-layer params, decoder linear layers) of a model built on the
    meta device; cached per config and head, since the greedy lever search replans many times."""
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
    _COUNTS[key] = (type(model).__name__, params, largest, decoder_linears(model))
    return _COUNTS[key]


def model_shape(hf_config, head: Head, source: str) -> ModelShape:
    """Count a model's parameters on the meta device and read its layer dimensions."""
    cls, params, largest, linears = _meta_counts(hf_config, head)
    text = hf_config.get_text_config()
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    inter = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    return ModelShape(cls, params, largest, hidden, int(text.num_hidden_layers), heads, kv_heads,
                      head_dim, int(inter), int(text.vocab_size), source, linears)


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

    init = cfg.value.init_from
    if init == "auto":
        init = "reward" if cfg.reward.model is not None else "policy"
    if init == "reward" and reward_hf is not None:
        value_hf, value_src = reward_hf, reward_src
    elif init == "path":
        value_hf, value_src = other("value.path", cfg.value.path, cfg.value.arch)
    else:
        value_hf, value_src = policy_hf, policy_src

    from_base = reference_from_policy_base(cfg)  # LoRA: the policy engine, adapters off
    shapes = {
        "policy": model_shape(policy_hf, "causal", policy_src),
        "value": model_shape(value_hf, "token", value_src),
        "reference": None if from_base else model_shape(ref_hf, "causal", ref_src),
        "reward": model_shape(reward_hf, "sequence", reward_src) if reward_hf is not None else None,
    }
    policy_config = copy.deepcopy(policy_hf)
    policy_config._attn_implementation = cfg.policy.attn_implementation  # as roles.py loads it
    return RoleShapes(shapes, tuple(notes), policy_config)


# ------------------------------------------------------------------------- model states
@dataclass(frozen=True)
class ModelStates:
    """One role's model states under its ZeRO stage and offload."""

    gpu_bytes_per_rank: int  # DeepSpeed's per-GPU figure: resident partition + gather buffer
    gather_bytes: int  # the largest-layer gather buffer (only while the role runs)
    cpu_bytes_per_node: int

    @property
    def resident_bytes(self) -> int:
        """Bytes that stay on each GPU between the role's forward/backward passes."""
        return self.gpu_bytes_per_rank - self.gather_bytes


def zero3_train_states(total_params: int, largest_layer_params: int, num_gpus_per_node: int,
                       num_nodes: int, offload_optimizer: bool, offload_param: bool,
                       zero_init: bool = True,
                       additional_buffer_factor: float = BUFFER_FACTOR) -> ModelStates:
    """ZeRO-3 model states of a trained role, as DeepSpeed's
    estimate_zero3_model_states_mem_needs computes them (same expressions, same rounding).

    Param offload without optimizer offload, which that estimator does not model, keeps the
    16 bytes/param of optimizer state and gradients on the GPU and the 2 of weights on CPU.
    """
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params  # 16-bit weights + 16-bit grads of it
    if offload_optimizer:
        if offload_param:
            gpu_mem = largest_layer_memory
            per_param = 18
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            per_param = 16
        if zero_init:
            cpu_mem = total_params * per_param * gpus_factor * additional_buffer_factor
        else:
            cpu_mem = (total_params * max(4 * num_gpus_per_node, per_param * gpus_factor)
                       * additional_buffer_factor)
    elif offload_param:
        gpu_mem = largest_layer_memory + int(16 * total_params / total_gpus)
        cpu_mem = total_params * 2 * gpus_factor * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return ModelStates(int(gpu_mem), largest_layer_memory, int(cpu_mem))


def train_states(params: int, largest: int, gpus_per_node: int, nodes: int, zero_stage: int,
                 offload_optimizer: bool, offload_param: bool) -> ModelStates:
    """Model states of a trained role (16-bit weights, fp32 AdamW) under any ZeRO stage."""
    if zero_stage == 3:
        return zero3_train_states(params, largest, gpus_per_node, nodes, offload_optimizer,
                                  offload_param)
    total_gpus = nodes * gpus_per_node
    # Per param: 2 weights16 + 2 grads16 + 4 grads32 + 4 master32 + 8 Adam = 20 bytes, the
    # split DeepSpeed's estimate_zero2_model_states_mem_needs documents.
    if zero_stage == 2 or (zero_stage == 1 and offload_optimizer):
        if offload_optimizer:
            return ModelStates(2 * params, 0,
                               int(params * max(4 * total_gpus, 16) * BUFFER_FACTOR))
        gpu = 2 * params + int(18 * params / total_gpus)
    elif zero_stage == 1:  # optimizer states and fp32 copies partitioned, 16-bit grads not
        gpu = 4 * params + int(16 * params / total_gpus)
    else:
        gpu = 20 * params
    return ModelStates(gpu, 0, int(params * 4 * gpus_per_node * BUFFER_FACTOR))


def inference_states(params: int, largest: int, gpus_per_node: int, nodes: int, zero_stage: int,
                     offload_param: bool) -> ModelStates:
    """Model states of a frozen role: 16-bit weights only, partitioned under ZeRO-3."""
    total_gpus = nodes * gpus_per_node
    if zero_stage < 3:  # ZeRO 1/2 partition nothing of a model without an optimizer
        return ModelStates(2 * params, 0, int(params * 2 * gpus_per_node * BUFFER_FACTOR))
    gather = 2 * largest
    if offload_param:
        return ModelStates(gather, gather, int(params * 2 / nodes * BUFFER_FACTOR))
    return ModelStates(gather + int(2 * params / total_gpus), gather,
                       int(largest * 2 * gpus_per_node * BUFFER_FACTOR))


# -------------------------------------------------------------------------- activations
def layer_activation_bytes(shape: ModelShape, seq: int, batch: int, eager: bool) -> int:
    """16-bit activations one decoder layer saves for backward (pre-norm, gated MLP, GQA, no
    dropout), counted the way Korthikanti et al. 2022 count a GPT layer's 34*s*b*h:

      attention: 2sbh input of QKV + 2sbh Q + 4*s*b*kv_dim K and V + 2sbh input of the output
                 projection; eager attention adds scores and probabilities, 4*a*s^2*b
                 (SDPA/flash kernels never store them, the 5as/h term of the paper goes away)
      MLP:       2sbh input + 8*s*b*i for gate, up, act(gate) and act(gate)*up
      norms:     2 x 4sbh, the fp32 inputs of the two RMSNorms
    """
    s, b, h, i = seq, batch, shape.hidden, shape.intermediate
    kv_dim = shape.kv_heads * shape.head_dim
    total = s * b * (16 * h + 4 * kv_dim + 8 * i)
    if eager:
        total += 4 * shape.heads * s * s * b
    return total


def train_activation_bytes(shape: ModelShape, seq: int, batch: int, checkpointing: bool,
                           eager: bool) -> int:
    """Activations of one forward/backward: every layer's, or with (per-layer) checkpointing
    each layer's 16-bit input plus one layer recomputed in full during backward."""
    layer = layer_activation_bytes(shape, seq, batch, eager)
    if checkpointing:
        return shape.layers * 2 * seq * batch * shape.hidden + layer
    return shape.layers * layer


def prefill_activation_bytes(shape: ModelShape, tokens: int, batch: int, eager: bool,
                             tp: int = 1) -> int:
    """Peak activations of a prefill through the generation replica (no grad, layers one after
    another, so only one layer's tensors are alive besides the residual stream), per rank.
    16-bit tensors, h = hidden, kv = kv_heads * head_dim, i = intermediate; the projections'
    outputs are 1/tp wide under tensor parallelism, the residual stream is whole. Per token:

      RMSNorm:   2h residual + 8h (its fp32 upcast and the fp32 normalised copy)        = 10h
      attention: 2h residual + 2h normed + (2h q + 4kv k, v + 2h + 2kv rotated q, k
                 + 2h attention output) / tp + 2h output projection     = 6h + (6h + 6kv)/tp
      MLP:       2h residual + 2h normed + 6i/tp (act(gate), up, their product)  = 4h + 6i/tp

    and the peak is the largest of the three; eager attention adds its scores and
    probabilities, 4 * (heads/tp) * s^2 * b. The KV cache and the last position's logits (both
    loops prefill with logits_to_keep=1) are separate terms of the plan."""
    h, i = shape.hidden, shape.intermediate
    kv = shape.kv_heads * shape.head_dim
    per_token = max(10 * h, 6 * h + (6 * h + 6 * kv) // tp, 4 * h + 6 * i // tp)
    total = tokens * batch * per_token
    if eager:
        total += 4 * (shape.heads // tp) * tokens * tokens * batch
    return total


def logits_bytes(shape: ModelShape, tokens: int, batch: int) -> int:
    """16-bit logits plus the fp32 log-softmax taken of them (computed in chunks or not, one
    fp32 copy is alive at the peak)."""
    return batch * tokens * shape.vocab * (2 + 4)


def kv_cache_bytes(shape: ModelShape, tokens: int, batch: int) -> int:
    """16-bit K and V of every layer for `batch` sequences of `tokens` tokens."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * tokens * batch * 2


# --------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_mem_bytes: int
    cpu_mem_bytes: int | None = None  # per node; None = unchecked

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class RolePlan:
    role: str
    shape: ModelShape | None  # None: a reward function / the LoRA policy's base
    trained: bool
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    states: ModelStates


@dataclass(frozen=True)
class Phase:
    """One moment of an iteration: the resident model states of every role plus what this
    moment adds on each GPU."""

    name: str
    transient: dict[str, int]  # term -> bytes per GPU

    def total(self, resident: int) -> int:
        return resident + RUNTIME_OVERHEAD_BYTES + sum(self.transient.values())


@dataclass(frozen=True)
class Lever:
    description: str
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class LeverEffect:
    lever: Lever
    saves_bytes: int  # peak GPU bytes per rank before minus after
    peak_after_bytes: int
    cpu_after_bytes: int  # CPU bytes per node after it (offloading moves memory there)
    fits_after: bool


@dataclass(frozen=True)
class Plan:
    cluster: Cluster
    roles: dict[str, RolePlan]
    seq_prompt: int
    seq_response: int
    micro_batch: int
    score_micro_batch: int
    gen_batch: int
    generation_mode: str  # resolved: gathered | tensor_parallel | zero3
    generation_loop: str  # resolved: own | hf
    tp_size: int  # ranks per tensor-parallel group
    tp_unsupported: str | None  # why tensor_parallel cannot split the policy (None: it can)
    resident_bytes: int
    phases: list[Phase]
    peak_gpu_bytes: int
    peak_phase: str
    cpu_bytes_per_node: int
    fits_gpu: bool
    fits_cpu: bool | None
    notes: list[str] = field(default_factory=list)
    biggest_lever: LeverEffect | None = None
    lever_path: list[LeverEffect] = field(default_factory=list)  # greedy, biggest first
    min_nodes: int | None = None  # smallest node count that fits as configured

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_cpu is not False


def lora_params(shape: ModelShape, lora) -> int:
    """Adapter parameters of a Llama-layout model: r x (in + out) for each adapted projection
    (all-linear = q, k, v, o, gate, up, down of every layer; the output head never)."""
    h, q, kv, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, \
        shape.intermediate
    sizes = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h,
             "gate_proj": h + i, "up_proj": h + i, "down_proj": i + h}
    names = sizes if lora.target_modules == "all-linear" else lora.target_modules
    return shape.layers * lora.r * sum(sizes.get(n, 0) for n in names)


def _lora_states(shape: ModelShape, adapters: int, cluster: Cluster, d) -> ModelStates:
    """A LoRA role: the frozen 16-bit base (as a frozen role) + the trained adapters' states."""
    base = inference_states(shape.params, shape.largest_layer_params, cluster.gpus_per_node,
                            cluster.nodes, d.zero_stage, d.offload_param)
    ad = train_states(adapters, 0, cluster.gpus_per_node, cluster.nodes, d.zero_stage,
                      d.offload_optimizer, d.offload_param)
    return ModelStates(base.gpu_bytes_per_rank + ad.gpu_bytes_per_rank, base.gather_bytes,
                       base.cpu_bytes_per_node + ad.cpu_bytes_per_node)


def _role_plan(cfg: Config, role: str, shape: ModelShape | None, cluster: Cluster) -> RolePlan:
    d = getattr(cfg.deepspeed, role)
    d = d.model_copy(update={"zero_stage": d.stage(cluster.world_size)})  # resolve auto
    trained = role in TRAINED_ROLES
    lora = getattr(cfg, role).lora if trained else None
    if shape is None:
        states = ModelStates(0, 0, 0)
    elif lora is not None:  # the value head (hidden x 1) is trained fully
        states = _lora_states(shape, lora_params(shape, lora)
                              + (shape.hidden if role == "value" else 0), cluster, d)
    elif trained:
        states = train_states(shape.params, shape.largest_layer_params, cluster.gpus_per_node,
                              cluster.nodes, d.zero_stage, d.offload_optimizer, d.offload_param)
    else:
        states = inference_states(shape.params, shape.largest_layer_params,
                                  cluster.gpus_per_node, cluster.nodes, d.zero_stage,
                                  d.offload_param)
    return RolePlan(role, shape, trained, d.zero_stage, d.offload_optimizer and trained,
                    d.offload_param, states)


def tp_shard_params(shape: ModelShape, tp: int) -> int:
    """Parameters of one rank's tensor-parallel replica: the attention and MLP projections of
    every layer split tp ways (Llama layout: q, k, v, o and gate, up, down), the rest whole."""
    attn = shape.hidden * shape.head_dim * (2 * shape.heads + 2 * shape.kv_heads)
    mlp = 3 * shape.hidden * shape.intermediate
    split = shape.layers * (attn + mlp)
    return shape.params - split + split // tp


def _forward_gather(rp: RolePlan) -> int:
    """A forward-only pass gathers 16-bit weights: 2 bytes per param of the largest layer."""
    return 2 * rp.shape.largest_layer_params if rp.zero_stage == 3 else 0


def compute_plan(cfg: Config, shapes: RoleShapes, cluster: Cluster) -> Plan:
    """Model states per role and the peak per GPU over generation, scoring and training."""
    # a critic-free estimator (ppo.advantage_estimator) builds no value model: no value role
    roles = {r: _role_plan(cfg, r, shapes.shapes[r], cluster) for r in ROLES
             if r != "value" or cfg.ppo.uses_critic}
    resident = sum(rp.states.resident_bytes for rp in roles.values())
    prompt, response = cfg.data.max_prompt_len, cfg.generation.max_new_tokens
    seq = prompt + response
    micro = cfg.ppo.micro_batch_size
    score_micro = cfg.ppo.score_micro_batch_size or micro
    # a rank's responses: its prompts x ppo.samples_per_prompt
    per_rank = max(1, math.ceil(cfg.ppo.rollout_batch_size * cfg.ppo.samples_per_prompt
                                / cluster.world_size))
    # a rank decodes at most its own responses at once (a tensor-parallel group: tp x that)
    gen_batch = min(cfg.generation.batch_size or per_rank, per_rank)
    pol = roles["policy"]
    ps = pol.shape
    phases: list[Phase] = []

    # generation: the policy decodes gen_batch prompts with a KV cache
    replica = 2 * ps.params
    # the engine's decision (generation_choice), on the free memory of this plan
    choice = choose_generation(
        cfg.generation, shapes.policy_config, cfg.generation.tp_size or cluster.gpus_per_node,
        replica_bytes=lambda n: 2 * tp_shard_params(ps, n),
        free_bytes=lambda: cluster.gpu_mem_bytes - resident - RUNTIME_OVERHEAD_BYTES,
        linears=ps.decoder_linears)
    mode, tp = choice.mode, choice.tp_size
    shard = 2 * tp_shard_params(ps, tp)
    gather = _forward_gather(pol)  # 0 unless ZeRO-3 partitions the policy
    batch, kv_share = gen_batch, 1
    if mode == "gathered":
        gen = {"16-bit policy replica": replica, "layer gather while copying": gather}
    elif mode == "tensor_parallel":  # the group decodes its ranks' prompts together
        batch = min(cfg.generation.batch_size or tp * gen_batch, tp * gen_batch)
        kv_share = tp
        gen = {f"16-bit policy replica shard (1/{tp} of each layer)": shard,
               "layer gather while copying": gather}
    else:
        gen = {"layer gather (ZeRO-3 hooks)": gather}
    gen_common = {
        "KV cache": kv_cache_bytes(ps, seq, batch) // kv_share,
        "prefill activations (one layer)": prefill_activation_bytes(
            ps, prompt, batch, cfg.policy.attn_implementation == "eager", kv_share),
        "fp32 logits of one step": batch * ps.vocab * 4,
    }
    phases.append(Phase(f"generation ({mode})", {**gen, **gen_common}))

    # scoring: one forward per model role over the rollout, score_micro sequences at a time
    for role in ("reference", "policy", "value", "reward"):
        rp = roles.get(role)
        if rp is None or rp.shape is None:
            continue
        tokens = min(seq, cfg.reward.max_len) if role == "reward" else seq
        eager = (cfg.policy.attn_implementation if role in ("policy", "reference")
                 else cfg.value.attn_implementation if role == "value"
                 else "sdpa") == "eager"
        t = {"layer gather": _forward_gather(rp),
             "activations (one layer)": layer_activation_bytes(rp.shape, tokens, score_micro,
                                                               eager)}
        if role in ("policy", "reference"):
            t["logits"] = logits_bytes(rp.shape, tokens, score_micro)
        phases.append(Phase(f"scoring: {role}", t))

    # training: forward + backward of one micro-batch of each trained role
    for role in (r for r in TRAINED_ROLES if r in roles):
        rp, section = roles[role], getattr(cfg, role)
        gather = rp.states.gather_bytes
        t = {"layer gather (weights + grads)": gather,
             "activations" + (" (checkpointed)" if section.gradient_checkpointing else ""):
                 train_activation_bytes(rp.shape, seq, micro, section.gradient_checkpointing,
                                        section.attn_implementation == "eager")}
        if role == "policy":
            t["logits"] = logits_bytes(rp.shape, seq, micro)
        phases.append(Phase(f"training: {role}", t))

    peak = max(phases, key=lambda p: p.total(resident))
    cpu = sum(rp.states.cpu_bytes_per_node for rp in roles.values())
    notes = list(shapes.notes)
    for role in roles:
        dtype = getattr(cfg, role).dtype if role in TRAINED_ROLES else cfg.policy.dtype
        if dtype == "fp32" and roles[role].shape is not None:
            notes.append(f"{role} dtype fp32: the plan assumes 16-bit weights and activations; "
                         "fp32 roughly doubles both")
            break
    if "value" not in roles:
        notes.append(f"ppo.advantage_estimator = {cfg.ppo.advantage_estimator}: critic-free, "
                     "no value model (no weights, gradients or optimizer state for it)")
    for role in (r for r in TRAINED_ROLES if r in roles):
        lora, shape = getattr(cfg, role).lora, roles[role].shape
        if lora is not None:
            n = lora_params(shape, lora)
            notes.append(f"{role}.lora r={lora.r} on {lora.target_modules}: {_params(n)} adapter "
                         f"params ({100 * n / shape.params:.2f}%) with grads and optimizer "
                         "state; the base is frozen 16-bit weights")
    if reference_from_policy_base(cfg):
        notes.append("reference: the policy's base with its adapters off (no reference role; "
                     "its scoring forward costs what the policy's does)")
    for role in (r for r in TRAINED_ROLES if r in roles):
        d = getattr(cfg.deepspeed, role)
        if d.offload_param and not d.offload_optimizer:
            notes.append(f"deepspeed.{role}: offload_param without offload_optimizer keeps the "
                         "optimizer state on the GPU")
    try:
        validate(cfg, cluster.world_size)
    except ConfigError as e:
        notes.append(f"the config does not validate for world size {cluster.world_size}: "
                     + str(e).replace("invalid config:\n  ", "").replace("\n  ", "; "))
    return Plan(
        cluster=cluster, roles=roles, seq_prompt=prompt, seq_response=response, micro_batch=micro,
        score_micro_batch=score_micro, gen_batch=gen_batch, generation_mode=mode,
        generation_loop=choice.loop, tp_size=tp, tp_unsupported=choice.tp_unsupported,
        resident_bytes=resident, phases=phases, peak_gpu_bytes=peak.total(resident),
        peak_phase=peak.name, cpu_bytes_per_node=cpu,
        fits_gpu=peak.total(resident) <= cluster.gpu_mem_bytes,
        fits_cpu=None if cluster.cpu_mem_bytes is None else cpu <= cluster.cpu_mem_bytes,
        notes=notes)


# ------------------------------------------------------------------------------- levers
def candidate_levers(cfg: Config, plan: Plan) -> list[Lever]:
    """Config changes that lower the GPU peak, each as the overrides that make it."""
    levers = []
    for role in plan.roles:
        rp, d = plan.roles[role], getattr(cfg.deepspeed, role)
        if rp.shape is None:
            continue
        if rp.zero_stage < 3:
            levers.append(Lever(f"ZeRO-3 for the {role}", (f"deepspeed.{role}.zero_stage=3",)))
        elif rp.trained and not d.offload_optimizer:
            levers.append(Lever(f"offload the {role}'s optimizer to CPU",
                                (f"deepspeed.{role}.offload_optimizer=true",)))
        elif not d.offload_param:
            levers.append(Lever(f"offload the {role}'s parameters to CPU",
                                (f"deepspeed.{role}.offload_param=true",)))
        if rp.trained and not getattr(cfg, role).gradient_checkpointing:
            levers.append(Lever(f"gradient checkpointing for the {role}",
                                (f"{role}.gradient_checkpointing=true",)))
    if plan.generation_mode == "gathered" and plan.tp_unsupported is None:
        levers.append(Lever("split the generation replica over the GPUs of a node",
                            ("generation.mode=tensor_parallel",)))
    if plan.generation_mode in ("gathered", "tensor_parallel"):
        levers.append(Lever("generate through ZeRO-3 layer gathering instead of a replica",
                            ("generation.mode=zero3",)))
    if plan.micro_batch > 1:
        levers.append(Lever("halve the training micro batch",
                            (f"ppo.micro_batch_size={plan.micro_batch // 2}",)))
    if plan.score_micro_batch > 1:
        levers.append(Lever("halve the scoring micro batch",
                            (f"ppo.score_micro_batch_size={plan.score_micro_batch // 2}",)))
    # prompts per decoding call: a rank's own, or a tensor-parallel group's together
    group = ((cfg.generation.tp_size or plan.cluster.gpus_per_node)
             if plan.generation_mode == "tensor_parallel" else 1)
    decode_batch = min(cfg.generation.batch_size or group * plan.gen_batch,
                       group * plan.gen_batch)
    if decode_batch > 1:
        levers.append(Lever("halve the generation batch",
                            (f"generation.batch_size={decode_batch // 2}",)))
    return levers


def _with_overrides(cfg: Config, overrides: tuple[str, ...]) -> Config | None:
    try:
        return Config.model_validate(apply_overrides(cfg.to_dict(), list(overrides)))
    except (ConfigError, ValidationError):  # a lever that makes the config invalid is none
        return None


def _excess(plan: Plan) -> int:
    """How far a plan is from fitting: bytes over the GPU and CPU budgets."""
    c = plan.cluster
    over = max(0, plan.peak_gpu_bytes - c.gpu_mem_bytes)
    if c.cpu_mem_bytes is not None:
        over += max(0, plan.cpu_bytes_per_node - c.cpu_mem_bytes)
    return over


def find_levers(cfg: Config, shapes: RoleShapes, cluster: Cluster, plan: Plan,
                max_steps: int = 12) -> list[LeverEffect]:
    """Greedy: apply the lever that brings the plan closest to fitting, until it fits or no
    lever helps. The first entry is the biggest single lever."""
    steps: list[LeverEffect] = []
    current, current_plan = cfg, plan
    for _ in range(max_steps):
        if current_plan.fits:
            break
        best = None
        for lever in candidate_levers(current, current_plan):
            changed = _with_overrides(current, lever.overrides)
            if changed is None:
                continue
            after = compute_plan(changed, shapes, cluster)
            gain = _excess(current_plan) - _excess(after)
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, lever, changed, after)
        if best is None:
            break
        _, lever, current, after = best
        steps.append(LeverEffect(lever, current_plan.peak_gpu_bytes - after.peak_gpu_bytes,
                                 after.peak_gpu_bytes, after.cpu_bytes_per_node, after.fits))
        current_plan = after
    return steps


def min_nodes_that_fit(cfg: Config, shapes: RoleShapes, cluster: Cluster,
                       limit: int = 1024) -> int | None:
    """Smallest node count (same GPUs per node) at which the config fits as it is and its
    batch sizes divide the world size (config.validate), so the advice can be followed."""
    for nodes in range(cluster.nodes + 1, limit + 1):
        try:
            validate(cfg, nodes * cluster.gpus_per_node)
        except ConfigError:
            continue
        if compute_plan(cfg, shapes, replace(cluster, nodes=nodes)).fits:
            return nodes
    return None


def plan(cfg: Config, cluster: Cluster, shapes: RoleShapes | None = None) -> Plan:
    """The full plan: numbers, verdict, and when it does not fit, the levers."""
    shapes = shapes or resolve_shapes(cfg)
    result = compute_plan(cfg, shapes, cluster)
    if result.fits:
        return result
    steps = find_levers(cfg, shapes, cluster, result)
    notes = result.notes
    if result.tp_unsupported and result.tp_size > 1:  # why the lever list lacks it
        notes = notes + [f"generation.mode=tensor_parallel (tp_size {result.tp_size}) is no "
                         f"option for this policy: {result.tp_unsupported}"]
    return replace(result, biggest_lever=steps[0] if steps else None, lever_path=steps,
                   min_nodes=min_nodes_that_fit(cfg, shapes, cluster), notes=notes)


# ------------------------------------------------------------------------------ output
def to_json(p: Plan) -> dict[str, Any]:
    def lever(e: LeverEffect) -> dict[str, Any]:
        return {"description": e.lever.description, "overrides": list(e.lever.overrides),
                "saves_bytes": e.saves_bytes, "peak_after_bytes": e.peak_after_bytes,
                "cpu_after_bytes": e.cpu_after_bytes, "fits_after": e.fits_after}

    roles = {}
    for name, rp in p.roles.items():
        s = rp.shape
        roles[name] = {
            "model": s.model_class if s else None, "shape_source": s.source if s else None,
            "params": s.params if s else 0,
            "largest_layer_params": s.largest_layer_params if s else 0,
            "trained": rp.trained, "zero_stage": rp.zero_stage,
            "offload_optimizer": rp.offload_optimizer, "offload_param": rp.offload_param,
            "gpu_bytes_per_rank": rp.states.gpu_bytes_per_rank,
            "gpu_resident_bytes_per_rank": rp.states.resident_bytes,
            "gather_bytes": rp.states.gather_bytes,
            "cpu_bytes_per_node": rp.states.cpu_bytes_per_node,
        }
    c = p.cluster
    return {
        "world_size": c.world_size, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
        "gpu_mem_bytes": c.gpu_mem_bytes, "cpu_mem_bytes": c.cpu_mem_bytes,
        "tokens": {"prompt": p.seq_prompt, "response": p.seq_response,
                   "total": p.seq_prompt + p.seq_response},
        "batch_per_rank": {"train_micro": p.micro_batch, "score_micro": p.score_micro_batch,
                           "generation": p.gen_batch},
        "generation_mode": p.generation_mode,
        "roles": roles,
        "resident_bytes_per_rank": p.resident_bytes,
        "runtime_overhead_bytes": RUNTIME_OVERHEAD_BYTES,
        "phases": [{"name": ph.name, "transient_bytes": ph.transient,
                    "total_bytes": ph.total(p.resident_bytes)} for ph in p.phases],
        "peak_gpu_bytes": p.peak_gpu_bytes, "peak_phase": p.peak_phase,
        "gpu_bytes_per_node": p.peak_gpu_bytes * c.gpus_per_node,
        "cpu_bytes_per_node": p.cpu_bytes_per_node,
        "fits_gpu": p.fits_gpu, "fits_cpu": p.fits_cpu, "fits": p.fits,
        "biggest_lever": lever(p.biggest_lever) if p.biggest_lever else None,
        "lever_path": [lever(e) for e in p.lever_path],
        "min_nodes": p.min_nodes,
        "notes": p.notes,
    }


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def format_plan(p: Plan, title: str) -> str:
    c = p.cluster
    out = [
        f"ds-ppo plan: {title} on {c.nodes} node(s) x {c.gpus_per_node} GPU(s) = world size "
        f"{c.world_size}, {c.gpu_mem_bytes / GiB:.1f} GiB per GPU",
        f"tokens: {p.seq_prompt} prompt + {p.seq_response} response = "
        f"{p.seq_prompt + p.seq_response}; per rank: training micro-batch {p.micro_batch}, "
        f"scoring micro-batch {p.score_micro_batch}, generation batch {p.gen_batch} (sequences)",
        "",
        "Model states (GiB; every rank holds the same: ZeRO data parallelism)",
        f"{'role':<10} {'model':<31} {'params':>9} {'ZeRO':>4}  {'offload':<10} "
        f"{'GPU/rank':>8} {'resident':>8} {'gather':>7} {'CPU/node':>9}  shape from",
    ]
    for name, rp in p.roles.items():
        s = rp.shape
        if s is None:
            what = "(policy base, adapters off)" if name == "reference" else \
                "(reward function, no model)"
            out.append(f"{name:<10} {what:<31}")
            continue
        off = "+".join(x for x, on in (("optimizer", rp.offload_optimizer),
                                       ("params", rp.offload_param)) if on) or "-"
        st = rp.states
        out.append(f"{name:<10} {s.model_class:<31} {_params(s.params):>9} {rp.zero_stage:>4}  "
                   f"{off:<10} {_gib(st.gpu_bytes_per_rank):>8} {_gib(st.resident_bytes):>8} "
                   f"{_gib(st.gather_bytes):>7} {_gib(st.cpu_bytes_per_node):>9}  {s.source}")
    out += [
        "",
        "Peak per GPU by phase (GiB) = resident states of all roles + runtime overhead + the "
        "phase's own",
        f"{'phase':<28} {'resident':>8} {'overhead':>8} {'phase':>7} {'total':>7}  phase terms",
    ]
    for ph in p.phases:
        own = sum(ph.transient.values())
        terms = ", ".join(f"{k} {_gib(v)}" for k, v in ph.transient.items() if v)
        mark = "  <- peak" if ph.name == p.peak_phase else ""
        out.append(f"{ph.name:<28} {_gib(p.resident_bytes):>8} "
                   f"{_gib(RUNTIME_OVERHEAD_BYTES):>8} {_gib(own):>7} "
                   f"{_gib(ph.total(p.resident_bytes)):>7}  {terms}{mark}")
    headroom = c.gpu_mem_bytes - p.peak_gpu_bytes
    verdict = "FITS" if p.fits else "DOES NOT FIT"
    out += ["", f"Verdict: {verdict}. Peak {_gib(p.peak_gpu_bytes)} GiB of "
                f"{c.gpu_mem_bytes / GiB:.1f} GiB per GPU ({p.peak_phase}), "
                + (f"{_gib(headroom)} GiB headroom." if headroom >= 0
                   else f"{_gib(-headroom)} GiB over.")]
    cpu = f"CPU {_gib(p.cpu_bytes_per_node)} GiB"
    if c.cpu_mem_bytes is None:
        cpu += " (not checked: pass --cpu-mem-gib)"
    else:
        cpu += f" of {c.cpu_mem_bytes / GiB:.1f} GiB" + ("" if p.fits_cpu else " -- DOES NOT FIT")
    out.append(f"Per node: GPU {c.gpus_per_node} x {_gib(p.peak_gpu_bytes)} = "
               f"{_gib(p.peak_gpu_bytes * c.gpus_per_node)} GiB; {cpu}.")
    if not p.fits:
        fits_word = "fits" if c.cpu_mem_bytes is not None else "fits the GPUs (CPU unchecked)"
        if p.biggest_lever:
            e = p.biggest_lever
            out.append(f"Biggest lever: {e.lever.description} ({' '.join(e.lever.overrides)}): "
                       f"saves {_gib(e.saves_bytes)} GiB per GPU -> peak "
                       f"{_gib(e.peak_after_bytes)} GiB per GPU, CPU {_gib(e.cpu_after_bytes)} GiB "
                       f"per node{'; then it ' + fits_word if e.fits_after else ''}.")
        else:
            out.append("No config lever lowers the peak.")
        if len(p.lever_path) > 1:
            last = p.lever_path[-1]
            out.append("Levers in order (greedy): "
                       + " ".join(o for e in p.lever_path for o in e.lever.overrides)
                       + f" -> peak {_gib(last.peak_after_bytes)} GiB per GPU, CPU "
                       + f"{_gib(last.cpu_after_bytes)} GiB per node; "
                       + (f"then it {fits_word}." if last.fits_after else "still does not fit."))
        if p.min_nodes:
            out.append(f"Or scale out: as configured it fits on {p.min_nodes} nodes of "
                       f"{c.gpus_per_node} GPUs (the fewest whose world size the ppo batch sizes "
                       "divide).")
    if p.notes:
        out += ["", "Notes:"] + [f"- {n}" for n in p.notes]
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    """`ds-ppo plan`: print the plan as a table, or one JSON object with --json."""
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise UserError(f"--nodes ({args.nodes}) and --gpus-per-node ({args.gpus_per_node}) "
                        "must be at least 1")
    if args.gpu_mem_gib <= 0:
        raise UserError(f"--gpu-mem-gib must be > 0 (got {args.gpu_mem_gib})")
    cfg = load_config(args.config, args.overrides)
    cpu = None if args.cpu_mem_gib is None else int(args.cpu_mem_gib * GiB)
    cluster = Cluster(args.nodes, args.gpus_per_node, int(args.gpu_mem_gib * GiB), cpu)
    result = plan(cfg, cluster)
    if args.json:
        print(json.dumps(to_json(result), indent=2))
    else:
        print(format_plan(result, str(args.config or "tiny")))
    return 0
