"""The checkpoint directory: its layout, which checkpoint a run continues from, and whether a
checkpoint is whole. Nothing here loads weights (writing and loading them: engine/checkpoint/save_load.py).

Layout (output_dir/checkpoints/):
    iter_000010/policy/ds/...    DeepSpeed checkpoint of the policy (weights, optimizer, LR schedule)
    iter_000010/value/ds/...     the same for the value model
    iter_000010/*/ds_universal/  made on demand: DeepSpeed's universal format, for resuming on
                                 another data-parallel world size (e.g. 2 ranks -> 1)
    iter_000010/*/ds_universal_autoep/  made on demand: the same under the parameter names of
                                 AutoEP's layers, for resuming with expert parallelism a role
                                 saved without it
    iter_000010/hf/              the policy's HF config + tokenizer, and its weights as
                                 safetensors unless checkpoint.save_hf_weights=false
    iter_000010/hf_value/        the same for the value model
    (LoRA roles, engine/lora.py: DeepSpeed's files hold only the trained parameters, adapters and
    the value head, never the frozen base; hf/ holds the policy's PEFT adapter directory instead
    of weights, and trainer_state.json a fingerprint of each base, checked on resume)
    iter_000010/trainer_state.json   iteration, MLflow run id, world size, roles, the job's own
                                 state (a PPO run's KL controller, estimator, ...)
    iter_000010/rng/rank_00000.pt    RNG states of every rank (tensors only)
    latest                       the name of the newest COMPLETE checkpoint

Choosing the checkpoint to resume from (`find_resume`, rank 0) never falls back to a fresh start
while checkpoints exist: an unusable `latest` falls back to the newest complete checkpoint (by
the iteration in its trainer_state.json), a corrupted checkpoint is an error naming the file and
the previous checkpoint, and checkpoints newer than the resumed one are renamed aside, not
overwritten or pruned. Stale `.tmp` directories of interrupted saves are removed then.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ds_ppo.algo.choices import estimator as estimator_spec
from ds_ppo.errors import CheckpointError, ConfigError, UserError
from ds_ppo.role_names import TRAINED_ROLES

log = logging.getLogger("ds_ppo")
# marks a directory an export wrote (engine/checkpoint/hf_export.py): the source, dtype, and for a run's own
# export at its end (output_dir/final) the iteration it holds
EXPORT_MARKER = "ds_ppo_export.json"
TAG = "ds"  # DeepSpeed tag inside each role's folder
UNIVERSAL_TAG = "ds_universal"  # the same, converted for another world size
AUTOEP_UNIVERSAL_TAG = "ds_universal_autoep"  # that, under AutoEP's names (saved without EP)
_NAME = re.compile(r"iter_(\d+)")  # a checkpoint's directory name (fullmatch)


@dataclass
class TrainerState:
    """What a checkpoint's trainer_state.json holds: the run's own (every job), and `job_state`,
    the job's (a PPO run's KL and entropy controllers, its estimator, its prompt stream's
    position), which only the job reads and writes."""

    iteration: int = 0  # units completed
    mlflow_run_id: str | None = None
    world_size: int = 1
    seed: int = 0
    lora_bases: dict = field(default_factory=dict)  # LoRA role -> {path, fingerprint} of its base
    job: str = "ppo"  # the job that wrote it (its registry name: ppo, sft, rm, ...)
    # deepspeed.sequence_parallel_size of the run that wrote it (written before the key: 1)
    sequence_parallel_size: int = 1
    # saved with a manifest.json (checkpoint.verify): every load then requires one
    manifest: bool = False
    alarms: dict = field(default_factory=dict)  # run/alarms.AlarmState (tracking.alarms)
    # checkpoint.keep_best: {"metric", "value", "iteration"} of the best save so far
    best: dict = field(default_factory=dict)
    # the trained roles that ran expert parallelism: role -> deepspeed.<role>.expert_parallel_size
    expert_parallel: dict = field(default_factory=dict)
    # the trained roles whose DeepSpeed files the checkpoint holds (policy; value with a critic)
    roles: list = field(default_factory=lambda: ["policy"])
    job_state: dict = field(default_factory=dict)  # the job's own, JSON-serialisable


# the keys a PPO run's trainer state held at its top level before `job_state` held them
_PPO_KEYS = ("kl_controller", "entropy_controller", "advantage_estimator", "prompts_drawn")


def _current(saved: dict) -> dict:
    """A trainer_state.json written before `job_state` and `roles` existed, in today's layout:
    a PPO run's own keys move into its job_state (a file from before the estimator key was
    written was a gae run's), and its roles follow from its estimator (other jobs wrote the
    PPO keys' defaults, which mean nothing for them)."""
    if "job_state" in saved:
        return saved
    saved = dict(saved)
    own = {k: saved.pop(k) for k in _PPO_KEYS if k in saved}
    if saved.get("job", "ppo") == "ppo":
        own.setdefault("advantage_estimator", "gae")
        saved["job_state"] = own
        critic = estimator_spec(own["advantage_estimator"]).critic
        saved.setdefault("roles", list(TRAINED_ROLES) if critic else ["policy"])
    return saved


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:06d}"


