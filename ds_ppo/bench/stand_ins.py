"""Stand-ins that run the PPO stages on one process without DeepSpeed: `OneProcessEngine` in
place of a DeepSpeedEngine, tiny random-weight models (`small_llama`, `small_moe`: seed 0, eval
mode), and (forced_lengths.py) a causal LM whose response lengths are set in advance. The tests
and the maintainers' measurement scripts in tools/ use them."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


class OneProcessEngine(torch.nn.Module):
    """Stands in for a DeepSpeedEngine on one process (wrap it in an engine/role_objects role), to
    run and measure the PPO stages without DeepSpeed (the tests and tools/ do):
    backward accumulates the gradient (the optimizer never steps, so a whole update's gradient
    can be compared), the boundaries the update places are recorded, forwards are counted."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.calls, self.boundaries = 0, []

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.module(*args, **kwargs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        pass

    def set_gradient_accumulation_boundary(self, boundary):
        self.boundaries.append(boundary)

    def get_global_grad_norm(self):
        return None


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
