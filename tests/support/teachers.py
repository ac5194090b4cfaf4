"""Tiny distillation teachers (no download): a Llama of the tiny default's shape whose next-token
distribution is the same after any context, preferring a few chosen tokens (a "unigram
teacher"), saved with the student's tokenizer."""
from __future__ import annotations

from pathlib import Path

import torch

TINY_ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                 tie_word_embeddings=False)
POSITIVE = "good happy love great kind nice fun joy sun smile"


def unigram_teacher(out: Path, tokenizer, preferred: list[int], logit: float = 4.0) -> Path:
    """Save under `out` a causal LM (the tiny default's shape, `tokenizer`'s vocabulary) that
    gives every `preferred` token the logit `logit` and every other token 0, after any context:
    the layers add nothing (their output projections are 0) and every token embeds to one
    vector, so the final hidden state is that vector's norm after any prefix."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **TINY_ARCH)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        v = torch.ones(config.hidden_size)
        model.model.embed_tokens.weight.copy_(v.expand_as(model.model.embed_tokens.weight))
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros_like(model.lm_head.weight)
        head[preferred] = logit / config.hidden_size  # RMSNorm(ones) = ones: logit = sum
        model.lm_head.weight.copy_(head)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def positive_token_ids(tokenizer) -> list[int]:
    """The ids of the pieces of a few positive words (the tiny default's reward counts them)."""
    ids = tokenizer(POSITIVE, add_special_tokens=False)["input_ids"]
    return sorted(set(ids) - set(tokenizer.all_special_ids))
