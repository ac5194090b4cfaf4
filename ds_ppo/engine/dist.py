"""Process-group set-up and the few collectives the trainer needs.

Data-parallel (DP) group: with deepspeed.sequence_parallel_size = N (`set_sequence_parallel`),
the N consecutive ranks of a sequence-parallel (SP) group hold the same rows, so they are ONE
data-parallel rank: `dp_rank()` / `dp_world_size()` index the rows, sums run over the ranks
with the same place in their SP group (each row counted once), maxima over the world (the
same value either way; every rank's count of collective forwards must agree). With N = 1 the
DP group is the world."""
from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import uuid
from contextlib import closing
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ds_ppo import watchdog

log = logging.getLogger("ds_ppo")
_timeout_minutes = 30.0  # dist_timeout_minutes of this job (init_distributed sets it)
# deepspeed.sequence_parallel_size and this rank's groups (set_sequence_parallel)
_SP: dict = {"size": 1, "sp_group": None, "dp_group": None}
_GROUPS: dict[int, dict] = {}  # SP size -> this rank's {"sp_group", "dp_group"}
# ppo.placement = split (`init_distributed(generation_ranks=K)`): the launcher's world of W
# ranks is T = W - K training ranks, whose default process group (DeepSpeed's world, and every
# collective of this module) holds them alone, and K generation ranks outside it; the bridge,
# a gloo group of all W ranks on the same store, carries rollouts and weights between them
_SPLIT: dict = {"bridge": None, "rank": 0, "world": 1, "generation_ranks": 0, "store": None,
                "token": ""}


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


def import_deepspeed():
    """`import deepspeed`, without the guarded `import mlflow` of its autotuner (which ds_ppo
    never runs): with mlflow installed that import was about 40% of DeepSpeed's own import time,
    paid by every rank, also with tracking.enabled=false. mlflow stays importable afterwards
    (ds_ppo's tracking imports it when it logs). Where mlflow or deepspeed is already imported,
    a plain import."""
    import sys

    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed
        return deepspeed
    sys.modules["mlflow"] = None  # `import mlflow` raises ImportError: the guard takes it
    try:
        import deepspeed
    finally:
        if sys.modules.get("mlflow", False) is None:
            del sys.modules["mlflow"]
    return deepspeed


def init_distributed(timeout_minutes: float = 30.0, generation_ranks: int = 0) -> torch.device:
    """Join (or, run without a launcher, create) the process group; return this rank's device.

    Without the `deepspeed` launcher (plain `ds-ppo train`) the run is a world of one; the
    launcher's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* variables are used when present.
    `generation_ranks` K > 0 (ppo.placement = split): the last K ranks of the launcher's world
    join no default group (`is_generation_rank`), the others form it alone, and all of them the
    bridge (`bridge_send` / `bridge_recv`).
    """
    deepspeed = import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    global _timeout_minutes
    _timeout_minutes = timeout_minutes
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
    launched_world, launched_rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    generating = generation_ranks > 0 and launched_rank >= launched_world - generation_ranks
    if generation_ranks > 0 and not generating:  # DeepSpeed's world: the training ranks
        os.environ["WORLD_SIZE"] = str(launched_world - generation_ranks)
    if acc.device_name() != "cpu":
        acc.set_device(local_rank)
    else:
        threads = cpu_threads_per_rank(os.environ, _cpu_count())
        if threads is not None:
            torch.set_num_threads(threads)
    if not dist.is_initialized() and not generating:
        try:
            deepspeed.init_distributed(dist_backend=acc.communication_backend_name(),
                                       timeout=timedelta(minutes=timeout_minutes))
        except dist.DistError as err:  # a hang at start-up, turned into a message and exit 2
            raise join_error(err, dict(os.environ), timeout_minutes) from None
    if generation_ranks > 0:
        _join_bridge(launched_rank, launched_world, generation_ranks, generating,
                     timedelta(minutes=timeout_minutes))
    name = acc.device_name(local_rank) if acc.device_name() != "cpu" else "cpu"
    return torch.device(name)


