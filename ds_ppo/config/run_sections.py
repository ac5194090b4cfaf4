"""What a run records: MLflow tracking and checkpoints (saves, exports, verification)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from ds_ppo.config.section_base import Section


# --------------------------------------------------------------------------- tracking
class AlarmsConfig(Section):
    """When a run stops learning: its policy turned deterministic, its groups carry no signal,
    or a watched metric fell from its best (ds_ppo/run/alarms.py)."""

    enabled: bool = Field(
        True, description="Check each iteration's metrics; an alarm prints one warning line and "
        "logs the MLflow tag and metric alarm/<name> (1 in the iteration it fired). It fires "
        "when its condition starts to hold, and again only after the condition has been clear "
        "for as many iterations as it takes to fire. false: no checks.")
    entropy_floor: float = Field(
        0.02, ge=0, description="Alarm alarm/entropy: policy/entropy (nats per token) below this "
        "for entropy_iterations iterations in a row: the policy samples (nearly) one response, "
        "so group estimators see equal scores and learning stops. 0: off.")
    entropy_iterations: int = Field(
        10, gt=0, description="Iterations in a row below entropy_floor before alarm/entropy.")
    zero_std_ceiling: float = Field(
        0.95, gt=0, le=1, description="Alarm alarm/zero_std: group/zero_std_frac (the share of "
        "prompts whose samples_per_prompt responses all score alike: no advantage, no gradient) "
        "above this for zero_std_iterations iterations in a row. 1: off.")
    zero_std_iterations: int = Field(
        10, gt=0, description="Iterations in a row above zero_std_ceiling before alarm/zero_std.")
    zero_signal_iterations: int = Field(
        3, gt=0, description="alarm/zero_std fires sooner, after this many iterations in a row "
        "in which every response's advantage is 0 (advantage/zero_frac = 1: e.g. every group "
        "scored alike under grpo, dr_grpo or rloo with no batch baseline, "
        "ppo.zero_std_advantage): such a batch gives the policy no gradient at all. Needs "
        "zero_std_ceiling < 1.")
    watch: list[str] = Field(
        default_factory=list, description="Metrics whose fall is an alarm alarm/drop (e.g. "
        "[env/accuracy], [score/mean], [eval/score_mean]): when the mean over the last window "
        "iterations that logged it is more than max_drop below its best such mean. Each must be a "
        "metric the job logs with this config (docs/METRICS.md; env/<key> with an env). "
        "Empty: off.")
    max_drop: float = Field(
        0.2, gt=0, description="Alarm alarm/drop: how far (in the metric's units) a watched "
        "metric's moving mean may fall below its best.")
    window: int = Field(
        10, gt=0, description="Iterations in a watched metric's moving mean (those that logged "
        "it).")
    stop: bool = Field(
        False, description="For unattended runs: on the first alarm, save a checkpoint and stop "
        "with exit code 5 (resume with the same command once the settings are changed). Needs "
        "enabled and an alarm that can fire.")


class TrackingConfig(Section):
    enabled: bool = Field(True, description="Log to MLflow (false: mlflow is never imported).")
    uri: str | None = Field(
        None, description="Tracking URI; default $MLFLOW_TRACKING_URI, else a local store in "
        "output_dir/mlruns.")
    experiment: str = Field("ds_ppo", description="MLflow experiment name.")
    run_name: str | None = Field(None, description="MLflow run name; default output_dir's name.")
    tags: dict[str, str] = Field(default_factory=dict, description="Extra run tags.")
    required: bool = Field(
        True, description="Fail at start when the tracking server cannot be reached "
        "(false: warn and train without it).")
    log_samples_every: int = Field(
        10, ge=0, description="Log a table of sample prompts/responses/scores every N iterations "
        "(0: never).")
    num_samples: int = Field(8, gt=0, description="Rows in each sample table.")
    log_system_metrics: bool = Field(False, description="MLflow system metrics (CPU/GPU).")
    register_model: str | None = Field(
        None, description="Register the exported policy (output_dir/final) as a new version of "
        "this MLflow registered model at the end of training, tagged with run_id, iteration, "
        "eval_score (the last evaluation's, if any) and config_hash.")
    register_every: int = Field(
        0, ge=0, description="Also register the policy of every checkpoint whose iteration is a "
        "multiple of N (its safetensors copy: checkpoint.save_hf_weights); 0: only at the end.")
    parent_run_id: str | None = Field(
        None, description="An MLflow run id (in the same tracking store): this run is created "
        "as its child (tag mlflow.parentRunId), so a pipeline's steps (SFT, reward model, RL) "
        "show as one parent run with a child run per step.")
    register_copy: bool = Field(
        True, description="Copy the model into the run's artifacts as an MLflow transformers "
        "model; false: register a reference to the directory (for very large models; the "
        "version's export_dir tag names it, and it must stay where it is).")
    alarms: AlarmsConfig = Field(
        default_factory=AlarmsConfig, description="Warnings when the run loses its learning "
        "signal or a skill (on the console and in MLflow), and an optional stop.")


# ------------------------------------------------------------------------- checkpoint

    def problems(self) -> list[str]:
        if self.register_every and not self.register_copy:
            return [f"tracking.register_every = {self.register_every} with "
                    "tracking.register_copy=false would register checkpoint directories by "
                    "reference, which checkpoint.keep_last pruning deletes later: set "
                    "tracking.register_copy=true, or tracking.register_every=0 (the final "
                    "export, never pruned, is registered either way)"]
        return []


class CheckpointConfig(Section):
    every: int = Field(50, ge=0, description="Save every N iterations (0: only at the end).")
    keep_last: int = Field(2, gt=0, description="Complete checkpoints kept on disk.")
    save_at_end: bool = Field(True, description="Save a checkpoint after the last iteration.")
    export_at_end: bool = Field(
        True, description="Export the policy as a Hugging Face directory at output_dir/final.")
    save_hf_weights: bool = Field(
        True, description="Also write the policy's and value's weights as safetensors into each "
        "checkpoint (streamed a parameter group at a time by the ranks of node 0), so that "
        "`ds-ppo export` reads no pickle.")
    export_dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="Weight dtype of exported models (safetensors): auto = the dtype "
        "the policy trained in (policy.dtype as resolved: fp32 on CPU, bf16 on most GPUs); "
        "bf16/fp16 halve the size of an fp32 run's export.")
    save_on_signal: bool = Field(
        True, description="On SIGTERM or SIGUSR1 (a scheduler's preemption notice, e.g. sbatch "
        "--signal=USR1@300) or Ctrl-C: finish the iteration, save a checkpoint, exit 128 + the "
        "signal (a second Ctrl-C aborts at once). SIGTERM during a reward call, environment "
        "call or decode gives it up and exits 143 at once, without a save (the last "
        "checkpoint is the resume point). false: the signals' default (SIGTERM kills at once).")
    verify: bool = Field(
        True, description="Write a manifest (every file's size and CRC-32) into each checkpoint "
        "and into output_dir/final, and check it on resume, in `ds-ppo export` and when a "
        "model path (policy.path, reward.model, ...) is a ds_ppo export: a damaged, cut or "
        "missing file is named, with the newest checkpoint that verifies. Costs one read of the "
        "checkpoint's files at each save and resume, spread over the ranks "
        "(docs/CHECKPOINTS.md); false skips both, for very large checkpoints on slow storage.")
    keep_best: str | None = Field(
        None, description="A metric (e.g. env/accuracy, eval/score_mean): each save compares its "
        "mean over the iterations since the previous save with the best so far; the better "
        "checkpoint is named by checkpoints/best and never pruned by keep_last. It must be a "
        "metric the job logs with this config (docs/METRICS.md). null: off.")
    keep_best_mode: Literal["max", "min"] = Field(
        "max", description="Whether keep_best's metric is better higher (max) or lower (min).")

    def problems(self) -> list[str]:
        if self.keep_best is not None and not self.every:
            return [f"checkpoint.keep_best = {self.keep_best!r} keeps the best of the periodic "
                    "checkpoints, but checkpoint.every = 0 saves none: set "
                    "checkpoint.every (e.g. 25)"]
        return []
