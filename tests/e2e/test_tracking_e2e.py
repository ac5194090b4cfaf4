"""The tiny training against a real MLflow server (tests/support/mlflow_server.py), read back through
MlflowClient; resume continues the same run; unreachable at start fails fast; a server killed
mid-run loses log calls, not training; credentials in the URLs reach no output, a reward service
that fails for good keeps the last iteration, MLflow's telemetry stays off."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.mlflow_server import free_port, mlflow_server  # noqa: F401  (the session's server fixture)

from conftest import clean_env, read_metrics, run_cli

pytestmark = pytest.mark.slow

SMALL = ["ppo.rollout_batch_size=16", "ppo.mini_batch_size=8", "ppo.micro_batch_size=4",
         "generation.max_new_tokens=8", "checkpoint.every=2", "checkpoint.export_at_end=false",
         "tracking.log_samples_every=2", "tracking.num_samples=4"]

# the policy into the model registry at the checkpoint of iteration 2 and at each run's end;
# evaluations give the versions an eval_score
REGISTER = ["checkpoint.export_at_end=true", "tracking.register_model=ds_ppo_e2e_policy",
            "tracking.register_every=2", "data.eval_split=train[90%:]", "data.eval_every=2",
            "data.eval_size=8"]


def _client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _run_of(uri, output_dir):
    client = _client(uri)
    exp = client.get_experiment_by_name("ds_ppo_e2e")
    runs = [r for r in client.search_runs([exp.experiment_id])
            if r.data.params.get("output_dir") == str(output_dir)]
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]


@pytest.fixture(scope="module")
def tracked(mlflow_server, tmp_path_factory):  # noqa: F811
    mlflow_server.ensure_running()
    mlflow_uri = mlflow_server.uri
    work = tmp_path_factory.mktemp("tracked")
    out = work / "out"
    args = ["train", *SMALL, f"tracking.uri={mlflow_uri}", "tracking.experiment=ds_ppo_e2e",
            f"output_dir={out}", *REGISTER]
    first = run_cli([*args, "iterations=4"], cwd=work)
    client, run = _run_of(mlflow_uri, out)
    first_id = run.info.run_id
    resumed = run_cli([*args, "iterations=6"], cwd=work)
    return mlflow_uri, out, first_id, first, resumed


def test_run_params_metrics_tags_artifacts(tracked):
    uri, out, run_id, first, _ = tracked
    client, run = _run_of(uri, out)
    p = run.data.params
    assert p["ppo.kl_coef"] == "0.02" and p["ppo.rollout_batch_size"] == "16"
    assert p["policy.arch.hidden_size"] == "64"
    for key in ("score/mean", "loss/policy", "kl/sequence_mean", "time/generation_s"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [1, 2, 3, 4, 5, 6]
    tags = run.data.tags
    assert tags["world_size"] == "1" and tags["num_nodes"] == "1"
    assert tags["version.deepspeed"] and tags["version.torch"] and tags["version.transformers"]
    assert tags["policy"] == "arch:llama"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "deepspeed", "samples"} <= artifacts
    roles = {a.path for a in client.list_artifacts(run.info.run_id, "deepspeed")}
    assert roles == {"deepspeed/policy.json", "deepspeed/value.json", "deepspeed/reference.json"}
    samples = {a.path for a in client.list_artifacts(run.info.run_id, "samples")}
    assert "samples/iter_000002.json" in samples and "samples/iter_000006.json" in samples
    # the logged number is the whole job's: it equals metrics.jsonl, written from the same dict
    rows = read_metrics(out)
    hist = client.get_metric_history(run.info.run_id, "score/mean")
    assert [m.value for m in hist] == pytest.approx([r["score/mean"] for r in rows])


def test_samples_and_evaluations_are_printed_and_kept_beside_mlflow(tracked, capsys):
    """Each evaluation prints a line; samples.jsonl holds the rows of MLflow's samples and
    eval_samples tables (once each across the resume), and `ds-ppo samples` reads them back."""
    import json

    from ds_ppo.cli import main

    uri, out, run_id, first, resumed = tracked
    assert "eval    2/4 | score +" in first.stdout and "eval    4/4 | score +" in first.stdout
    assert "eval    6/6 | score +" in resumed.stdout
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["split"]) for r in rows] == [
        (i, split) for i in (2, 4, 6) for split in ("train",) * 4 + ("eval",) * 4]
    # the tiny model samples byte-fallback pieces (half its vocabulary): shown by name, never
    # as U+FFFD or a control character
    texts = [r["response"] for r in rows]
    assert not any("\ufffd" in t or any(c < " " and c not in "\n\t" for c in t) for t in texts)
    assert any("<0x" in t for t in texts)
    client = _client(uri)
    for split, table in (("train", "samples"), ("eval", "eval_samples")):
        path = client.download_artifacts(run_id, f"{table}/iter_000004.json", str(out.parent))
        logged = json.loads(open(path).read())
        mine = [r for r in rows if r["iteration"] == 4 and r["split"] == split]
        table = [dict(zip(logged["columns"], values)) for values in logged["data"]]
        assert [(t["prompt"], t["response"]) for t in table] == [
            (r["prompt"], r["response"]) for r in mine]
        # (MLflow's JSON table keeps 10 significant digits)
        assert [t["score"] for t in table] == pytest.approx([r["score"] for r in mine], rel=1e-8)
    assert main(["samples", str(out), "--iteration", "4", "--split", "eval"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"iteration 4: 4 samples from {out}/samples.jsonl")
    assert f"response: {mine[0]['response']!r}" in shown
    assert main(["samples", str(out), "--iteration", "3"]) == 2
    assert "iterations with samples: 2, 4, 6" in capsys.readouterr().err


def test_resume_continues_the_same_run(tracked):
    uri, out, run_id, _, resumed = tracked
    client, run = _run_of(uri, out)
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert "resumed from" in resumed.stdout


def test_registered_versions_load_back_and_generate_the_exports_tokens(tracked):
    """The checkpoint of iteration 2 and both runs' exports (iterations 4 and 6) are versions of
    tracking.register_model, tagged with the run, iteration, eval score and config hash; the
    latest loads back with the transformers flavour and generates the export's greedy tokens."""
    from support.registry_checks import export_greedy, registered_greedy

    uri, out, run_id, _, _ = tracked
    client = _client(uri)
    versions = sorted(client.search_model_versions("name='ds_ppo_e2e_policy'"),
                      key=lambda v: int(v.version))
    assert [v.tags["iteration"] for v in versions] == ["2", "4", "6"]
    rows = {r["iteration"]: r for r in read_metrics(out)}
    for v in versions:
        assert v.run_id == run_id and v.tags["run_id"] == run_id
        assert v.source == f"runs:/{run_id}/policy/iter_{int(v.tags['iteration']):06d}"
        assert float(v.tags["eval_score"]) == pytest.approx(
            rows[int(v.tags["iteration"])]["eval/score_mean"])
        assert v.tags["flavor"] == "transformers" and len(v.tags["config_hash"]) == 16
    assert versions[0].tags["config_hash"] != versions[2].tags["config_hash"]  # iterations=4/6
    assert registered_greedy(uri, "ds_ppo_e2e_policy", versions[-1].version) == \
        export_greedy(out / "final")