def _join_bridge(rank_: int, world: int, generation_ranks: int, generating: bool,
                 timeout: timedelta) -> None:
    """The bridge of a split placement: a gloo group of the launcher's whole world on the
    training ranks' store (rank 0's TCPStore at MASTER_ADDR:MASTER_PORT)."""
    if generating:
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=timeout)
    else:
        base = dist.distributed_c10d._get_default_store()
        while isinstance(base, dist.PrefixStore):  # the default group's prefixes
            base = base.underlying_store
    bridge = dist.ProcessGroupGloo(dist.PrefixStore("ds_ppo_bridge", base), rank_, world, timeout)
    # this start's token for the watchdog's keys (`run_token`), rank 0's, on every rank
    token = torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8).clone()
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    bridge.broadcast([token], opts).wait()
    _SPLIT.update(bridge=bridge, rank=rank_, world=world, generation_ranks=generation_ranks,
                  store=base, token=bytes(token.tolist()).hex())


def is_generation_rank() -> bool:
    """A rank of a split placement that only generates (no default group, no engine)."""
    s = _SPLIT
    return s["bridge"] is not None and s["rank"] >= s["world"] - s["generation_ranks"]


def generation_peer(training_rank: int) -> int:
    """The bridge rank of the generation rank that serves `training_rank` (split placement):
    training rank r is served by generation rank r mod K."""
    s = _SPLIT
    return s["world"] - s["generation_ranks"] + training_rank % s["generation_ranks"]


def served_training_ranks(generation_rank: int) -> list[int]:
    """The training ranks that bridge rank `generation_rank` serves, in rank order (the first
    also sends it the weights)."""
    s = _SPLIT
    trainers = s["world"] - s["generation_ranks"]
    return [r for r in range(trainers) if generation_peer(r) == generation_rank]


def bridge_send(obj, dst: int, timeout_s: float | None = None) -> None:
    """`obj` (tensors on any device, dataclasses of them, Python values) to bridge rank `dst`,
    pickled: a length, then the bytes. Blocks until `dst` took it (at most `timeout_s` per
    part when given; then raises)."""
    import io

    buf = io.BytesIO()
    torch.save(_moved(obj, torch.device("cpu")), buf)
    payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    bridge = _SPLIT["bridge"]
    wait = () if timeout_s is None else (timedelta(seconds=timeout_s),)
    bridge.send([torch.tensor([payload.numel()], dtype=torch.int64)], dst, 0).wait(*wait)
    bridge.send([payload], dst, 1).wait(*wait)


def bridge_recv(src: int, device: torch.device | None = None):
    """The next object bridge rank `src` sent (`bridge_send`), its tensors on `device`."""
    import io

    bridge = _SPLIT["bridge"]
    size = torch.zeros(1, dtype=torch.int64)
    bridge.recv([size], src, 0).wait()
    payload = torch.empty(int(size), dtype=torch.uint8)
    bridge.recv([payload], src, 1).wait()
    obj = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)
    return obj if device is None else _moved(obj, device)


def cpu_threads_per_rank(environ, cpu_count: int) -> int | None:
    """Torch threads for one of several CPU ranks on a node: the node's cores shared out
    (each rank would otherwise start one thread per core, and the ranks' threads would fight
    over the cores). None (torch's default) with one rank per node, or when OMP_NUM_THREADS
    says otherwise (the deepspeed launcher's --bind_cores_to_rank sets it)."""
    if "OMP_NUM_THREADS" in environ:
        return None
    local = int(environ.get("LOCAL_SIZE") or environ.get("LOCAL_WORLD_SIZE") or 1)
    return max(1, cpu_count // local) if local > 1 else None


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may run on
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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


def set_zero3_leaf_modules(model: torch.nn.Module, classes: list[type]) -> None:
    """ZeRO-3 treats each module of `classes` in `model` as one leaf: all its parameters are
    gathered when it is entered and no hooks run inside it (DeepSpeed's set_z3_leaf_modules;
    before deepspeed.initialize). No classes: nothing."""
    if classes:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, classes)


