"""`ds-ppo bench --peer trl` at a very small size: TRL's GRPOTrainer and ds_ppo from the same
prepared starting point, one table with per-phase seconds, sequences/s, scores and ratios (the
checks of its run, check_peer_run, run on launch/bench_gpu.sh's peer step in test_bench.py).
Needs trl (the `[peer]` extra, installed by .ci/run); no absolute times are asserted. Plus the
table's arithmetic on made-up numbers and the CLI's hand-off to the peer bench."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import clean_env
from ds_ppo.bench.peer import PHASES, _summary, pair_ratios, table
from ds_ppo.errors import UserError

try:
    import trl  # noqa: F401
    HAVE_TRL = True
except ImportError:
    HAVE_TRL = False


def test_summary_and_ratios():
    steps = [{"score": 0.1 * i, "seconds": 10.0 if i == 0 else 2.0, "sequences": 8,
              "generation_s": 0.5, "scoring_s": 0.5, "update_s": 1.0} for i in range(7)]
    trl_row = _summary("TRL x", steps, "seconds", 30.0, 4)
    assert trl_row["s_per_iter"] == 2.0  # the first (warm-up) iteration is left out
    assert trl_row["seq_per_s"] == 4.0
    assert trl_row["score_first5"] == pytest.approx(0.2)
    assert trl_row["score_last5"] == pytest.approx(0.4)
    ours = dict(trl_row, label="ds_ppo y", s_per_iter=3.0, seq_per_s=2.0)
    lines = table([trl_row, ours]).splitlines()
    assert lines[2].split("|")[10:12] == [" 1.00x ", " 1.00x "]
    assert lines[3].split("|")[10:12] == [" 1.50x ", " 0.50x "]


def test_pairs_take_their_ratio_to_their_own_trl_run():
    """--pairs: each ds_ppo run is divided by the TRL run of its pair, not by the first one."""
    steps = [{"score": 0.5, "seconds": 2.0, "sequences": 8, "generation_s": 0.5,
              "scoring_s": 0.5, "update_s": 1.0} for _ in range(3)]
    base = _summary("TRL x", steps, "seconds", 30.0, 4)
    results = [dict(base, pair=0), dict(base, label="ds_ppo GRPO", s_per_iter=1.0, pair=0),
               dict(base, s_per_iter=4.0, pair=1),
               dict(base, label="ds_ppo GRPO", s_per_iter=1.0, pair=1)]
    assert pair_ratios(results) == {"ds_ppo GRPO": [0.5, 0.25]}
    lines = table(results).splitlines()
    assert "(pair 2)" in lines[5] and lines[5].split("|")[10] == " 0.25x "


def test_grpo_rollout_run_is_grpo_without_the_scoring_forward(monkeypatch, tmp_path):
    """--runs grpo,grpo-rollout: the second is the first plus ppo.old_logprobs=rollout."""
    from ds_ppo.bench import peer

    calls = []
    monkeypatch.setattr(peer, "run_dsppo", lambda name, label, overrides, out, meta:
                        calls.append((name, overrides)) or {"label": label})
    out = peer._run_pair(["grpo", "grpo-rollout"], tmp_path, tmp_path, {}, 4,
                         ["generation.max_new_tokens=6"], 1, [])
    (n1, grpo), (n2, rollout) = calls
    assert (n1, n2) == ("dsppo_grpo_2", "dsppo_grpo_rollout_2")
    assert "ppo.advantage_estimator=grpo" in grpo and rollout == grpo + ["ppo.old_logprobs=rollout"]
    assert [r["pair"] for r in out] == [1, 1]


@pytest.mark.skipif(not HAVE_TRL, reason="trl is not installed")
def test_trl_mirrors_the_policys_gradient_checkpointing(tmp_path):
    """TRL's GRPOConfig turns gradient checkpointing on by default (a recomputed forward in every
    backward); the peer run takes ds_ppo's policy.gradient_checkpointing instead, and its
    schedule: 2 epochs x (128 / 64) optimizer steps of 2 x 32 sequences."""
    from ds_ppo.bench.peer_trl import _config, _parse

    args = _parse(["--shared", str(tmp_path), "--out", str(tmp_path / "o.jsonl")])
    meta = {"mini_batch_size": 16, "micro_batch_size": 8, "ppo_epochs": 2, "max_new_tokens": 8,
            "temperature": 1.0, "top_p": 1.0, "top_k": 0, "pad_token_id": 0, "lr": 1e-3,
            "grad_clip": 1.0, "kl_coef": 0.02, "seed": 1}
    for on in (False, True):
        config, opt_per_step = _config(args, dict(meta, gradient_checkpointing=on), 3, 128)
        assert config.gradient_checkpointing is on
        assert opt_per_step == 4 and config.max_steps == 12
        assert (config.per_device_train_batch_size, config.gradient_accumulation_steps) == (32, 2)


# The peer bench at a very small size. Its one run in the suite is the `peer` step of
# launch/bench_gpu.sh (tests/e2e/test_bench.py, with these flags), which checks it with
# check_peer_run: a second run here would only repeat it.
PEER_TINY = ["--iterations", "2", "ppo.rollout_batch_size=4", "ppo.mini_batch_size=4",
             "ppo.micro_batch_size=4", "generation.max_new_tokens=6"]


def check_peer_run(out, results: list[dict], printed: str) -> None:
    """`ds-ppo bench --peer trl --runs trl,ppo PEER_TINY --out-dir OUT`: its JSON results and
    what it printed."""
    trl_row, ours = results
    assert trl_row["label"].startswith("TRL") and ours["label"].startswith("ds_ppo PPO")
    assert trl_row["sequences"] == 4 * 4 and ours["sequences"] == 4  # G=4 vs one per prompt
    for r in results:
        assert r["iterations"] == 2 and r["optimizer_steps"] == 2  # 2 epochs x 1 mini-batch
        assert all(r[p] >= 0 for p in PHASES) and r["s_per_iter"] > 0
        assert r["s_per_iter"] >= r["generation_s"] + r["scoring_s"] - 1e-9
        assert 0.0 <= r["score_first5"] <= 1.0 and 0.0 <= r["score_last5"] <= 1.0
    # the table printed both rows with their ratios to TRL
    rows = [line for line in printed.splitlines() if line.startswith("| ")]
    assert len(rows) == 3 and "s/iter vs TRL" in rows[0]
    ratio = ours["s_per_iter"] / trl_row["s_per_iter"]
    assert f"{ratio:.2f}x" in rows[2]
    # both sides started from the prepared weights (ds_ppo checks its own copy byte for byte)
    meta = json.loads((out / "shared" / "meta.json").read_text())
    assert meta["policy_sha256"] and meta["reward"] == "ds_ppo.rewards:positive_words"


def _pretrained_dir(tmp_path):
    """A tiny Llama and its tokenizer written with save_pretrained, as a downloaded model is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ds_ppo.data.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin:tiny", tmp_path / "cache")
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    d = tmp_path / "pretrained"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_peer_starting_point_from_policy_path(tmp_path):
    """policy.path=DIR: no random init; both sides load DIR (its weights hashed, so each ds_ppo
    run is checked against them) and TRL the tokenizer as ds_ppo loads it."""
    from ds_ppo.bench.peer import _weights_hash, prepare

    d = _pretrained_dir(tmp_path)
    meta = prepare(tmp_path / "shared", [f"policy.path={d}", "iterations=2"])
    assert meta["from_path"] and meta["policy"] == str(d.resolve())
    assert meta["policy_sha256"] == _weights_hash(d)
    assert not (tmp_path / "shared" / "policy").exists()
    assert (tmp_path / "shared" / "tokenizer" / "tokenizer_config.json").exists()
    (d / "model.safetensors").rename(d / "weights.bin")
    with pytest.raises(UserError, match="must be a local directory with safetensors"):
        prepare(tmp_path / "shared2", [f"policy.path={d}"])


