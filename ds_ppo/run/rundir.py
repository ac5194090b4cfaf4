"""The run directory (output_dir) outside the checkpoints: one run at a time, and a metrics log
that loses no rows.

- `lock_output_dir`: rank 0 holds `output_dir/.ds_ppo.lock` (host and pid) until the process
  exits. A second run on the same directory stops with `OutputDirBusy`; a lock left by a process
  that no longer exists on this host (a SIGKILL) is taken over with a warning.
- `start_metrics_log`: a resumed run keeps `metrics.jsonl`'s rows (and `samples.jsonl`'s) up to
  the resumed iteration (a torn last line, cut by a kill or a full disk, is dropped with a
  warning; a malformed line elsewhere is an error naming the file and line); a fresh start moves
  an existing log aside (`metrics.jsonl.1`, ...) instead of truncating it.
"""
from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import socket
import time
from pathlib import Path

from ds_ppo.engine import dist
from ds_ppo.errors import OutputDirBusy, UserError

log = logging.getLogger("ds_ppo")
LOCK_NAME = ".ds_ppo.lock"
METRICS_NAME = "metrics.jsonl"
SAMPLES_NAME = "samples.jsonl"  # the sample tables, one row per sample (ds-ppo samples)


# --------------------------------------------------------------------------- the lock
def lock_output_dir(output_dir: str | Path) -> None:
    """Collective: rank 0 takes the run lock on output_dir (released when the process exits);
    every rank raises `OutputDirBusy` if another live run holds it."""
    dist.on_rank0(acquire_lock, Path(output_dir))


def acquire_lock(output_dir: Path) -> Path:
    """Take `output_dir/.ds_ppo.lock` for this process; returns the lock file.

    Raises:
        OutputDirBusy: a process that is still running (or one on another host, which cannot be
            checked) holds it.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    lock = output_dir / LOCK_NAME
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime(
        "%Y-%m-%d %H:%M:%S")}
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_lock(lock)
            if holder.get("host") == me["host"] and holder.get("pid") == me["pid"]:
                # this process holds it (train() called again), or a killed run whose process
                # had this pid (a restarted container) left it: released at exit either way
                atexit.register(release_lock, lock)
                return lock
            if holder.get("host") == me["host"] and not _alive(holder.get("pid")):
                log.warning("taking over the lock %s of process %s on %s, which no longer runs "
                            "(it was killed)", lock, holder.get("pid"), me["host"])
                lock.unlink(missing_ok=True)
                continue
            who = (f"process {holder.get('pid')} on host {holder.get('host')} (started "
                   f"{holder.get('started')})" if holder else "an unknown process")
            raise OutputDirBusy(
                f"output_dir {output_dir} is in use by another run: {who} holds {lock}. Wait "
                "for it to finish or use another output_dir; if that run is gone (e.g. its "
                f"node died), delete {lock}") from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        atexit.register(release_lock, lock)
        return lock
    raise OutputDirBusy(f"could not take the lock {lock}: another run took it at the same time")


def release_lock(lock: Path) -> None:
    """Remove the lock file if this process holds it."""
    holder = _read_lock(lock)
    if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        lock.unlink(missing_ok=True)


def _read_lock(lock: Path) -> dict:
    try:
        holder = json.loads(lock.read_text())
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}  # cut or garbled: treated as held by an unknown process


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return True  # unknown: never take it over
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


# ----------------------------------------------------------------------- metrics.jsonl
def read_metrics_log(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl. A torn last line (a write cut off) is dropped with a warning.

    Raises:
        UserError: a line before the last is not a JSON object with an `iteration`.
    """
    return [row for row, _ in _parse_metrics(path)]


def _parse_metrics(path: Path) -> list[tuple[dict, str]]:
    """(row, its line as written) for each row of a metrics.jsonl; see `read_metrics_log`."""
    lines = path.read_text(errors="replace").splitlines()
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    rows = []
    for k, (n, line) in enumerate(numbered):
        try:
            row = json.loads(line)
            int(row["iteration"])
        except (ValueError, KeyError, TypeError) as e:
            if k == len(numbered) - 1:
                log.warning("%s line %d is cut off (a write was interrupted): dropped", path, n)
                break
            raise UserError(f"{path} line {n} is not a metrics row ({type(e).__name__}: {e}); "
                            "fix or delete that line, then run again") from None
        rows.append((row, line))
    return rows


def start_metrics_log(output_dir: str | Path, resumed_iteration: int | None) -> None:
    """Collective. Resumed: keep the rows up to `resumed_iteration` (later ones ran before a
    crash and run again now). Fresh start: move an existing, non-empty log aside."""
    dist.on_rank0(_start_metrics_log, Path(output_dir), resumed_iteration)


def _start_metrics_log(output_dir: Path, resumed_iteration: int | None) -> None:
    for name in (METRICS_NAME, SAMPLES_NAME):  # both logs hold rows with an `iteration`
        _start_log(output_dir / name, resumed_iteration)


def _start_log(path: Path, resumed_iteration: int | None) -> None:
    output_dir, name = path.parent, path.name
    if not path.exists():
        return
    if resumed_iteration is None:
        if path.stat().st_size == 0:
            return
        n = 1
        while path.with_name(f"{name}.{n}").exists():
            n += 1
        aside = path.with_name(f"{name}.{n}")
        os.replace(path, aside)
        log.warning("a fresh start in %s: the earlier %s is kept as %s", output_dir,
                    name, aside.name)
        return
    kept = [line for row, line in _parse_metrics(path) if row["iteration"] <= resumed_iteration]
    tmp = path.with_name(name + ".tmp")
    try:
        tmp.write_text("".join(line + "\n" for line in kept))
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            tmp.unlink(missing_ok=True)
            raise UserError(f"no space left on the device while writing {tmp}; {path} is "
                            "unchanged") from None
        raise
    os.replace(tmp, path)