def rank() -> int:
    """This rank in the default group (a split placement's generation rank: its bridge rank)."""
    return dist.get_rank() if dist.is_initialized() else _SPLIT["rank"]


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def sp_layout(world: int, size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(SP groups, DP groups) of a world of `world` ranks with SP size `size`: SP group k is the
    consecutive ranks [k*size, (k+1)*size) (DeepSpeed's parallel_state_sp layout: a group
    shares a node); DP group j is the ranks at place j of their SP group."""
    if size < 1 or world % size:
        raise ValueError(f"sequence-parallel size {size} does not divide the world size {world}")
    sp = [list(range(k * size, (k + 1) * size)) for k in range(world // size)]
    return sp, [list(range(j, world, size)) for j in range(size)]


def sp_coords(rank: int, world: int, size: int) -> tuple[int, int, int]:
    """(data-parallel rank, data-parallel world size, place in the SP group) of `rank`."""
    sp_layout(world, size)  # checks that size divides world
    return rank // size, world // size, rank % size


def set_sequence_parallel(size: int):
    """Make the SP groups of `size` consecutive ranks and the DP groups across them (every rank
    creates every group, as torch.distributed requires); returns this rank's SP group (None
    for size 1). Collective; once per process."""
    if size == 1:
        _SP.update(size=1, sp_group=None, dp_group=None)
        return None
    if size not in _GROUPS:  # made once per size: every rank builds the same engines in turn
        sp, dp = sp_layout(world_size(), size)
        mine = {}
        for kind, layout in (("sp_group", sp), ("dp_group", dp)):
            for ranks in layout:
                g = dist.new_group(ranks)
                if rank() in ranks:
                    mine[kind] = g
        _GROUPS[size] = mine
    _SP.update(size=size, **_GROUPS[size])
    return _SP["sp_group"]


def sp_size() -> int:
    """deepspeed.sequence_parallel_size of this job (1 before set_sequence_parallel)."""
    return _SP["size"]


def sp_group():
    """This rank's sequence-parallel group (None without sequence parallelism)."""
    return _SP["sp_group"]


def dp_group():
    """The data-parallel group sums run over (None: the world)."""
    return _SP["dp_group"]


def dp_rank() -> int:
    """This rank's data-parallel rank: which rows it holds (its SP group's index)."""
    return rank() // _SP["size"]


def dp_world_size() -> int:
    """Data-parallel ranks: world / deepspeed.sequence_parallel_size."""
    return world_size() // _SP["size"]


def is_sp_leader() -> bool:
    """The first rank of this rank's SP group (every rank without sequence parallelism)."""
    return rank() % _SP["size"] == 0


def broadcast_in_sp_group(obj, device: torch.device):
    """The SP group's first rank's Python object (tensors, dataclasses of them, lists, dicts)
    on every rank of the group, its tensors on `device` (itself without sequence parallelism).
    Tensors travel as CPU copies, so no rank unpickles another GPU's device."""
    if _SP["size"] == 1:
        return obj
    src = rank() - rank() % _SP["size"]
    box = [_moved(obj, torch.device("cpu")) if rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=_SP["sp_group"])
    return _moved(box[0], device)


def exchange_objects(obj, device: torch.device) -> list:
    """Every data-parallel rank's `obj` (tensors, dataclasses of them, lists, dicts), in
    data-parallel rank order, its tensors on `device`; they travel as CPU copies."""
    gathered = gather_objects(_moved(obj, torch.device("cpu")), data_parallel=True)
    return [_moved(o, device) for o in gathered]


