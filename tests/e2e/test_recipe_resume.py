"""The RLHF recipe's extras in a real run (`ds-ppo train` in fresh processes): a critic warm-up,
the policy's EMA and PPO-ptx together. During the warm-up the policy's weights stay the initial
ones while the value model's change; the iterations count; a resume inside the warm-up and one
after it (the EMA then differs from the weights) continue exactly: metrics bit-identical to the
uninterrupted run's, EMA distance included."""
from __future__ import annotations

import json
import re
import shutil

import pytest
from safetensors.torch import load_file

from conftest import REPO, SMALL, read_metrics, run_cli

VOLATILE = ("time/", "tokens_per_s/", "memory/")
WARMUP = 2


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def _args(out, ptx, iterations: int = 4) -> list[str]:
    return ["train", *SMALL, f"iterations={iterations}", "checkpoint.every=1", "checkpoint.keep_last=4",
            f"ppo.critic_warmup_iterations={WARMUP}", "policy.ema_decay=0.8",
            "ppo.ptx_coef=0.2", f"data.ptx_path={ptx}", f"output_dir={out}",
            "checkpoint.export_at_end=true"]


def _rewound(full, target, iteration: int):
    """A copy of the full run's output_dir as if it had stopped after `iteration`."""
    shutil.copytree(full, target)
    ckpts = target / "checkpoints"
    for later in range(iteration + 1, 5):
        shutil.rmtree(ckpts / f"iter_{later:06d}")
    (ckpts / "latest").write_text(f"iter_{iteration:06d}")
    return target


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("recipe")
    ptx = work / "ptx.jsonl"
    ptx.write_text("".join(json.dumps({"text": t}) + "\n" for t in (
        "the cat sat on the mat", "a good day for a walk", "we love the sea and the sun",
        "my aunt is happy today", "the dog runs in the park", "i like warm bread")))
    full = work / "full"
    run_cli(_args(full, ptx), cwd=work)
    return work, full, ptx


def test_critic_warmup_leaves_the_policy_and_trains_the_value(full_run):
    _, full, _ = full_run
    rows = read_metrics(full)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]  # warm-up iterations count
    assert [r["value/warmup"] for r in rows] == [1.0, 1.0, 0.0, 0.0]
    assert ["loss/policy" in r or "loss/ptx" in r for r in rows] == [False, False, True, True]
    assert all(r["loss/ptx"] > 0 for r in rows[WARMUP:])
    documented = set(re.findall(r"`([a-z_]+/[a-z0-9_]+|kl_coef)`",
                                (REPO / "docs" / "METRICS.md").read_text()))
    assert set(rows[-1]) - {"iteration"} <= documented, set(rows[-1]) - documented
    # the EMA equals the weights until the policy's first step, then lags behind them
    assert [r["ema/distance"] > 0 for r in rows] == [False, False, True, True]
    init = load_file(full / "init_models" / "policy" / "model.safetensors")

    def weights(it, sub="hf"):
        return load_file(full / "checkpoints" / f"iter_{it:06d}" / sub / "model.safetensors")

    for it in range(1, WARMUP + 1):
        assert all((weights(it)[k] == init[k]).all() for k in init), it  # policy untouched
    assert any(not (weights(WARMUP + 1)[k] == init[k]).all() for k in init)
    value1, value2 = weights(1, "hf_value"), weights(2, "hf_value")
    assert any(not (value1[k] == value2[k]).all() for k in value1)  # the value model trains
    # the EMA's export beside the policy's: a plain HF model, not the trained weights
    from transformers import AutoModelForCausalLM

    final, ema = (load_file(full / d / "model.safetensors") for d in ("final", "final_ema"))
    assert final.keys() == ema.keys() and any(not (final[k] == ema[k]).all() for k in final)
    AutoModelForCausalLM.from_pretrained(full / "final_ema")


@pytest.mark.parametrize("at", [1, 3])
def test_resume_inside_the_warmup_and_with_an_ema_continues_exactly(full_run, at):
    """Resumed from iteration 1 (inside the warm-up; run to iteration 3: the warm-up's end and
    the policy's first step) and from iteration 3 (the EMA restored from the checkpoint, where
    it no longer equals the weights). The LR schedule is constant: `iterations` changes
    nothing else."""
    work, full, ptx = full_run
    split = _rewound(full, work / f"from_{at}", at)
    end = 3 if at == 1 else 4
    resumed = run_cli(_args(split, ptx, end), cwd=work)
    assert "resumed from" in resumed.stdout
    a, b = read_metrics(full)[:end], read_metrics(split)
    assert [r["iteration"] for r in b] == list(range(1, end + 1))
    for ra, rb in zip(a, b):
        assert _comparable(ra) == _comparable(rb), ra["iteration"]
