"""What a run saves: a checkpoint now, the checkpoint of a run stopped by its reward source,
and the final save and export (`ds-ppo train` and the supervised jobs alike)."""
from __future__ import annotations

import logging
from pathlib import Path

from ds_ppo import watchdog
from ds_ppo.config import Config
from ds_ppo.engine import dist
from ds_ppo.engine.checkpoint import (TrainerState, checkpoint_name, latest_checkpoint,
                                      save_checkpoint, set_rng_state)
from ds_ppo.engine.roles import Engines
from ds_ppo.errors import RewardError

log = logging.getLogger("ds_ppo")


def checkpoint_now(cfg: Config, out: Path, engines: Engines, state: TrainerState, tokenizer,
                   in_flight=None) -> str:
    """`in_flight`: this rank's work in flight (the job's `in_flight`), saved beside the rest."""
    with watchdog.phase("save", state.iteration):  # logs "saved checkpoint ..." (rank 0)
        return str(save_checkpoint(out, engines, state, tokenizer, cfg.checkpoint.keep_last,
                                   cfg.checkpoint.save_hf_weights, cfg.checkpoint.verify,
                                   in_flight))


def stop_on_reward_error(err: RewardError, cfg: Config, out: Path, engines: Engines,
                          state: TrainerState, tokenizer, last: str | None,
                          rng_at_start: dict | None = None, in_flight=None) -> RewardError:
    """Checkpoint the last completed iteration (the weights still are its weights unless the
    failure came after this iteration's update, in evaluation), and the error to stop with.
    `rng_at_start`: the random state when the unfinished iteration began; the checkpoint holds it,
    so a resume samples that iteration again exactly as the uninterrupted run would have (and
    `in_flight`, the job's work in flight then).
    Collective: every rank raises a RewardError here (scoring agrees on the outcome)."""
    latest = latest_checkpoint(out)
    if (not err.after_update and state.iteration > 0 and
            (latest is None or latest.name != checkpoint_name(state.iteration))):
        if rng_at_start is not None:
            set_rng_state(rng_at_start)
        last = checkpoint_now(cfg, out, engines, state, tokenizer, in_flight)
    elif latest is not None:
        last = str(latest)
    stop = type(err)(stop_message(err, last))
    stop.after_update, stop.fix = err.after_update, err.fix
    return stop


def stop_message(err: RewardError, last: str | None) -> str:
    """`err` as the run stops with it: where the work is (`last`: the checkpoint to resume
    from, None when nothing was saved) and what to do (`err.fix`), each said once."""
    if last:
        return (f"{err}: stopped (the last completed iteration's checkpoint is {last}). "
                f"{err.fix}, then run the same command again to resume from it.")
    return (f"{err}: stopped (no checkpoint was saved). {err.fix}, then run the same command: "
            "the run starts over.")


def finish(cfg: Config, engines: Engines, state: TrainerState, tokenizer,
            last_checkpoint: str | None, model_class: str = "AutoModelForCausalLM",
            in_flight=None):
    """Save the final state (unless the last iteration was just saved) and export the policy
    (a supervised job's model: `model_class` names what it loads with)."""
    from ds_ppo.engine.checkpoint.hf_export import export_final
    from ds_ppo.run.export import dtype_name, export_dtype

    out = Path(cfg.output_dir)
    latest = latest_checkpoint(out)
    if cfg.checkpoint.save_at_end and (latest is None or
                                       latest.name != checkpoint_name(state.iteration)):
        last_checkpoint = checkpoint_now(cfg, out, engines, state, tokenizer, in_flight)
    export_dir = None
    if cfg.checkpoint.export_at_end:
        export_dir = str(out / "final")
        dtype = export_dtype(cfg.checkpoint.export_dtype, engines.dtype)
        sealed = cfg.checkpoint.verify
        # written aside and renamed into place; marked as ds_ppo's (`ds-ppo export --out
        # output_dir/final` may replace it), with its manifest (checkpoint.verify)
        with watchdog.phase("export", state.iteration):
            export_final(engines.policy, tokenizer, out / "final", dtype, f"the run in {out}",
                         iteration=state.iteration, with_manifest=sealed)
        if dist.is_main():
            log.info("exported the %s to %s (%s weights; load with %s.from_pretrained)",
                     "policy" if model_class == "AutoModelForCausalLM" else "model", export_dir,
                     dtype_name(dtype), model_class)
        if engines.policy.ema is not None:  # policy.ema_decay: the EMA weights beside it
            with engines.policy.ema.swapped_in(), watchdog.phase("export", state.iteration):
                export_final(engines.policy, tokenizer, out / "final_ema", dtype,
                             f"the run in {out} (EMA)", iteration=state.iteration,
                             with_manifest=sealed)
            if dist.is_main():
                log.info("exported the policy's EMA to %s (%s weights)", out / "final_ema",
                         dtype_name(dtype))
    return last_checkpoint, export_dir