def _moved(obj, device: torch.device):
    """`obj` with every tensor inside it on `device` (dataclass fields, lists, tuples, dicts)."""
    import dataclasses

    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _moved(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, (list, tuple)):
        return type(obj)(_moved(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _moved(v, device) for k, v in obj.items()}
    return obj


moved = _moved  # for callers outside: e.g. a checkpoint's objects onto this rank's device


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def watchdog_store(timeout_s: float = 5.0):
    """A client of its own (`clone`) to the job's store, the TCPStore on rank 0's node that the
    ranks met through, for the watchdog's heartbeats (`ds_ppo.watchdog`); None on one rank or
    without such a store. A split placement's ranks, generation ranks included, all beat into
    the bridge's store, also with one training rank."""
    if _SPLIT["store"] is None and world_size() <= 1:
        return None
    try:
        store = (_SPLIT["store"] or dist.distributed_c10d._get_default_store()).clone()
        store.set_timeout(timedelta(seconds=timeout_s))
    except (AttributeError, RuntimeError, ValueError) as err:
        log.warning("the watchdog cannot reach the job's store (%s): a hang will name this "
                    "rank's phase only", err)
        return None
    return store


def watchdog_world() -> tuple[int, int]:
    """(the ranks the watchdog watches, how many of the last of them are generation ranks): the
    launcher's whole world under a split placement, else the default group."""
    if _SPLIT["bridge"] is not None:
        return _SPLIT["world"], _SPLIT["generation_ranks"]
    return world_size(), 0


def run_token() -> str:
    """A token for this start of the job, alike on every rank (the watchdog's keys): under a
    split placement the bridge's, else rank 0's broadcast (collective over the default group)."""
    if _SPLIT["bridge"] is not None:
        return _SPLIT["token"]
    return broadcast_object(uuid.uuid4().hex if is_main() else None)


def is_collective_failure(err: BaseException) -> bool:
    """Whether `err` is a collective (or the process group's store) failing: a timeout, or a
    peer that went away (gloo raises these as RuntimeErrors naming gloo)."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("gloo" in text or "NCCL" in text
                                              or "Connection closed by peer" in text)


def collective_device(t: torch.Tensor) -> torch.device:
    """Where a collective on `t` can run: NCCL takes only CUDA tensors, so a CPU tensor (metric
    sums built from Python floats) goes through this rank's GPU; gloo takes it where it is."""
    if t.device.type == "cpu" and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return t.device


def _all_reduce(t: torch.Tensor, op, group=None) -> torch.Tensor:
    """A reduced copy of t over `group` (None: the world), on t's device (identity on one
    process)."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return t.clone()
    work = t.to(collective_device(t), copy=True)
    dist.all_reduce(work, op=op, group=group)
    return work.to(t.device)


def all_reduce_sum(t: torch.Tensor, over_world: bool = False) -> torch.Tensor:
    """Sum over the data-parallel group: each row counted once, also when an SP group of N
    ranks holds it; `over_world`: over every rank (what is split over all ranks, such as ZeRO
    partitions). Returns a new tensor; identity on one process."""
    return _all_reduce(t, dist.ReduceOp.SUM, None if over_world else _SP["dp_group"])


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Maximum over every rank (the data-parallel maximum too: an SP group's ranks hold the
    same rows); a count of collective forwards agreed on by the world (returns a new tensor;
    identity on one process)."""
    return _all_reduce(t, dist.ReduceOp.MAX)


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s Python object on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj, data_parallel: bool = False) -> list:
    """Every rank's object, in rank order, on every rank; `data_parallel`: one per
    data-parallel rank (the ranks at this rank's place in their SP groups)."""
    group = _SP["dp_group"] if data_parallel else None
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
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


def first_failure(error: BaseException | None) -> tuple[int, str, str | None] | None:
    """Collective, after the ranks agreed that one failed: (rank, message, its `fix`
    attribute) of the lowest rank whose `error` is not None, on every rank (None: none
    failed). A rank that did not fail can then say which rank did and why, instead of
    pointing at another rank's log."""
    mine = None if error is None else (str(error), getattr(error, "fix", None))
    for r, failed in enumerate(gather_objects(mine)):
        if failed is not None:
            return r, failed[0], failed[1]
    return None


