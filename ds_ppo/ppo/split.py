"""ppo.placement = split (docs/ASYNC.md): the last ppo.generation_ranks ranks only generate, the
others only train.

What runs where:

- a training rank: its DeepSpeed engines over the process group of the training ranks alone
  (`dist.init_distributed(generation_ranks=K)`), and `RolloutSchedule` as under colocated, with
  a `RemoteWorker` in place of the background thread: it hands the generation rank that serves
  it (training rank r: generation rank r mod K) what the thread would get (the iterations, their
  prompt indices, the policy version, the random stream's state; with ppo.partial_rollouts, the
  rollouts decoded in part) and takes back the buffered rollouts (and those still in part) and
  the stream's new state. The rollouts, the stream and everything a checkpoint
  holds stay on the training rank, so a checkpoint is the colocated placement's;
- a generation rank (`serve_generation`): a 16-bit replica and no ZeRO engine, the
  `RolloutWorker` on it (decoding, the reward function's calls), for each training rank it
  serves in turn, from that rank's stream: the samples are those colocated gives.

A weight sync: every training rank takes part in the ZeRO gathers (`stream_weights`, one chunk of
GATHER_CHUNK_NUMEL elements whole at a time); training rank g < K sends each chunk, with the
checksum of every weight, to generation rank g, which copies it into its replica and checks it
(a LoRA policy: each adapted layer as its adapters, plus its frozen weight at the first sync
only, merged on the generation rank from the copy it keeps, so later syncs send the adapters);
the verdict comes back and the training ranks agree on it, so a corrupted bucket stops the run
with one line on every rank.

Every message goes over the bridge (`dist.bridge_send` / `bridge_recv`, gloo: CPU copies).
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import time
from dataclasses import dataclass

import torch

from ds_ppo import watchdog
from ds_ppo.engine import dist
from ds_ppo.engine.generation import (copy_buffers, empty_replica, replica_skeleton,
                                      stream_weights, weight_checksum)
from ds_ppo.engine.lora import merge_lora, plain_model
from ds_ppo.ppo.rollout_worker import (Batch, Buffered, RolloutWorker, WeightSyncError,
                                     sync_error)

log = logging.getLogger("ds_ppo")


class RemoteWorker:
    """A training rank's side of a split placement: the `RolloutWorker` calls of
    `RolloutSchedule`, answered by the generation rank that serves this rank."""

    def __init__(self, run) -> None:
        self.run = run
        me = dist.rank()
        self.peer = dist.generation_peer(me)
        # the first training rank a generation rank serves sends it the weights
        self.primary = dist.rank() == dist.served_training_ranks(self.peer)[0]
        # a LoRA policy: the adapted layers whose frozen weight the generation rank holds (sent
        # at the first sync); later syncs send their adapters only
        self.held: set[str] = set()
        # commands whose answer has not come back (a weight sync counts while it runs, and
        # after it failed); the generation rank was told to stop
        self.open, self.stopped = 0, False
        atexit.register(self._leave)
        if self.primary:  # what the generation rank decodes and scores with, and its replica
            dist.bridge_send({"op": "setup", "prompts": run.prompts, "tokenizer": run.tokenizer,
                              "eos_ids": run.eos_ids, "dtype": run.engines.dtype,
                              "training_ranks": dist.world_size(),
                              "skeleton": replica_skeleton(plain_model(run.engines.policy.module))},
                             self.peer)

    def sync(self, version: int) -> int:
        """Weight sync (collective over the training ranks): the policy's weights of `version`
        into the generation ranks' replicas, chunk by chunk, each checked there; a mismatch
        anywhere stops every training rank with one line. Returns the bytes sent by this rank."""
        engines = self.run.engines
        module = plain_model(engines.policy.module)
        sent = 0
        self.open += 1
        if self.primary:
            dist.bridge_send({"op": "sync", "version": version}, self.peer)

        def emit(bucket: dict[str, torch.Tensor | dict]) -> None:
            nonlocal sent
            tensors = dict(_tensors(bucket))
            sums = {name: weight_checksum(w) for name, w in tensors.items()}
            dist.bridge_send({"weights": bucket, "sums": sums}, self.peer)
            sent += sum(w.numel() * w.element_size() for w in tensors.values())

        stream_weights(module, engines.dtype, emit if self.primary else None, held=self.held)
        bad = None
        if self.primary:
            dist.bridge_send({"weights": None, "buffers": dict(module.named_buffers())},
                             self.peer)
            bad = dist.bridge_recv(self.peer)["bad"]
        failed = dist.all_reduce_max(torch.tensor([1.0 if bad else 0.0], dtype=torch.float64))
        if bad or float(failed[0]):
            raise sync_error(version, bad, "the generation ranks' replicas")
        self.open -= 1
        return sent

    def produce(self, iteration: int, indices: list[int], version: int,
                generator: torch.Generator) -> Buffered:
        """The rollout of `iteration`, generated now on the generation rank (this rank waits)."""
        self.open += 1
        dist.bridge_send({"op": "produce", "work": [(iteration, indices)], "version": version,
                          "generator": generator.get_state()}, self.peer)
        return self._answer(generator).rollouts[0]

    def submit_batch(self, work: list[tuple[int, list[int]]], version: int,
                     generator: torch.Generator) -> _Pending:
        """The rollouts of `work` started on the generation rank; `.result()` (after the
        update) waits for them."""
        self.open += 1
        dist.bridge_send({"op": "batch", "work": work, "version": version,
                          "generator": generator.get_state()}, self.peer)
        return _Pending(self, generator)

    def submit_segments(self, work: list, version: int, segments_of: int,
                        generator: torch.Generator) -> _Pending:
        """ppo.partial_rollouts: the next segments of `work` (`RolloutWorker.advance`'s, each
        rollout's `Partial` so far included) started on the generation rank; `.result()` (after
        the update) waits for them. The rollouts still in part come back with the batch, so a
        checkpoint of this rank holds them as a colocated one does."""
        self.open += 1
        dist.bridge_send({"op": "advance", "work": work, "version": version,
                          "segments_of": segments_of, "generator": generator.get_state()},
                         self.peer)
        return _Pending(self, generator)

    def stop(self, timeout_s: float | None = None) -> None:
        """The run's last iteration is done: the generation rank may leave."""
        self.stopped = True
        dist.bridge_send({"op": "stop"}, self.peer, timeout_s)

    def _leave(self) -> None:
        """At this process's exit: a run that stopped between iterations before its last one (an
        alarm's stop, a scheduler's signal, a diverged run) lets the generation rank go too,
        which then exits 0. After an error inside an iteration (a command still open) nothing
        is sent: the generation rank finds this rank gone and says so."""
        if self.stopped or self.open:
            return
        try:
            self.stop(timeout_s=10.0)
        except Exception:  # noqa: BLE001  (the generation rank is gone or stuck: nothing to tell)
            pass

    def _answer(self, generator: torch.Generator) -> Batch:
        """The generation rank's answer: the batch, and the random stream where it left it."""
        got = dist.bridge_recv(self.peer, self.run.engines.device)
        self.open -= 1
        generator.set_state(got["generator"])
        return got["batch"]


