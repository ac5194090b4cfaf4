"""A checkpoint's manifest: every file's size and CRC-32, so a damaged checkpoint is found before
it is loaded (a flipped byte inside a tensor loads silently otherwise).

Written at save, after every rank finished writing: each rank checksums a share of the files
(`shares`: a file whose name carries a rank number, `zero_pp_rank_3_...` or `rank_00003.pt`,
is that rank's; the rest are spread by size), writes its part, and rank 0 merges the parts
into `manifest.json` before the checkpoint is committed. Checked on resume (every rank its
share, the same split) and by `ds-ppo export` (the files the export reads). `checkpoint.verify:
false` skips both. An export (output_dir/final, `ds-ppo export --out`) gets one too, written by
one process once it is complete (`write`), checked wherever it is loaded. Nothing here imports
torch or DeepSpeed: the checks are plain file reads.

A checkpoint saved with a manifest says so in its trainer_state.json, an export in its
ds_ppo_export.json: the checks take `expected`, so a deleted manifest is an error, not a
checkpoint that loads unchecked.

    manifest.json   {"version": 1, "checksum": "crc32", "files": {"policy/ds/x.pt": [size, crc]}}

Files made later inside a checkpoint (the universal copies for another world size) are not
listed and not checked; a listed file that is missing, of another size or another CRC-32 is.
"""
from __future__ import annotations

import json
import os
import re
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST = "manifest.json"
_PARTS = ".manifest_parts"  # per-rank parts while a save is in progress
_CHUNK = 16 * 2**20
_RANK_IN_NAME = re.compile(r"(?:zero_pp_rank_|^rank_)(\d+)")
_LATER = ("ds_universal",)  # directories made after the save (not listed)


def file_crc(path: Path) -> tuple[int, int]:
    """(size in bytes, CRC-32) of a file, read in chunks (zlib releases the GIL while it sums,
    so threads check several files at once)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def list_files(root: Path) -> dict[str, int]:
    """{path relative to root: size} of every file of a checkpoint (not the manifest itself)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d != _PARTS and not d.startswith(_LATER))
        for name in filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if rel != MANIFEST:
                out[rel] = p.stat().st_size
    return out


def shares(sizes: dict[str, int], world: int) -> list[list[str]]:
    """Which rank checksums which file: a file named for a rank (DeepSpeed's
    `zero_pp_rank_N_...`, our `rng/rank_0000N.pt`) is rank N's (modulo `world`); the others go,
    largest first, to the rank with the least bytes so far. Deterministic: every rank computes
    the same split from the same listing."""
    out: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    rest = []
    for rel in sorted(sizes):
        m = _RANK_IN_NAME.search(Path(rel).name)
        if m is None:
            rest.append(rel)
            continue
        r = int(m.group(1)) % world
        out[r].append(rel)
        load[r] += sizes[rel]
    for rel in sorted(rest, key=lambda k: (-sizes[k], k)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[r].append(rel)
        load[r] += sizes[rel]
    return out


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _sums(root: Path, rels: list[str]) -> dict[str, list[int]]:
    with ThreadPoolExecutor(_threads()) as pool:
        return {rel: list(v) for rel, v in zip(rels, pool.map(lambda r: file_crc(root / r), rels))}


def write_share(root: Path, rank: int, world: int) -> float:
    """This rank's part of the manifest of the checkpoint being written in `root` (after every
    rank finished writing). -> seconds taken."""
    start = time.perf_counter()
    mine = shares(list_files(root), world)[rank]
    parts = root / _PARTS
    parts.mkdir(exist_ok=True)
    tmp = parts / f"rank_{rank:05d}.json.tmp"
    tmp.write_text(json.dumps(_sums(root, mine)))
    os.replace(tmp, parts / f"rank_{rank:05d}.json")
    return time.perf_counter() - start


def merge(root: Path) -> int:
    """Rank 0, after every rank wrote its part: `manifest.json` from the parts (a file no part
    covers, e.g. one another node's listing missed, is checksummed here). -> files listed."""
    files: dict[str, list[int]] = {}
    parts = root / _PARTS
    for part in sorted(parts.glob("rank_*.json")):
        files.update(json.loads(part.read_text()))
    missed = [rel for rel in list_files(root) if rel not in files]
    files.update(_sums(root, missed))
    for part in parts.iterdir():
        part.unlink()
    parts.rmdir()
    _write(root, files)
    return len(files)


def write(root: Path) -> int:
    """One process: `manifest.json` of every file in the complete directory `root` (an export).
    -> files listed."""
    files = _sums(root, sorted(list_files(root)))
    _write(root, files)
    return len(files)


def _write(root: Path, files: dict[str, list[int]]) -> None:
    lines = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(files.items()))
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(f'{{"version": 1, "checksum": "crc32", "files": {{\n{lines}\n}}}}\n')
    os.replace(tmp, root / MANIFEST)


def read(root: Path) -> dict[str, list[int]] | None:
    """The manifest's files (None: the checkpoint has no manifest, e.g. saved with
    checkpoint.verify=false or before manifests existed).

    Raises:
        ValueError: the manifest itself is unreadable.
    """
    try:
        data = json.loads((root / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise ValueError("is not a ds_ppo manifest")
    return data["files"]


def problems(root: Path, rank: int = 0, world: int = 1,
             prefixes: tuple[str, ...] | None = None,
             expected: str | None = None) -> list[tuple[str, str]]:
    """Check this rank's share of the files the manifest lists (only those under `prefixes`,
    e.g. ("hf/",), when given): [(file relative to root, what is wrong)], empty when all match
    or there is no manifest and none is `expected` (else: why one is, e.g. "trainer_state.json
    records that it was saved with one")."""
    try:
        files = read(root)
    except ValueError as e:
        return [(MANIFEST, str(e))] if rank == 0 else []
    if files is None:
        if expected is not None and rank == 0:
            return [(MANIFEST, f"is missing ({expected}: it was deleted or lost in a copy)")]
        return []
    if prefixes is not None:
        files = {k: v for k, v in files.items() if k.startswith(prefixes)}
    mine = shares({k: v[0] for k, v in files.items()}, world)[rank]

    def one(rel: str) -> tuple[str, str] | None:
        size, crc = files[rel]
        try:
            actual = (root / rel).stat().st_size
        except FileNotFoundError:
            return rel, "is missing"
        except OSError as e:
            return rel, f"cannot be read ({e.strerror or e})"
        if actual != size:
            return rel, (f"is {actual} bytes, {size} when it was saved (cut off or rewritten)"
                         if actual < size else
                         f"is {actual} bytes, {size} when it was saved (rewritten)")
        try:
            _, got = file_crc(root / rel)
        except OSError as e:
            return rel, f"cannot be read ({e.strerror or e})"
        if got != crc:
            return rel, (f"has changed since it was saved (CRC-32 {got:08x}, saved as "
                         f"{crc:08x}: damaged on disk or in transfer)")
        return None

    with ThreadPoolExecutor(_threads()) as pool:
        return [p for p in pool.map(one, mine) if p is not None]
