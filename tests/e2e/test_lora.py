"""LoRA (policy.lora, value.lora; ds_ppo/engine/lora.py).

Unit tests without DeepSpeed: the merged weights compute what the peft model computes, the base
fingerprint, the config. One short LoRA run of the tiny default (plus a resume of it, and a
resume refused for a changed base) shared by the end-to-end checks: first-iteration KL exactly 0,
checkpoint size, merged and adapter-only exports (and cut adapters refused), exact resume. The
multi-rank checks (same first update on 2 ranks, only adapters and the head change, reference =
base) are in test_engine.py; a critic-free LoRA run on 2 ranks, resumed on 1, in test_scaleout.py.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import SMALL, read_metrics, run_cli
from ds_ppo.config import load_config, reference_from_policy_base, validate
from ds_ppo.errors import ConfigError, UserError

VOLATILE = ("time/", "tokens_per_s/", "memory/")
LORA = ["policy.lora.r=8"]


def _tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=False))


def _adapted(seed: int = 0):
    """A tiny llama with adapters (every projection and the output head) whose B is random (the
    update is not zero)."""
    from ds_ppo.engine.lora import add_adapters

    targets = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]"
    cfg = load_config(None, LORA + ["policy.lora.alpha=4",
                                    f"policy.lora.target_modules={targets}"]).policy.lora
    model = add_adapters(_tiny_llama(seed), cfg, seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model.eval()


# ------------------------------------------------------------------------ unit tests
def test_merged_weights_compute_what_the_peft_model_computes():
    from ds_ppo.engine.lora import replica_weights

    model = _adapted()
    plain = _tiny_llama(seed=5).eval()  # other weights: every tensor must be overwritten
    merged = {name: full() for name, _, full in replica_weights(model)}
    assert set(merged) == set(plain.state_dict())  # the plain model's names, adapters folded in
    plain.load_state_dict(merged)
    ids = torch.randint(0, 64, (3, 12))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = plain(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    # fp32: W + s B A vs W x + s B (A x) differ only by rounding order (~1e-7 relative)
    assert (got - want).abs().max() < 1e-5
    assert (base - want).abs().max() > 1e-2  # the adapters do change the output


def test_adapters_start_as_the_base_and_only_they_train():
    from ds_ppo.engine.lora import add_adapters, trainable

    base = _tiny_llama()
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        want = base(input_ids=ids).logits.clone()
    model = add_adapters(base, load_config(None, LORA).policy.lora, seed=1).eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)  # B = 0: exactly the base
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".lora_" in n for n in names)
    assert len(trainable(model)) == len(names)


def test_output_head_gets_an_adapter_on_a_random_init_untied_model_only():
    """policy.lora.output_head=auto: a random-init policy.arch's output head is adapted (peft's
    all-linear leaves it out), a loaded model's is not; a head tied to the embeddings cannot be."""
    from ds_ppo.engine.lora import adapts_output_head, add_adapters

    auto = load_config(None, LORA).policy.lora
    untied, tied = _tiny_llama(), _tiny_llama()
    tied.config.tie_word_embeddings = True
    assert adapts_output_head(auto, True, untied)
    assert not adapts_output_head(auto, False, untied) and not adapts_output_head(auto, True, tied)
    for value, want in (("true", True), ("false", False)):
        cfg = load_config(None, [*LORA, f"policy.lora.output_head={value}"]).policy.lora
        assert adapts_output_head(cfg, True, untied) is want
        assert adapts_output_head(cfg, False, untied) is want
    with pytest.raises(ConfigError, match="policy.lora.output_head = True: .* tied"):
        adapts_output_head(load_config(None, [*LORA, "policy.lora.output_head=true"]).policy.lora,
                           True, tied)
    adapted = add_adapters(_tiny_llama(), auto, seed=1, output_head=True)
    names = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert {"base_model.model.lm_head.lora_A.default.weight",
            "base_model.model.lm_head.lora_B.default.weight"} <= names
    assert all(".lora_" in n for n in names)  # the head's own weight stays frozen
    # every projection all-linear adapts, plus the head: 7 per layer + 1, two tensors each
    assert len(names) == 2 * (7 * 2 + 1)
    listed = load_config(None, [*LORA, "policy.lora.target_modules=[q_proj]"]).policy.lora
    adapted = add_adapters(_tiny_llama(), listed, seed=1, output_head=True)
    assert sorted({n.split(".lora_")[0].split(".")[-1] for n, p in adapted.named_parameters()
                   if p.requires_grad}) == ["lm_head", "q_proj"]
    with pytest.raises(ConfigError, match="value.lora.output_head = True"):
        validate(load_config(None, ["value.lora.output_head=true"]), 1)


