"""The tiny models of the in-process stage tests (random weights, seed 0, eval mode)."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def small_llama(cls=LlamaForCausalLM, seed: int = 0, **kw):
    """A one-layer Llama (hidden size 16, 2 attention heads, 1 KV head) over a 50-token
    vocabulary, as `cls` (a causal LM, or a sequence/token classifier with `num_labels`);
    `kw`: other LlamaConfig fields (a tokenizer's vocab_size and pad_token_id, other sizes)."""
    torch.manual_seed(seed)
    sizes = dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1)
    return cls(LlamaConfig(**{**sizes, **kw})).eval()


def small_moe(model_type: str = "qwen3_moe", cls=None, seed: int = 0, **kw):
    """A two-layer mixture-of-experts causal LM (4 experts, top-2; hidden size 16) over a
    50-token vocabulary: `qwen3_moe` or `mixtral`, as `cls` (default AutoModelForCausalLM)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    sizes = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8, num_experts_per_tok=2,
                 intermediate_size=32, max_position_embeddings=64)
    if model_type == "qwen3_moe":
        sizes.update(num_experts=4, moe_intermediate_size=16)
    else:
        sizes.update(num_local_experts=4)
    config = AutoConfig.for_model(model_type, **{**sizes, **kw})
    return (cls or AutoModelForCausalLM).from_config(config).eval()