@dataclass
class _Pending:
    """A batch being generated on a generation rank (what a Future is under colocated)."""

    worker: RemoteWorker
    generator: torch.Generator

    def result(self) -> Batch:
        return self.worker._answer(self.generator)


def serve_generation(cfg, device: torch.device) -> None:
    """A generation rank's whole run: the commands of the training ranks it serves, until the
    first of them says stop. The first served rank drives the order (setup, sync, produce,
    batch or advance, stop); every served rank sends its own produce / batch / advance / stop,
    which are answered in rank order, each from that rank's own random stream (`_answers`).

    This rank's watchdog beats its phase into the job's store, so a training rank that waits
    for a stopped generation rank names it. A training rank that goes away (killed, stopped by
    its watchdog or by an error of its own) stops this rank with one line naming it, exit 4."""
    served = dist.served_training_ranks(dist.rank())
    first, others = served[0], served[1:]
    dog = _start_watchdog(cfg)
    # exempt: the training ranks load their models (a universal conversion: minutes) first;
    # then the model's code is imported and its replica built here, before any timed phase
    with watchdog.phase(f"waiting for training rank {first}'s set-up", limit_s=None):
        setup = _from(first)
        assert setup["op"] == "setup", setup["op"]
        worker = _worker(cfg, setup, device)
    _serve(worker, device, first, others)
    dog.leave()