def _named_by(root: Path, pointer: str) -> Path | None:
    """The checkpoint directory the file `pointer` names, or None when it is missing, unreadable
    or garbled."""
    try:
        name = (root / pointer).read_bytes().decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return root / name if _NAME.fullmatch(name) else None


def named_by_latest(root: Path) -> Path | None:
    """The directory `latest` names, or None when `latest` is missing, unreadable or garbled."""
    return _named_by(root, "latest")


def named_by_best(root: Path) -> Path | None:
    """The directory `best` names (checkpoint.keep_best), or None."""
    return _named_by(root, "best")


def best_of(root: Path, state: TrainerState) -> Path | None:
    """checkpoint.keep_best: the directory in `root` of the save that `state` records as the best
    so far (state.best), or None when it records none. The trainer state decides; `best` follows
    it (written with each save's commit, repaired at the next start)."""
    iteration = state.best.get("iteration")
    return None if iteration is None else root / checkpoint_name(int(iteration))


def write_pointer(root: Path, pointer: str, target: Path) -> None:
    """`root/pointer` (latest, best) names `target`: written to a temporary file, then renamed
    over the pointer (atomic), so a kill leaves the old name or the new, never a cut one."""
    tmp = root / f"{pointer}.tmp"
    tmp.write_text(target.name)
    os.replace(tmp, root / pointer)


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


