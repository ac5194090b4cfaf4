"""Checkpoints that lose nothing.

Layout (output_dir/checkpoints/):
    iter_000010/policy/ds/...    DeepSpeed checkpoint of the policy (weights, optimizer, LR schedule)
    iter_000010/value/ds/...     the same for the value model
    iter_000010/*/ds_universal/  made on demand: DeepSpeed's universal format, for resuming on
                                 another data-parallel world size (e.g. 2 ranks -> 1)
    iter_000010/hf/              the policy's HF config + tokenizer, and its weights as
                                 safetensors unless checkpoint.save_hf_weights=false
    iter_000010/hf_value/        the same for the value model
    (LoRA roles, engine/lora.py: DeepSpeed's files hold only the trained parameters, adapters and
    the value head, never the frozen base; hf/ holds the policy's PEFT adapter directory instead
    of weights, and trainer_state.json a fingerprint of each base, checked on resume)
    iter_000010/trainer_state.json   iteration, KL controller, MLflow run id, world size
    iter_000010/rng/rank_00000.pt    RNG states of every rank (tensors only)
    latest                       the name of the newest COMPLETE checkpoint

Writing protocol: every rank writes into `iter_NNNNNN.tmp/`; after a barrier (every rank done),
rank 0 renames it to `iter_NNNNNN/` and then replaces `latest` through a temporary file and an
atomic rename. A process killed at any point leaves `latest` naming the previous complete
checkpoint; stale `.tmp` directories are removed at the next start. The checkpoint directory
must be on a filesystem all nodes share.

Choosing the checkpoint to resume from (`find_resume`, rank 0) never falls back to a fresh start
while checkpoints exist: an unusable `latest` falls back to the newest complete checkpoint (by
the iteration in its trainer_state.json), a corrupted checkpoint is an error naming the file and
the previous checkpoint, and checkpoints newer than the resumed one are renamed aside, not
overwritten or pruned.

Loading never unpickles arbitrary objects: trainer state is JSON, RNG states load with
`torch.load(weights_only=True)`, exports read the safetensors copies; DeepSpeed's own shard files
(pickles) are read only to resume a run from its own output_dir.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ds_ppo.engine import dist
from ds_ppo.errors import CheckpointError, ConfigError, UserError

log = logging.getLogger("ds_ppo")
TAG = "ds"  # DeepSpeed tag inside each role's folder
UNIVERSAL_TAG = "ds_universal"  # the same, converted for another world size
_NAME = re.compile(r"iter_(\d+)")  # a checkpoint's directory name (fullmatch)


@dataclass
class TrainerState:
    iteration: int = 0  # iterations completed
    kl_controller: dict = field(default_factory=dict)
    mlflow_run_id: str | None = None
    world_size: int = 1
    seed: int = 0
    advantage_estimator: str = "gae"  # checkpoints written before the key existed were all gae
    lora_bases: dict = field(default_factory=dict)  # LoRA role -> {path, fingerprint} of its base


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:06d}"


def _pointer(root: Path) -> Path | None:
    """The directory `latest` names, or None when `latest` is missing, unreadable or garbled."""
    try:
        name = (root / "latest").read_bytes().decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return root / name if _NAME.fullmatch(name) else None


def _iteration(path: Path) -> int | None:
    """The iteration recorded in a checkpoint's trainer_state.json; None if it cannot be read."""
    try:
        return int(json.loads((path / "trainer_state.json").read_text())["iteration"])
    except (OSError, ValueError, KeyError, TypeError):  # JSONDecodeError is a ValueError
        return None


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(iteration, directory) of every checkpoint in `root` whose trainer_state.json reads,
    oldest first (ordered by the recorded iteration, not by name)."""
    found = []
    for p in root.glob("iter_*"):
        if p.is_dir() and _NAME.fullmatch(p.name) and (it := _iteration(p)) is not None:
            found.append((it, p))
    return sorted(found, key=lambda x: (x[0], x[1].name))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint a run continues from: the one `latest` names; when `latest` is missing,
    garbled or names no directory, the newest complete checkpoint (with a warning). None when
    the run has no checkpoints at all.

    Raises:
        CheckpointError: checkpoint directories exist but none of them is complete.
    """
    root = checkpoints_dir(output_dir)
    named = _pointer(root)
    if named is not None and named.is_dir():
        return named
    done = complete_checkpoints(root)
    pointer = root / "latest"
    if done:
        why = ("is missing" if not pointer.exists() else
               f"names {named.name}, which does not exist" if named is not None else
               "is unreadable")
        log.warning("%s %s: continuing from the newest complete checkpoint, %s", pointer, why,
                    done[-1][1])
        return done[-1][1]
    if pointer.exists() or any(_NAME.fullmatch(p.name) for p in root.glob("iter_*")):
        raise CheckpointError(f"{root} holds no usable checkpoint (no iter_* directory with a "
                              "readable trainer_state.json, and `latest` names none): resume from "
                              "another checkpoint (resume=PATH), or move the directory away to "
                              "start fresh")
    return None