# ------------------------------------------------- secrets, a service that fails, telemetry
# Every character a URL allows in a password (RFC 3986: unreserved, sub-delims, ':' and a
# percent-encoded '@') and in a query value ('&' and '#' would end it); each starts with a
# prefix found nowhere else, searched for as written, percent-decoded and JSON-escaped.
USER, PASSWORD = "Usr-._~!$'()*+,;=Z", "Pwd-._~!$&'()*+,;=:%40Z"
TOKEN = "Tok-._~!$'()*+,;=:@/?%26Z"
PREFIXES = (b"Usr-._~", b"Pwd-._~", b"Tok-._~")


class _Service:
    """A reward service on 127.0.0.1 that scores the first request (iteration 1) and answers
    every later one with HTTP 400: a service that fails for good at iteration 2."""

    def __init__(self) -> None:
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from ds_ppo.rewards import positive_words

        count = [0]

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                count[0] += 1
                status, body = (200, json.dumps({"scores": positive_words(
                    req["prompts"], req["responses"])})) if count[0] == 1 else (400, "no")
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.port = self.httpd.server_port

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def leaky(mlflow_server, tmp_path_factory):  # noqa: F811
    """One run given credentials in both URLs (tracking.uri, reward.url), whose reward service
    fails for good at iteration 2; run as a user's shell would (no CI variables, its own
    XDG_CONFIG_HOME, where MLflow's telemetry would leave its installation id)."""
    mlflow_server.ensure_running()
    work = tmp_path_factory.mktemp("leaky")
    service = _Service()
    tracking = mlflow_server.uri.replace("http://", f"http://{USER}:{PASSWORD}@")
    out = work / "out"
    env = clean_env(XDG_CONFIG_HOME=str(work / "xdg"))
    for name in ("PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS"):
        env.pop(name, None)
    proc = run_cli(["train", *SMALL, "iterations=3", "checkpoint.every=5",
                    f"tracking.uri={tracking}", "tracking.experiment=ds_ppo_leaky",
                    "reward.function=null",
                    f"reward.url=http://{USER}:{PASSWORD}@127.0.0.1:{service.port}/s?k={TOKEN}",
                    f"output_dir={out}"], cwd=work, env=env, check=False)
    service.close()
    return work, out, proc


