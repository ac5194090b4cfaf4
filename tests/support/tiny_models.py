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
