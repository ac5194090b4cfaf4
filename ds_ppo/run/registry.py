"""The trained policy in the MLflow model registry (`tracking.register_model: NAME`).

At the end of training (and, with `tracking.register_every`, at checkpoints) rank 0 logs the
policy into the run and registers it as a new version of NAME:

- `tracking.register_copy: true` (default): the Hugging Face directory is logged as an MLflow
  model with the transformers flavour at `policy/iter_<iteration>` (loadable with
  `mlflow.transformers.load_model("models:/NAME/<version>")`). Should the flavour fail with the
  installed packages, the directory's files are logged there as they are (load them with
  `from_pretrained` after `mlflow.artifacts.download_artifacts`).
- `false` (very large models): nothing is copied; `policy/iter_<iteration>/reference.json` and
  the version's `export_dir` tag name the directory, which must stay where it is (a shared
  file system). A local path cannot be the version's source itself: an MLflow server refuses
  local sources outside the run's artifact directory.

Every version is tagged `run_id`, `iteration`, `config_hash` (see `config_hash`) and, when the
run evaluated, `eval_score` (the last `eval/score_mean`). A run registers each iteration once:
the same command run again (a retry, or a finished run resumed) finds the version by its run id
and iteration tag and registers nothing. Registration never stops a training: a failure at a
checkpoint is a warning; a failure at the end (after the export, everything saved) ends the
command with exit code 4 and a last line that says what to retry.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_ppo.config import Config

log = logging.getLogger("ds_ppo")


def config_hash(cfg: Config) -> str:
    """16 hex digits of the SHA-256 of the resolved config (JSON, sorted keys, reward.url
    without credentials): equal configs give equal hashes."""
    from ds_ppo.redaction import redact_url

    data = cfg.to_dict()
    data["reward"]["url"] = redact_url(data["reward"].get("url"))
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def last_eval_score(history: list[dict[str, float]]) -> float | None:
    """The latest `eval/score_mean` of this process's iterations, if any."""
    scores = [m["eval/score_mean"] for m in history if "eval/score_mean" in m]
    return scores[-1] if scores else None


def register_at_checkpoint(cfg: Config, tracker, checkpoint: str | Path, iteration: int,
                           history: list[dict[str, float]]) -> Any:
    """Register checkpoint/hf when `tracking.register_every` asks for this iteration (not the
    run's last one with an export at the end: that export is registered instead)."""
    every = cfg.tracking.register_every
    if not every or iteration % every or (iteration == cfg.iterations
                                          and cfg.checkpoint.export_at_end):
        return None
    from ds_ppo.engine import dist

    # rank 0 alone loads, converts and uploads the model (minutes at 70B): the other ranks wait
    # for it without a collective, whose timeout could fire (collective: every rank calls this)
    return dist.main_does(
        lambda: register_policy(cfg, tracker, Path(checkpoint) / "hf", iteration,
                                last_eval_score(history)),
        Path(checkpoint).parent, f"registering {checkpoint} in the MLflow model registry")


def register_policy(cfg: Config, tracker, model_dir: str | Path | None, iteration: int,
                    eval_score: float | None = None, strict: bool = False) -> Any:
    """Rank 0 (a tracker with a run): log `model_dir` into the run and register it as a new
    version of tracking.register_model, unless the run already registered this iteration (then
    that version). -> the ModelVersion, or None (not configured, not rank 0, or failed: warned;
    with `strict`, a failure raises RegistrationError instead, exit code 4)."""
    name = cfg.tracking.register_model
    if name is None or model_dir is None:
        return None
    if getattr(tracker, "client", None) is None:  # a NullTracker: another rank, or no MLflow
        if _is_main():
            _failed(f"tracking.register_model = {name!r}: no MLflow run to register from "
                    f"(tracking unavailable); {model_dir} is not registered", strict)
        return None
    model_dir = Path(model_dir).resolve()
    try:
        return _register(cfg, tracker, name, model_dir, iteration, eval_score)
    except Exception as err:  # the training is done and saved: say so, and how to retry
        _failed(f"tracking.register_model = {name!r}: registering {model_dir} failed: "
                f"{type(err).__name__}: {str(err)[:500]}; the model is on disk, register it by "
                "hand (mlflow.register_model) or rerun the same command with the tracking "
                "server reachable (it registers each run's iteration once)", strict)
        return None


