"""ppo.placement = split's weight sync (ppo/split.py) in one process: the training rank's side
(`RemoteWorker.sync`) and the generation rank's (`_receive_weights`) in two threads joined by a
bridge of queues that pickles every message as the real one does. The replica equals the policy
after a sync; a corrupted bucket stops both sides with one line naming the weight; partial
rollouts advance on the generation rank as on a colocated worker; a training rank that goes away
at any message stops the generation rank with one line naming it. The whole placement through
the real launcher: tests/dist/test_schedule_dist.py, tests/dist/test_watchdog_dist.py."""
from __future__ import annotations

import io
import queue
import threading
from types import SimpleNamespace

import pytest
import torch

from ds_ppo.config import load_config
from ds_ppo.engine import dist
from ds_ppo.ppo import split
from ds_ppo.ppo.rollout_worker import RolloutWorker, WeightSyncError
from ds_ppo.bench.stand_ins import small_llama


@pytest.fixture
def bridge(monkeypatch):
    """Bridge rank 0 trains, rank 1 generates; each message pickled through torch.save."""
    inbox = {0: queue.Queue(), 1: queue.Queue()}
    monkeypatch.setattr(dist, "_SPLIT", {"bridge": object(), "rank": 0, "world": 2,
                                         "generation_ranks": 1, "store": None, "token": ""})

    def send(obj, dst, timeout_s=None):
        buf = io.BytesIO()
        torch.save(obj, buf)
        inbox[dst].put(buf.getvalue())

    def recv(src, device=None):
        return torch.load(io.BytesIO(inbox[1 - src].get(timeout=60)), weights_only=False)

    monkeypatch.setattr(dist, "bridge_send", send)
    monkeypatch.setattr(dist, "bridge_recv", recv)
    return inbox


def _pair(model):
    """A training rank's side of a split placement for the policy `model` (its setup message
    taken) and a generation rank's worker, over the test's bridge."""
    engines = SimpleNamespace(policy=SimpleNamespace(module=model), dtype=torch.float32,
                              reward_fn=None, device=torch.device("cpu"))
    remote = split.RemoteWorker(SimpleNamespace(engines=engines, prompts=None, tokenizer=None,
                                                eos_ids=[2]))
    setup = dist.bridge_recv(0)
    assert setup["op"] == "setup" and setup["dtype"] == torch.float32
    worker = RolloutWorker(load_config(None, []), None, None, [2], torch.device("cpu"), None, 1)
    worker.replica = split.empty_replica(setup["skeleton"], torch.float32, torch.device("cpu"))
    return remote, worker


def _sync_once(remote, worker, version: int, errors: dict) -> int | None:
    """One weight sync of `version`, the generation rank's side on a thread: the bytes the
    training side sent (None when it stopped); each side's WeightSyncError into `errors`."""
    def generation_rank():
        try:
            split._receive_weights(worker, dist.bridge_recv(0), 0, torch.device("cpu"))
        except WeightSyncError as e:
            errors["generation"] = str(e)

    thread = threading.Thread(target=generation_rank)
    thread.start()
    sent = None
    try:
        sent = remote.sync(version)
    except WeightSyncError as e:
        errors["training"] = str(e)
    thread.join(60)
    return sent


def _sync(bridge, version: int):
    """One weight sync of a small policy: (the policy, the generation side's replica, each
    side's error)."""
    model = small_llama()
    remote, worker = _pair(model)
    errors = {}
    _sync_once(remote, worker, version, errors)
    return model, worker.replica, errors


def test_replica_equals_the_policy_after_a_sync(bridge, monkeypatch):
    """Sent bucket by bucket (chunks of at most 500 elements here, or one larger weight)."""
    import ds_ppo.engine.generation as generation

    monkeypatch.setattr(generation, "GATHER_CHUNK_NUMEL", 500)
    buckets, send = [], dist.bridge_send

    def counting(obj, dst, timeout_s=None):
        if isinstance(obj, dict) and obj.get("weights"):
            buckets.append(sum(w.numel() for w in obj["weights"].values()))
        send(obj, dst)

    monkeypatch.setattr(dist, "bridge_send", counting)
    model, replica, errors = _sync(bridge, 0)
    assert not errors
    largest = max(p.numel() for p in model.parameters())
    assert len(buckets) > 2 and all(n <= max(500, largest) for n in buckets)
    assert sum(buckets) == sum(p.numel() for p in model.parameters())
    theirs = dict(replica.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in model.named_parameters())
    buffers = dict(replica.named_buffers())
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())


