"""ds_ppo.run.tracking against a real MLflow server (SQLite backend, proxied artifacts), the
embedded store in output_dir, an unreachable server and a server killed mid-run.

Everything is read back through `MlflowClient`, as a user would see it.
"""
import json
import logging
import math
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.mlflow_server import free_port
from support.mlflow_server import mlflow_server, mlflow_uri  # noqa: F401  (fixtures)

from ds_ppo.config import Config
from ds_ppo.run.tracking import (
    HTTP_DEFAULTS,
    MlflowTracker,
    NullTracker,
    TrackingError,
    clean_key,
    flatten,
    open_tracker,
    redact,
    resolve_uri,
)

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

TAGS = {"world_size": "2", "num_nodes": "1", "policy": "arch:llama"}
DS_CONFIGS = {"policy": {"train_batch_size": 8, "zero_optimization": {"stage": 3}},
              "value": {"train_batch_size": 8, "zero_optimization": {"stage": 2}}}
KEYS = ("loss/policy", "time/generation_s", "value/explained_variance")


@pytest.fixture(autouse=True)
def _hermetic_env(monkeypatch):
    """No tracking URI from the outside; the HTTP bounds open_tracker sets are undone after."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name, value in HTTP_DEFAULTS.items():
        monkeypatch.setenv(name, value)


def make_cfg(tmp_path: Path, **tracking) -> Config:
    return Config.model_validate({
        "policy": {"arch": {"model_type": "llama", "hidden_size": 64}},
        "reward": {"function": "ds_ppo.rewards:positive_words"},
        "output_dir": str(tmp_path / "run"),
        "tracking": tracking,
    })


def metrics(step: int) -> dict[str, float]:
    return {"loss/policy": 1.0 / step, "time/generation_s": 0.5 * step,
            # the trainer logs NaN when the returns have no variance: MLflow keeps it
            "value/explained_variance": math.nan if step == 2 else 0.1 * step}


def log_steps(tracker, steps, samples_at=()) -> None:
    for step in steps:
        tracker.log_metrics(metrics(step), step=step)
        if step in samples_at:
            tracker.log_samples([{"prompt": f"p{i}", "response": f"r{i}", "score": float(i)}
                                 for i in range(3)], step=step)


def log_ds_configs(tracker) -> None:
    """As the trainer does once its engines exist."""
    for role, ds_config in DS_CONFIGS.items():
        tracker.log_dict(ds_config, f"deepspeed/{role}.json")


def history_steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def artifact_paths(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    out = set()
    for f in client.list_artifacts(run_id, path):
        out |= artifact_paths(client, run_id, f.path) if f.is_dir else {f.path}
    return out


# ------------------------------------------------------------------------ pure helpers
def test_uri_resolution_order(tmp_path, monkeypatch):
    cfg = make_cfg(tmp_path)
    uri, embedded = resolve_uri(cfg)
    assert embedded and uri == f"sqlite:///{(tmp_path / 'run' / 'mlruns' / 'mlflow.db').resolve()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://from-env:5000")
    assert resolve_uri(cfg) == ("http://from-env:5000", False)
    assert resolve_uri(make_cfg(tmp_path, uri="http://from-config:5000")) == \
        ("http://from-config:5000", False)


def test_keys_and_flattening():
    assert clean_key("loss/policy") == "loss/policy"
    assert clean_key("time/generation_s") == "time/generation_s"
    assert clean_key("score (mean)%") == "score _mean__"
    assert clean_key("../x//y") == "_/x/_/y"
    flat = flatten({"ppo": {"kl_coef": 0.1, "betas": [0.9, 0.95]}, "tracking": {"tags": {}},
                    "policy": {"arch": {"model_type": "llama"}, "path": None}})
    assert flat == {"ppo.kl_coef": "0.1", "ppo.betas": "[0.9, 0.95]", "tracking.tags": "{}",
                    "policy.arch.model_type": "llama", "policy.path": "None"}


# ------------------------------------------------------------------------ real server
@pytest.fixture(scope="module")
def server_run(mlflow_server, tmp_path_factory):  # noqa: F811
    """A run of 3 iterations with samples at 2, logged to the server and closed; its URI
    carries credentials (which the server ignores), as a user's may."""
    uri = mlflow_server.ensure_running().replace("http://", "http://alice:SECRET@")
    cfg = make_cfg(tmp_path_factory.mktemp("server_run"), uri=uri,
                   experiment="ds_ppo_test", tags={"team": "rl"})
    tracker = open_tracker(cfg, is_main=True, run_id=None, tags=TAGS)
    assert isinstance(tracker, MlflowTracker)
    log_ds_configs(tracker)
    log_steps(tracker, [1, 2, 3], samples_at=[2])
    tracker.close()
    assert tracker.lost_calls == 0
    return cfg, tracker, MlflowClient(tracking_uri=uri)


