"""Streamed HF weight writing (ds_ppo/engine/checkpoint/hf_writer.py): shard layout like transformers, files
plain transformers loads, several writers, and a writer whose peak CPU memory is one tensor, not
the model (measured in a fresh process on a ~400 MB model)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import clean_env

from ds_ppo.engine.checkpoint.hf_writer import (Entry, ShardedWriter, parse_size, plan_shards,
                                     write_module_weights)


def _tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg)


def test_parse_size_like_transformers():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size(123) == 123
    with pytest.raises(ValueError):
        parse_size("5 parsecs")


def test_plan_shards_cuts_consecutive_groups_and_isolates_big_tensors():
    f32 = torch.float32
    entries = [Entry("a", (10,), f32), Entry("b", (10,), f32), Entry("c", (30,), f32),
               Entry("d", (5,), f32)]
    # 40 B, 40 B, 120 B (over the limit alone), 20 B with a 100 B limit
    assert [[e.name for e in s] for s in plan_shards(entries, 100)] == [["a", "b"], ["c"], ["d"]]
    assert [[e.name for e in s] for s in plan_shards(entries, 1000)] == [["a", "b", "c", "d"]]


@pytest.mark.parametrize("tied", [True, False])
def test_sharded_export_loads_with_transformers(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    from ds_ppo.run.export import export_engine

    model = _tiny_llama(tied)
    # several shards + index (small max_shard_size), and the product's one-file default
    write_module_weights(model, tmp_path / "sharded", torch.bfloat16, max_shard_size="8KB")
    export_engine(type("E", (), {"module": model})(), None, tmp_path / "one", torch.bfloat16)
    model.config.save_pretrained(tmp_path / "sharded")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    assert ("lm_head.weight" in index["weight_map"]) == (not tied)  # tied: stored once
    assert (tmp_path / "one" / "model.safetensors").exists()
    for d in ("sharded", "one"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / d, dtype=torch.bfloat16)
        for name, t in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], t.to(torch.bfloat16)), (d, name)
        assert (loaded.lm_head.weight.data_ptr() ==
                loaded.model.embed_tokens.weight.data_ptr()) == tied
    assert json.loads((tmp_path / "one" / "config.json").read_text())["dtype"] == "bfloat16"


def test_shards_spread_over_writers_make_one_checkpoint(tmp_path):
    """Two writers (ranks of node 0), each writing its own shards of the same plan, give the
    files one writer gives."""
    from safetensors.torch import load_file

    model = _tiny_llama(tied=True)
    params = list(model.named_parameters())
    entries = [Entry(n, tuple(p.shape), torch.float16) for n, p in params]
    for rank in (0, 1):
        w = ShardedWriter(tmp_path / "two", entries, "8KB", rank=rank, writers=2)
        for n, p in params:
            w.write(n, p.data)
        w.close()
    write_module_weights(model, tmp_path / "one", torch.float16, max_shard_size="8KB")
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "two").iterdir())
    for f in files:
        if f.endswith(".safetensors"):
            a, b = load_file(tmp_path / "one" / f), load_file(tmp_path / "two" / f)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_out_of_order_write_is_refused(tmp_path):
    e = [Entry("a", (2,), torch.float32), Entry("b", (2,), torch.float32)]
    w = ShardedWriter(tmp_path, e, "5GB")
    with pytest.raises(RuntimeError, match="out of order"):
        w.write("b", torch.zeros(2))


_PEAK_SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    import psutil, torch
    from types import SimpleNamespace
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from ds_ppo.run.export import export_engine

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=4096,
                      num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)  # fp32, ~400 MB
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # warm-up on a tiny model: the imports and caches of the first export are not the writer's
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2))
    export_engine(SimpleNamespace(module=tiny), None, sys.argv[1] + "_warm", torch.bfloat16)
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak, done = [base], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.0005)

    t = threading.Thread(target=sample); t.start()
    t0 = time.perf_counter()
    export_engine(SimpleNamespace(module=model), None, sys.argv[1], torch.bfloat16)
    seconds = time.perf_counter() - t0
    done.set(); t.join()
    loaded = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
    ref = model.state_dict()
    same = all(torch.equal(v, ref[k].to(torch.bfloat16)) for k, v in loaded.state_dict().items())
    tied = loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    print(json.dumps(dict(growth=peak[0] - base, largest=largest, total=total, same=same,
                          tied=tied, seconds=seconds)))
""")


def test_export_peak_memory_is_one_tensor_not_the_model(tmp_path):
    """Peak RSS growth of the writer < 3 x the largest parameter (fp32): a 16-bit copy of the
    model (what gathering it into a CPU replica costs) is > 10 x that."""
    proc = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "out")],
                          env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(r)
    assert r["total"] // 2 > 10 * r["largest"]  # the bound is far below a whole 16-bit copy
    assert r["growth"] < 3 * r["largest"], r
    assert r["same"] and r["tied"]