def test_a_corrupted_bucket_stops_both_sides(bridge, monkeypatch):
    monkeypatch.setenv("DS_PPO_FAULT", "corrupt_sync:3")
    _, _, errors = _sync(bridge, 3)
    first = next(iter(dict(small_llama().named_parameters())))
    line = (f"weight sync of policy version 3 into the generation ranks' replicas failed its "
            f"checksum ({first}): stopped; the engines' weights are intact, run the same command "
            "again to resume")
    assert errors == {"generation": line, "training": line}


def _lora_syncs(versions, output_head: bool = True):
    """Weight syncs of `versions` of a small LoRA policy, its trained parameters moved before
    each after the first: (policy, replica, bytes sent per sync, errors)."""
    from ds_ppo.config.role_sections import LoraConfig
    from ds_ppo.engine.lora import add_adapters

    model = add_adapters(small_llama(), LoraConfig(r=4), seed=1, output_head=output_head)
    remote, worker = _pair(model)
    sent, errors = [], {}
    for k, version in enumerate(versions):
        if k:  # as an optimizer step would: every trained parameter moves
            with torch.no_grad():
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(k)))
        got = _sync_once(remote, worker, version, errors)
        if got is not None:
            sent.append(got)
    return model, worker.replica, sent, errors


def test_lora_syncs_after_the_first_send_the_adapters_only(bridge):
    from ds_ppo.engine.generation import build_replica
    from ds_ppo.engine.lora import trained_bytes

    model, replica, sent, errors = _lora_syncs([0, 1, 2])
    assert not errors
    # bit for bit what a full rebuild of the policy gives (fp32 on CPU: the same merge)
    full = build_replica(model, torch.float32, torch.device("cpu"))
    ours = replica.state_dict()
    assert all(torch.equal(w, ours[n]) for n, w in full.state_dict().items())
    whole = sum(p.numel() * 4 for p in full.parameters())
    assert sent[0] == whole + trained_bytes(model)  # the base once, with the adapters
    assert sent[1:] == [trained_bytes(model)] * 2


def test_a_corrupted_adapter_sync_stops_both_sides(bridge, monkeypatch):
    monkeypatch.setenv("DS_PPO_FAULT", "corrupt_sync:1")  # the sync after the first
    *_, errors = _lora_syncs([0, 1], output_head=False)
    assert errors["generation"] == errors["training"]
    line = errors["training"]
    assert "\n" not in line and "policy version 1" in line and "_proj.weight" in line


def test_partial_rollouts_advance_on_the_generation_rank(bridge):
    """ppo.partial_rollouts under split: each round the training rank sends its rollouts in
    part with the segments to decode (`submit_segments`), the generation rank advances them
    (`_answers`, keeping the rollouts' reward streams by training rank) and sends back the
    buffered rollout and the `Partial`s, which stay on the training rank between rounds: the
    tokens, versions, random stream and scores a colocated worker gives, each row's reward
    called once on the generation rank."""
    from test_partial_rollouts import _reward_worker, _scored

    cpu = torch.device("cpu")
    engines = SimpleNamespace(policy=SimpleNamespace(module=small_llama()), dtype=torch.float32,
                              reward_fn=None, device=cpu)
    remote = split.RemoteWorker(SimpleNamespace(engines=engines, prompts=None, tokenizer=None,
                                                eos_ids=[2]))
    assert dist.bridge_recv(0)["op"] == "setup"
    called: list[str] = []
    serving = _reward_worker(lambda p, r: (called.extend(r), _scored(p, r))[1])
    colocated = _reward_worker(_scored)
    streams: dict[int, dict] = {}
    mine, theirs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    part = colocated_part = None  # the training rank's, the colocated worker's
    for segments, version in ((1, 1), (2, 2)):
        pending = remote.submit_segments([(4, [2, 0, 1], part, segments)], version, 2, mine)
        for r, answer in split._answers(serving, [(0, dist.bridge_recv(0))], torch.Generator(),
                                        streams, cpu):
            dist.bridge_send(answer, r)
        got = pending.result()
        expected = colocated.advance([(4, [2, 0, 1], colocated_part, segments)], version, 2,
                                     theirs)
        assert torch.equal(mine.get_state(), theirs.get_state())
        if segments == 1:
            (part,), (colocated_part,) = got.partial, expected.partial
            assert not got.rollouts and not part.live.all() and 4 in streams[0]
            for key in ("response_ids", "logprobs", "versions", "live"):
                assert torch.equal(getattr(part, key), getattr(colocated_part, key)), key
    (b,), (e,) = got.rollouts, expected.rollouts
    for key in ("response_ids", "mask", "rollout_logprobs", "token_versions"):
        assert torch.equal(getattr(b.rollout, key), getattr(e.rollout, key)), key
    assert b.version == e.version == 1 and b.called.scores == e.called.scores
    assert sorted(called) == sorted(b.rollout.responses)  # the stream kept across the rounds