def test_server_run_params_tags_status(server_run, mlflow_uri):  # noqa: F811
    cfg, tracker, client = server_run
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "run"  # output_dir's name
    assert client.get_experiment(run.info.experiment_id).name == "ds_ppo_test"
    params = run.data.params
    assert params["ppo.kl_coef"] == "0.1"
    assert params["policy.arch.hidden_size"] == "64"
    assert params["tracking.uri"] == cfg.tracking.uri.replace("alice:SECRET", "***")
    assert not [k for k, v in params.items() if "SECRET" in v]
    assert set(params) == set(flatten(cfg.to_dict()))  # every config field, > 100: batched
    tags = run.data.tags
    assert {k: tags[k] for k in TAGS} == TAGS
    assert tags["team"] == "rl"
    for pkg in ("ds_ppo", "deepspeed", "torch", "transformers"):
        assert tags[f"version.{pkg}"], pkg
    assert tags["version.torch"] == __import__("torch").__version__


def test_server_run_metrics_every_step(server_run, mlflow_uri):  # noqa: F811
    _, tracker, client = server_run
    for key in KEYS:
        assert history_steps(client, tracker.run_id, key) == [1, 2, 3], key
    ev = {m.step: m.value for m in client.get_metric_history(tracker.run_id,
                                                             "value/explained_variance")}
    assert math.isnan(ev[2]) and ev[3] == pytest.approx(0.3)


def test_server_run_artifacts(server_run, mlflow_uri, tmp_path):  # noqa: F811
    _, tracker, client = server_run
    assert artifact_paths(client, tracker.run_id) == {
        "config.yaml", "deepspeed/policy.json", "deepspeed/value.json", "samples/iter_000002.json"}
    local = Path(client.download_artifacts(tracker.run_id, "", str(tmp_path)))
    assert "kl_coef: 0.1" in (local / "config.yaml").read_text()
    assert "uri: http://***@127.0.0.1:" in (local / "config.yaml").read_text()
    assert "SECRET" not in (local / "config.yaml").read_text()
    assert json.loads((local / "deepspeed" / "value.json").read_text()) == DS_CONFIGS["value"]
    table = json.loads((local / "samples" / "iter_000002.json").read_text())
    assert table["columns"] == ["prompt", "response", "score"]
    assert table["data"][2] == ["p2", "r2", 2.0]
    # the tag through which the UI shows it as a table
    logged = json.loads(client.get_run(tracker.run_id).data.tags["mlflow.loggedArtifacts"])
    assert {"path": "samples/iter_000002.json", "type": "table"} in logged


def test_where_names_run_and_server(server_run):
    cfg, tracker, _ = server_run
    line = tracker.where()
    assert tracker.run_id in line and cfg.tracking.uri.replace("alice:SECRET", "***") in line
    assert "SECRET" not in line