def test_models_that_rename_weights_on_load_still_export(tmp_path):
    """Mixtral's experts are merged on load in transformers 5: the export goes through
    save_pretrained's reverse conversion (the original per-expert names other tools read), and
    loads back equal."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_ppo.run.export import export_engine

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("mixtral", vocab_size=64, hidden_size=16, intermediate_size=32,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               num_local_experts=2, num_experts_per_tok=1)
    model = AutoModelForCausalLM.from_config(cfg)
    export_engine(type("E", (), {"module": model})(), None, tmp_path / "moe", torch.float32)
    with safe_open(tmp_path / "moe" / "model.safetensors", "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.1.w2.weight" in f.keys()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32)
    ref = model.state_dict()
    assert loaded.state_dict().keys() == ref.keys()
    assert all(torch.equal(v, ref[k]) for k, v in loaded.state_dict().items())


def test_a_llama_loaded_under_zero3_streams(tmp_path):
    """Under ZeRO-3, transformers leaves every mapping it tried (legacy LayerNorm.gamma ->
    weight renames included) in `model._weight_conversions`, even for a Llama whose names never
    change: that must not send the export to the whole-model save_pretrained fallback."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping

    from ds_ppo.engine.checkpoint.hf_writer import _needs_conversion

    cfg = AutoConfig.for_model("llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(cfg)
    model._weight_conversions = get_model_conversion_mapping(model)  # as the ZeRO-3 load does
    assert model._weight_conversions  # the legacy renames are there
    assert not _needs_conversion(model)


def test_exports_put_back_the_dropout_training_switched_off(tmp_path):
    """disable_dropout zeroes the loaded config's dropout; the written config (export, and the
    checkpoint's hf/ copy through saved_config) has the model's own probabilities again."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ds_ppo.engine.checkpoint.hf_writer import saved_config
    from ds_ppo.engine.roles import _model_config
    from ds_ppo.run.export import export_engine

    LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, attention_dropout=0.3).save_pretrained(tmp_path / "src")
    config, dropped = _model_config(str(tmp_path / "src"), True)
    assert dropped == {"attention_dropout": 0.3} and config.attention_dropout == 0.0
    model = AutoModelForCausalLM.from_config(config)
    model.ds_ppo_dropout = dropped  # what engine/roles.py records on a trained role's model
    export_engine(type("E", (), {"module": model})(), None, tmp_path / "out", torch.float32)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["attention_dropout"] == 0.3
    assert model.config.attention_dropout == 0.0  # training's own config is untouched
    # a sub-config's field (a multimodal model's text_config) is found by its dotted name
    outer = type("M", (), {"config": LlamaConfig(), "ds_ppo_dropout": {}})()
    outer.config.text_config = LlamaConfig(attention_dropout=0.0)
    outer.ds_ppo_dropout = {"text_config.attention_dropout": 0.2}
    assert saved_config(outer).text_config.attention_dropout == 0.2


def test_the_export_at_the_end_replaces_final_whole_or_not_at_all(tmp_path, monkeypatch):
    """export_final writes aside and renames: a write that dies half-way (here: the weights
    file cut after 4 KB, then an error, as a kill leaves it) leaves the previous final/ as it
    was, loadable; a complete one replaces it."""
    import ds_ppo.engine.checkpoint.hf_export as engine_export
    from transformers import AutoModelForCausalLM

    from ds_ppo.engine.checkpoint.hf_export import MARKER, export_final

    final = tmp_path / "final"
    first, second = _tiny_llama(True), _tiny_llama(False)
    export_final(type("E", (), {"module": first})(), None, final, torch.float32, "run 1")
    before = {p.name: p.read_bytes() for p in final.iterdir()}
    real = engine_export.export_engine

    def dies_half_way(engine, tokenizer, out_dir, dtype):
        real(engine, tokenizer, out_dir, dtype)
        weights = out_dir / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:4096])
        raise RuntimeError("killed")

    monkeypatch.setattr(engine_export, "export_engine", dies_half_way)
    with pytest.raises(RuntimeError, match="killed"):
        export_final(type("E", (), {"module": second})(), None, final, torch.float32, "run 2")
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before
    AutoModelForCausalLM.from_pretrained(final)  # still the first export, whole
    monkeypatch.setattr(engine_export, "export_engine", real)
    export_final(type("E", (), {"module": second})(), None, final, torch.float32, "run 2")
    assert json.loads((final / MARKER).read_text())["checkpoint"] == "run 2"
    loaded = AutoModelForCausalLM.from_pretrained(final)
    assert torch.equal(loaded.lm_head.weight, second.lm_head.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # nothing left beside it