@pytest.mark.skipif(not HAVE_TRL, reason="trl is not installed")
def test_peer_bench_runs_from_a_pretrained_directory(tmp_path):
    d = _pretrained_dir(tmp_path)
    cmd = [sys.executable, "-m", "ds_ppo", "bench", "--peer", "trl", "--runs", "trl,ppo",
           "--iterations", "2", "--out-dir", str(tmp_path / "bench"), "--json",
           str(tmp_path / "r.json"), f"policy.path={d}", "ppo.rollout_batch_size=4",
           "ppo.mini_batch_size=4", "ppo.micro_batch_size=4", "generation.max_new_tokens=6"]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trl_row, ours = json.loads((tmp_path / "r.json").read_text())["results"]
    assert trl_row["iterations"] == ours["iterations"] == 2


def test_bench_help_lists_every_mode():
    proc = subprocess.run([sys.executable, "-m", "ds_ppo", "bench", "--help"], env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for mode in ("--peer trl", "--schedule", "--summarize", "ds_ppo.bench.decode"):
        assert mode in proc.stdout, mode


def test_ds_ppo_bench_peer_hands_its_arguments_to_the_peer_bench(monkeypatch):
    """`ds-ppo bench --peer trl ARGS` is the peer bench's main with ARGS (which the bench_gpu.sh
    step runs as `python -m ds_ppo.bench.peer`)."""
    from ds_ppo import cli
    from ds_ppo.bench import peer

    seen = []
    monkeypatch.setattr(peer, "main", lambda argv: seen.append(argv) or 0)
    args = ["--peer", "trl", "--runs", "trl,ppo", *PEER_TINY]
    assert cli.main(["bench", *args]) == 0
    assert seen == [args]
