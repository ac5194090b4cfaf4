"""Which models `generation.mode: tensor_parallel` can split over a group of ranks, read from a
Hugging Face config alone (no torch): the engine's replica (engine/generation/tensor_parallel.py),
`ds-ppo plan` and `--dry-run` apply the same rule."""
from __future__ import annotations

from collections.abc import Collection

# tensor_parallel (engine/generation/tensor_parallel.py) splits these linear layers of every
# decoder layer:
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output features split
ROW = ("o_proj", "down_proj")  # input features split, partial outputs summed
KV = ("k_proj", "v_proj")  # of COLUMN: with fewer KV heads than ranks, one KV head per rank
EXPERTS = ("gate_up_proj", "down_proj")  # a MoE layer's fused experts: split by expert
# Families whose sharded replica was checked to decode exactly as the whole one (two gloo ranks,
# float32). Others may hold layers that mix heads (e.g. OLMo-2 normalises q over all heads)
# and would silently compute something else.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "granite", "qwen3_moe", "mixtral")


def unshardable(config, size: int, linears: Collection[str] | None = None) -> str | None:
    """Why a model with this HF config (and, when given, these `decoder_linears`) cannot be
    split over `size` ranks, or None. The model must be Llama-shaped: every linear layer inside
    the decoder layers is one of COLUMN + ROW (fused qkv_proj / gate_up_proj linears are not
    split), the heads and the dense MLP width divide by `size`, the KV heads divide by it or it
    by them (then each rank holds one KV head), and a mixture-of-experts model's experts per
    layer (fused EXPERTS tensors, split by expert) divide by it."""
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return (f"model_type {model_type!r} is not one tensor_parallel has been checked on "
                f"({', '.join(MODEL_TYPES)})")
    others = sorted(set(linears or ()) - set(COLUMN + ROW))
    if others:
        return (f"linear layers {others[:4]} in the decoder layers (tensor_parallel splits "
                f"only {', '.join(COLUMN + ROW)})")
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    width = getattr(config, "intermediate_size", None)
    experts = (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
               if model_type in ("qwen3_moe", "mixtral") else None)
    dense = not experts or _dense_mlp_layers(config)  # the MLP width is split
    if heads is None or (dense and width is None):
        return f"{type(config).__name__} has no num_attention_heads / intermediate_size"
    split = [("num_attention_heads", heads)]
    if dense:
        split.append(("intermediate_size", width))
    if experts:
        split.append(("num_experts" if model_type == "qwen3_moe" else "num_local_experts",
                      experts))
    bad = [f"{name}={n}" for name, n in split if n % size]
    if kv_heads % size and size % kv_heads:
        bad.append(f"num_key_value_heads={kv_heads} (nor tp_size a multiple of it)")
    if bad:
        return f"{', '.join(bad)} not divisible by tp_size={size}"
    return None


def _dense_mlp_layers(config) -> bool:
    """Whether a Qwen3-MoE config has dense MLP layers beside its MoE ones (`mlp_only_layers`,
    or decoder_sparse_step > 1); Mixtral has none."""
    return (getattr(config, "model_type", None) == "qwen3_moe"
            and (bool(getattr(config, "mlp_only_layers", None))
                 or (getattr(config, "decoder_sparse_step", 1) or 1) > 1))