def resolve_checkpoint(spec: str | Path) -> Path:
    """A checkpoint directory itself, or a run's output_dir or checkpoints/ dir (-> its latest)."""
    p = Path(spec)
    if (p / "trainer_state.json").exists():
        return p
    found = None
    for out in (p, p.parent) if p.name == "checkpoints" else (p,):
        if checkpoints_dir(out).is_dir():
            found = latest_checkpoint(out)
            break
    if found is None:
        raise UserError(f"{p} holds no complete ds_ppo checkpoint (neither trainer_state.json "
                        "nor checkpoints/latest)")
    return found


def _previous(path: Path) -> Path | None:
    """The newest complete checkpoint older than `path` in the same directory."""
    it = _iteration(path)
    if it is None:
        m = _NAME.fullmatch(path.name)
        it = int(m.group(1)) if m else None
    older = [p for i, p in complete_checkpoints(path.parent) if p != path and
             (it is None or i < it)]
    return older[-1] if older else None


def unusable(path: Path, file: Path, what: str) -> CheckpointError:
    """The error for a checkpoint that cannot be loaded: names the checkpoint, the file, and the
    checkpoint to resume from instead."""
    prev = _previous(path)
    fix = (f"resume from the previous checkpoint: resume={prev}" if prev is not None else
           f"there is no earlier checkpoint: move {path} away to start fresh")
    return CheckpointError(f"checkpoint {path} is unusable: {file} {what}. To continue, {fix}")


def read_state(path: Path) -> TrainerState:
    file = path / "trainer_state.json"
    try:
        return TrainerState(**json.loads(file.read_text()))
    except FileNotFoundError:
        raise unusable(path, file, "is missing") from None
    except (OSError, ValueError, TypeError) as e:  # cut, garbled, not a trainer state
        raise unusable(path, file, f"cannot be read ({type(e).__name__}: {e})") from None


# the start of a file torch.save wrote in its legacy format (DeepSpeed's
# "checkpoint": {"checkpoint_serialization": false}): a pickled magic number
_LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."


def _check_torch_file(path: Path, file: Path) -> None:
    """torch.save writes a zip archive: a cut or garbled file has no readable zip directory.
    (A legacy-format file is only checked for its magic number.)"""
    try:
        with open(file, "rb") as f:
            if f.read(len(_LEGACY_TORCH_MAGIC)) == _LEGACY_TORCH_MAGIC:
                return
        with zipfile.ZipFile(file) as z:
            if not z.namelist():
                raise zipfile.BadZipFile("empty archive")
    except FileNotFoundError:
        raise unusable(path, file, "is missing") from None
    except (OSError, zipfile.BadZipFile) as e:
        raise unusable(path, file, f"is corrupted or cut off ({e})") from None


def verify_checkpoint(path: Path, world_size: int) -> TrainerState:
    """Check, without loading any weights, that a checkpoint is whole: trainer_state.json reads,
    each role's DeepSpeed files are intact archives, and (same world size) every rank's RNG file
    is there. Raises CheckpointError naming the file."""
    state = read_state(path)
    # a critic-free run (grpo, rloo, ...) saved no value model
    for role in ("policy", "value") if state.advantage_estimator == "gae" else ("policy",):
        files = sorted((path / role / TAG).rglob("*.pt"))
        if not files:
            raise unusable(path, path / role / TAG, "holds no DeepSpeed checkpoint files")
        for f in files:
            _check_torch_file(path, f)
    if state.world_size == world_size:
        for r in range(world_size):
            _check_torch_file(path, path / "rng" / f"rank_{r:05d}.pt")
    return state