def _worker(cfg, setup: dict, device: torch.device) -> RolloutWorker:
    """The worker of the set-up message, its replica built (weights not yet copied)."""
    from ds_ppo.rewards.source import reward_function

    # the reward built here as the training ranks build theirs (a RewardService is not sent)
    worker = RolloutWorker(cfg, setup["prompts"], setup["tokenizer"], setup["eos_ids"], device,
                           reward_function(cfg, setup["training_ranks"]),
                           cfg.ppo.max_lag)
    worker.replica = empty_replica(setup["skeleton"], setup["dtype"], device)
    return worker


def _serve(worker: RolloutWorker, device: torch.device, first: int, others: list[int]) -> None:
    """`serve_generation` after the set-up: the commands until the stop."""
    log.info("generation rank %d: serving training rank(s) %s", dist.rank(), [first, *others])
    generator = torch.Generator(device=device)
    streams: dict[int, dict] = {}  # partial rollouts' reward streams, by training rank
    while True:
        watchdog.at(f"waiting for training rank {first}'s next command")
        cmd = _from(first)
        if cmd["op"] == "sync":
            with watchdog.phase(f"weight sync (policy version {cmd['version']})"):
                _receive_weights(worker, cmd, first, device)
            continue
        commands = [(first, cmd)]
        for r in others:
            with watchdog.phase(f"waiting for training rank {r}'s command"):
                commands.append((r, _from(r)))
        if cmd["op"] == "stop":
            return
        iteration = cmd["work"][0][0] if cmd["work"] else None
        with watchdog.phase("generation", iteration):
            answers = _answers(worker, commands, generator, streams, device)
        for r, answer in answers:
            with watchdog.phase(f"sending the rollouts to training rank {r}", iteration):
                _to(answer, r)


def _from(src: int, device: torch.device | None = None):
    """`dist.bridge_recv`; a training rank that went away stops this rank (`_gone`)."""
    try:
        return dist.bridge_recv(src, device)
    except Exception as e:  # noqa: BLE001  (not a collective failure: raised as it is)
        if dist.is_collective_failure(e):
            _gone(src, e)
        raise


def _to(obj, dst: int) -> None:
    """`dist.bridge_send`; a training rank that went away stops this rank (`_gone`)."""
    try:
        dist.bridge_send(obj, dst)
    except Exception as e:  # noqa: BLE001  (not a collective failure: raised as it is)
        if dist.is_collective_failure(e):
            _gone(dst, e)
        raise


def _gone(rank: int, err: BaseException) -> None:
    """Training rank `rank` went away (killed, stopped by its watchdog, or by an error of its
    own): this rank's watchdog line names it and this rank's phase, exit 4."""
    # gloo's first line, less its source position and advice: "Connection closed by peer [ip]:port"
    why = re.sub(r"^\[[^\]]*\]\s*", "", (str(err).strip().splitlines() or [""])[0])
    watchdog.current().fire(f"training rank {rank} went away ({why.split('. ')[0][:160]}; its "
                            "own output says why, if it could write any)")


def _start_watchdog(cfg) -> watchdog.Watchdog:
    """This generation rank's watchdog (watchdog_minutes), beating into the job's store beside
    the training ranks' (`dist.watchdog_world`: the launcher's ranks)."""
    from ds_ppo.config import watchdog_limit_s

    world, generation_ranks = dist.watchdog_world()
    return watchdog.install(watchdog.Watchdog(
        watchdog_limit_s(cfg), dist.rank(), world, dist.watchdog_store(), cfg.output_dir,
        run_token=dist.run_token(), generation_ranks=generation_ranks)).start()