def test_value_head_is_trained_fully_and_never_adapted():
    from transformers import LlamaConfig, LlamaForTokenClassification

    from ds_ppo.engine.lora import add_adapters

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1)
    model = add_adapters(LlamaForTokenClassification(config), load_config(None, LORA).policy.lora,
                         seed=1, head="score", causal_lm=False)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(n for n in names if ".lora_" not in n) == [
        "base_model.model.score.bias", "base_model.model.score.weight"]
    assert not any("score.lora" in n for n in names)


def test_tensor_parallel_splits_a_lora_policy_like_its_base():
    from ds_ppo.engine.generation.choice import decoder_linears, unshardable

    model = _adapted()
    assert unshardable(model.config, 2, decoder_linears(model)) is None


def test_base_fingerprint_notices_changed_files(tmp_path):
    from ds_ppo.engine.lora import base_fingerprint, base_record, check_base

    path = tmp_path / "base"
    _tiny_llama().save_pretrained(path)
    record = base_record({"policy": str(path)})
    check_base(record, {"policy": str(path)}, tmp_path)  # unchanged: fine
    assert base_fingerprint(str(path)) == record["policy"]["fingerprint"]
    config = json.loads((path / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5 if config["rms_norm_eps"] != 1e-5 else 1e-6
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="policy.lora: the base model files at .* changed"):
        check_base(record, {"policy": str(path)}, tmp_path)
    with pytest.raises(UserError, match="value.lora"):
        check_base(record, {}, tmp_path)  # LoRA settings differ from the checkpoint's


def test_lora_config_and_reference_from_base():
    cfg = load_config(None, ["policy.lora.r=4", "policy.lora.target_modules=[q_proj,v_proj]"])
    assert cfg.policy.lora.r == 4 and cfg.policy.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.policy.lora.alpha == 16.0 and cfg.value.lora is None
    assert load_config(None, ["policy.lora.r=4"]).policy.lora.target_modules == "all-linear"
    assert reference_from_policy_base(cfg)  # auto with policy LoRA: no reference engine
    assert not reference_from_policy_base(load_config(None, []))
    assert not reference_from_policy_base(
        load_config(None, LORA + ["reference.from_policy_base=false"]))
    assert not reference_from_policy_base(load_config(None, LORA + ["reference.path=other"]))
    with pytest.raises(ConfigError, match="reference.from_policy_base = True needs policy.lora"):
        validate(load_config(None, ["reference.from_policy_base=true"]), 1)
    with pytest.raises(ConfigError, match="reference.from_policy_base = True and reference.path"):
        validate(load_config(None, LORA + ["reference.from_policy_base=true",
                                           "reference.path=x"]), 1)
    with pytest.raises(ConfigError, match="policy.lora.r"):
        load_config(None, ["policy.lora.r=0"])
    # the optional section's keys are checked like any section's
    with pytest.raises(ConfigError, match=r"policy.lora has no 'rank' \(valid: alpha, dropout,"):
        load_config(None, ["policy.lora.rank=8"])
    with pytest.raises(ConfigError,
                       match=r"'value.lora.rank' \(valid here: alpha, dropout, output_head, r,"):
        load_config(None, ["value.lora={rank: 8}"])


# ----------------------------------------------------------------- one LoRA run, shared
@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """3 iterations of the small tiny default with policy.lora.r=8, a checkpoint after each,
    the merged fp32 export at the end; and a second run resuming from its iteration-2
    checkpoint in another output_dir (its base rebuilt there from the same seed)."""
    work = tmp_path_factory.mktemp("lora")
    run, resumed = work / "run", work / "resumed"
    common = [*SMALL, *LORA, "iterations=3", "checkpoint.every=1", "checkpoint.keep_last=3"]
    run_cli(["train", *common, f"output_dir={run}", "checkpoint.export_at_end=true",
             "checkpoint.export_dtype=fp32"], cwd=work)
    proc = run_cli(["train", *common, f"output_dir={resumed}",
                    f"resume={run / 'checkpoints' / 'iter_000002'}"], cwd=work)
    return {"work": work, "run": run, "resumed": resumed, "resume_stdout": proc.stdout}


def test_first_iteration_kl_is_exactly_zero(lora_run):
    rows = read_metrics(lora_run["run"])
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[0]["kl/sequence_mean"] == 0.0 and rows[0]["kl/token_mean"] == 0.0
    assert rows[1]["kl/sequence_mean"] != 0.0  # the updated adapters moved the policy


def test_resume_rebuilds_the_base_and_continues_exactly(lora_run):
    assert "resumed from" in lora_run["resume_stdout"]
    a, b = read_metrics(lora_run["run"]), read_metrics(lora_run["resumed"])
    assert [r["iteration"] for r in b] == [3]

    def comparable(row):
        return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}
    assert comparable(a[2]) == comparable(b[0])