def find_resume(output_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint a run continues from (None: a fresh start), checked whole. Collective:
    rank 0 decides (and removes interrupted saves, renames newer checkpoints aside), every rank
    gets its answer or its error."""
    def decide() -> str | None:
        _clean_partial(checkpoints_dir(output_dir))
        if resume == "never":
            root = checkpoints_dir(output_dir)
            if (root / "latest").exists() or complete_checkpoints(root):
                raise ConfigError(f"resume = never but {output_dir} already holds checkpoints; "
                                  "use resume=auto to continue, or a new output_dir")
            return None
        path = latest_checkpoint(output_dir) if resume == "auto" else resolve_checkpoint(resume)
        if path is None:
            return None
        state = verify_checkpoint(path, dist.world_size())
        _set_aside_newer(checkpoints_dir(output_dir), path, state.iteration)
        return str(path)

    found = dist.on_rank0(decide)
    return Path(found) if found is not None else None


def _aside_name(root: Path, name: str, suffix: str) -> Path:
    target, n = root / f"{name}.{suffix}", 1
    while target.exists():
        n += 1
        target = root / f"{name}.{suffix}{n}"
    return target


def _set_aside_newer(root: Path, resumed: Path, iteration: int) -> None:
    """Rename (never delete) this run's checkpoints newer than the one it resumes from, so the
    saves that follow neither overwrite them nor get pruned in their favour."""
    for p in sorted(root.glob("iter_*")):
        m = _NAME.fullmatch(p.name)
        if not (m and p.is_dir()) or p.resolve() == resumed.resolve():
            continue
        it = _iteration(p)
        if (it if it is not None else int(m.group(1))) > iteration:
            target = _aside_name(root, p.name, "aside")
            os.replace(p, target)
            log.warning("moved %s aside to %s: it is newer than %s, which this run continues "
                        "from (delete it when you no longer need it)", p, target.name, resumed)


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


rng_state, set_rng_state = _rng_state, _set_rng_state  # this rank's streams, as a save holds them


def save_checkpoint(output_dir: str | Path, engines, state: TrainerState, tokenizer,
                    keep_last: int, save_hf_weights: bool = True) -> Path:
    """Collective: every rank calls it. Returns the final directory.

    Raises:
        CheckpointError: the disk filled up (or a file hit the size limit) during the save; the
            partial save is removed and `latest` still names the previous checkpoint.
    """
    root = checkpoints_dir(output_dir)
    final = root / checkpoint_name(state.iteration)
    tmp = root / (checkpoint_name(state.iteration) + ".tmp")
    try:
        if dist.is_main():
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            (tmp / "rng").mkdir()
        dist.barrier()
        # exclude_frozen_parameters: a LoRA role's frozen base is rebuilt from its path on resume
        engines.policy.save_checkpoint(str(tmp / "policy"), tag=TAG, save_latest=False,
                                       exclude_frozen_parameters=True)
        if engines.value is not None:  # critic-free estimators have no value model to save
            engines.value.save_checkpoint(str(tmp / "value"), tag=TAG, save_latest=False,
                                          exclude_frozen_parameters=True)
        torch.save(_rng_state(), tmp / "rng" / f"rank_{dist.rank():05d}.pt")
        _fault_point("save", state.iteration, tmp)
        from ds_ppo.engine.lora import is_lora, save_adapters

        save_adapters(engines.policy, tmp / "hf")  # a LoRA policy's adapters (small; collective)
        if save_hf_weights:  # collective gathers; the ranks of node 0 write safetensors
            from ds_ppo.export import export_engine

            for engine, sub in ((engines.policy, "hf"), (engines.value, "hf_value")):
                if engine is not None and not is_lora(engine.module):  # no copy of a LoRA base
                    export_engine(engine, tokenizer if sub == "hf" else None, tmp / sub,
                                  engines.dtype)
        if dist.is_main():
            engines.policy.module.config.save_pretrained(tmp / "hf")
            tokenizer.save_pretrained(tmp / "hf")
            if engines.value is not None:
                engines.value.module.config.save_pretrained(tmp / "hf_value")
            (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=2))
        dist.barrier()  # every rank finished writing
        if dist.is_main():
            _commit(root, tmp, final)
    except (OSError, RuntimeError) as e:
        raise _save_failed(e, root, tmp) from None
    if dist.is_main():
        _prune(root, keep_last, final)
    dist.barrier()
    return final


def _commit(root: Path, tmp: Path, final: Path) -> None:
    """Rank 0: the complete `tmp` becomes `final`, then `latest` names it. An existing `final`
    is renamed aside first, not deleted: a kill between the renames leaves it as
    `iter_N.replaced`, which the next start puts back (see `_clean_partial`)."""
    old = None
    if final.exists():
        old = root / (final.name + ".replaced")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    pointer_tmp = root / "latest.tmp"
    pointer_tmp.write_text(final.name)
    os.replace(pointer_tmp, root / "latest")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# how torch.save's C++ writer reports a failed write (it drops the errno)
_TORCH_WRITE_FAILED = ("inline_container", "PytorchStreamWriter", "iostream error",
                       "file write failed")


def _save_failed(e: Exception, root: Path, tmp: Path) -> Exception:
    """A disk-full (or file-size-limit) failure during a save as one CheckpointError; any other
    error unchanged. torch.save loses the errno ("enforce fail at inline_container.cc"), so
    there the free space and the file-size limit decide."""
    code = getattr(e, "errno", None)
    torch_write = code is None and any(m in str(e) for m in _TORCH_WRITE_FAILED)
    if code in (errno.ENOSPC, errno.EDQUOT) or (torch_write and _disk_full(root)):
        reason = "no space left on the device"
    elif code == errno.EFBIG or (torch_write and _size_limited()):
        reason = "file too large (the file-size limit, `ulimit -f`)"
    else:
        return e
    where = getattr(e, "filename", None) or tmp
    if dist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)  # frees the space the partial save took
    prev = _pointer(root)
    kept = (f"the previous checkpoint {prev} is intact; free space and run the same command "
            "to resume from it" if prev is not None and prev.is_dir() else
            "no earlier checkpoint exists")
    return CheckpointError(f"{reason} while writing {where}; {kept}")


def _disk_full(path: Path) -> bool:
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 16 * 2**20


def _size_limited() -> bool:
    import resource

    return resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY


def _fault_point(where: str, iteration: int, path: Path) -> None:
    """Fault injection for the crash tests, in the middle of saving iteration N (after the
    engines wrote their files, before the checkpoint is complete):
    DS_PPO_FAULT=kill_during_save:N makes the process SIGKILL itself;
    DS_PPO_FAULT=enospc_during_save:N fails as a full disk does (OSError ENOSPC)."""
    spec = os.environ.get("DS_PPO_FAULT", "")
    if spec == f"kill_during_{where}:{iteration}":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    if spec == f"enospc_during_{where}:{iteration}":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path / "rng"))


def _prune(root: Path, keep_last: int, just_written: Path) -> None:
    """Delete complete checkpoints beyond the newest `keep_last` (by recorded iteration); never
    the one `latest` names nor the one just written."""
    done = complete_checkpoints(root)
    keep = {p for _, p in done[-keep_last:]} | {just_written, _pointer(root)}
    for _, old in done:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)


def _clean_partial(root: Path) -> None:
    """Rank 0: remove saves that were killed before completing; put back a checkpoint a killed
    save had renamed aside to replace it (`_commit`)."""
    for tmp in root.glob("iter_*.tmp"):
        log.warning("removing incomplete checkpoint %s (a save was interrupted)", tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    for old in root.glob("iter_*.replaced"):
        final = root / old.name[:-len(".replaced")]
        if final.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            log.warning("restoring %s (a save that was replacing it was interrupted)", final)
            os.replace(old, final)


def check_estimator_family(path: Path, estimator: str) -> None:
    """Resuming must keep the value model or its absence: a UserError naming both estimators
    when the checkpoint at `path` was trained with a value model and `estimator` has none, or
    the other way round (other changes of estimator are allowed)."""
    from ds_ppo.errors import UserError

    saved = read_state(path).advantage_estimator
    had_value = (path / "value").exists()
    if had_value != (estimator == "gae"):
        what = {True: "with a value model", False: "without a value model"}
        raise UserError(
            f"cannot resume from {path}: it was trained with ppo.advantage_estimator = "
            f"{saved!r} ({what[had_value]}), the config sets ppo.advantage_estimator = "
            f"{estimator!r} ({what[estimator == 'gae']}); set ppo.advantage_estimator={saved} "
            "to continue that run, or start a new run in another output_dir")


def ensure_universal(path: Path) -> None:
    """Convert a checkpoint's policy and value to DeepSpeed's universal format (rank 0, once,
    with DeepSpeed's parallel extract/merge workers), so it loads on a different data-parallel
    world size. Collective; the other ranks wait without a collective timeout (dist.main_does)."""
    for role in ("policy", "value"):  # every rank checks, so none waits at the barrier alone
        if not any((path / role / TAG).glob("zero_pp_rank_*")):
            raise ConfigError(
                f"{path / role} was saved without ZeRO (stage 0: zero_stage auto or 0 on one "
                f"rank), which DeepSpeed cannot convert for another world size: resume it on "
                f"world size {read_state(path).world_size}, or train with "
                f"deepspeed.policy.zero_stage=3 deepspeed.value.zero_stage=3 from the start")

    def convert():
        for role in ("policy", "value"):
            target = path / role / UNIVERSAL_TAG
            if target.exists() or not (path / role).exists():  # no value: a critic-free run
                continue
            log.info("converting %s to a universal checkpoint (world size changed)", path / role)
            tmp = path / role / (UNIVERSAL_TAG + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            start = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                 "--input_folder", str(path / role / TAG), "--output_folder", str(tmp),
                 *_workers_for(path / role / TAG)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"ds_to_universal failed for {path / role}:\n"
                                   f"{proc.stderr[-3000:]}")
            os.replace(tmp, target)
            log.info("converted %s to a universal checkpoint in %.1f s", path / role,
                     time.perf_counter() - start)
    dist.main_does(convert, path, "converting the checkpoint to universal format")


def universal_workers(cpus: int, free_bytes: int, shard_bytes: int, shards: int) -> list[str]:
    """ds_to_universal's worker counts: extraction workers each load one rank's ZeRO shard file
    (shard_bytes), so as many as half the free memory holds, up to one per core and per shard;
    merge workers (each holding every slice of one parameter) a quarter of that."""
    extract = max(1, min(cpus, shards, free_bytes // 2 // max(1, shard_bytes)))
    return ["--num_extract_workers", str(extract),
            "--num_merge_workers", str(max(1, min(extract, cpus) // 4))]


def _workers_for(ds_dir: Path) -> list[str]:
    import psutil

    shards = [f.stat().st_size for f in ds_dir.rglob("*optim_states.pt")] or [1]
    return universal_workers(os.cpu_count() or 1, psutil.virtual_memory().available,
                             max(shards), len(shards))


def load_checkpoint(path: Path, engines, universal: bool = False) -> TrainerState:
    """Restore engines (weights, optimizer, LR schedule), RNG of this rank, trainer state.
    `universal`: load the universal-format copy (engines built with load_universal).

    Raises:
        CheckpointError: a file of the checkpoint cannot be read (named, with what to do).
    """
    state = read_state(path)
    for role in ("policy", "value"):
        engine = getattr(engines, role)
        if engine is None:  # a critic-free estimator (checked against the checkpoint before)
            continue
        tag = UNIVERSAL_TAG if universal else TAG
        try:
            loaded, _ = engine.load_checkpoint(str(path / role), tag=tag,
                                               # a LoRA role's file lacks the frozen base
                                               load_module_strict=role not in state.lora_bases,
                                               load_optimizer_states=True,
                                               load_lr_scheduler_states=True)
        except (torch.OutOfMemoryError, torch.distributed.DistError):
            raise  # RuntimeErrors that say nothing about the files: not "unusable"
        except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError,
                zipfile.BadZipFile) as e:
            raise unusable(path, path / role / tag,
                           f"cannot be loaded ({type(e).__name__}: {e})") from None
        if loaded is None:
            raise unusable(path, path / role / tag, "holds no checkpoint DeepSpeed can load")
    if state.world_size == dist.world_size():
        rng_file = path / "rng" / f"rank_{dist.rank():05d}.pt"
        try:
            _set_rng_state(torch.load(rng_file, weights_only=True))
        except FileNotFoundError:
            raise unusable(path, rng_file, "is missing") from None
        except (OSError, RuntimeError, EOFError, ValueError, KeyError,
                pickle.UnpicklingError) as e:
            raise unusable(path, rng_file, f"cannot be read ({type(e).__name__}: {e})") from None
    else:
        # a different world size: there is no saved stream for this rank; reseed deterministically
        torch.manual_seed(state.seed * 7919 + state.iteration * 31 + dist.rank())
        log.warning("world size changed (%d -> %d): RNG streams reseeded", state.world_size,
                    dist.world_size())
    return state
