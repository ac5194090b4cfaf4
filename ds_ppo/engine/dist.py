"""Process-group set-up and the few collectives the trainer needs (all across the DP group)."""
from __future__ import annotations

import os
import re
import socket
from datetime import timedelta
from contextlib import closing

import torch
import torch.distributed as dist


def _free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (rank, world size, local rank) as launchers that start every rank directly name them
_RANK_SOURCES = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


def launcher_rank_vars(environ) -> dict[str, str]:
    """RANK/WORLD_SIZE/LOCAL_RANK from OpenMPI's, MPICH/Intel MPI's or SLURM's variables, for
    ranks started without them (`deepspeed --launcher openmpi|slurm`); {} when RANK is already
    set or no launcher variables are present. Also used by launch/ds_ppo_entry.py."""
    if "RANK" in environ:
        return {}
    for rank, size, local in _RANK_SOURCES:
        if rank in environ and size in environ:
            return {"RANK": environ[rank], "WORLD_SIZE": environ[size],
                    "LOCAL_RANK": environ.get(local, "0")}
    return {}


def init_distributed(timeout_minutes: float = 30.0) -> torch.device:
    """Join (or, run without a launcher, create) the process group; return this rank's device.

    Without the `deepspeed` launcher (plain `ds-ppo train`) the run is a world of one; the
    launcher's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* variables are used when present.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # MASTER_ADDR/PORT of such ranks come from the launcher's command line
    os.environ.update(launcher_rank_vars(os.environ))
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    acc = get_accelerator()
    from ds_ppo.engine.extensions import check_build_locks, skip_cpu_shm_comm

    skip_cpu_shm_comm(acc.device_name())  # nothing to JIT-build on a CPU machine
    check_build_locks()  # a killed build's lock: a message, not a silent wait forever
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if acc.device_name() != "cpu":
        acc.set_device(local_rank)
    if not dist.is_initialized():
        try:
            deepspeed.init_distributed(dist_backend=acc.communication_backend_name(),
                                       timeout=timedelta(minutes=timeout_minutes))
        except dist.DistError as err:  # a hang at start-up, turned into a message and exit 2
            raise join_error(err, dict(os.environ), timeout_minutes) from None
    name = acc.device_name(local_rank) if acc.device_name() != "cpu" else "cpu"
    return torch.device(name)


def join_error(err: Exception, environ, timeout_minutes: float):
    """The JoinError for a failed rendezvous: what this rank saw, then what to check."""
    from ds_ppo.errors import JoinError

    where = f"{environ.get('MASTER_ADDR')}:{environ.get('MASTER_PORT')}"
    me = f"rank {environ.get('RANK')} of {environ.get('WORLD_SIZE')}"
    seen = (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(".")
    if isinstance(err, dist.DistNetworkError):
        hint = (f"rank 0 is not reachable at {where} from this node: check that rank 0 is "
                "running, that MASTER_ADDR is an address of rank 0's node that this node can "
                "reach (not localhost on a multi-node job), and that the port is open")
    else:
        hint = ("not every rank joined in time: start every node's launcher with the same "
                "MASTER_ADDR, MASTER_PORT and node count; a rank that crashed before joining "
                "says why in its own log")
    return JoinError(f"{me} could not join the job at {where} within dist_timeout_minutes = "
                     f"{timeout_minutes:g}: {seen}. {hint}.")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def collective_device(t: torch.Tensor) -> torch.device:
    """Where a collective on `t` can run: NCCL takes only CUDA tensors, so a CPU tensor (metric
    sums built from Python floats) goes through this rank's GPU; gloo takes it where it is."""
    if t.device.type == "cpu" and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return t.device


def _all_reduce(t: torch.Tensor, op) -> torch.Tensor:
    """A reduced copy of t over the data-parallel group, on t's device (identity on one
    process)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return t.clone()
    work = t.to(collective_device(t), copy=True)
    dist.all_reduce(work, op=op)
    return work.to(t.device)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the data-parallel group (returns a new tensor; identity on one process)."""
    return _all_reduce(t, dist.ReduceOp.SUM)


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Maximum over the data-parallel group (returns a new tensor; identity on one process)."""
    return _all_reduce(t, dist.ReduceOp.MAX)


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s Python object on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj) -> list:
    """Every rank's object, in rank order, on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ranks on this node, as launchers name it: torchrun, the deepspeed launcher, OpenMPI, MPICH /
# Intel MPI, SLURM ("8", or "8(x2)" for 2 nodes of 8)
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                    "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


def local_world_size() -> int:
    """Ranks on this node, from the launcher's variables; else the visible GPUs (one rank per
    GPU), capped by the world size; on CPU without them, the world size."""
    for var in _LOCAL_SIZE_VARS:
        digits = re.match(r"\d+", os.environ.get(var, ""))
        if digits and int(digits.group()) > 0:
            return int(digits.group())
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return min(world_size(), torch.cuda.device_count())
    return world_size()


def num_nodes() -> int:
    return max(1, world_size() // local_world_size())
