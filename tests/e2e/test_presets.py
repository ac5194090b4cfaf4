"""The GPU presets run as shipped, shrunk: each keeps every setting of its file (ZeRO stages,
dtype, gradient checkpointing, generation mode, estimator and its loss terms) but the model's
size, the batch sizes and the placeholders (a tiny tokenizer, examples/problems.jsonl, a reward
function for the reward model). The others: tiny (tests/e2e/test_train.py), calculator
(tests/e2e/test_envs.py), recipe (tests/e2e/test_recipe.py); the multi-node ones are checked at
their world size by tests/unit/test_config_sources.py and planned by tests/unit/test_plan.py."""
from __future__ import annotations

import pytest

from conftest import REPO, read_metrics, run_cli

TINY_SHAPE = ["policy.arch.hidden_size=64", "policy.arch.intermediate_size=128",
              "policy.arch.num_hidden_layers=2", "policy.arch.num_attention_heads=4",
              "policy.arch.num_key_value_heads=2", "policy.arch.vocab_size=512",
              "policy.arch.max_position_embeddings=128", "policy.tokenizer=builtin:tiny",
              f"data.path={REPO / 'examples' / 'problems.jsonl'}", "data.max_prompt_len=16",
              "generation.max_new_tokens=8", "iterations=2", "tracking.enabled=false",
              "checkpoint.export_at_end=false"]
SMALL_BATCHES = {
    "1b": ["reward.function=ds_ppo.rewards:positive_words", "ppo.rollout_batch_size=8",
           "ppo.mini_batch_size=8", "ppo.micro_batch_size=4", "ppo.score_micro_batch_size=4",
           "generation.batch_size=8"],
    "8b": ["reward.function=ds_ppo.rewards:positive_words", "ppo.rollout_batch_size=8",
           "ppo.mini_batch_size=8", "ppo.micro_batch_size=4", "ppo.score_micro_batch_size=4",
           "generation.batch_size=8"],
    "grpo": ["data.eval_split=null", "ppo.rollout_batch_size=2", "ppo.mini_batch_size=16",
             "ppo.micro_batch_size=4", "ppo.score_micro_batch_size=4",
             "generation.batch_size=16"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMALL_BATCHES))
def test_a_gpu_preset_trains_shrunk(name, tmp_path):
    run_cli(["train", "--config", name, f"output_dir={tmp_path / 'out'}", *TINY_SHAPE,
             *SMALL_BATCHES[name]], cwd=tmp_path)
    rows = read_metrics(tmp_path / "out")
    assert [r["iteration"] for r in rows] == [1, 2]
    assert all(r["loss/policy"] == r["loss/policy"] for r in rows)  # finite, not NaN
    if name == "grpo":
        assert "loss/value" not in rows[0] and "loss/kl" in rows[0]  # critic-free, KL as a loss
