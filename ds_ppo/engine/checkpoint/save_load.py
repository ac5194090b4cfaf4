"""Checkpoints that lose nothing: writing one, and loading one into the engines (the directory's
layout, choosing and checking a checkpoint: files.py beside this module).

Writing protocol: every rank writes into `iter_NNNNNN.tmp/`; after a barrier (every rank done),
rank 0 renames it to `iter_NNNNNN/`, points `best` at the checkpoint its trainer state calls best
(checkpoint.keep_best) and then replaces `latest` (each pointer through a temporary file and an
atomic rename); only then are old checkpoints pruned. A process killed at any point leaves
`latest` naming the previous complete checkpoint or this one, and `best` the one the trainer
state of `latest`'s checkpoint calls best, or, when killed between the two pointers, the save
that the next start redoes (which repairs `best`); stale `.tmp` directories are removed at the
next start. The checkpoint directory
must be on a filesystem all nodes share.

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
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

import torch

from ds_ppo.engine import dist
from ds_ppo.engine.checkpoint import manifest
from ds_ppo.engine.checkpoint.files import (AUTOEP_UNIVERSAL_TAG, TAG, UNIVERSAL_TAG,
                                            TrainerState, best_of,
                                            checkpoint_name, checkpoints_dir,
                                            complete_checkpoints, find_resume, latest_checkpoint,
                                            named_by_best, named_by_latest, read_state,
                                            resolve_checkpoint, unusable, verify_checkpoint,
                                            write_pointer)
from ds_ppo.engine.checkpoint.hf_export import disk_full_reason, export_engine
from ds_ppo.engine.checkpoint.hf_writer import saved_config
from ds_ppo.engine.lora import is_lora, save_adapters
from ds_ppo.errors import CheckpointError, ConfigError
from ds_ppo.role_names import TRAINED_ROLES

log = logging.getLogger("ds_ppo")


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
                    keep_last: int, save_hf_weights: bool = True, verify: bool = True,
                    in_flight=None) -> Path:
    """Collective: every rank calls it. Returns the final directory. `verify`: write the
    manifest (every file's size and CRC-32, engine/checkpoint/manifest.py) that resume and export check.
    `in_flight`: this rank's work in flight (a job's, e.g. ppo.schedule's buffered rollout),
    saved as in_flight/rank_N.pt when not None (`read_in_flight`).
    Rank 0 logs the save, then each checkpoint that keep_last prunes. checkpoint.keep_best:
    `best` is pointed, with the commit, at the save `state.best` names (the driver decides).

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
            if getattr(engines.policy, "ema", None) is not None:
                (tmp / "ema").mkdir()
        dist.barrier()
        # a LoRA role saves no frozen base: it is rebuilt from its path on resume
        engines.policy.save_checkpoint(tmp / "policy", TAG)
        if engines.value is not None:  # critic-free estimators have no value model to save
            engines.value.save_checkpoint(tmp / "value", TAG)
        torch.save(_rng_state(), tmp / "rng" / f"rank_{dist.rank():05d}.pt")
        if in_flight is not None:
            (tmp / "in_flight").mkdir(exist_ok=True)
            torch.save(in_flight, tmp / "in_flight" / f"rank_{dist.rank():05d}.pt")
        if getattr(engines.policy, "ema", None) is not None:  # each rank its own partitions
            engines.policy.ema.save(tmp / "ema")
        _fault_point("save", state.iteration, tmp)
        save_adapters(engines.policy, tmp / "hf")  # a LoRA policy's adapters (small; collective)
        if save_hf_weights:  # collective gathers; the ranks of node 0 write safetensors
            for engine, sub in ((engines.policy, "hf"), (engines.value, "hf_value")):
                if engine is not None and not is_lora(engine.module):  # no copy of a LoRA base
                    export_engine(engine, tokenizer if sub == "hf" else None, tmp / sub,
                                  engines.dtype)
        if dist.is_main():
            saved_config(engines.policy.module).save_pretrained(tmp / "hf")
            tokenizer.save_pretrained(tmp / "hf")
            if engines.value is not None:
                saved_config(engines.value.module).save_pretrained(tmp / "hf_value")
            # `manifest`: a load then requires manifest.json (deleting it switches nothing off)
            (tmp / "trainer_state.json").write_text(json.dumps(asdict(replace(
                state, manifest=verify, expert_parallel=_expert_parallel(engines),
                roles=[r for r in TRAINED_ROLES if getattr(engines, r) is not None])),
                indent=2))
        dist.barrier()  # every rank finished writing
        if verify:
            _write_manifest(tmp)
        if dist.is_main():
            _commit(root, tmp, final, best_of(root, state))
    except (OSError, RuntimeError) as e:
        raise _save_failed(e, root, tmp) from None
    if dist.is_main():
        log.info("saved checkpoint %s (iteration %d)", final, state.iteration)
        _prune(root, keep_last, final)
    dist.barrier()
    return final


def _write_manifest(tmp: Path) -> None:
    """Collective: each rank checksums its share of the files just written, rank 0 merges the
    parts into manifest.json (before the commit: a checkpoint `latest` names has one)."""
    seconds = manifest.write_share(tmp, dist.rank(), dist.world_size())
    dist.barrier()
    if dist.is_main():
        start = time.perf_counter()
        files = manifest.merge(tmp)
        log.debug("manifest of %s: %d files, rank 0's share in %.2f s, merged in %.2f s", tmp,
                  files, seconds, time.perf_counter() - start)


def _commit(root: Path, tmp: Path, final: Path, best: Path | None) -> None:
    """Rank 0: the complete `tmp` becomes `final`, then `best` names `best` (the checkpoint the
    saved trainer state calls best, when it exists), then `latest` names `final`: once `latest`
    moved, `best` agrees with its trainer state. An existing `final` is renamed aside first, not
    deleted: a kill between the renames leaves it as `iter_N.replaced`, which the next start
    puts back (see `_clean_partial`)."""
    old = None
    if final.exists():
        old = root / (final.name + ".replaced")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    if best is not None and best.is_dir():
        write_pointer(root, "best", best)
    write_pointer(root, "latest", final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _save_failed(e: Exception, root: Path, tmp: Path) -> Exception:
    """A disk-full (or file-size-limit) failure during a save as one CheckpointError; any other
    error unchanged."""
    reason = disk_full_reason(e, root)
    if reason is None:
        return e
    where = getattr(e, "filename", None) or tmp
    if dist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)  # frees the space the partial save took
    prev = named_by_latest(root)
    kept = (f"the previous checkpoint {prev} is intact; free space and run the same command "
            "to resume from it" if prev is not None and prev.is_dir() else
            "no earlier checkpoint exists")
    return CheckpointError(f"{reason} while writing {where}; {kept}")


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
    the one `latest` names, the one `best` names (checkpoint.keep_best: the commit pointed it at
    the checkpoint the trainer state just saved calls best) nor the one just written."""
    done = complete_checkpoints(root)
    keep = {p for _, p in done[-keep_last:]} | {just_written, named_by_latest(root),
                                                 named_by_best(root)}
    for _, old in done:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)
            log.info("removed checkpoint %s (checkpoint.keep_last = %d)", old, keep_last)


def saved_zero3(path: Path) -> dict[str, bool]:
    """For each trained role a checkpoint holds: whether it was saved by ZeRO-3 (one model-state
    shard per rank, `zero_pp_rank_*_model_states.pt`) rather than by stage 0-2 (the whole
    16-bit module in `mp_rank_00_model_states.pt`)."""
    return {role: any((path / role / TAG).glob("zero_pp_rank_*_model_states.pt"))
            for role in TRAINED_ROLES if (path / role / TAG).is_dir()}


def stage_changed(path: Path, stages: dict[str, int]) -> list[str]:
    """The trained roles whose ZeRO-3-or-not layout in the checkpoint differs from `stages`
    (this run's): DeepSpeed loads those only through the universal format."""
    return [role for role, zero3 in saved_zero3(path).items()
            if role in stages and zero3 != (stages[role] == 3)]


def _expert_parallel(engines) -> dict[str, int]:
    """The trained roles built with AutoEP's layers, with their expert-parallel size (1 included:
    a role resumed at size 1 from an expert-parallel checkpoint keeps AutoEP's parameter names)
    (TrainerState)."""
    from ds_ppo.engine.moe import ep_layers, ep_size

    return {role: ep_size(engine.module) for role in TRAINED_ROLES
            if (engine := getattr(engines, role, None)) is not None and ep_layers(engine.module)}


def expert_parallel_resume(path: Path, sizes: dict[str, int]) -> tuple[frozenset[str], bool]:
    """How checkpoint `path` resumes under this run's deepspeed.<role>.expert_parallel_size
    (`sizes`: role -> size > 1): (the trained roles to build with AutoEP's layers: those the
    checkpoint holds as AutoEP layers, at their configured size, 1 included, whose parameter
    names a model without them does not take, and those run with expert parallelism here;
    whether the load must go through DeepSpeed's universal checkpoint, which re-slices the
    experts: a role's expert-parallel size changed, or a role saved without expert parallelism
    runs with it (`ensure_universal` writes its copy under AutoEP's parameter names)."""
    saved = read_state(path).expert_parallel
    changed = any(sizes.get(r, 1) != n for r, n in saved.items()) or any(
        r not in saved for r in sizes)
    return frozenset(saved) | frozenset(sizes), changed


def ensure_universal(path: Path, autoep: frozenset[str] = frozenset()) -> None:
    """Convert a checkpoint's policy and value to DeepSpeed's universal format (rank 0, once,
    with DeepSpeed's parallel extract/merge workers), so it loads on a different data-parallel
    world size or expert-parallel size. `autoep`: the roles this run builds with AutoEP's layers;
    those the checkpoint holds without them get a second copy under AutoEP's parameter names
    (`AUTOEP_UNIVERSAL_TAG`, `_autoep_universal`). Collective; the other ranks wait without a
    collective timeout (dist.main_does)."""
    # the roles the checkpoint holds: a critic-free run (grpo, rloo, ...) saved no value model
    roles = [role for role in TRAINED_ROLES if (path / role).is_dir()]
    for role in roles:  # every rank checks, so none waits at the barrier alone
        if not any((path / role / TAG).glob("zero_pp_rank_*")):
            raise ConfigError(
                f"{path / role} was saved without ZeRO (stage 0: zero_stage auto or 0 on one "
                f"rank), which DeepSpeed cannot convert for another world size or ZeRO stage: "
                f"resume it on world size {read_state(path).world_size} with the stages it was "
                f"saved with, or train with deepspeed.policy.zero_stage=3 "
                f"deepspeed.value.zero_stage=3 from the start")

    def convert():
        for role in roles:
            target = path / role / UNIVERSAL_TAG
            if target.exists():
                continue
            log.info("converting %s to a universal checkpoint", path / role)
            tmp = path / role / (UNIVERSAL_TAG + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            start = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                 "--input_folder", str(path / role / TAG), "--output_folder", str(tmp),
                 *_workers_for(path / role / TAG)], capture_output=True, text=True)
            if proc.returncode != 0:
                shutil.rmtree(tmp, ignore_errors=True)
                log.debug("ds_to_universal's output for %s:\n%s", path / role,
                          proc.stderr[-3000:])
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
                raise unusable(path, path / role / TAG,
                               f"cannot be converted for another world size by DeepSpeed's "
                               f"ds_to_universal ({last}; a shard file missing or damaged?)")
            os.replace(tmp, target)
            log.info("converted %s to a universal checkpoint in %.1f s", path / role,
                     time.perf_counter() - start)
        saved_ep = read_state(path).expert_parallel
        for role in roles:
            if role in autoep and role not in saved_ep:
                _autoep_universal(path / role / UNIVERSAL_TAG, path / role / AUTOEP_UNIVERSAL_TAG)
    dist.main_does(convert, path, "converting the checkpoint to universal format")


def _autoep_universal(src: Path, dst: Path) -> None:
    """A universal checkpoint of a role saved without expert parallelism (`src`, ZeRO-3: each
    parameter's fp32 weights and Adam moments flat under zero/<name>/) rewritten under the names
    and layout of AutoEP's layers (`moe.autoep_tensors`), the experts as DeepSpeed's universal
    expert tensors (full (E, ...) with their expert count), which DeepSpeed slices for each rank's
    experts at load. Every other file is a hard link (a copy where the filesystem has none).
    Written to dst.tmp, then renamed: a killed conversion is redone."""
    from deepspeed.checkpoint.constants import (CAT_DIM, EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS,
                                                PARAM)

    from ds_ppo.engine.moe import autoep_tensors

    if dst.exists():
        return
    start = time.perf_counter()
    states = sorted(src.glob("*model_states.pt"))
    if not states:
        raise unusable(src.parents[1], src, "holds no model states to read parameter shapes from")
    shapes = {name: tuple(shape) for group in torch.load(states[0], weights_only=False,
                                                          map_location="cpu")["param_shapes"]
              for name, shape in group.items()}
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "zero").mkdir(parents=True)

    def link(a: Path, b: Path) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)
    for f in src.iterdir():
        if f.is_file():
            link(f, tmp / f.name)
    renamed = 0
    for d in sorted((src / "zero").iterdir()):
        if not d.is_dir():
            link(d, tmp / "zero" / d.name)
            continue
        parts = None
        for f in sorted(d.glob("*.pt")):  # fp32, exp_avg, exp_avg_sq
            saved = torch.load(f, weights_only=False, map_location="cpu")
            parts = autoep_tensors(d.name, saved[PARAM] if isinstance(saved, dict) else saved,
                                   shapes)
            if parts is None:
                break
            for name, t in parts:
                (tmp / "zero" / name).mkdir(exist_ok=True)
                if ".experts." in name:
                    t = {PARAM: t, CAT_DIM: 0, EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: t.shape[0]}
                elif isinstance(saved, dict):  # the router, with its universal metadata
                    t = {**saved, PARAM: t}
                torch.save(t, tmp / "zero" / name / f.name)
        if parts is None:  # AutoEP keeps the parameter's name
            shutil.copytree(d, tmp / "zero" / d.name, copy_function=link)
        else:
            renamed += 1
    if not renamed:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"{src.parent} was saved without expert parallelism and holds no "
                          "mixture-of-experts block AutoEP's layers take (a router `gate` beside "
                          "fused experts `gate_up_proj`/`down_proj`): resume it with "
                          "deepspeed.<role>.expert_parallel_size=1")
    os.replace(tmp, dst)
    log.info("wrote %s under AutoEP's parameter names (%d tensors renamed) in %.1f s", dst,
             renamed, time.perf_counter() - start)


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip().splitlines()
    return text[0][:limit] if text else ""


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


