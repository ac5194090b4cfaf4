"""`ds-ppo sft` and `ds-ppo rm` end to end, in this process (real DeepSpeed engines, one rank):
a run stopped by a scheduler's SIGTERM after step 2 checkpoints, and the same command resumes it
exactly (every metric of steps 3-4 and the final weights equal those of an uninterrupted run);
evaluation every sft.eval_every / rm.eval_every steps; the exports load with plain transformers
(AutoModelForCausalLM / AutoModelForSequenceClassification, one label) and give the scores the
job computed. The 1-vs-2-rank invariance of both losses: tests/dist/test_engine.py."""
from __future__ import annotations

import json
import re
import signal

import pytest
import torch

from conftest import REPO, read_metrics, sigterm_after
from ds_ppo.config import load_config, validate_job
from ds_ppo.trainer import run_supervised
from ds_ppo.run.preemption import Preempted

VOLATILE = ("time/",)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("rows")
    words = "the cat sat on a mat and my aunt is happy good love sun".split()
    sft, pairs = [], []
    for i in range(24):
        prompt = " ".join(words[(i + k) % len(words)] for k in range(1 + i % 3))
        answer = " ".join(words[(2 * i + k) % len(words)] for k in range(1 + i % 4))
        sft.append({"prompt": prompt, "completion": answer})
        pairs.append({"prompt": prompt, "chosen": answer, "rejected": "sad bad " + answer})
    (d / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    return d


def _cfg(job: str, data, out, *extra):
    rows = data / ("sft.jsonl" if job == "sft" else "pairs.jsonl")
    cfg = load_config(None, [
        "tracking.enabled=false", f"output_dir={out}", f"data.path={rows}",
        f"data.eval_split={rows}", "data.eval_size=8", f"{job}.steps=4", f"{job}.batch_size=8",
        f"{job}.micro_batch_size=4", f"{job}.eval_every=2", "checkpoint.every=0",
        "checkpoint.keep_last=1", *extra])
    validate_job(cfg, job, 1)
    return cfg


@pytest.mark.parametrize("job", ["sft", "rm"])
def test_sigterm_checkpoint_and_exact_resume(job, data, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    full, split = tmp_path / "full", tmp_path / "split"
    run_supervised(_cfg(job, data, full), job)
    with monkeypatch.context() as m:
        sigterm_after(2, m)
        with pytest.raises(Preempted) as stopped:
            run_supervised(_cfg(job, data, split), job)
    assert stopped.value.exit_code == 128 + signal.SIGTERM and stopped.value.iteration == 2
    assert not (split / "final").exists()
    run_supervised(_cfg(job, data, split), job)  # the same command: resumes at step 3
    a, b = read_metrics(full), read_metrics(split)
    assert [r["iteration"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert {k: v for k, v in ra.items() if not k.startswith(VOLATILE)} == \
            {k: v for k, v in rb.items() if not k.startswith(VOLATILE)}, ra["iteration"]
    assert [r["iteration"] for r in a if "eval/loss" in r] == [2, 4]  # {job}.eval_every=2
    doc = (REPO / "docs" / "METRICS.md").read_text()  # every logged metric is documented
    assert set(a[-1]) - {"iteration"} <= set(re.findall(r"`([a-z_]+/[a-z_]+)`", doc))
    loss = f"loss/{job}"
    assert a[-1][loss] < a[0][loss]  # it learns
    # `ds-ppo train` in that output_dir would not resume from a supervised job's checkpoint
    from ds_ppo.engine.checkpoint import latest_checkpoint
    from ds_ppo.ppo.resume_check import check_estimator_family
    from ds_ppo.errors import UserError

    with pytest.raises(UserError, match=f"checkpoint of `ds-ppo {job}`"):
        check_estimator_family(latest_checkpoint(split), "grpo")
    wa, wb = load_file(full / "final" / "model.safetensors"), \
        load_file(split / "final" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_exports_load_with_plain_transformers(data, tmp_path):
    """The SFT export loads as a causal LM; a reward model trained from it (fully, and with
    LoRA: its adapters merged into the export, the score head trained fully) loads as a
    sequence classifier whose scores give back the job's own evaluation."""
    from transformers import AutoModelForCausalLM

    sft_out = tmp_path / "sft"
    run_supervised(_cfg("sft", data, sft_out, "sft.steps=2", "checkpoint.export_dtype=fp32"),
                   "sft")
    policy = AutoModelForCausalLM.from_pretrained(sft_out / "final")
    assert policy.config.architectures == ["LlamaForCausalLM"]
    for name, extra in (("rm", []), ("rm_lora", ["policy.lora.r=8"])):
        # the reward model starts from the SFT model's backbone, as the recipe does
        res = run_supervised(_cfg("rm", data, tmp_path / name, "rm.steps=2", "policy.arch=null",
                                  f"policy.path={sft_out / 'final'}",
                                  "checkpoint.export_dtype=fp32", *extra), "rm")
        _check_reward_export(tmp_path / name / "final", data, res, policy.config.model_type)


def _check_reward_export(final, data, res, model_type):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm = AutoModelForSequenceClassification.from_pretrained(final)
    assert rm.config.num_labels == 1 and model_type == rm.config.model_type
    # what the critic-from-RM load (engine/roles.value_head_mapping) reads
    assert rm.config.architectures == ["LlamaForSequenceClassification"]
    assert not (final / "adapter_config.json").exists()
    tok = AutoTokenizer.from_pretrained(final)
    # the job's evaluation, recomputed from the export: mean r_chosen - r_rejected of the first
    # 8 pairs, each read at its last token (EOS) as ds-ppo train's reward role reads it
    rows = [json.loads(line) for line in (data / "pairs.jsonl").read_text().splitlines()][:8]
    margins = []
    for r in rows:
        scores = []
        for answer in (r["chosen"], r["rejected"]):
            ids = tok(r["prompt"])["input_ids"] + \
                tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            with torch.no_grad():
                scores.append(rm(torch.tensor([ids])).logits[0, 0].item())
        margins.append(scores[0] - scores[1])
    assert sum(margins) / len(margins) == pytest.approx(
        res.history[-1]["eval/margin_mean"], abs=1e-4)