def test_credentials_are_in_no_output_file_store_or_stream(leaky, mlflow_server):  # noqa: F811
    work, out, proc = leaky
    assert "View run" in proc.stdout  # MLflow's own line, with the URI, went through redaction
    places = {"stdout": proc.stdout.encode(), "stderr": proc.stderr.encode()}
    for root in (out, mlflow_server.root):
        places.update({str(p): p.read_bytes() for p in Path(root).rglob("*") if p.is_file()})
    leaks = [(where, prefix) for where, data in places.items() for prefix in PREFIXES
             if prefix in data or prefix in data.replace(b"\\", b"")]
    assert not leaks, leaks
    assert "reward.url = http://***@127.0.0.1:" in proc.stderr  # the error names the URL, masked


def test_a_service_that_fails_for_good_keeps_the_last_completed_iteration(leaky):
    _, out, proc = leaky
    assert proc.returncode == 2, proc.stderr[-3000:]
    ckpt = out / "checkpoints" / "iter_000001"
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_000001"
    assert f"the last completed iteration's checkpoint is {ckpt}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_mlflow_telemetry_is_off(leaky):
    work, _, _ = leaky
    assert not (work / "xdg" / "mlflow").exists()  # MLflow writes its installation id there


# (after the tests of the shared run: this one kills the session's server)
def test_unreachable_server_fails_fast_before_models_load(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"
    t0 = time.time()
    proc = run_cli(["train", *SMALL, f"tracking.uri={uri}", f"output_dir={tmp_path / 'o'}"],
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert uri in proc.stderr and "tracking.required=false" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o" / "init_models").exists()  # no model was built
    assert time.time() - t0 < 120


def test_server_killed_mid_run_training_continues(mlflow_server, tmp_path):  # noqa: F811
    mlflow_server.ensure_running()
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ds_ppo", "train", *SMALL, f"tracking.uri={mlflow_server.uri}",
           "tracking.experiment=ds_ppo_e2e", "iterations=6", f"output_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 2:
            break
        time.sleep(0.2)
    mlflow_server.stop(kill=True)
    stdout, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout[-4000:]
    assert [r["iteration"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_000006"
    assert "MLflow unreachable" in stdout and "log calls were lost" in stdout