GONE = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:4242. This is typically caused by a remote worker crashing.")


@pytest.mark.parametrize("where,commands,phase", [
    ("command", [], "waiting for training rank 0's next command"),
    ("weights", [{"op": "sync", "version": 3}], "weight sync (policy version 3)"),
    ("answer", [{"op": "batch", "work": [(2, [0, 1])], "version": 1, "generator": None}],
     "sending the rollouts to training rank 0 (iteration 2)"),
])
def test_a_training_rank_gone_stops_the_generation_rank_with_one_line(
        monkeypatch, tmp_path, capsys, where, commands, phase):
    """Training rank 0 goes away (SIGKILL) while the generation rank waits for its next
    command, receives the weights of a sync, or sends it the rollouts: one line naming the
    generation rank's phase and training rank 0, exit 4, no traceback."""
    from ds_ppo import watchdog

    monkeypatch.setattr(dist, "_SPLIT", {"bridge": object(), "rank": 1, "world": 2,
                                         "generation_ranks": 1, "store": None, "token": ""})
    # a generation rank is in no process group; an earlier test of this process may have left
    # the default group up
    monkeypatch.setattr(dist, "rank", lambda: 1)
    inbox = [{"op": "setup", "prompts": None, "tokenizer": None, "eos_ids": [2],
              "dtype": torch.float32, "training_ranks": 1, "skeleton": None}, *commands]

    def recv(src, device=None):
        if inbox:
            return inbox.pop(0)
        raise RuntimeError(GONE)

    def send(obj, dst, timeout_s=None):
        raise RuntimeError(GONE)

    monkeypatch.setattr(dist, "bridge_recv", recv)
    monkeypatch.setattr(dist, "bridge_send", send)
    monkeypatch.setattr(split, "_answers", lambda worker, cmds, *a: [(0, {"batch": None})])
    monkeypatch.setattr(split, "empty_replica", lambda *a: small_llama())
    exits = []

    def stop(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(split, "_start_watchdog", lambda cfg: watchdog.install(
        watchdog.Watchdog(None, rank=1, world_size=2, out_dir=tmp_path, exit=stop,
                          generation_ranks=1)))
    with pytest.raises(SystemExit):
        split.serve_generation(load_config(None, []), torch.device("cpu"))
    assert exits == [4]
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"ds-ppo: error: watchdog: generation rank 1 in {phase}: "
                               "training rank 0 went away (Connection closed by peer "
                               "[127.0.0.1]:4242; its own output says why"), lines[0]
    assert f"{tmp_path / 'hang-1.txt'}" in lines[0] and "(exit 4)" in lines[0]


def test_a_training_rank_that_leaves_between_iterations_tells_its_generation_rank(bridge):
    """At the process's exit (an alarm's stop, a scheduler's signal, a diverged run: between
    iterations) the training rank sends stop, so the generation rank exits 0; with a command
    still open (an error inside an iteration) it sends nothing; after the last iteration's stop,
    nothing more."""
    engines = SimpleNamespace(policy=SimpleNamespace(module=small_llama()), dtype=torch.float32,
                              reward_fn=None, device=torch.device("cpu"))
    remote = split.RemoteWorker(SimpleNamespace(engines=engines, prompts=None, tokenizer=None,
                                                eos_ids=[2]))
    assert dist.bridge_recv(0)["op"] == "setup"
    remote.submit_batch([(2, [0])], 1, torch.Generator())
    assert dist.bridge_recv(0)["op"] == "batch"
    remote._leave()  # the batch's answer not taken: mid-iteration
    assert bridge[1].empty()
    dist.bridge_send({"batch": None, "generator": torch.Generator().get_state()}, 0)
    remote._answer(torch.Generator())
    remote._leave()
    assert dist.bridge_recv(0)["op"] == "stop"
    remote._leave()
    assert bridge[1].empty()
