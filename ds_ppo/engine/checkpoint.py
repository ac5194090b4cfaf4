"""Checkpoints that lose nothing.

Layout (output_dir/checkpoints/):
    iter_000010/policy/ds/...    DeepSpeed checkpoint of the policy (weights, optimizer, LR schedule)
    iter_000010/value/ds/...     the same for the value model
    iter_000010/*/ds_universal/  made on demand: DeepSpeed's universal format, for resuming on
                                 another data-parallel world size (e.g. 2 ranks -> 1)
    iter_000010/hf/              the policy's HF config + tokenizer, and its weights as
                                 safetensors unless checkpoint.save_hf_weights=false
    iter_000010/hf_value/        the same for the value model
    iter_000010/trainer_state.json   iteration, KL controller, MLflow run id, world size
    iter_000010/rng/rank_00000.pt    RNG states of every rank (tensors only)
    latest                       the name of the newest COMPLETE checkpoint

Writing protocol: every rank writes into `iter_NNNNNN.tmp/`; after a barrier (every rank done),
rank 0 renames it to `iter_NNNNNN/` and then replaces `latest` through a temporary file and an
atomic rename. A process killed at any point leaves `latest` naming the previous complete
checkpoint; stale `.tmp` directories are removed at the next start. The checkpoint directory
must be on a filesystem all nodes share.

Loading never unpickles arbitrary objects: trainer state is JSON, RNG states load with
`torch.load(weights_only=True)`, exports read the safetensors copies; DeepSpeed's own shard files
(pickles) are read only to resume a run from its own output_dir.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ds_ppo.engine import dist
from ds_ppo.errors import ConfigError

log = logging.getLogger("ds_ppo")
TAG = "ds"  # DeepSpeed tag inside each role's folder
UNIVERSAL_TAG = "ds_universal"  # the same, converted for another world size


@dataclass
class TrainerState:
    iteration: int = 0  # iterations completed
    kl_controller: dict = field(default_factory=dict)
    mlflow_run_id: str | None = None
    world_size: int = 1
    seed: int = 0


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:06d}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    root = checkpoints_dir(output_dir)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "trainer_state.json").exists() else None


def resolve_checkpoint(spec: str | Path) -> Path:
    """A checkpoint directory itself, or a run's output_dir or checkpoints/ dir (-> its latest)."""
    from ds_ppo.errors import UserError

    p = Path(spec)
    if (p / "trainer_state.json").exists():
        return p
    found = latest_checkpoint(p) or latest_checkpoint(p.parent)
    if found is None:
        raise UserError(f"{p} holds no complete ds_ppo checkpoint (neither trainer_state.json "
                        "nor checkpoints/latest)")
    return found


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state(),
             "python": torch.tensor(list(random.getstate()[1]), dtype=torch.int64)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    if "python" in state:
        random.setstate((3, tuple(int(x) for x in state["python"].tolist()), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(output_dir: str | Path, engines, state: TrainerState, tokenizer,
                    keep_last: int, save_hf_weights: bool = True) -> Path:
    """Collective: every rank calls it. Returns the final directory."""
    root = checkpoints_dir(output_dir)
    final = root / checkpoint_name(state.iteration)
    tmp = root / (checkpoint_name(state.iteration) + ".tmp")
    if dist.is_main():
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        (tmp / "rng").mkdir()
    dist.barrier()
    engines.policy.save_checkpoint(str(tmp / "policy"), tag=TAG, save_latest=False)
    engines.value.save_checkpoint(str(tmp / "value"), tag=TAG, save_latest=False)
    torch.save(_rng_state(), tmp / "rng" / f"rank_{dist.rank():05d}.pt")
    _fault_point("save", state.iteration)
    if save_hf_weights:  # collective gathers; rank 0 writes safetensors
        from ds_ppo.export import export_engine

        export_engine(engines.policy, tokenizer, tmp / "hf", engines.dtype)
        export_engine(engines.value, None, tmp / "hf_value", engines.dtype)
    if dist.is_main():
        engines.policy.module.config.save_pretrained(tmp / "hf")
        tokenizer.save_pretrained(tmp / "hf")
        engines.value.module.config.save_pretrained(tmp / "hf_value")
        (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=2))
    dist.barrier()  # every rank finished writing
    if dist.is_main():
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = root / "latest.tmp"
        pointer_tmp.write_text(final.name)
        os.replace(pointer_tmp, root / "latest")
        _prune(root, keep_last)
    dist.barrier()
    return final


def _fault_point(where: str, iteration: int) -> None:
    """Fault injection for the crash tests: DS_PPO_FAULT=kill_during_save:N makes the process
    SIGKILL itself in the middle of saving iteration N (after the engines wrote their files,
    before the checkpoint is complete)."""
    spec = os.environ.get("DS_PPO_FAULT", "")
    if spec == f"kill_during_{where}:{iteration}":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _prune(root: Path, keep_last: int) -> None:
    done = sorted(p for p in root.glob("iter_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def clean_partial(output_dir: str | Path) -> None:
    """Remove directories of saves that were killed before completing (rank 0)."""
    if dist.is_main():
        for tmp in checkpoints_dir(output_dir).glob("iter_*.tmp"):
            log.warning("removing incomplete checkpoint %s (a save was interrupted)", tmp)
            shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()


def read_state(path: Path) -> TrainerState:
    return TrainerState(**json.loads((path / "trainer_state.json").read_text()))


def ensure_universal(path: Path) -> None:
    """Convert a checkpoint's policy and value to DeepSpeed's universal format (rank 0, once),
    so it loads on a different data-parallel world size. Collective."""
    for role in ("policy", "value"):  # every rank checks, so none waits at the barrier alone
        if not any((path / role / TAG).glob("zero_pp_rank_*")):
            raise ConfigError(
                f"{path / role} was saved without ZeRO (stage 0: zero_stage auto or 0 on one "
                f"rank), which DeepSpeed cannot convert for another world size: resume it on "
                f"world size {read_state(path).world_size}, or train with "
                f"deepspeed.policy.zero_stage=3 deepspeed.value.zero_stage=3 from the start")
    if dist.is_main():
        for role in ("policy", "value"):
            target = path / role / UNIVERSAL_TAG
            if target.exists():
                continue
            log.info("converting %s to a universal checkpoint (world size changed)", path / role)
            tmp = path / role / (UNIVERSAL_TAG + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            proc = subprocess.run(
                [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                 "--input_folder", str(path / role / TAG), "--output_folder", str(tmp)],
                capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"ds_to_universal failed for {path / role}:\n"
                                   f"{proc.stderr[-3000:]}")
            os.replace(tmp, target)
    dist.barrier()


def load_checkpoint(path: Path, engines, universal: bool = False) -> TrainerState:
    """Restore engines (weights, optimizer, LR schedule), RNG of this rank, trainer state.
    `universal`: load the universal-format copy (engines built with load_universal)."""
    state = read_state(path)
    for role in ("policy", "value"):
        engine = getattr(engines, role)
        loaded, _ = engine.load_checkpoint(str(path / role),
                                           tag=UNIVERSAL_TAG if universal else TAG,
                                           load_optimizer_states=True,
                                           load_lr_scheduler_states=True)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the {role} checkpoint in {path / role}")
    rng_file = path / "rng" / f"rank_{dist.rank():05d}.pt"
    if rng_file.exists() and state.world_size == dist.world_size():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        # a different world size: there is no saved stream for this rank; reseed deterministically
        torch.manual_seed(state.seed * 7919 + state.iteration * 31 + dist.rank())
        log.warning("world size changed (%d -> %d): RNG streams reseeded", state.world_size,
                    dist.world_size())
    return state