def _load_ema(path: Path, engines, same_world: bool) -> None:
    """The policy's EMA (policy.ema_decay) from the checkpoint; one saved without an EMA starts
    it from the resumed weights (with a warning)."""
    ema = getattr(engines.policy, "ema", None)
    if ema is None:
        return
    if not (path / "ema").is_dir():
        ema.reset()
        if dist.is_main():
            log.warning("%s holds no EMA of the policy (saved without policy.ema_decay): the "
                        "EMA starts from the resumed weights", path)
        return
    try:
        ema.load(path / "ema", same_world)
    except (OSError, RuntimeError, EOFError, ValueError, KeyError,
            pickle.UnpicklingError) as e:
        raise unusable(path, path / "ema", f"cannot be read ({type(e).__name__}: {e})") from None


def read_in_flight(path: Path, check: Callable[[Any, int], str | None] | None = None):
    """This rank's work in flight that checkpoint `path` holds (`save_checkpoint`'s
    `in_flight`), or None: it holds none, or was saved at another world size or
    sequence-parallel size (the work is then redone). `check(saved, iteration)` (the job's
    `in_flight_problem`) names what in it is out of range, also where no manifest verified the
    file (checkpoint.verify = false): the checkpoint is then refused."""
    state = read_state(path)
    file = path / "in_flight" / f"rank_{dist.rank():05d}.pt"
    if ((state.world_size, state.sequence_parallel_size) != (dist.world_size(), dist.sp_size())
            or not file.is_file()):
        return None
    try:  # our own file, checked by the manifest: objects, not only tensors
        saved = torch.load(file, weights_only=False, map_location="cpu")
    except Exception as e:  # noqa: BLE001  (a damaged file: any error of the unpickler)
        raise unusable(path, file, f"cannot be read ({type(e).__name__}: {_first_line(e)})"
                       ) from None
    problem = None if check is None else check(saved, state.iteration)
    if problem is not None:
        raise unusable(path, file, f"holds {problem}: the file is damaged")
    return saved