def on_rank0(fn, *args):
    """`fn(*args)` on rank 0 only; its result on every rank. A `UserError` it raises is raised on
    every rank alike (same class and message), so a rank-0 check stops the whole job instead of
    leaving the other ranks waiting at the next collective. Any other exception (an OSError of
    the file work, ...) is raised on rank 0 as it is and on the others as a RuntimeError naming
    it: no rank is left waiting for a broadcast that never comes."""
    from ds_ppo import errors

    verdict, error = None, None
    if is_main():
        try:
            verdict = ("ok", fn(*args))
        except errors.UserError as e:
            verdict, error = ("error", type(e).__name__, str(e)), e
        except Exception as e:  # noqa: BLE001  (re-raised below, after the others heard of it)
            verdict, error = ("crash", type(e).__name__, str(e)), e
    verdict = broadcast_object(verdict)
    if error is not None:
        raise error
    if verdict[0] == "ok":
        return verdict[1]
    if verdict[0] == "crash":
        name = getattr(fn, "__name__", "its work")
        raise RuntimeError(f"rank 0 failed in {name}: {verdict[1]}: {verdict[2]} "
                           "(the full traceback is in rank 0's log)")
    raise getattr(errors, verdict[1], errors.UserError)(verdict[2])


HEARTBEAT_S = 10.0  # how often rank 0 shows it is alive while working alone
POLL_S = 1.0


def main_does(work, where: str | Path, what: str, stale_after_s: float | None = None):
    """Rank 0 runs `work()` (file work of any length: a universal-checkpoint conversion, ...)
    while the other ranks wait for it WITHOUT a collective, so no collective timeout can fire
    however long it takes. Returns work()'s result on rank 0, None elsewhere. Collective.

    The others poll a marker file in `where` (a directory every rank sees: the checkpoint
    directory, which must be on a shared filesystem anyway). Rank 0 rewrites a heartbeat file
    every HEARTBEAT_S seconds; a heartbeat unchanged for `stale_after_s` (default
    dist_timeout_minutes) of a waiting rank's own clock means rank 0 died, and the wait fails.
    A failure of work() on rank 0 is written to the marker and raised on every rank."""
    token = broadcast_object(uuid.uuid4().hex if is_main() else None)
    where = Path(where)
    done, beat = where / f".ds_ppo_{token}.done", where / f".ds_ppo_{token}.alive"
    if world_size() == 1:
        return work()
    # work of any length with its own heartbeat: exempt from the watchdog's limit
    with watchdog.phase(what if is_main() else f"waiting for rank 0 {what}", limit_s=None):
        if is_main():
            where.mkdir(parents=True, exist_ok=True)
            result = _run_with_heartbeat(work, done, beat, what)
        else:
            result = None
            _wait_for(done, beat, what, stale_after_s or 60 * _timeout_minutes)
    barrier()  # every rank is here now: a short wait
    if is_main():
        done.unlink(missing_ok=True)
        beat.unlink(missing_ok=True)
    return result


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _run_with_heartbeat(work, done: Path, beat: Path, what: str):
    stop = threading.Event()

    def heartbeat():
        n = 0
        while True:
            _write_atomic(beat, str(n))
            n += 1
            if stop.wait(HEARTBEAT_S):
                return

    thread = threading.Thread(target=heartbeat, daemon=True, name="ds_ppo-heartbeat")
    thread.start()
    try:
        result = work()
    except BaseException as err:
        _write_atomic(done, f"failed: {type(err).__name__}: {err}"[:4000])
        raise
    finally:
        stop.set()
        thread.join()
    _write_atomic(done, "ok")
    return result


def _wait_for(done: Path, beat: Path, what: str, stale_after_s: float) -> None:
    start = last_change = time.monotonic()
    last_beat, next_log = None, start + 300
    while not done.exists():
        now = time.monotonic()
        try:
            current = beat.read_text()
        except OSError:
            current = last_beat
        if current != last_beat:
            last_beat, last_change = current, now
        elif now - last_change > stale_after_s:
            raise RuntimeError(f"rank 0 stopped showing progress while {what} (no heartbeat in "
                               f"{stale_after_s / 60:.1f} min, dist_timeout_minutes): it probably "
                               "died; its log says why")
        if now >= next_log:
            log.info("rank %d: still waiting for rank 0 %s (%.0f min)", rank(), what,
                     (now - start) / 60)
            next_log = now + 300
        time.sleep(POLL_S)
    text = done.read_text()
    if text != "ok":
        raise RuntimeError(f"rank 0 failed while {what}: {text}")
