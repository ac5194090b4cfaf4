"""A Hugging Face reward model as the reward role: the value model starts from its weights when
the tokenizers agree (as DeepSpeed-Chat does), and responses are re-encoded when they differ."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clean_env, read_metrics, run_cli

pytestmark = pytest.mark.slow

SMALL = ["tracking.enabled=false", "ppo.rollout_batch_size=8", "ppo.mini_batch_size=8",
         "ppo.micro_batch_size=4", "generation.max_new_tokens=6", "checkpoint.every=0",
         "checkpoint.save_at_end=false", "checkpoint.export_at_end=false", "iterations=2",
         "reward.function=null"]


def _make_reward_model(out: Path, tokenizer_spec: str, cache: Path) -> None:
    """A tiny random LlamaForSequenceClassification (1 label) with the given tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from ds_ppo.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_spec, cache)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      num_labels=1, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(7)
    model = LlamaForSequenceClassification(cfg)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # scores that vary with the input
    model.save_pretrained(out)
    tok.save_pretrained(out)


CHECK = """
import json, sys, torch, deepspeed
from pathlib import Path
from ds_ppo.config import load_config
from ds_ppo.engine.dist import init_distributed
from ds_ppo.ppo.train_job import ppo_engines
from ds_ppo.data.tokenizer import load_tokenizer
cfg = load_config(None, sys.argv[1:])
dev = init_distributed()
tok = load_tokenizer("builtin:tiny", Path(cfg.output_dir))
eng = ppo_engines(cfg, tok, dev)
def full(p):
    with deepspeed.zero.GatheredParameters([p]):
        return p.detach().clone()
rm = eng.reward.module.model  # the HF model inside forward.LastTokenScorer
same = torch.equal(full(eng.value.module.score.weight), full(rm.score.weight))
emb = torch.equal(full(eng.value.module.model.embed_tokens.weight),
                  full(rm.model.embed_tokens.weight))
# scoring runs through the engine's forward: ZeRO-3's coordinator completes its fetch trace
# (through attribute forwarding it stayed INVALID for good, its step counter never reset)
coordinator = eng.reward.engine.optimizer.get_param_coordinator()
ids = torch.randint(3, 50, (2, 7))
with torch.no_grad():
    scores = [eng.reward.scores(ids, torch.ones_like(ids)) for _ in range(3)]
print(json.dumps({"head_from_reward": same, "backbone_from_reward": emb,
                  "trace_complete": coordinator.is_complete_trace(),
                  "same_scores": all(torch.equal(scores[0], s) for s in scores)}))
"""


def test_value_model_starts_from_reward_model(tmp_path):
    rm = tmp_path / "rm"
    _make_reward_model(rm, "builtin:tiny", tmp_path)
    args = SMALL + [f"reward.model={rm}", f"output_dir={tmp_path / 'out'}",
                    # the ZeRO-3 fetch trace is the point (the tiny preset's auto is 0 on one rank)
                    "deepspeed.reward.zero_stage=3", "deepspeed.value.zero_stage=3"]
    proc = subprocess.run([sys.executable, "-c", CHECK, *args], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res == {"head_from_reward": True, "backbone_from_reward": True,
                   "trace_complete": True, "same_scores": True}
    # prompts of up to 16 tokens + 6 response tokens: a reward.max_len of 12 cuts some inputs,
    # which is counted and reported, never silent
    proc = run_cli(["train", *args, "reward.max_len=12"], cwd=tmp_path)
    rows = read_metrics(tmp_path / "out")
    assert len(rows) == 2 and all(r["score/std"] > 0 for r in rows)  # real per-response scores
    assert all(0 < r["reward/input_cut_rate"] <= 1 for r in rows)
    assert proc.stdout.count("longer than reward.max_len = 12") == 1


def test_reward_model_with_another_tokenizer_reencodes(tmp_path):
    from ds_ppo.data.tokenizer import tiny_corpus_path, train_tokenizer

    other = train_tokenizer(tiny_corpus_path(), 300, tmp_path / "other_tok", model_type="unigram")
    rm = tmp_path / "rm"
    _make_reward_model(rm, str(other), tmp_path)
    proc = run_cli(["train", *SMALL, f"reward.model={rm}", f"output_dir={tmp_path / 'out'}",
                    "policy.gradient_checkpointing=true", "value.gradient_checkpointing=true"],
                   cwd=tmp_path)
    assert "decoded and re-encoded" in proc.stdout
    rows = read_metrics(tmp_path / "out")
    assert len(rows) == 2 and all(r["score/std"] > 0 for r in rows)
    assert all(r["reward/input_cut_rate"] == 0 for r in rows)  # reward.max_len 1024
    # the value model fell back to the policy's backbone (it reads policy token ids)
    assert f"value model starts from {tmp_path / 'out' / 'init_models' / 'policy'}" in proc.stdout
