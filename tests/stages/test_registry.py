"""tracking.register_model against the real `mlflow server` (tests/support/mlflow_server.py), at unit
level on a tiny Hugging Face directory: a copied version loads back with the transformers
flavour and generates the export's greedy tokens; a by-reference version copies nothing; a
registry failure warns instead of failing; the config rules; and (same server) reward.url's
credentials stay out of what a run logs. (The end-to-end registration of a training run is in
test_tracking_e2e.py, sharing its run.)"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from support.mlflow_server import mlflow_server, mlflow_uri  # noqa: F401  (the session's server fixture)

from conftest import free_port
from support.registry_checks import export_greedy, registered_greedy
from ds_ppo.config import load_config, validate
from ds_ppo.errors import ConfigError, RegistrationError
from ds_ppo.run.registry import config_hash, register_policy
from ds_ppo.run.tracking import open_tracker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random-init tiny Llama with the builtin tokenizer, saved as an HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ds_ppo.data.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("hf")
    tok = load_tokenizer("builtin:tiny", root / "cache")
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64, vocab_size=len(tok),
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "final")
    tok.save_pretrained(root / "final")
    return root / "final"


def _tracker(uri, tmp_path, *overrides):
    cfg = load_config(None, [f"tracking.uri={uri}", "tracking.experiment=ds_ppo_registry",
                             f"output_dir={tmp_path / 'out'}", *overrides])
    return cfg, open_tracker(cfg, is_main=True, run_id=None, tags={})


def test_copied_version_loads_back_and_generates_the_exports_tokens(mlflow_uri, model_dir,
                                                                    tmp_path):
    from mlflow import MlflowClient

    cfg, tracker = _tracker(mlflow_uri, tmp_path, "tracking.register_model=registry_copy")
    version = register_policy(cfg, tracker, model_dir, iteration=7, eval_score=0.25)
    tracker.close()
    assert version is not None
    mv = MlflowClient(mlflow_uri).get_model_version("registry_copy", version.version)
    assert mv.run_id == tracker.run_id and mv.source == f"runs:/{tracker.run_id}/policy/iter_000007"
    assert mv.tags == {"run_id": tracker.run_id, "iteration": "7", "eval_score": "0.25",
                       "config_hash": config_hash(cfg), "flavor": "transformers"}
    assert registered_greedy(mlflow_uri, "registry_copy", mv.version) == export_greedy(model_dir)


def test_by_reference_version_copies_nothing(mlflow_uri, model_dir, tmp_path):
    from mlflow import MlflowClient

    cfg, tracker = _tracker(mlflow_uri, tmp_path, "tracking.register_model=registry_ref",
                            "tracking.register_copy=false")
    version = register_policy(cfg, tracker, model_dir, iteration=3)
    tracker.close()
    client = MlflowClient(mlflow_uri)
    mv = client.get_model_version("registry_ref", version.version)
    assert mv.tags["export_dir"] == str(model_dir.resolve()) and "eval_score" not in mv.tags
    files = [a.path for a in client.list_artifacts(tracker.run_id, "policy/iter_000003")]
    assert files == ["policy/iter_000003/reference.json"]  # no weights uploaded
    local = client.download_artifacts(tracker.run_id, "policy/iter_000003/reference.json",
                                      str(tmp_path))
    ref = json.loads(Path(local).read_text())
    assert ref["export_dir"] == mv.tags["export_dir"]
    assert export_greedy(mv.tags["export_dir"]) == export_greedy(model_dir)


def test_without_the_flavour_the_files_are_logged_and_load_back(mlflow_uri, model_dir,
                                                                 tmp_path, monkeypatch):
    """Should the transformers flavour fail with the installed packages, the HF directory is
    logged as it is; from_pretrained on the downloaded version gives the export's tokens."""
    import mlflow
    from mlflow import MlflowClient

    import ds_ppo.run.registry as registry

    def broken(*args):
        raise ImportError("no flavour here")

    monkeypatch.setattr(registry, "_save_transformers_model", broken)
    cfg, tracker = _tracker(mlflow_uri, tmp_path, "tracking.register_model=registry_files")
    version = register_policy(cfg, tracker, model_dir, iteration=2)
    tracker.close()
    mv = MlflowClient(mlflow_uri).get_model_version("registry_files", version.version)
    assert mv.tags["flavor"] == "files"
    mlflow.set_tracking_uri(mlflow_uri)
    try:
        local = mlflow.artifacts.download_artifacts(f"models:/registry_files/{mv.version}",
                                                    dst_path=str(tmp_path / "dl"))
    finally:
        mlflow.set_tracking_uri(None)
    assert (Path(local) / "model.safetensors").exists()
    assert export_greedy(local) == export_greedy(model_dir)


