"""Single-rank file work without collective timeouts (dist.main_does), on two gloo ranks.

The process group's timeout is 2 s; rank 0 works alone for 4 s. A plain barrier there times
out; with main_does the other rank waits on a marker file and both finish. A failure on rank 0
reaches the waiting rank as an error naming it; a rank 0 that stops its heartbeat is declared
dead after stale_after_s. Also: ds_to_universal's worker counts."""
from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as tdist
import torch.multiprocessing as mp

from ds_ppo.engine import dist
from ds_ppo.engine.checkpoint import universal_workers

WORK_S = 4.0


def _worker(rank: int, init_file: str, where: str, modes: str) -> None:
    """Each of `modes` (comma-separated, in order) in one process group."""
    tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                             world_size=2, timeout=timedelta(seconds=2))
    try:
        for mode in modes.split(","):
            _case(rank, where, mode)
    finally:
        tdist.destroy_process_group()


def _case(rank: int, where: str, mode: str) -> None:
    def work(fail: bool):
        time.sleep(WORK_S)
        if fail:
            raise ValueError("disk full")
        return "converted"

    if mode == "on_rank0":  # an OSError of rank 0's file work reaches the other rank
        def write(path):
            raise OSError(28, "No space left on device", path)
        try:
            dist.on_rank0(write, where)
        except (OSError, RuntimeError) as err:
            assert "No space left" in str(err), err
            assert isinstance(err, OSError) == (rank == 0), err
            assert rank == 0 or "rank 0 failed in write" in str(err), err
        else:
            raise AssertionError("rank 0's OSError did not reach every rank")
        assert dist.on_rank0(lambda: 7) == 7  # the group still works afterwards
        return
    if mode == "barrier":  # what ensure_universal did: the waiting rank's barrier times out
        if rank == 0:
            work(False)
        tdist.barrier()
        return
    result = dist.main_does(lambda: work(False), where, "converting")
    assert result == ("converted" if rank == 0 else None)
    tdist.barrier()  # the group still works afterwards
    assert not list(Path(where).glob(".ds_ppo_*"))  # markers removed
    try:
        dist.main_does(lambda: work(True), where, "converting")
    except (ValueError, RuntimeError) as err:
        assert "disk full" in str(err), err
        assert rank == 0 or "rank 0 failed while converting" in str(err), err
    else:
        raise AssertionError("rank 0's failure did not reach every rank")


def test_other_ranks_outwait_the_collective_timeout_and_hear_of_rank_0s_failures(tmp_path):
    """One pair of ranks (each spawn starts two interpreters) for both cases, in turn:
    - on_rank0: without the broadcast of rank 0's failure, rank 1 would wait out the 2 s timeout
      and fail on it instead (the spawn would still raise, but not with this message);
    - main_does: twice 4 s of rank-0 work under a 2 s collective timeout, once done, once failed."""
    start = time.monotonic()
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path), "on_rank0,main_does"),
             nprocs=2)
    assert time.monotonic() - start >= 2 * WORK_S


def test_a_plain_barrier_times_out_there(tmp_path):
    with pytest.raises(Exception):
        mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path), "barrier"), nprocs=2)


def test_a_silent_rank_0_is_declared_dead(tmp_path, monkeypatch):
    monkeypatch.setattr(dist, "POLL_S", 0.05)
    (tmp_path / "beat").write_text("0")  # never changes again
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="stopped showing progress"):
        dist._wait_for(tmp_path / "done", tmp_path / "beat", "converting", stale_after_s=0.5)
    assert time.monotonic() - start < 5


def test_universal_workers_bounded_by_cores_memory_and_shards():
    GB = 10**9
    # 64 shards of 19 GB, 1 TB free: 26 fit in half the memory, 96 cores
    assert universal_workers(96, 1000 * GB, 19 * GB, 64) == [
        "--num_extract_workers", "26", "--num_merge_workers", "6"]
    # small shards: one per core, and never more than the shards
    assert universal_workers(8, 100 * GB, GB, 64)[1] == "8"
    assert universal_workers(8, 100 * GB, GB, 2) == [
        "--num_extract_workers", "2", "--num_merge_workers", "1"]
    assert universal_workers(4, GB, 10 * GB, 8)[1] == "1"  # at least one


def test_cpu_ranks_share_the_nodes_cores():
    """Several CPU ranks on a node split its cores (each would otherwise take them all: 2 ranks
    of the tiny default on 2 cores ran 3-4x slower per iteration); one rank, or an explicit
    OMP_NUM_THREADS (the launcher's --bind_cores_to_rank sets it), keeps torch's default."""
    from ds_ppo.engine.dist import cpu_threads_per_rank

    assert cpu_threads_per_rank({"LOCAL_SIZE": "2"}, 16) == 8  # the deepspeed launcher's name
    assert cpu_threads_per_rank({"LOCAL_WORLD_SIZE": "4"}, 16) == 4  # torchrun's
    assert cpu_threads_per_rank({"LOCAL_SIZE": "4"}, 2) == 1  # never 0
    assert cpu_threads_per_rank({"LOCAL_SIZE": "1"}, 16) is None
    assert cpu_threads_per_rank({}, 16) is None
    assert cpu_threads_per_rank({"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "3"}, 16) is None
