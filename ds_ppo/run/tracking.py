"""MLflow tracking: one run per training, written by rank 0 alone.

The trainer reduces every metric across the data-parallel group first (mean, or max for
memory and seconds; see ds_ppo.metrics), so the numbers rank 0 logs describe the whole
job. Every other rank gets a `NullTracker` and never imports mlflow; neither does any rank
when `tracking.enabled=false` (the GPU image has no mlflow).

What a run holds
    experiment `tracking.experiment`, name `tracking.run_name` (default: output_dir's name);
    tags: those the trainer passes (world size, node count, model names), `tracking.tags`,
    `version.<package>` for ds_ppo/deepspeed/torch/transformers, the git commit of the
    working directory (`mlflow.source.git.commit`) when it is a git checkout;
    params: every config field, flattened (`ppo.kl_coef`, `policy.arch.hidden_size`);
    metrics: each iteration's, with step = iteration;
    artifacts: `config.yaml` (the resolved config), `deepspeed/<role>.json` (each role's
    final DeepSpeed config), `samples/iter_<step>.json` (a table of prompts, responses and
    scores every `tracking.log_samples_every` iterations, logged with `log_table` so the
    UI shows it as a table); with `tracking.register_model`, `policy/iter_<step>/` (the
    policy registered as a model version: ds_ppo.run.registry);
    with `tracking.log_system_metrics` and psutil installed: MLflow's `system/...` CPU,
    memory, disk, network (and GPU, with pynvml) metrics, whose step counts samples
    (one every 10 s, or $MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL), not iterations.

Where it goes
    `tracking.uri`, else $MLFLOW_TRACKING_URI, else an embedded SQLite store in
    `<output_dir>/mlruns/mlflow.db` with artifacts in `<output_dir>/mlruns/artifacts`: no
    server needed; look at it with `mlflow ui --backend-store-uri sqlite:///<abs>/mlruns/mlflow.db`
    (`Tracker.where()` prints the exact line). SQLite, not a `./mlruns` directory: MLflow 3
    refuses the file store unless MLFLOW_ALLOW_FILE_STORE=true.

Multi-node
    A multi-node `deepspeed` launch (a hostfile with more than one host, or --force_multi;
    backends pdsh, openmpi, mpich, impi, mvapich, slurm) copies to every node the
    environment variables whose names start with MLFLOW, PYTHON, MV2 or UCX (and NCCL with
    the CUDA accelerator): `EXPORT_ENVS` in deepspeed/launcher/runner.py, plus every
    KEY=VALUE line of a `.deepspeed_env` file in $HOME or the launch directory (file name
    overridable with $DS_ENV_FILE). So MLFLOW_TRACKING_URI, MLFLOW_TRACKING_USERNAME/
    PASSWORD/TOKEN and MLFLOW_HTTP_REQUEST_* set where `deepspeed --hostfile ...` runs reach
    rank 0 on whichever node it lands. The pdsh backend writes them as `export KEY=VALUE;`
    without quoting: keep such values free of spaces and shell characters. A single-node
    launch simply inherits the environment; with --no_ssh (one launcher per node, started
    by hand) nothing is copied: set the variables on every node.

Faults
    Start: the first contact (find/create the experiment, create/reopen the run) failing
    raises `TrackingError` naming the URI and the fixes, or with `tracking.required=false`
    warns and returns a `NullTracker`. Mid-run: every MLflow call is guarded; a failure
    warns once, the call is counted in `lost_calls` and training goes on (metrics.jsonl
    in output_dir keeps everything); after a failure, calls are dropped without trying
    for `RETRY_AFTER_S` seconds so a dead server costs at most one timeout per
    interval. `close()` reports how many calls were lost. HTTP requests are bounded by
    setting MLFLOW_HTTP_REQUEST_TIMEOUT / MLFLOW_HTTP_REQUEST_MAX_RETRIES for this process
    unless the user set them (MLflow's defaults, 120 s and 7 retries, block for minutes).

Resume
    Given the run id saved in the checkpoint, the same run is reopened (status RUNNING
    again); params are immutable in MLflow and are not logged again (changed values are
    warned about, and the new config is kept as `resumes/<k>/config.yaml`); metric steps
    and sample tables up to the last step the run already holds are skipped, so a resume
    from an earlier checkpoint does not duplicate steps.
"""
from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import os
import re
import shlex
import subprocess
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import yaml