def test_checkpoint_holds_adapters_not_the_base(lora_run):
    ckpt = lora_run["run"] / "checkpoints" / "iter_000003"
    params = sum(t.numel() for t in _safetensors(lora_run["run"] / "final").values())
    # a full fine-tuning checkpoint holds at least fp32 weights + two AdamW moments per weight
    full_policy = 12 * params
    # the policy's data files: DeepSpeed's (adapters, their optimizer state) and the adapter;
    # r=8 on the 64-wide tiny model, output head included, is 13% of its weights (0.1-1% on
    # real models): 0.23 of the full checkpoint; a copy of the base's fp32 weights alone would
    # add 1/3 of it
    data = [f for f in (ckpt / "policy").rglob("*.pt")] + list((ckpt / "hf").glob("*.safetensors"))
    policy = sum(f.stat().st_size for f in data)
    assert policy < 0.3 * full_policy, (policy, full_policy)
    assert not list((ckpt / "hf").glob("model*.safetensors"))  # the adapter, no merged copy
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert set(state["lora_bases"]) == {"policy"}


def _safetensors(path):
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_merged_and_adapter_only_exports(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ds_ppo.run.export import export_checkpoint

    run, work = lora_run["run"], lora_run["work"]
    merged, adapter = work / "merged", work / "adapter"
    # `ds-ppo export` (without and with --adapter-only) in this process: no process group
    export_checkpoint(run, merged, torch.float32)
    export_checkpoint(run, adapter, torch.bfloat16, adapter_only=True)
    assert not (merged / "adapter_config.json").exists()
    # offline (peft's merge of the checkpoint's adapter) == in the job (our merged replica)
    a, b = _safetensors(merged), _safetensors(run / "final")
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    base_path = json.loads((run / "checkpoints" / "iter_000003" / "trainer_state.json")
                           .read_text())["lora_bases"]["policy"]["path"]
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    ids = torch.randint(3, 500, (2, 10))
    base_logits = _logits(base, ids)
    with_adapter = _logits(PeftModel.from_pretrained(base, adapter), ids)
    plain = _logits(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), ids)
    # fp32 on CPU: merged weights vs adapter applied at run time differ by rounding only
    assert (plain - with_adapter).abs().max() < 1e-5
    assert (with_adapter - base_logits).abs().max() > 1e-3


@pytest.mark.parametrize("adapter_only", [False, True])
def test_a_cut_adapter_is_not_exported(lora_run, tmp_path, capsys, adapter_only):
    """The checkpoint's adapter cut to 4 KB: a merged export and an --adapter-only export each
    stop with one line naming the file, with the manifest's check (size) and without it (the
    safetensors header), and write nothing."""
    from ds_ppo.cli import main

    ckpt = tmp_path / "iter_000003"
    shutil.copytree(lora_run["run"] / "checkpoints" / "iter_000003", ckpt)
    adapter = ckpt / "hf" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:4096])
    for verify in ([], ["--no-verify"]):
        args = ["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "out"), *verify]
        assert main(args + (["--adapter-only"] if adapter_only else [])) == 2
        out, err = capsys.readouterr()
        assert f"{adapter} is " in err and "cut off" in err, err
        lines = err.strip().splitlines()
        if verify:  # the skipped check is said out loud first
            assert "--no-verify: the files of" in lines.pop(0), err
        assert len(lines) == 1 and "exported" not in out
    assert not (tmp_path / "out").exists()


def test_resume_on_a_changed_base_fails_clearly(lora_run):
    work = lora_run["work"]
    out = work / "changed"
    shutil.copytree(lora_run["run"] / "checkpoints", out / "checkpoints")
    shutil.copytree(lora_run["run"] / "init_models", out / "init_models")
    config = out / "init_models" / "policy" / "config.json"
    data = json.loads(config.read_text())
    data["rms_norm_eps"] = data["rms_norm_eps"] * 2
    config.write_text(json.dumps(data))
    proc = run_cli(["train", *SMALL, *LORA, "iterations=4", f"output_dir={out}"], cwd=work,
                   check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "policy.lora: the base model files at" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_tiny_default_with_lora_learns(tmp_path):
    """`ds-ppo train policy.lora.r=8`, nothing else, in half its 40 iterations: the mean score of
    the last 5 iterations clearly above the first 5 (0.05 -> 0.40 here; 0.80 over 40:
    docs/RESULTS.md).
    With policy.lora.output_head=false (adapters below the random-init head only) it stays flat:
    0.05 -> 0.09, entropy 6.225 throughout."""
    out = tmp_path / "run"
    proc = run_cli(["train", *LORA, "iterations=20", "tracking.enabled=false",
                    "checkpoint.every=0", "checkpoint.export_at_end=false",
                    f"output_dir={out}"], cwd=tmp_path, timeout=900)
    rows = read_metrics(out)
    assert [r["iteration"] for r in rows] == list(range(1, 21))
    first = sum(r["score/mean"] for r in rows[:5]) / 5
    last = sum(r["score/mean"] for r in rows[-5:]) / 5
    assert last > first + 0.2, (first, last)
    assert rows[-1]["policy/entropy"] < rows[0]["policy/entropy"] - 0.3
    assert "LoRA policy: 20,992 trainable" in proc.stdout  # the head's adapter among them