def _failed(message: str, strict: bool) -> None:
    if strict:
        from ds_ppo.errors import RegistrationError

        raise RegistrationError(f"training finished and saved, but {message}") from None
    log.warning("%s", message)


def registered_version(client, name: str, run_id: str, iteration: int) -> Any:
    """The version of `name` this run already registered for `iteration`, or None."""
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    except MlflowException:  # no such registered model yet
        return None
    for v in versions:
        if (v.tags or {}).get("iteration") == str(iteration):
            return v
    return None


def _is_main() -> bool:
    from ds_ppo.engine import dist

    return dist.is_main()


def _register(cfg: Config, tracker, name: str, model_dir: Path, iteration: int,
              eval_score: float | None) -> Any:
    from mlflow.exceptions import MlflowException

    client, run_id = tracker.client, tracker.run_id
    done = registered_version(client, name, run_id, iteration)
    if done is not None:  # the same command run again (a retry, a finished run resumed)
        log.info("the policy of iteration %d is already %s version %s (run %s): not registered "
                 "again", iteration, name, done.version, run_id)
        return done
    path = f"policy/iter_{iteration:06d}"
    tags = {"run_id": run_id, "iteration": str(iteration), "config_hash": config_hash(cfg)}
    if eval_score is not None:
        tags["eval_score"] = repr(float(eval_score))
    if cfg.tracking.register_copy:
        tags["flavor"] = _log_model(client, run_id, model_dir, path, Path(cfg.output_dir))
    else:
        tags["export_dir"] = str(model_dir)
        _bounded(lambda: client.log_dict(
            run_id, {"export_dir": str(model_dir), "format": "huggingface",
                     "load": "AutoModelForCausalLM.from_pretrained(export_dir)"},
            f"{path}/reference.json"), "logging the reference")
    try:
        _bounded(lambda: client.create_registered_model(name), "creating the registered model")
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version = _bounded(lambda: client.create_model_version(
        name, f"runs:/{run_id}/{path}", run_id=run_id, tags=tags,
        description=f"ds_ppo policy after iteration {iteration} ({model_dir})"),
        "creating the model version")
    log.info("registered the policy of iteration %d as %s version %s%s", iteration, name,
             version.version, "" if cfg.tracking.register_copy else f" (by reference: {model_dir})")
    return version


# Whole-call deadline of each registry metadata call (a server that answers a byte at a time
# defeats MLflow's per-read MLFLOW_HTTP_REQUEST_TIMEOUT); the model upload itself is not bounded
REGISTRY_CALL_S = 120.0


def _bounded(fn, what: str):
    from ds_ppo.http_deadline import call_within

    return call_within(fn, REGISTRY_CALL_S, f"the MLflow registry call {what}")


def _log_model(client, run_id: str, model_dir: Path, path: str, scratch: Path) -> str:
    """Log model_dir at `path` in the run; -> the flavour used (transformers, or files)."""
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch, prefix=".register_") as tmp:
        try:
            saved = _save_transformers_model(model_dir, Path(tmp) / "model")
        except Exception as err:
            log.warning("the MLflow transformers flavour failed (%s: %s); logging %s as plain "
                        "files (load with from_pretrained after download_artifacts)",
                        type(err).__name__, str(err)[:300], model_dir)
            saved = None
        client.log_artifacts(run_id, str(saved or model_dir), path)
    return "transformers" if saved else "files"


def _save_transformers_model(model_dir: Path, target: Path) -> Path:
    import warnings

    import mlflow.transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # explicit requirements: MLflow's inference imports optional packages (torchvision)
        mlflow.transformers.save_model({"model": model, "tokenizer": tokenizer}, str(target),
                                       task="text-generation", pip_requirements=_requirements())
    return target


def _requirements() -> list[str]:
    reqs = []
    for dist_name in ("torch", "transformers", "safetensors", "accelerate"):
        try:
            version = importlib.metadata.version(dist_name).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
        reqs.append(f"{dist_name}=={version}")
    return reqs