from ds_ppo.errors import UserError
from ds_ppo.redaction import redact, redact_output, redact_tree, register_secret, register_url

if TYPE_CHECKING:
    from ds_ppo.config import Config

log = logging.getLogger(__name__)

# Bounded HTTP for this process unless the user chose otherwise: a dead server costs
# (1 + retries) * timeout at worst, per attempt.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1"}
RETRY_AFTER_S = 30.0  # after a failed call, drop calls (counted as lost) this long
VERSION_PACKAGES = {"ds_ppo": "ds-ppo", "deepspeed": "deepspeed", "torch": "torch",
                    "transformers": "transformers"}
STATUSES = ("FINISHED", "FAILED", "KILLED")
# MLflow's limits (mlflow.utils.validation), used when mlflow does not say
_MAX_KEY, _MAX_PARAM_VALUE, _MAX_TAG_VALUE, _MAX_PER_BATCH = 250, 6000, 8000, 100
_MAX_METRICS_PER_BATCH = 1000
_BAD_KEY_CHARS = re.compile(r"[^\w./\- :]")


class TrackingError(UserError):
    """MLflow cannot be used as configured (server unreachable, mlflow missing, ...)."""


class Tracker(Protocol):
    run_id: str | None
    lost_calls: int

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_samples(self, rows: list[dict], step: int, name: str = "samples") -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_dict(self, obj: dict, artifact_file: str) -> None: ...
    def log_params(self, params: dict[str, str]) -> None: ...
    def set_tag(self, key: str, value: str) -> None: ...
    def close(self, status: str = "FINISHED") -> None: ...
    def where(self) -> str: ...


class NullTracker:
    """Logs nothing: ranks other than 0, `tracking.enabled=false`, or an optional server away."""

    run_id: str | None = None
    lost_calls: int = 0

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_samples(self, rows: list[dict], step: int, name: str = "samples") -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_dict(self, obj: dict, artifact_file: str) -> None:
        pass

    def log_params(self, params: dict[str, str]) -> None:
        pass

    def set_tag(self, key: str, value: str) -> None:
        pass

    def close(self, status: str = "FINISHED") -> None:
        pass

    def where(self) -> str:
        return "MLflow: not tracking"


# ---------------------------------------------------------------------------- helpers
def resolve_uri(cfg: Config) -> tuple[str, bool]:
    """(tracking URI, whether it is the embedded store in output_dir)."""
    uri = cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri, False
    return f"sqlite:///{embedded_dir(cfg) / 'mlflow.db'}", True


def embedded_dir(cfg: Config) -> Path:
    return Path(cfg.output_dir).resolve() / "mlruns"


def clean_key(key: str) -> str:
    """A metric/param/tag key MLflow accepts: our `loss/policy` stays, other characters -> `_`."""
    key = _BAD_KEY_CHARS.sub("_", str(key)).strip("/") or "_"
    key = "/".join(p if p not in ("", ".", "..") else "_" for p in key.split("/"))
    return key[:_MAX_KEY]


def flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """Nested config dict -> {"ppo.kl_coef": "0.1", ...}; dicts flatten, other values str()."""
    if isinstance(obj, dict) and (obj or not prefix):
        out: dict[str, str] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: str(obj)}


def version_tags() -> dict[str, str]:
    tags = {}
    for name, dist_name in VERSION_PACKAGES.items():
        try:
            tags[f"version.{name}"] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return tags


def git_commit(cwd: str | os.PathLike | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40,64}", commit) else None


def run_tags(cfg: Config, tags: dict[str, str]) -> dict[str, str]:
    """Tags of a new run: versions, git commit, the trainer's, then the user's (which win)."""
    out = version_tags()
    commit = git_commit()
    if commit:
        out["mlflow.source.git.commit"] = out["git.commit"] = commit
    out["mlflow.source.name"] = "ds_ppo"
    try:
        import getpass

        out["mlflow.user"] = getpass.getuser()
    except Exception:  # no user name in a container is no reason to fail
        pass
    out.update({str(k): str(v) for k, v in tags.items()})
    out.update(cfg.tracking.tags)
    return {clean_key(k): v[:_MAX_TAG_VALUE] for k, v in out.items()}