def test_registry_failure_warns_and_returns_none(mlflow_uri, model_dir, tmp_path, caplog,
                                                 monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    cfg, tracker = _tracker(mlflow_uri, tmp_path, "tracking.register_model=registry_down",
                            "tracking.register_copy=false")
    tracker.client = MlflowClient(f"http://127.0.0.1:{free_port()}")  # the server went away
    with caplog.at_level(logging.WARNING, logger="ds_ppo"):
        assert register_policy(cfg, tracker, model_dir, iteration=1) is None
    assert "registering" in caplog.text and "failed" in caplog.text
    assert str(model_dir.resolve()) in caplog.text
    # at the end of training (strict) the failure is the command's exit code, 4, and last line
    with pytest.raises(RegistrationError) as err:
        register_policy(cfg, tracker, model_dir, iteration=1, strict=True)
    assert err.value.exit_code == 4
    assert str(err.value).startswith("training finished and saved, but tracking.register_model")


def test_a_run_registers_each_iteration_once(mlflow_uri, model_dir, tmp_path):
    """The same command run again (a retry, a finished run resumed) reopens the same MLflow run
    and registers the same iteration: the existing version comes back, no duplicate."""
    from mlflow import MlflowClient

    cfg, tracker = _tracker(mlflow_uri, tmp_path, "tracking.register_model=registry_once",
                            "tracking.register_copy=false")
    first = register_policy(cfg, tracker, model_dir, iteration=5)
    again = register_policy(cfg, tracker, model_dir, iteration=5)
    later = register_policy(cfg, tracker, model_dir, iteration=6)
    tracker.close()
    assert again.version == first.version != later.version
    versions = MlflowClient(mlflow_uri).search_model_versions("name = 'registry_once'")
    assert sorted(v.version for v in versions) == sorted({first.version, later.version})


def test_register_config_rules():
    with pytest.raises(ConfigError, match="checkpoint.export_at_end=true"):
        validate(load_config(None, ["tracking.register_model=m",
                                    "checkpoint.export_at_end=false"]), 1)
    with pytest.raises(ConfigError, match="multiple of checkpoint.every = 20"):
        validate(load_config(None, ["tracking.register_model=m",
                                    "tracking.register_every=30"]), 1)
    with pytest.raises(ConfigError, match="needs tracking.register_model"):
        validate(load_config(None, ["tracking.register_every=20"]), 1)
    validate(load_config(None, ["tracking.register_model=m", "tracking.register_every=40"]), 1)


def test_checkpoints_are_not_registered_by_a_reference_that_pruning_deletes():
    """register_copy=false registers a directory by reference; a checkpoint's hf/ is deleted
    by checkpoint.keep_last pruning, so register_every needs register_copy=true (the final
    export, never pruned, may be registered by reference)."""
    with pytest.raises(ConfigError, match="keep_last pruning deletes later"):
        validate(load_config(None, ["tracking.register_model=m", "tracking.register_every=20",
                                    "tracking.register_copy=false"]), 1)
    validate(load_config(None, ["tracking.register_model=m", "tracking.register_copy=false"]), 1)


def test_config_hash_ignores_url_credentials_but_not_settings():
    base = ["reward.function=null"]
    a = load_config(None, [*base, "reward.url=http://u:one@h/s"])
    b = load_config(None, [*base, "reward.url=http://u:two@h/s"])
    c = load_config(None, [*base, "reward.url=http://u:one@h/s", "ppo.kl_coef=0.5"])
    assert config_hash(a) == config_hash(b) != config_hash(c)


def test_reward_url_credentials_are_not_logged(mlflow_uri, tmp_path):
    """reward.url's user and password stay out of the run's params, tag and config.yaml, whatever
    characters a URL allows in them (a quote in the password defeated a pattern)."""
    from mlflow import MlflowClient

    from ds_ppo.run.driver import _open_tracker

    cfg = load_config(None, ["reward.function=null",
                             "reward.url=http://bob:hunter2-._~!$&'()*+,;=:%40Z@h:8000/s",
                             f"tracking.uri={mlflow_uri}", f"output_dir={tmp_path / 'out'}"])
    tracker = _open_tracker(cfg, None)
    tracker.close()
    client = MlflowClient(tracker.uri)
    run = client.get_run(tracker.run_id)
    assert run.data.params["reward.url"] == "http://***@h:8000/s"
    assert run.data.tags["reward"] == "http://***@h:8000/s"
    logged = json.dumps(run.data.params) + json.dumps(run.data.tags)
    logged += Path(client.download_artifacts(tracker.run_id, "config.yaml", str(tmp_path))
                   ).read_text()
    assert "hunter2" not in logged and "bob" not in logged


def test_registering_a_checkpoint_does_not_hold_other_ranks_in_a_collective(monkeypatch, tmp_path):
    """Rank 0 alone loads and uploads the checkpoint (minutes at 70B): the call goes through
    dist.main_does (others wait on a marker file, no collective timeout), once per due save."""
    import ds_ppo.run.registry as registry
    from ds_ppo.engine import dist

    calls, registered = [], []
    monkeypatch.setattr(dist, "main_does",
                        lambda work, where, what: calls.append((Path(where), what)) or work())
    monkeypatch.setattr(registry, "register_policy",
                        lambda cfg, tracker, model_dir, it, score: registered.append(it) or it)
    cfg = load_config(None, ["tracking.register_model=m", "tracking.register_every=2",
                             "checkpoint.every=2", "iterations=6"])
    ckpt = tmp_path / "checkpoints" / "iter_000002"
    assert registry.register_at_checkpoint(cfg, None, ckpt, 2, []) == 2
    assert registry.register_at_checkpoint(cfg, None, ckpt, 3, []) is None  # not due
    assert calls == [(ckpt.parent, f"registering {ckpt} in the MLflow model registry")]
    assert registered == [2]


def test_a_registry_call_that_never_finishes_is_given_up_with_a_warning(tmp_path, monkeypatch,
                                                                         caplog):
    """MLflow's own HTTP client bounds each read only: a registry server that drips its answer
    would hold the end of a finished run. Each metadata call has a whole-call deadline
    (REGISTRY_CALL_S); past it the registration is a warning (the export is on disk)."""
    import threading
    import time
    import types

    from ds_ppo.run import registry

    class DrippingClient:
        def search_model_versions(self, *a, **kw):
            return []  # nothing registered yet

        def log_dict(self, *a, **kw):
            pass

        def create_registered_model(self, name):
            pass

        def create_model_version(self, *a, **kw):
            threading.Event().wait()  # the answer never completes

    monkeypatch.setattr(registry, "REGISTRY_CALL_S", 0.5)
    monkeypatch.setattr(registry, "_is_main", lambda: True)
    cfg = load_config(None, ["tracking.register_model=tiny", "tracking.register_copy=false"])
    tracker = types.SimpleNamespace(client=DrippingClient(), run_id="r1")
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="ds_ppo"):
        assert registry.register_policy(cfg, tracker, tmp_path, 3) is None
    assert time.monotonic() - t0 < 3
    assert "the MLflow registry call creating the model version did not finish within 0.5 s" \
        in caplog.text
