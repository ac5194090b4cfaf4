"""DeepSpeed's JIT-built C++ extensions at start-up: none on a CPU machine by default, and a stale
build lock named instead of waited on forever.

On the CPU accelerator DeepSpeed JIT-compiles its shared-memory collectives
(`deepspeed_shm_comm`, an optimisation of CPU all-reduce over gloo) on the first start of every
process. torch serialises such builds with a `lock` file in the extensions cache
(`~/.cache/torch_extensions/py311_cpu/<name>/lock`, or under TORCH_EXTENSIONS_DIR); a process
killed during the build leaves the file behind, and every later start waits on it, silently and
forever. So on CPU ds_ppo skips that op (collectives go through gloo; DS_PPO_CPU_SHM_COMM=1 builds
and uses it), and before DeepSpeed can wait on a lock, a lock that no live process holds is an
error naming the file to remove.
"""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

from ds_ppo.errors import UserError

SHM_COMM = "deepspeed_shm_comm"
# a lock file whose holder we cannot see (another user's process) counts as stale after this
_UNSEEN_OWNER_STALE_S = 30 * 60


def skip_cpu_shm_comm(accelerator_name: str) -> bool:
    """Mark DeepSpeed's CPU shared-memory comm op incompatible (so `deepspeed.init_distributed`
    neither builds nor loads it) on the CPU accelerator unless DS_PPO_CPU_SHM_COMM=1. Returns
    whether it was skipped. Call before `deepspeed.init_distributed`."""
    if accelerator_name != "cpu" or os.environ.get("DS_PPO_CPU_SHM_COMM") == "1":
        return False
    import deepspeed.ops

    if "__compatible_ops__" not in vars(deepspeed.ops):  # not probed yet: probe lazily
        deepspeed.ops.__compatible_ops__ = _OpsProbedOnRead()
    deepspeed.ops.__compatible_ops__[SHM_COMM] = False
    return True


class _OpsProbedOnRead(dict):
    """DeepSpeed's table of compatible ops (`deepspeed.ops.__compatible_ops__`), each op probed
    when it is first read. DeepSpeed's own table probes all of them on first access, which
    compiles test programs (about 1 s per process); `deepspeed.comm` reads one entry."""

    def __missing__(self, name: str) -> bool:
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
        from deepspeed.ops.op_builder.builder import probe_is_compatible

        builder = ALL_OPS.get(name)
        self[name] = bool(builder is not None and probe_is_compatible(builder))
        return self[name]

    def get(self, name, default=None):
        return self[name] if name in self or _known_op(name) else default


def _known_op(name: str) -> bool:
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    return name in ALL_OPS


def extensions_root(environ=os.environ) -> Path:
    """The torch extensions cache holding every extension's build directory (as torch picks it:
    TORCH_EXTENSIONS_DIR, else <cache>/torch_extensions/py<ver>_<cpu|cuXY|rocmXY>)."""
    if environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(environ["TORCH_EXTENSIONS_DIR"])
    from torch.utils.cpp_extension import get_default_build_root

    import torch

    acc = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
           f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{py}_{acc}"


# processes that may hold a build lock (python, or a build tool it runs)
_BUILDERS = re.compile(r"python|ninja|deepspeed|ds-ppo|torchrun|c\+\+|g\+\+|gcc|cc1|clang|\bld\b")


def _lock_holders(locks: set[str]) -> tuple[set[str], bool]:
    """The lock files some visible process holds open (torch's FileBaton keeps its file
    descriptor open until it releases the lock), and whether some python or build process could
    not be inspected (another user's)."""
    import psutil

    held, unseen = set(), False
    for proc in psutil.process_iter(["name"]):
        try:
            held.update(f.path for f in proc.open_files() if f.path in locks)
        except (psutil.AccessDenied, psutil.ZombieProcess):
            unseen = unseen or bool(_BUILDERS.search(proc.info.get("name") or "python"))
        except psutil.NoSuchProcess:
            pass
    return held, unseen


def stale_locks(root: Path, now: float | None = None) -> list[Path]:
    """Build locks under `root` (`<root>/<extension>/lock`) that no live process holds: left by a
    build that was killed. A lock whose holder may be invisible to us (another user's process)
    is stale only when older than 30 minutes."""
    locks = [p for p in root.glob("*/lock") if p.is_file()] if root.is_dir() else []
    if not locks:
        return []
    held, unseen = _lock_holders({os.path.realpath(p) for p in locks})
    now = time.time() if now is None else now
    stale = []
    for path in locks:
        try:
            age = now - path.stat().st_mtime
        except FileNotFoundError:  # released while we looked
            continue
        # a lock younger than a few seconds may have been taken after the scan
        if (os.path.realpath(path) not in held and age > 5
                and (not unseen or age > _UNSEEN_OWNER_STALE_S)):
            stale.append(path)
    return stale


def check_build_locks(root: Path | None = None) -> None:
    """UserError naming the stale build locks in the torch extensions cache (a start would wait on
    them forever)."""
    stale = stale_locks(extensions_root() if root is None else root)
    if stale:
        paths = " ".join(str(p) for p in stale)
        raise UserError(
            f"a C++ extension build was killed and left its lock file: {paths}. No process holds "
            f"it, but DeepSpeed would wait for it forever. Remove it (rm {paths}) and start again; "
            "the extension is rebuilt on the next start.")
