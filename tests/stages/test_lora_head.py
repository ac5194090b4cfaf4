"""policy.lora.output_head auto on a model loaded from a path: a saved head that still looks
freshly initialised (std = initializer_range, rows of equal norm) is adapted as a random-init
policy.arch's is; a trained-looking or tied head is not."""
from __future__ import annotations

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from ds_ppo.config import LoraConfig
from ds_ppo.engine.lora import adapts_output_head, head_looks_random_init


def _saved(tmp_path, name: str, tied: bool = False, rows_scale: float = 0.0,
           hidden: int = 64) -> tuple[LlamaForCausalLM, str]:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
                      tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # rows of unequal norm, as frequent and rare tokens' rows become
        model.lm_head.weight.mul_(torch.exp(rows_scale * torch.randn(cfg.vocab_size, 1)))
    (tmp_path / name).mkdir()  # the head is all the check reads (model.save_pretrained is slow)
    save_file({"lm_head.weight": model.get_output_embeddings().weight.detach().contiguous()},
              str(tmp_path / name / "model.safetensors"))
    return model, str(tmp_path / name)


def test_auto_adapts_a_random_init_head_loaded_from_a_path(tmp_path):
    auto = LoraConfig(r=8)
    for hidden in (64, 256):
        model, path = _saved(tmp_path, f"random{hidden}", hidden=hidden)
        assert head_looks_random_init(tmp_path / f"random{hidden}", "lm_head.weight",
                                      model.config)
        assert adapts_output_head(auto, False, model, path)
    model, path = _saved(tmp_path, "trained", rows_scale=0.3)
    assert not adapts_output_head(auto, False, model, path)
    model, path = _saved(tmp_path, "tied", tied=True)
    assert not adapts_output_head(auto, False, model, path)
    model, path = _saved(tmp_path, "random")
    assert not adapts_output_head(LoraConfig(r=8, output_head=False), False, model, path)
    assert adapts_output_head(auto, True, model, None)  # policy.arch: random by construction
