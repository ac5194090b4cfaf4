"""`ds-ppo dpo` end to end, in this process (real DeepSpeed engines, one rank, a tiny random-init
policy): a run stopped by a scheduler's SIGTERM after step 2 resumes exactly (every metric of
steps 3-4 and the final weights equal those of an uninterrupted run), it learns a trivially
learnable pair set (the reward margin rises), and its export loads as a causal LM; with LoRA
the reference is the policy's base (no second model), and each loss starts where its formula
says a policy equal to its reference starts."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from conftest import REPO, read_metrics, sigterm_after
from ds_ppo.config import load_config, validate_job
from ds_ppo.run.preemption import Preempted
from ds_ppo.trainer import run_job

VOLATILE = ("time/",)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """24 pairs whose rejected answer is the chosen one after "sad bad": learnable in steps."""
    path = tmp_path_factory.mktemp("rows") / "pairs.jsonl"
    words = "the cat sat on a mat and my aunt is happy good love sun".split()
    rows = []
    for i in range(24):
        prompt = " ".join(words[(i + k) % len(words)] for k in range(1 + i % 3))
        answer = " ".join(words[(2 * i + k) % len(words)] for k in range(1 + i % 4))
        rows.append({"prompt": prompt, "chosen": answer, "rejected": "sad bad " + answer})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(pairs, out, *extra):
    cfg = load_config(None, [
        "tracking.enabled=false", f"output_dir={out}", f"data.path={pairs}",
        f"data.eval_split={pairs}", "data.eval_size=8", "dpo.steps=4", "dpo.batch_size=8",
        "dpo.micro_batch_size=4", "dpo.eval_every=2", "checkpoint.every=0",
        "checkpoint.keep_last=1", *extra])
    validate_job(cfg, "dpo", 1)
    return cfg


def test_sigterm_checkpoint_exact_resume_learning_and_export(pairs, tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    full, split = tmp_path / "full", tmp_path / "split"
    run_job(_cfg(pairs, full), "dpo")
    with monkeypatch.context() as m:
        sigterm_after(2, m)
        with pytest.raises(Preempted) as stopped:
            run_job(_cfg(pairs, split), "dpo")
    assert stopped.value.iteration == 2 and not (split / "final").exists()
    run_job(_cfg(pairs, split), "dpo")  # the same command: resumes at step 3
    a, b = read_metrics(full), read_metrics(split)
    assert [r["iteration"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert {k: v for k, v in ra.items() if not k.startswith(VOLATILE)} == \
            {k: v for k, v in rb.items() if not k.startswith(VOLATILE)}, ra["iteration"]
    doc = (REPO / "docs" / "METRICS.md").read_text()  # every logged metric is documented
    assert set(a[-1]) - {"iteration"} <= set(re.findall(r"`([a-z_]+/[a-z_]+)`", doc))
    # the policy starts as its reference: DPO's loss is log 2, both rewards 0
    assert a[0]["loss/dpo"] == pytest.approx(math.log(2), abs=1e-6)
    assert a[0]["dpo/chosen_reward"] == pytest.approx(0.0, abs=1e-6)
    # it learns: the margin rises, the loss falls, the evaluation ranks the pairs
    margins = [r["dpo/reward_margin"] for r in a]
    assert margins[0] == 0.0 and margins[-1] > margins[1] > 0.05
    assert a[-1]["loss/dpo"] < a[0]["loss/dpo"] and a[-1]["eval/reward_accuracy"] == 1.0
    wa, wb = load_file(full / "final" / "model.safetensors"), \
        load_file(split / "final" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    policy = AutoModelForCausalLM.from_pretrained(full / "final")
    assert policy.config.architectures == ["LlamaForCausalLM"]


@pytest.mark.parametrize("loss,extra,first,built", [
    ("sigmoid", ["policy.lora.r=8"], math.log(2), 0),  # the LoRA base is the reference
    ("ipo", [], (1 / (2 * 0.1)) ** 2, 1),  # (h - 1 / (2 beta))^2 at h = 0
    ("simpo", ["dpo.beta=2.0"], None, 0),  # no reference
])
def test_each_loss_and_lora_run(pairs, tmp_path, monkeypatch, loss, extra, first, built):
    from ds_ppo.engine import supervised

    made = []
    real = supervised._init_reference
    monkeypatch.setattr(supervised, "_init_reference",
                        lambda *a, **k: made.append(a[1]) or real(*a, **k))
    res = run_job(_cfg(pairs, tmp_path / loss, f"dpo.loss={loss}", "dpo.steps=2",
                       "data.eval_split=null", *extra), "dpo")
    assert len(made) == built  # reference engines loaded
    m = res.history
    if first is not None:
        assert m[0]["loss/dpo"] == pytest.approx(first, rel=1e-5)
    assert m[-1]["loss/dpo"] < m[0]["loss/dpo"]
    assert (tmp_path / loss / "final" / "config.json").exists()