def _answers(worker: RolloutWorker, commands: list[tuple[int, dict]],
             generator: torch.Generator, streams: dict[int, dict], device: torch.device
             ) -> list[tuple[int, dict]]:
    """Each served training rank's produce / batch / advance command (rank, command) answered in
    rank order, its rows from its own random stream and, with partial rollouts, its rollouts'
    reward streams its own (`streams`: `RolloutWorker.streams` by training rank, kept here
    across iterations)."""
    answers = []
    for r, c in commands:
        generator.set_state(c["generator"])
        if c["op"] == "produce":
            t0 = time.perf_counter()
            j, indices = c["work"][0]
            batch = Batch([worker.produce(j, indices, c["version"], generator)],
                          time.perf_counter() - t0)
        elif c["op"] == "advance":
            worker.streams = streams.get(r, {})
            batch = worker.advance(dist.moved(c["work"], device), c["version"],
                                   c["segments_of"], generator)
            streams[r] = worker.streams
        else:
            batch = worker.produce_batch(c["work"], c["version"], generator)
        answers.append((r, {"batch": batch, "generator": generator.get_state()}))
    return answers


def _tensors(bucket: dict):
    """(checksum name, tensor) of every tensor a bucket sends: a weight by its name, a LoRA
    layer's parts (`lora.lora_parts`) as name/a, name/b, name/base."""
    for name, w in bucket.items():
        if isinstance(w, dict):
            yield from ((f"{name}/{k}", v) for k, v in w.items() if isinstance(v, torch.Tensor))
        else:
            yield name, w


def _receive_weights(worker: RolloutWorker, cmd: dict, src: int, device: torch.device) -> None:
    """One weight sync into the replica (built at the set-up): each chunk copied and checked
    against the sender's checksums; a LoRA layer merged here from its adapters and the frozen
    weight the first sync sent (kept in `worker.bases`), and the merged copy checked against
    the merge. The verdict goes back to `src`. A mismatch stops this rank too, with the
    training ranks' line."""
    version = cmd["version"]
    params = dict(worker.replica.named_parameters())
    bad = None
    first_bucket = True
    while True:
        got = _from(src, device)
        if got["weights"] is None:
            copy_buffers(worker.replica, got["buffers"])
            break
        bucket, sums = got["weights"], dict(got["sums"])
        received = dict(_tensors(bucket))
        for name, s in list(sums.items()):  # what was received, before it is used
            if bad is None and weight_checksum(received[name]) != s:
                bad = name.split("/")[0]
        for name, w in bucket.items():
            if isinstance(w, dict):  # a LoRA layer: merged here
                if "base" in w:
                    worker.bases[name] = w["base"]
                w = merge_lora(worker.bases[name], w["a"], w["b"], w["scale"],
                               w["fan_in_fan_out"])
                sums[name] = weight_checksum(w.to(params[name].dtype))
            if name in params:
                params[name].data.copy_(w)
        if first_bucket and bucket:
            _fault_point(params, bucket, version)
            first_bucket = False
        for name in bucket:
            if bad is None and name in params and weight_checksum(params[name]) != sums[name]:
                bad = name
    worker.replica.config.use_cache = True
    worker.replica.eval()
    _to({"bad": bad}, src)
    if bad is not None:
        raise sync_error(version, bad, "the generation ranks' replicas")


def _fault_point(params: dict, bucket: dict, version: int) -> None:
    """Fault injection for the tests: DS_PPO_FAULT=corrupt_sync:N changes one element of the
    first received weight of policy version N on the generation rank (as a bad transfer
    would)."""
    if os.environ.get("DS_PPO_FAULT", "") == f"corrupt_sync:{version}":
        with torch.no_grad():
            params[next(iter(bucket))].view(-1)[0] += 1.0


__all__ = ["RemoteWorker", "serve_generation", "WeightSyncError"]