_WARNED: set[tuple] = set()  # the fallbacks `latest_checkpoint` has warned of in this process


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint a run continues from: the one `latest` names; when `latest` is missing,
    garbled or names no directory, the newest complete checkpoint (with a warning). None when
    the run has no checkpoints at all.

    Raises:
        CheckpointError: checkpoint directories exist but none of them is complete.
    """
    root = checkpoints_dir(output_dir)
    named = named_by_latest(root)
    if named is not None and named.is_dir():
        return named
    done = complete_checkpoints(root)
    pointer = root / "latest"
    if done:
        why = ("is missing" if not pointer.exists() else
               f"names {named.name}, which does not exist" if named is not None else
               "is unreadable")
        # once per job: several steps of a start ask, on every rank
        if (pointer, why, done[-1][1]) not in _WARNED and os.environ.get("RANK", "0") == "0":
            _WARNED.add((pointer, why, done[-1][1]))
            log.warning("%s %s: continuing from the newest complete checkpoint, %s", pointer,
                        why, done[-1][1])
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


def unusable(path: Path, file: Path, what: str, fallback: Path | None | bool = True,
             command: str = "resume") -> CheckpointError:
    """The error for a checkpoint that cannot be loaded: names the checkpoint, the file, and the
    checkpoint to use instead (`fallback`: True = the previous one; a path = that one, e.g. the
    newest that verifies; None = there is none). `command`: "resume", "export" or "generate"."""
    prev = _previous(path) if fallback is True else fallback or None
    which = ("the previous checkpoint" if fallback is True else
             "the newest checkpoint that verifies")
    use = (f"resume={prev}" if command == "resume" else
           f"ds-ppo {command} {'--model' if command == 'generate' else '--checkpoint'} {prev}")
    if prev is not None:
        fix = f"{command} from {which}: {use}"
    elif command == "resume":
        fix = f"there is no earlier checkpoint: move {path} away to start fresh"
    else:
        fix = "there is no earlier checkpoint to " + ("generate from" if command == "generate"
                                                      else "export")
    return CheckpointError(f"checkpoint {path} is unusable: {file} {what}. To continue, {fix}")


def newest_verified(path: Path) -> Path | None:
    """The newest checkpoint older than `path` in its directory whose files all match their
    manifest (rank 0, every file read: only on the way to an error)."""
    from ds_ppo.engine.checkpoint import manifest

    it = _iteration(path)
    for i, older in reversed(complete_checkpoints(path.parent)):
        if older != path and (it is None or i < it) and not manifest.problems(older):
            return older
    return None


def _first_problem(path: Path, prefixes: tuple[str, ...] | None,
                   expected: str | None) -> tuple[str, str] | None:
    """Collective: each rank checks its share of `path`'s files against the manifest
    (engine/checkpoint/manifest.py; `expected`: why a missing manifest is an error); the first problem of
    any rank as (its file relative to `path`, what is wrong, with how many more files differ),
    alike on every rank, or None."""
    from ds_ppo.engine import dist
    from ds_ppo.engine.checkpoint import manifest  # here: this module needs no torch (--dry-run)

    mine = manifest.problems(path, dist.rank(), dist.world_size(), prefixes, expected)
    found = [p for part in dist.gather_objects(mine) for p in part]
    if not found:
        return None
    rel, what = found[0]
    return rel, what + (f" ({len(found) - 1} more files differ)" if len(found) > 1 else "")


def verify_files(path: Path, command: str = "resume",
                 prefixes: tuple[str, ...] | None = None) -> float:
    """Collective: check `path`'s files against its manifest, each rank its share (see
    engine/checkpoint/manifest.py), before anything is loaded. -> seconds taken (this rank).

    Raises:
        CheckpointError (every rank): a file is missing, cut off or changed; names it and the
            newest older checkpoint that verifies.
    """
    import time

    from ds_ppo.engine import dist

    start = time.perf_counter()
    expected = ("its trainer_state.json records that it was saved with one"
                if read_state(path).manifest else None)
    problem = _first_problem(path, prefixes, expected)
    if problem is not None:
        def fail():
            rel, what = problem
            raise unusable(path, path / rel, what, newest_verified(path), command)
        dist.on_rank0(fail)
    return time.perf_counter() - start


def has_manifest(path: Path) -> bool:
    """Whether the checkpoint `path` has, or was saved with, a manifest."""
    from ds_ppo.engine.checkpoint.manifest import MANIFEST

    return (path / MANIFEST).exists() or read_state(path).manifest


def _export_marker(path: Path) -> dict:
    try:
        marker = json.loads((path / EXPORT_MARKER).read_text())
    except (OSError, ValueError):  # missing or damaged: the manifest (if any) names it
        return {}
    return marker if isinstance(marker, dict) else {}


def is_export(path: Path) -> bool:
    """Whether `path` is a model directory ds_ppo exported (it holds its marker or a manifest)."""
    from ds_ppo.engine.checkpoint.manifest import MANIFEST

    return path.is_dir() and ((path / EXPORT_MARKER).exists() or (path / MANIFEST).exists())


def verify_export(path: Path, what: str) -> float:
    """Collective: check the export `path` (output_dir/final, `ds-ppo export --out`) against its
    manifest, each rank its share, before it loads; one that its ds_ppo_export.json says was
    written with a manifest must have it. `what` names it in the error (e.g. "policy.path").
    -> seconds taken (this rank).

    Raises:
        CheckpointError (every rank): a file is missing, cut off or changed; names it and how
            to get the export again.
    """
    import time

    from ds_ppo.engine import dist

    start = time.perf_counter()
    marker = _export_marker(path)
    expected = (f"its {EXPORT_MARKER} records that it was written with one"
                if marker.get("manifest") else None)
    problem = _first_problem(path, None, expected)
    if problem is not None:
        def fail():
            rel, why = problem
            source = str(marker.get("checkpoint", ""))
            if source.startswith("the run in ") and not source.endswith("(EMA)"):
                source = source.removeprefix("the run in ")
            fix = (f"export it again: ds-ppo export --checkpoint {source} --out {path}"
                   if source and not source.startswith("the run in ") else
                   "export it again from the checkpoint it came from (ds-ppo export)")
            raise CheckpointError(f"{what} {path} is unusable: {path / rel} {why}. "
                                  f"To use it, {fix}")
        dist.on_rank0(fail)
    return time.perf_counter() - start


def verify_model_paths(paths: dict[str, str | None], verify: bool) -> None:
    """Collective: every local model directory in `paths` ({config key: path}) that ds_ppo
    exported is checked against its manifest (`verify_export`) before anything loads;
    `verify` false (checkpoint.verify) skips that, with a warning naming each."""
    from ds_ppo.engine import dist
    from ds_ppo.engine.checkpoint.manifest import MANIFEST

    for key, spec in paths.items():
        if spec is None or not is_export(Path(spec)):
            continue
        if not verify:
            if dist.is_main():
                log.warning("checkpoint.verify=false: %s %s is loaded WITHOUT checking its files "
                            "against its manifest (a damaged file may load as wrong weights)",
                            key, spec)
            continue
        seconds = verify_export(Path(spec), key)
        if dist.is_main():
            if (Path(spec) / MANIFEST).exists():
                log.info("verified %s %s against its manifest in %.1f s", key, spec, seconds)
            else:
                log.warning("%s %s has no manifest (exported with checkpoint.verify=false or "
                            "before manifests existed): its files are loaded unchecked", key,
                            spec)


def read_state(path: Path) -> TrainerState:
    file = path / "trainer_state.json"
    try:
        return TrainerState(**_current(json.loads(file.read_text())))
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
    for role in state.roles:  # a critic-free run (grpo, rloo, ...) saved no value model
        files = sorted((path / role / TAG).rglob("*.pt"))
        if not files:
            raise unusable(path, path / role / TAG, "holds no DeepSpeed checkpoint files")
        for f in files:
            _check_torch_file(path, f)
    if state.world_size == world_size:
        for r in range(world_size):
            _check_torch_file(path, path / "rng" / f"rank_{r:05d}.pt")
    return state


def find_resume(output_dir: str | Path, resume: str, verify: bool = True) -> Path | None:
    """The checkpoint a run continues from (None: a fresh start), checked whole (with `verify`,
    every file against the manifest). Collective: rank 0 decides (and removes interrupted
    saves, renames newer checkpoints aside), every rank gets its answer or its error."""
    from ds_ppo.engine import dist  # here: the rest of this module needs no torch (--dry-run)

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
        verify_checkpoint(path, dist.world_size())
        return str(path)

    found = dist.on_rank0(decide)
    if found is None:
        return None
    path = Path(found)
    if verify:
        seconds = verify_files(path)
        if dist.is_main():
            if has_manifest(path):
                log.info("verified %s against its manifest in %.1f s (checkpoint.verify)", path,
                         seconds)
            else:
                log.warning("%s has no manifest (saved with checkpoint.verify=false, or before "
                            "manifests existed): its files are loaded unchecked", path)
    elif dist.is_main() and has_manifest(path):
        log.warning("checkpoint.verify=false: %s is loaded WITHOUT checking its files against "
                    "its manifest (a damaged file may load as wrong weights)", path)

    def settle() -> None:  # rank 0: the newer saves aside, then `best` agrees with the state
        root = checkpoints_dir(output_dir)
        _set_aside_newer(root, path, read_state(path).iteration)
        _repair_best(root, path)
    dist.on_rank0(settle)
    return path


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


def _repair_best(root: Path, resumed: Path) -> None:
    """Rank 0, at the start: `best` names the checkpoint the resumed trainer state calls best. A
    save points `best` just before `latest`; a kill between the two leaves `best` naming the save
    this run redoes (moved aside by `_set_aside_newer`). A checkpoint resumed from another
    directory (resume=PATH) records a best of that directory: nothing to repair here."""
    if resumed.parent.resolve() != root.resolve():
        return
    best, named = best_of(root, read_state(resumed)), named_by_best(root)
    if best is None:
        if named is not None and not named.is_dir():
            (root / "best").unlink()
            log.warning("removed checkpoints/best: it named %s, which is not a checkpoint of "
                        "this run's history up to %s (a save was interrupted)", named.name,
                        resumed.name)
    elif not best.is_dir():
        log.warning("the trainer state of %s calls %s the best checkpoint (checkpoint.keep_best), "
                    "but it does not exist (deleted?): checkpoints/best is left as it is", resumed,
                    best.name)
    elif named != best:
        write_pointer(root, "best", best)
        log.warning("checkpoints/best now names %s, the best checkpoint by the trainer state of %s "
                    "(it named %s: a save was interrupted)", best.name, resumed.name,
                    named.name if named is not None else "nothing")


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


def finished_run(output_dir: str | Path, resume: str, iterations: int, export_at_end: bool,
                 job: str = "ppo") -> tuple[Path, TrainerState] | None:
    """(checkpoint, its state) when the run in output_dir is already complete: the checkpoint it
    would resume from holds `iterations` (or more) and, with `export_at_end`, output_dir/final
    holds that iteration's export. Read from the files alone (no torch), so a re-run stops
    before anything loads; None when there is something to do (or a checkpoint is unusable:
    the real start names the problem, as it does for another `job`'s checkpoint)."""
    try:
        path = (None if resume == "never" else latest_checkpoint(output_dir)
                if resume == "auto" else resolve_checkpoint(resume))
        state = read_state(path) if path is not None else None
    except UserError:
        return None
    if state is None or state.iteration < iterations or state.job != job:
        return None
    if export_at_end:
        try:
            marker = json.loads((Path(output_dir) / "final" / EXPORT_MARKER).read_text())
        except (OSError, ValueError):
            marker = {}
        if marker.get("iteration") != state.iteration:
            return None  # the run stopped before its export: the models load to write it
    return path, state


def finished_message(output_dir: str | Path, path: Path, state: TrainerState, iterations: int,
                     export_at_end: bool, key: str = "iterations") -> str:
    """`key`: the setting that counts the run (iterations; sft.steps, rm.steps)."""
    return (f"ds-ppo: the run in {output_dir} already completed {state.iteration} of "
            f"{key}={iterations} ({path}"
            + (f", exported to {Path(output_dir) / 'final'}" if export_at_end else "")
            + f"); nothing to train: raise {key} to continue")