def load_checkpoint(path: Path, engines, universal: bool = False) -> TrainerState:
    """Restore engines (weights, optimizer, LR schedule), RNG of this rank, trainer state.
    `universal`: load the universal-format copy (engines built with load_universal).

    Raises:
        CheckpointError: a file of the checkpoint cannot be read (named, with what to do).
    """
    from ds_ppo.engine.moe import ep_layers

    state = read_state(path)
    for role in TRAINED_ROLES:
        engine = getattr(engines, role)
        if engine is None:  # a critic-free estimator (checked against the checkpoint before)
            continue
        tag = UNIVERSAL_TAG if universal else TAG
        if universal and role not in state.expert_parallel and ep_layers(engine.module):
            tag = AUTOEP_UNIVERSAL_TAG  # saved without expert parallelism, resumed with it
        try:
            # a LoRA role's file lacks the frozen base
            loaded = engine.load_checkpoint(path / role, tag, strict=role not in state.lora_bases)
        except (torch.OutOfMemoryError, torch.distributed.DistError):
            raise  # RuntimeErrors that say nothing about the files: not "unusable"
        except Exception as e:  # noqa: BLE001  a damaged pickle raises anything (OverflowError,
            # UnicodeDecodeError, AttributeError, ...): each means the files are unusable
            raise unusable(path, path / role / tag,
                           f"cannot be loaded ({type(e).__name__}: {_first_line(e)})") from None
        if loaded is None:
            raise unusable(path, path / role / tag, "holds no checkpoint DeepSpeed can load")
    _load_ema(path, engines, same_world=state.world_size == dist.world_size())
    # the ZeRO layout depends on the world size only (DeepSpeed is not told of SP groups), but a
    # rank's sampling stream is its data-parallel rank's: another SP size regroups the streams
    if (state.world_size, state.sequence_parallel_size) == (dist.world_size(), dist.sp_size()):
        rng_file = path / "rng" / f"rank_{dist.rank():05d}.pt"
        try:
            _set_rng_state(torch.load(rng_file, weights_only=True))
        except FileNotFoundError:
            raise unusable(path, rng_file, "is missing") from None
        except Exception as e:  # noqa: BLE001  (a damaged file: any error of the unpickler)
            raise unusable(path, rng_file,
                           f"cannot be read ({type(e).__name__}: {_first_line(e)})") from None
    else:
        # a different world size: there is no saved stream for this rank; reseed deterministically
        # (the ranks of an SP group share their data-parallel rank's stream)
        # modulo 2**64: the value torch.manual_seed takes a negative or large seed as
        torch.manual_seed((state.seed * 7919 + state.iteration * 31 + dist.dp_rank()) % 2**64)
        log.warning("world size or sequence-parallel size changed (%d -> %d ranks, SP %d -> %d)"
                    ": RNG streams reseeded", state.world_size, dist.world_size(),
                    state.sequence_parallel_size, dist.sp_size())
    return state