def test_resume_continues_same_run_without_duplicates(mlflow_uri, tmp_path, caplog):  # noqa: F811
    cfg = make_cfg(tmp_path, uri=mlflow_uri, experiment="ds_ppo_resume")
    first = open_tracker(cfg, is_main=True, run_id=None, tags=TAGS)
    log_steps(first, [1, 2, 3], samples_at=[3])
    first.close("KILLED")  # crashed after iteration 3; the checkpoint is from iteration 1

    # resumed with a changed config: params are immutable in MLflow, so they stay
    cfg2 = make_cfg(tmp_path, uri=mlflow_uri, experiment="ds_ppo_resume")
    cfg2 = cfg2.model_copy(update={"iterations": 200})
    with caplog.at_level(logging.WARNING, logger="ds_ppo.run.tracking"):
        again = open_tracker(cfg2, is_main=True, run_id=first.run_id, tags=TAGS)
    assert again.run_id == first.run_id and again.resumed
    assert "iterations=200" in caplog.text
    log_steps(again, [2, 3, 4, 5], samples_at=[3, 5])
    again.close()
    assert again.lost_calls == 0

    client = MlflowClient(tracking_uri=mlflow_uri)
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["iterations"] == "100"
    assert run.data.tags["ds_ppo.resumes"] == "1"
    for key in KEYS:
        assert history_steps(client, first.run_id, key) == [1, 2, 3, 4, 5], key
    paths = artifact_paths(client, first.run_id)
    assert {"samples/iter_000003.json", "samples/iter_000005.json",
            "resumes/1/config.yaml"} <= paths
    local = client.download_artifacts(first.run_id, "samples/iter_000003.json", str(tmp_path))
    assert len(json.loads(Path(local).read_text())["data"]) == 3  # not appended to twice
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_resume_of_unknown_run_starts_a_new_one(mlflow_uri, tmp_path, caplog):  # noqa: F811
    cfg = make_cfg(tmp_path, uri=mlflow_uri)
    with caplog.at_level(logging.WARNING, logger="ds_ppo.run.tracking"):
        tracker = open_tracker(cfg, is_main=True, run_id="0" * 32, tags={})
    assert tracker.run_id not in (None, "0" * 32)
    assert "starting a new run" in caplog.text
    tracker.close()


# ------------------------------------------------------------------- embedded default
def test_embedded_store_in_output_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    cfg = make_cfg(tmp_path, log_system_metrics=True)
    tracker = open_tracker(cfg, is_main=True, run_id=None, tags=TAGS)
    log_ds_configs(tracker)
    log_steps(tracker, [1, 2], samples_at=[1])
    time.sleep(1.0)  # a few system-metric samples
    tracker.close()

    store = (tmp_path / "run" / "mlruns").resolve()
    uri = f"sqlite:///{store / 'mlflow.db'}"
    assert (store / "mlflow.db").is_file()
    assert f"mlflow ui --backend-store-uri {uri}" in tracker.where()
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith((store / "artifacts").as_uri())
    assert history_steps(client, tracker.run_id, "loss/policy") == [1, 2]
    assert artifact_paths(client, tracker.run_id) >= {"config.yaml", "deepspeed/policy.json",
                                                      "samples/iter_000001.json"}
    assert any(k.startswith("system/cpu") for k in run.data.metrics), sorted(run.data.metrics)


# --------------------------------------------------------------------------- faults
def test_unreachable_server_fails_fast(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(TrackingError) as err:
        open_tracker(make_cfg(tmp_path, uri=uri), is_main=True, run_id=None, tags={})
    assert time.monotonic() - t0 < 20
    assert uri in str(err.value)
    assert "tracking.required=false" in str(err.value)
    assert "tracking.enabled=false" in str(err.value)


def test_unreachable_server_not_required_warns(tmp_path, caplog):
    uri = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="ds_ppo.run.tracking"):
        tracker = open_tracker(make_cfg(tmp_path, uri=uri, required=False), is_main=True,
                               run_id=None, tags={})
    assert isinstance(tracker, NullTracker) and tracker.run_id is None
    assert uri in caplog.text and "training without MLflow" in caplog.text