def ui_hint(uri: str, experiment_id: str | None = None, run_id: str | None = None) -> str:
    if uri.startswith(("http://", "https://")):
        if experiment_id and run_id:
            return f"open {uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
        return f"open {uri}"
    return f"mlflow ui --backend-store-uri {shlex.quote(uri)}"


def _bound_http_time() -> None:
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)


def quiet_mlflow() -> None:
    """Before mlflow is first imported (the CLI calls it first thing: deepspeed imports mlflow):
    no usage telemetry (MLflow 3.2+ sends it by default, from a thread, and writes an
    installation id to ~/.config/mlflow) unless the user set MLFLOW_DISABLE_TELEMETRY."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def protect_secrets(uri: str) -> None:
    """The tracking URI's and MLflow's credentials are hidden in everything this process logs
    or prints (MLflow prints the run's URL with the URI's user:password at the run's end)."""
    register_url(uri)
    for name in ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        register_secret(os.environ.get(name))
    redact_output()


def _setup_failed(cfg: Config, uri: str, err: BaseException) -> NullTracker:
    msg = redact(f"cannot use MLflow at {uri}: {type(err).__name__}: {err}\n"
                 "  fix: start the tracking server (or correct tracking.uri / "
                 "$MLFLOW_TRACKING_URI), or train without it: tracking.required=false (warn and "
                 "continue) or tracking.enabled=false (no MLflow at all)")
    if cfg.tracking.required:
        raise TrackingError(msg) from err
    log.warning("%s; tracking.required=false: training without MLflow", msg.splitlines()[0])
    return NullTracker()


# ---------------------------------------------------------------------------- opening
def open_tracker(cfg: Config, *, is_main: bool, run_id: str | None,
                 tags: dict[str, str]) -> Tracker:
    """The tracker of this process: an MLflow run on rank 0, a `NullTracker` elsewhere.

    run_id: the run to continue (resume), or None for a new run. tags: the trainer's run
    tags (world size, node count, model names). The DeepSpeed configs come later (the tracker
    opens before the engines, so an unreachable server fails fast): `log_dict` them.
    Raises TrackingError when MLflow cannot be reached and tracking.required is true.
    """
    if not is_main or not cfg.tracking.enabled:
        return NullTracker()
    uri, embedded = resolve_uri(cfg)
    protect_secrets(uri)
    quiet_mlflow()
    try:
        import mlflow  # noqa: F401  (deferred: disabled tracking never imports it)
    except ImportError as err:
        return _setup_failed(cfg, uri, ImportError(
            f"{err} (pip install mlflow, or set tracking.enabled=false)"))
    _bound_http_time()
    try:
        tracker = MlflowTracker.connect(cfg, uri, embedded, run_id)
    except Exception as err:
        return _setup_failed(cfg, uri, err)
    tracker.record_setup(cfg, tags)
    return tracker


class MlflowTracker:
    """One MLflow run, addressed by id through an `MlflowClient` (no global active run)."""

    def __init__(self, client: Any, uri: str, experiment_id: str, run_id: str,
                 resumed: bool, logged_upto: int | None = None,
                 old_params: dict[str, str] | None = None, resume_count: int = 0) -> None:
        self.client, self.uri, self.experiment_id, self.run_id = client, uri, experiment_id, run_id
        self.local_log = "output_dir/metrics.jsonl"  # named in warnings; set by record_setup
        self.resumed = resumed
        self.logged_upto = logged_upto  # resume: steps <= this are already in the run
        self.lost_calls = 0
        self._old_params = old_params or {}
        self._resume_count = resume_count
        self._failed_at: float | None = None  # time of the last failed call, None when healthy
        self._warned = False
        self._closed = False
        self._monitor: Any = None

    # ---- start
    @classmethod
    def connect(cls, cfg: Config, uri: str, embedded: bool, run_id: str | None) -> MlflowTracker:
        """First contact: find/create the experiment and create/reopen the run (may raise)."""
        from mlflow import MlflowClient

        if embedded:
            embedded_dir(cfg).mkdir(parents=True, exist_ok=True)
        client = MlflowClient(tracking_uri=uri)
        if run_id is not None:
            reopened = cls._reopen(client, uri, run_id)
            if reopened is not None:
                return reopened
        experiment_id = cls._experiment_id(client, cfg, embedded)
        name = cfg.tracking.run_name or Path(cfg.output_dir).resolve().name
        parent = cfg.tracking.parent_run_id  # a pipeline's step: shown as the parent's child
        run = client.create_run(experiment_id, run_name=name,
                                 tags={"mlflow.parentRunId": parent} if parent else None)
        return cls(client, uri, experiment_id, run.info.run_id, resumed=False)

    @classmethod
    def _reopen(cls, client: Any, uri: str, run_id: str) -> MlflowTracker | None:
        from mlflow.exceptions import MlflowException

        try:
            run = client.get_run(run_id)
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            run = None
        if run is None or run.info.lifecycle_stage == "deleted":
            log.warning("MLflow run %s of the checkpoint is not in %s (or was deleted); "
                        "starting a new run", run_id, uri)
            return None
        client.update_run(run_id, status="RUNNING")
        # the latest value of each key sits at its largest step (MLflow's own resume logic
        # in SystemMetricsMonitor reads it the same way); system metrics count samples.
        steps = [m.step for m in getattr(run.data, "_metric_objs", [])
                 if not m.key.startswith("system/")]
        resumes = int(run.data.tags.get("ds_ppo.resumes", "0")) + 1
        return cls(client, uri, run.info.experiment_id, run_id, resumed=True,
                   logged_upto=max(steps) if steps else None,
                   old_params=dict(run.data.params), resume_count=resumes)

    @staticmethod
    def _experiment_id(client: Any, cfg: Config, embedded: bool) -> str:
        name = cfg.tracking.experiment
        exp = client.get_experiment_by_name(name)
        if exp is None:
            location = (embedded_dir(cfg) / "artifacts").as_uri() if embedded else None
            try:
                return client.create_experiment(name, artifact_location=location)
            except Exception:
                exp = client.get_experiment_by_name(name)  # created meanwhile by another job
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            raise TrackingError(f"MLflow experiment {name!r} is deleted; restore it (mlflow "
                                "experiments restore) or choose another tracking.experiment")
        return exp.experiment_id

    def record_setup(self, cfg: Config, tags: dict[str, str]) -> None:
        """Tags, params and config of a new run; resume notes of an old one."""
        from mlflow.entities import Param, RunTag

        self.local_log = str(Path(cfg.output_dir) / "metrics.jsonl")
        config = redact_tree(cfg.to_dict())  # every string without credentials (reward.url)
        limit = self._limit("MAX_PARAM_VAL_LENGTH", _MAX_PARAM_VALUE)
        params = {clean_key(k): redact(v)[:limit] for k, v in flatten(config).items()}
        config_yaml = redact(yaml.safe_dump(config, sort_keys=False))
        if self.resumed:
            changed = sorted(k for k, v in params.items()
                             if k in self._old_params and self._old_params[k] != v)
            if changed:
                log.warning("resumed MLflow run %s keeps its original params; changed now: %s "
                            "(new config logged as resumes/%d/config.yaml)", self.run_id,
                            ", ".join(f"{k}={params[k]}" for k in changed), self._resume_count)
            self._guard(self.client.set_tag, self.run_id, "ds_ppo.resumes",
                        str(self._resume_count))
            self.log_text(config_yaml, f"resumes/{self._resume_count}/config.yaml")
        else:
            entities = ([RunTag(k, v) for k, v in run_tags(cfg, tags).items()]
                        + [Param(k, v) for k, v in params.items()])
            for i in range(0, len(entities), _MAX_PER_BATCH):
                chunk = entities[i:i + _MAX_PER_BATCH]
                self._guard(self.client.log_batch, self.run_id,
                            params=[e for e in chunk if isinstance(e, Param)],
                            tags=[e for e in chunk if isinstance(e, RunTag)])
            self.log_text(config_yaml, "config.yaml")
        if cfg.tracking.log_system_metrics:
            self._start_system_metrics()

    @staticmethod
    def _limit(name: str, default: int) -> int:
        try:
            import mlflow.utils.validation as v

            return int(getattr(v, name, default))
        except ImportError:
            return default

    def _start_system_metrics(self) -> None:
        try:
            import psutil  # noqa: F401  (MLflow's CPU/memory monitors need it)
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        except ImportError as err:
            log.warning("tracking.log_system_metrics: %s; no system metrics", err)
            return
        try:
            self._monitor = SystemMetricsMonitor(self.run_id, resume_logging=self.resumed,
                                                 tracking_uri=self.uri)
            self._monitor.start()
        except Exception as err:
            self._monitor = None
            log.warning("tracking.log_system_metrics: could not start MLflow's monitor: %s", err)

    # ---- logging
    def _guard(self, fn: Callable, *args: Any, force: bool = False, **kwargs: Any) -> bool:
        """Call fn; on failure warn once, count the call as lost and go on. True = done.

        Within RETRY_AFTER_S of a failure the call is dropped untried, unless `force`.
        """
        if self._closed:
            return False
        now = time.monotonic()
        if not force and self._failed_at is not None and now - self._failed_at < RETRY_AFTER_S:
            self.lost_calls += 1
            return False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # pandas/sqlalchemy deprecation noise
                fn(*args, **kwargs)
        except Exception as err:
            self.lost_calls += 1
            self._failed_at = time.monotonic()
            if not self._warned:
                self._warned = True
                log.warning("MLflow unreachable: %s: %s; training continues, metrics kept in "
                            "%s (retrying every %.0f s)", type(err).__name__, str(err)[:500],
                            self.local_log, RETRY_AFTER_S)
            return False
        if self._failed_at is not None:
            log.warning("MLflow reachable again; %d log calls lost so far", self.lost_calls)
            self._failed_at = None
        return True

    def _already_logged(self, step: int) -> bool:
        return self.logged_upto is not None and step <= self.logged_upto

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """One batch per call: every key at `step` (NaN kept; MLflow stores inf as +-max float)."""
        if self._already_logged(step) or not metrics:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        entries = [Metric(clean_key(k), float(v), ts, int(step)) for k, v in metrics.items()]
        for i in range(0, len(entries), _MAX_METRICS_PER_BATCH):
            self._guard(self.client.log_batch, self.run_id,
                        metrics=entries[i:i + _MAX_METRICS_PER_BATCH])

    def log_samples(self, rows: list[dict], step: int, name: str = "samples") -> None:
        """A table artifact <name>/iter_<step>.json (name: samples, or eval_samples for the
        evaluation's); columns = union of the rows' keys."""
        if self._already_logged(step) or not rows:
            return
        columns: list[str] = []
        for row in rows:
            columns += [k for k in row if k not in columns]
        table = {c: [_jsonable(row.get(c)) for row in rows] for c in columns}
        path = f"{name}/iter_{step:06d}.json"
        try:
            import pandas  # noqa: F401  (log_table needs it)
        except ImportError:
            self.log_dict({"columns": columns, "data": [[table[c][i] for c in columns]
                                                        for i in range(len(rows))]}, path)
            return
        self._guard(self.client.log_table, self.run_id, data=table, artifact_file=path)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._guard(self.client.log_text, self.run_id, text, artifact_file)

    def log_dict(self, obj: dict, artifact_file: str) -> None:
        self._guard(self.client.log_dict, self.run_id, obj, artifact_file)

    def log_params(self, params: dict[str, str]) -> None:
        """Params known only once the models are built (e.g. trainable parameter counts); a
        resumed run keeps those it has (MLflow params are write-once)."""
        from mlflow.entities import Param

        new = [Param(clean_key(k), v) for k, v in params.items()
               if clean_key(k) not in self._old_params]
        if new:
            self._guard(self.client.log_batch, self.run_id, params=new)

    def set_tag(self, key: str, value: str) -> None:
        """A run tag set (or replaced) during training, e.g. an alarm's message."""
        self._guard(self.client.set_tag, self.run_id, clean_key(key), value[:5000])

    def close(self, status: str = "FINISHED") -> None:
        """End the run with FINISHED, FAILED or KILLED; report lost calls. Idempotent."""
        if self._closed:
            return
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        if self._monitor is not None:
            self._guard(self._monitor.finish, force=True)
            self._monitor = None
        self._guard(self.client.set_terminated, self.run_id, status, force=True)
        self._closed = True
        if self.lost_calls:
            log.warning("%d MLflow log calls were lost (run %s in %s); %s has every "
                        "iteration's metrics", self.lost_calls, self.run_id, self.uri,
                        self.local_log)

    def where(self) -> str:
        return redact(f"MLflow: run {self.run_id} in {self.uri}; view with: "
                      f"{ui_hint(self.uri, self.experiment_id, self.run_id)}")


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (str, bool, int)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    try:
        return float(v)  # numpy / torch scalars
    except (TypeError, ValueError):
        return json.dumps(v, default=str) if isinstance(v, (list, dict)) else str(v)
