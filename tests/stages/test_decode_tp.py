"""Our decoding loop on a tensor-parallel replica (two ranks): the CUDA-graph schedule with the
step's all-reduces inside, and the capture outcome agreed over the group.

On CPU (gloo) a stand-in graph replays the step function (as `_ReplayedStep` in
test_decode.py), so the warm-up / capture / replay schedule and the agreed fallback run with
real all-reduces in every step. The real capture (NCCL all-reduces recorded in the graph) needs
two GPUs: that test is skipped elsewhere (tools/GPU_CHECKS.md, the checks still to run on a GPU)."""
from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from test_decode import EOS, PAD, left_padded, tiny_llama

T = 12
FAILED = "RuntimeError: operation not permitted when stream is capturing"


class _ReplayedStep:
    def __init__(self, fn):
        self.fn, self.replays = fn, 0

    def replay(self):
        self.replays += 1
        self.fn()


def _sharded(full: torch.nn.Module, tp, device: str) -> torch.nn.Module:
    """This rank's shard of `full`, built as generation's build_replica builds one."""
    from ds_ppo.engine.generation.tensor_parallel import shard_modules, shard_of

    with torch.device("meta"):
        replica = type(full)(full.config)
    shard_modules(replica, tp)
    replica.to_empty(device=device)
    params = dict(full.named_parameters())
    for name, p in replica.named_parameters():
        p.data.copy_(shard_of(name, params[name].data, tp))
    buffers = dict(full.named_buffers())
    for name, b in replica.named_buffers():
        b.data.copy_(buffers[name].data)
    return replica.eval()


def _greedy(model, ids, mask, group, cuda_graph=True):
    from ds_ppo.engine.generation.loop import decode

    out = decode(model, ids, mask, max_new_tokens=T, eos_ids=[EOS], pad_id=PAD,
                 temperature=0.0, suppress_ids=[PAD], cuda_graph=cuda_graph,
                 stop_check_every=1000, group=group)
    return out.response_ids, out.stats


def _stand_in_case(dec, case: str, rank: int, model, ids, mask, ref, tp) -> None:
    """Stand-in graphs on both ranks (both_capture), or rank 1's capture failing (rank1_fails)."""
    graphs = []

    def capture(fn, device):
        if case == "rank1_fails" and rank == 1:
            return None, FAILED
        graphs.append(_ReplayedStep(fn))
        return graphs[-1], None

    dec._CAPTURE_FAILED = None
    dec._capture = capture
    out, stats = _greedy(model, ids, mask, tp.group)
    assert torch.equal(out, ref)  # the sharded replica decodes as the whole model
    if case == "both_capture":
        assert stats.graph and stats.graph_error is None
        assert len(graphs) == 1 and graphs[0].replays == T - 1 - dec.WARMUP_STEPS
        return
    # one rank failed: every rank decodes eagerly (rank 0's graph is never replayed: it
    # would wait on all-reduces rank 1 does not make in the same order)
    assert not stats.graph and stats.graph_error, stats
    assert (FAILED if rank == 1 else "another rank") in stats.graph_error
    assert all(g.replays == 0 for g in graphs), [g.replays for g in graphs]
    attempts = len(graphs)
    out, stats = _greedy(model, ids, mask, tp.group)  # the next rollout: no new attempt
    assert torch.equal(out, ref) and not stats.graph and len(graphs) == attempts


def _worker(rank: int, init_file: str, mode: str) -> None:
    import ds_ppo.engine.generation.loop as dec
    from ds_ppo.engine.generation.tensor_parallel import tp_group

    torch.set_num_threads(1)  # two ranks on a shared CPU
    backend = "nccl" if mode == "gpu" else "gloo"
    device = f"cuda:{rank}" if mode == "gpu" else "cpu"
    if mode == "gpu":
        torch.cuda.set_device(rank)
    tdist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                             world_size=2, timeout=timedelta(seconds=60))
    try:
        tp = tp_group(2)
        full = tiny_llama("sdpa", device=device)
        ids, mask = (t.to(device) for t in left_padded())
        ref, _ = _greedy(full, ids, mask, None, cuda_graph=False)
        model = _sharded(full, tp, device)
        if mode == "gpu":  # the real capture, NCCL all-reduces inside the graph
            out, stats = _greedy(model, ids, mask, tp.group)
            assert stats.graph and stats.graph_error is None, stats
            eager, _ = _greedy(model, ids, mask, tp.group, cuda_graph=False)
            assert torch.equal(out, eager)  # same kernels, replayed
            return
        dec._graphs_available = lambda device: True
        dec._on_side_stream = lambda fn, device: fn()
        for case in ("both_capture", "rank1_fails"):  # one start-up for both (tens of seconds)
            _stand_in_case(dec, case, rank, model, ids, mask, ref, tp)
        # continuous batching over the group: 2 slots for 5 prompts, rows ending early; the
        # ranks refill alike (same tokens, same ended flags) and decode as the whole model
        eos_ids = [EOS, *sorted({int(t) for t in ref[:, 2:8:3].flatten()})]
        whole = dec.decode(full, ids, mask, max_new_tokens=T, eos_ids=eos_ids, pad_id=PAD,
                           temperature=0.0, suppress_ids=[PAD], cuda_graph=False)
        cont = dec.decode(model, ids, mask, max_new_tokens=T, eos_ids=eos_ids, pad_id=PAD,
                          temperature=0.0, suppress_ids=[PAD], stop_check_every=2,
                          group=tp.group, slots=2)
        assert torch.equal(cont.response_ids, whole.response_ids) and cont.stats.refills == 3
    finally:
        tdist.destroy_process_group()


def test_tensor_parallel_graph_schedule_and_agreed_fallback(tmp_path):
    # fork: the ranks inherit the imported transformers (spawning re-imports it, ~30 s here);
    # not after an earlier test of this worker set up a process group (and DeepSpeed) in-process:
    # a forked child inherits that state and cannot start its own
    method = "spawn" if tdist.is_initialized() else "fork"
    mp.start_processes(_worker, args=(str(tmp_path / "init"), "stand_in"), nprocs=2,
                       start_method=method)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices: NCCL all-reduces captured in a CUDA graph "
                    "(listed in tools/GPU_CHECKS.md)")
def test_tensor_parallel_step_is_captured_with_nccl(tmp_path):
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    mp.spawn(_worker, args=(str(tmp_path / "init"), "gpu"), nprocs=2)