def test_credentials_of_a_tracking_uri_are_in_no_message(tmp_path, caplog):
    port = free_port()
    uri = f"https://alice:SECRET@127.0.0.1:{port}/mlflow?token=TOKEN&x=1"
    with caplog.at_level(logging.DEBUG):
        open_tracker(make_cfg(tmp_path, uri=uri, required=False), is_main=True, run_id=None,
                     tags={})
        with pytest.raises(TrackingError) as err:
            open_tracker(make_cfg(tmp_path, uri=uri), is_main=True, run_id=None, tags={})
    assert f"https://***@127.0.0.1:{port}/mlflow?token=***&x=***" in str(err.value)
    for text in (caplog.text, str(err.value)):
        assert "SECRET" not in text and "TOKEN" not in text
    assert redact("see http://u:p@h/x?a=b&c=d and /api?k=v or a?b=c") == (
        "see http://***@h/x?a=***&c=*** and /api?k=*** or a?b=c")


# --------------------------------------------------------------------------- disabled
def test_disabled_and_non_main_never_import_mlflow(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from ds_ppo.config import Config
        from ds_ppo.run.tracking import NullTracker, open_tracker
        base = {{"policy": {{"arch": {{"model_type": "llama"}}}},
                 "reward": {{"function": "ds_ppo.rewards:positive_words"}},
                 "output_dir": {str(tmp_path / "run")!r}}}
        off = Config.model_validate({{**base, "tracking": {{"enabled": False}}}})
        on = Config.model_validate(base)
        for cfg, is_main in ((off, True), (on, False)):
            t = open_tracker(cfg, is_main=is_main, run_id=None, tags={{}})
            assert isinstance(t, NullTracker) and t.run_id is None
            t.log_metrics({{"a": 1.0}}, step=1); t.log_samples([], step=1); t.close("FAILED")
        assert "mlflow" not in sys.modules, "mlflow was imported"
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "run" / "mlruns").exists()


# ---------------------------------------------------------- last: kills the server
def test_server_killed_mid_run(mlflow_server, tmp_path, caplog):  # noqa: F811
    """The session's server dies after iteration 1 (a later user of `mlflow_uri` restarts it)."""
    uri = mlflow_server.ensure_running()
    try:
        tracker = open_tracker(make_cfg(tmp_path, uri=uri), is_main=True, run_id=None,
                               tags=TAGS)
        log_steps(tracker, [1])
        assert tracker.lost_calls == 0
    finally:
        mlflow_server.stop(kill=True)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ds_ppo.run.tracking"):
        log_steps(tracker, [2, 3, 4, 5], samples_at=[4])
        tracker.log_text("late", "notes.txt")
        tracker.close("FINISHED")
    assert time.monotonic() - t0 < 30
    assert tracker.lost_calls == 4 + 1 + 1 + 1  # metrics, samples, text, set_terminated
    assert caplog.text.count("MLflow unreachable") == 1
    assert "7 MLflow log calls were lost" in caplog.text
    # what reached the server before it died is in its database
    client = MlflowClient(tracking_uri=mlflow_server.db_uri)
    assert history_steps(client, tracker.run_id, "loss/policy") == [1]
    assert client.get_run(tracker.run_id).data.params["ppo.kl_coef"] == "0.1"


def test_lora_settings_and_trainable_counts_are_params(tmp_path):
    cfg = Config.model_validate({
        "policy": {"arch": {"model_type": "llama", "hidden_size": 64},
                   "lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]}},
        "reward": {"function": "ds_ppo.rewards:positive_words"},
        "output_dir": str(tmp_path / "run")})
    tracker = open_tracker(cfg, is_main=True, run_id=None, tags=TAGS)
    tracker.log_params({"policy.trainable_params": "16384", "value.trainable_params": "123264"})
    tracker.close()
    # a resumed run keeps the params it has (MLflow refuses to change one)
    again = open_tracker(cfg, is_main=True, run_id=tracker.run_id, tags=TAGS)
    again.log_params({"policy.trainable_params": "1"})
    again.close()
    assert again.lost_calls == 0
    store = (tmp_path / "run" / "mlruns").resolve()
    params = MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}") \
        .get_run(tracker.run_id).data.params
    assert params["policy.lora.r"] == "8" and params["policy.lora.alpha"] == "16.0"
    assert params["policy.lora.target_modules"] == "['q_proj', 'v_proj']"
    assert params["value.lora"] == "None"
    assert params["policy.trainable_params"] == "16384"
    assert params["value.trainable_params"] == "123264"
