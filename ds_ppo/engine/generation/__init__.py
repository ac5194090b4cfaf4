"""Generation, the package's front door (`generate`, `choose_mode`, `choose_loop`, `build_replica`):
our hybrid engine, switching the ZeRO-3 policy into a fast inference form to generate rollouts.
Its parts: `loop.py` (our decoding loop), `slots.py` (continuous batching's slots),
`tensor_parallel.py` (a replica shared by a node's ranks), `choice.py` (which mode and loop a
model and config get, decided once for the engine and for `ds-ppo plan`).

DeepSpeed's built-in hybrid engine fails on transformers-5 Llama models and has no CPU kernels, and
HF `generate` through the ZeRO-3 hooks re-gathers every layer for every new token (206 tok/s vs
1297 tok/s hook-free for a 0.85B model on an H200). So:

- mode `gathered`: once per rollout, gather the policy's weights module by module (so at most one
  module's full weights are in flight besides the replica) into a hook-free replica in the compute
  dtype, generate there, then drop the replica before training resumes. Decoding on the replica
  is our own loop (`generation.loop`, `engine/generation/loop.py`: static cache, CUDA graphs) or HF
  generate.
  No collective runs during decoding, so ranks whose responses end at different lengths never wait
  on each other.
- mode `tensor_parallel`: `generation.tp_size` ranks (a node's GPUs by default) hold one replica
  between them (`engine/generation/tensor_parallel.py`: attention and MLP split, a
  mixture-of-experts layer's experts split by expert) and decode their prompts together. For
  models whose 16-bit copy does not fit one device but whose 1/tp_size shard does.
- mode `zero3`: generate through the ZeRO-3 hooks with `synced_gpus=True` (every rank keeps
  stepping until all are done, so the per-layer all-gathers stay matched). Every token gathers
  every layer: the last resort.
- mode `auto`: `gathered` when the replica (16-bit weights) fits in
  `generation.replica_memory_fraction` of free device memory, else `tensor_parallel` when its
  shard does, else `zero3`; the choice is logged.
"""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ds_ppo import abandon, watchdog
from ds_ppo.algo import response_mask
from ds_ppo.algo.distribution import LogitShape
from ds_ppo.config import GenerationConfig
from ds_ppo.containers import in_row_order, longest_first
from ds_ppo.engine import dist
from ds_ppo.engine.generation.loop import DecodeStats, decode
from ds_ppo.engine.lora import (adapter_weights, keep_bases, lora_parts, plain_model,
                                replica_weights, weight_shape)
from ds_ppo.engine.moe import ep_layers
from ds_ppo.errors import ConfigError
from ds_ppo.engine.generation.tensor_parallel import (TPGroup, gather_group_prompts, group_seed,
                                                      heads_of, pieces, shard_modules, shard_of,
                                                      split_dim, tp_group)
from ds_ppo.engine.generation.choice import (REPLICA_MODES, choose_generation, choose_loop,
                                             decoder_linears, use_continuous)

log = logging.getLogger("ds_ppo")


@dataclass
class Generated:
    """Raw generation output of one rank (B = this rank's prompts, T = response tokens)."""

    response_ids: torch.Tensor  # (B, T) long, pad after the first EOS
    mask: torch.Tensor  # (B, T) bool, True up to and including the first EOS
    ended: torch.Tensor  # (B,) bool, the response contains an EOS/stop token
    replica: torch.nn.Module | None = None  # the kept replica (generation.keep_replica)
    loop: str = "hf"  # the decoding loop that ran: own or hf
    decode_stats: list[DecodeStats] = field(default_factory=list)  # loop=own, one per chunk
    # (B, T) float32: each token's log-prob under the distribution it was sampled from, 0
    # outside mask (loop=own; None with HF generate)
    logprobs: torch.Tensor | None = None
    sampling: LogitShape | None = None  # the distribution sampled from (`sampling_shape`)
    # a mixture-of-experts policy's expert choices (loop=own; engine/moe.py): int16 top-k
    # indices per MoE layer, -1 where no token was routed
    prompt_routes: torch.Tensor | None = None  # (B, P, layers, k)
    response_routes: torch.Tensor | None = None  # (B, T, layers, k)


def _param_bytes(module: torch.nn.Module, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of one rank's replica: all weights, or with tp_size > 1 the sharded layers' share
    plus the replicated rest (embeddings, norms, output head)."""
    n = 0
    kv_heads = heads_of(plain_model(module))[1]
    for name, params, full in replica_weights(module):  # a LoRA layer's merged size: its base's
        numel = math.prod(weight_shape(params, full))
        n += numel if split_dim(name) is None else numel // pieces(name, tp_size, kv_heads)
    return n * torch.finfo(dtype).bits // 8


def _least_free_bytes(device: torch.device) -> float:
    """Free device memory (host memory on CPU), the least over all ranks (a collective), so
    every rank picks the same mode (different modes would hang)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        import psutil

        free = psutil.virtual_memory().available
    return -float(dist.all_reduce_max(
        torch.tensor([-float(free)], dtype=torch.float64, device=device)).item())


def choose_mode(cfg: GenerationConfig, module: torch.nn.Module, dtype: torch.dtype,
                device: torch.device) -> str:
    """Resolve generation.mode for this policy module by `choice.choose_generation`
    (the rule `ds-ppo plan` applies too): `auto` weighs the module's replica bytes against the
    least free memory over all ranks."""
    choice = choose_generation(
        cfg, getattr(module, "config", None), cfg.tp_size or dist.local_world_size(),
        replica_bytes=lambda tp: _param_bytes(module, dtype, tp),
        free_bytes=lambda: _least_free_bytes(device), linears=decoder_linears(module))
    if choice.mode not in REPLICA_MODES and ep_layers(plain_model(module)):
        # AutoEP's all-to-all inside HF generate through the ZeRO-3 hooks is not supported
        raise ConfigError(
            f"generation.mode = {cfg.mode!r} chose {choice.mode} (no replica fits), which does "
            "not combine with an expert-parallel policy (AutoEP's layers: "
            "deepspeed.policy.expert_parallel_size > 1, or a resumed checkpoint saved with it): "
            "set generation.mode=tensor_parallel (the experts split over generation.tp_size "
            "ranks) or free memory for a gathered replica (ds-ppo plan names the levers), or "
            "start from the checkpoint's export (checkpoints/<iteration>/hf) without expert "
            "parallelism")
    if cfg.mode == "auto" and dist.is_main():
        log.info("generation.mode=auto -> %s (replica %.2f GiB%s, least free %.2f GiB, "
                 "fraction %.2f)", choice.mode, choice.replica_bytes / 2**30,
                 f" per rank, tp_size {choice.tp_size}" if choice.mode == "tensor_parallel"
                 else "", choice.free_bytes / 2**30, cfg.replica_memory_fraction)
    return choice.mode


GATHER_CHUNK_NUMEL = 2**27  # elements per all-gather while copying weights (256 MiB in 16-bit)


def _param_chunks(module: torch.nn.Module, limit: int, bases: dict | None = None):
    """Consecutive groups of `lora.replica_weights` entries (name in the plain model, parameters,
    full tensor) whose parameters' full sizes add up to at most `limit` elements (a single larger
    weight forms its own group). Tied parameters appear once. `bases` not empty: only the
    entries a LoRA policy's training changes (`lora.adapter_weights`)."""
    chunk, size = [], 0
    entries = adapter_weights(module, bases) if bases else replica_weights(module)
    for name, params, full in entries:
        n = sum(getattr(p, "ds_numel", p.numel()) for p in params)
        n = max(n, math.prod(weight_shape(params, full)))  # expert-parallel: the whole tensor
        if chunk and size + n > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, params, full))
        size += n
    if chunk:
        yield chunk


def build_replica(module: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                  materialize: bool = True, into: torch.nn.Module | None = None,
                  tp: TPGroup | None = None, own_config: bool = False,
                  sums: dict[str, int] | None = None,
                  bases: dict[str, torch.Tensor] | None = None) -> torch.nn.Module | None:
    """A hook-free copy of a (possibly ZeRO-3-partitioned) HF model holding the current weights.

    Parameters are gathered in chunks of up to GATHER_CHUNK_NUMEL elements (one coalesced
    all-gather each, in module order), so the transient memory is one chunk's full weights (or
    one parameter, when a single one is larger) and a 1B model needs a handful of collectives,
    not one per module. Buffers (e.g. rotary frequencies) are not partitioned by ZeRO and are
    copied as they are, in their own dtype (`copy_buffers`). The gathers are
    collective: every rank must call this; with `materialize=False` a rank only takes part in
    them (e.g. all ranks but 0 when exporting) and gets None. `into`: a replica from an earlier
    call, refreshed in place (no new allocation, compiled graphs stay valid). `tp`: build this
    rank's shard of a tensor-parallel replica (`engine/generation/tensor_parallel.py`). A LoRA policy's
    replica is its plain HF model with the adapters merged into the weights (`engine/lora.py`).
    `own_config`: a new replica gets a copy of the model's config, not the same object (a
    replica decoding in a background worker switches its attention setting, which must not
    reach the trained model's forwards). `sums`: filled with each copied weight's checksum
    (`weight_checksum` of the gathered weight in the replica's dtype), to verify the copy.
    `bases`: a LoRA policy's replica refreshed with its adapters only. Empty (the first sync):
    every weight is copied and the adapted layers' frozen weights are kept in it; filled (a sync
    of `into`, the same replica, after that): only the adapted layers, merged from it and the
    gathered adapters (bit for bit what a full copy gives), and any other trained weight.
    """
    import deepspeed

    replica = into
    module = plain_model(module)  # a LoRA policy: the HF model inside, adapter layers and all
    if materialize and replica is None:
        replica = empty_replica(replica_skeleton(module, own_config), dtype, device, tp)
        if bases:  # a new replica holds no frozen weight yet
            bases.clear()
    target = dict(replica.named_parameters()) if replica is not None else {}
    kv_heads = heads_of(module)[1]
    first = bases is not None and not bases
    for chunk in _param_chunks(module, GATHER_CHUNK_NUMEL, None if first else bases):
        with deepspeed.zero.GatheredParameters([p for _, ps, _ in chunk for p in ps],
                                               modifier_rank=None):
            if first:
                keep_bases(chunk, bases)
            for name, _, full in chunk:
                if (tp is not None and sums is None and name in target
                        and _held_locally(full, tp)):
                    # an expert-parallel group that is the tensor-parallel group: this rank
                    # already holds its shard's experts, no gather
                    target[name].data.copy_(full.local())
                    continue
                # an expert-parallel weight's full() is a collective: every rank calls it
                if name in target or getattr(full, "collective", False):
                    w = full()
                    if name not in target:
                        continue
                    target[name].data.copy_(w if tp is None else shard_of(name, w, tp,
                                                                          kv_heads))
                    if sums is not None:
                        sums[name] = weight_checksum(w.to(target[name].dtype))
    if replica is None:
        return None
    copy_buffers(replica, dict(module.named_buffers()))
    replica.config.use_cache = True
    replica.eval()
    return replica


def copy_buffers(replica: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """The trained model's `buffers` (name -> tensor, e.g. rotary frequencies) into the
    replica's buffers of the same names, in the trained model's dtype: a float32 buffer of a
    bf16 model (HF keeps its rotary frequencies in float32) stays float32, since rounding it
    would give the replica other positions' rotations than the trainer's forward. A buffer of
    another dtype is replaced (a new replica), one of the same dtype copied in place (a
    refresh: captured graphs stay valid)."""
    own = dict(replica.named_buffers())
    for name, b in buffers.items():
        if name not in own:
            continue
        if own[name].dtype == b.dtype:
            own[name].data.copy_(b.data)
        else:
            owner, _, leaf = name.rpartition(".")
            setattr(replica.get_submodule(owner), leaf, b.detach().to(own[name].device,
                                                                       copy=True))


def _held_locally(full, tp: TPGroup) -> bool:
    """Whether an expert-parallel weight (`moe.ep_weights`: its `local` experts, held by the
    ranks `ep_ranks` in order) is on each rank of `tp` exactly that rank's tensor-parallel
    shard: the two groups are the same ranks. The same answer on every rank of the group."""
    ranks = getattr(full, "ep_ranks", None)
    return ranks is not None and tuple(ranks) == tuple(range(tp.first, tp.first + tp.size))


def replica_skeleton(module: torch.nn.Module, own_config: bool = True) -> dict:
    """What a replica of `module` (a plain HF model) is built from, without its weights: its
    class, config (a copy with `own_config`) and generation config; small and picklable, so a
    generation rank of a split placement builds its replica from it."""
    import copy

    return {"cls": type(module),
            "config": copy.deepcopy(module.config) if own_config else module.config,
            "generation_config": getattr(module, "generation_config", None)}


def empty_replica(skeleton: dict, dtype: torch.dtype, device: torch.device,
                  tp: TPGroup | None = None) -> torch.nn.Module:
    """A replica of `replica_skeleton`'s model on `device` in `dtype`, its weights not yet
    copied (`build_replica` / a weight sync fills them)."""
    with torch.device("meta"):
        replica = skeleton["cls"](skeleton["config"])
    if tp is not None:
        shard_modules(replica, tp)
    replica.to_empty(device=device)
    replica.to(dtype)
    # to_empty gives every parameter its own storage: an output head tied to the embeddings
    # (Llama-3.2-1B, Gemma, small Qwen2) would stay uninitialised, since named_parameters()
    # yields a tied weight once
    replica.tie_weights()
    if skeleton["generation_config"] is not None:
        replica.generation_config = skeleton["generation_config"]
    return replica


def stream_weights(module: torch.nn.Module, dtype: torch.dtype, emit,
                   held: set[str] | None = None) -> int:
    """The weights of a (possibly ZeRO-3-partitioned) HF model, gathered in chunks of up to
    GATHER_CHUNK_NUMEL elements as `build_replica` gathers them (collective: every rank of the
    engine's group calls it), handed to `emit(bucket)` one chunk at a time: `bucket` maps each
    replica weight's name to its full tensor in `dtype` (valid only during the call), so at most
    one chunk is whole on a rank at once. `emit` None: take part in the gathers only. `held`
    (a LoRA policy's split placement): each adapted layer goes as its parts (`lora.lora_parts`,
    a dict in place of the tensor), merged by the receiver, its frozen weight only when its
    name is not in `held`, which then gets it; with `held` filled, only what training changes
    (`lora.adapter_weights`). Returns the number of chunks."""
    import deepspeed

    module = plain_model(module)
    chunks = 0
    bases = dict.fromkeys(held) if held else None
    for chunk in _param_chunks(module, GATHER_CHUNK_NUMEL, bases):
        with deepspeed.zero.GatheredParameters([p for _, ps, _ in chunk for p in ps],
                                               modifier_rank=None):
            bucket = {}
            for name, _, full in chunk:
                if held is None or getattr(full, "layer", None) is None:
                    if emit is not None:
                        bucket[name] = full().to(dtype)
                    continue
                if emit is not None:
                    bucket[name] = lora_parts(full, dtype, with_base=name not in held)
                held.add(name)
            if emit is not None:
                emit(bucket)
        chunks += 1
    return chunks


def weight_checksum(w: torch.Tensor) -> int:
    """An exact checksum of a tensor's bits: its elements read as integers of their width,
    weighted by position (mod 1021, so a swap of two elements changes it), summed in int64."""
    flat = w.detach().contiguous().flatten()
    ints = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        flat.element_size()]).to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % 1021 + 1
    return int((ints * weights).sum())


def sampling_shape(cfg: GenerationConfig, eos_ids: list[int], pad_id: int) -> LogitShape:
    """The distribution responses are sampled from (both loops, every mode), which the trainer's
    log-probs, entropy and KL then use too (`Rollout.sampling`): the configured temperature,
    top-k, top-p and min_new_tokens, the stop tokens, and the pad token suppressed (a sampled
    pad would read as padding downstream) unless it is itself a stop token."""
    return LogitShape(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                      suppress_ids=() if pad_id in eos_ids else (pad_id,),
                      eos_ids=tuple(sorted(set(eos_ids))), min_new_tokens=cfg.min_new_tokens)


def _generate_kwargs(cfg: GenerationConfig, eos_ids: list[int], pad_id: int) -> dict:
    kw = dict(max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.min_new_tokens,
              eos_token_id=eos_ids, pad_token_id=pad_id, use_cache=True)
    suppress = sampling_shape(cfg, eos_ids, pad_id).suppress_ids
    if suppress:
        kw["suppress_tokens"] = list(suppress)
    if cfg.temperature == 0:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kw.update(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p,
                  top_k=cfg.top_k if cfg.top_k > 0 else None)
    return kw


def _hf_generate(model, cfg: GenerationConfig, eos_ids: list[int], pad_id: int,
                 replica_is_new: bool, synced_gpus: bool | None):
    """A `(ids, mask) -> response ids` function calling HF generate (loop=hf)."""
    kw = _generate_kwargs(cfg, eos_ids, pad_id)
    if synced_gpus is not None:
        kw["synced_gpus"] = synced_gpus
    elif cfg.cache_implementation == "static":
        kw["cache_implementation"] = "static"
        # transformers compiles the static-cache decoding step by itself on an accelerator;
        # generation.compile=false must mean no compilation
        if not cfg.compile:
            kw["disable_compile"] = True
    elif cfg.compile and replica_is_new:
        model.forward = torch.compile(model.forward, dynamic=True)

    def run(ids: torch.Tensor, am: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out = model.generate(input_ids=ids, attention_mask=am.long(),
                             stopping_criteria=_abandon_criteria(), **kw)
        abandon.check("generation")  # a SIGTERM ended every row: the decode is given up
        return out[:, ids.shape[1]:], None, None, None
    return run


def _abandon_criteria():
    """HF generate's stop after a SIGTERM (ds_ppo.abandon): every row ends at the next step
    (with synced_gpus the rank then keeps taking its steps beside the others, as a rank whose
    rows ended does). Reads a host flag; the (B,) answer is made on the device, no sync."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Abandon(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            return torch.full((input_ids.shape[0],), bool(abandon.requested()),
                              dtype=torch.bool, device=input_ids.device)
    return StoppingCriteriaList([Abandon()])


def _own_decode(model, cfg: GenerationConfig, eos_ids: list[int], pad_id: int, group=None,
                slots: int | None = None, generator: torch.Generator | None = None,
                on_done=None):
    """A `(ids, mask, rows) -> (response ids, log-probs, DecodeStats, routes)` function
    running our loop (loop=own); `group`: the tensor-parallel group decoding together (None: a
    whole replica); `slots`: rows decoding at once (None: all; fewer: continuous batching);
    `generator`: the random stream to sample from (None: torch's default). routes: a
    mixture-of-experts replica's (prompt, response) expert choices (`Decoded`), else None.
    `on_done(rows, tokens)`: each response as the loop finishes it (`decode`), its row named
    by `rows` (the caller's row index of each of `ids`' rows)."""
    shape = sampling_shape(cfg, eos_ids, pad_id)

    def run(ids: torch.Tensor, am: torch.Tensor, rows: list[int] | None = None):
        done = None  # on_done with the caller's row indices
        if on_done is not None and rows is not None:
            done = lambda local, tokens: on_done([rows[r] for r in local], tokens)  # noqa: E731
        out = decode(model, ids, am, max_new_tokens=cfg.max_new_tokens, eos_ids=eos_ids,
                     pad_id=pad_id, min_new_tokens=shape.min_new_tokens,
                     temperature=shape.temperature, top_k=shape.top_k, top_p=shape.top_p,
                     suppress_ids=shape.suppress_ids, cuda_graph=cfg.cuda_graph,
                     stop_check_every=cfg.stop_check_every, group=group, slots=slots,
                     compile_step=cfg.compile_step, generator=generator,
                     routes=True, on_done=done)
        routes = None if out.prompt_routes is None else (out.prompt_routes, out.response_routes)
        return out.response_ids, out.logprobs, out.stats, routes
    return run


@contextmanager
def _group_random_stream(tp: TPGroup | None, device: torch.device):
    """Tensor-parallel ranks must sample the same tokens: within a group, one shared seed for
    the call (the ranks' own random streams are restored after). Other modes: unchanged."""
    if tp is None or tp.size == 1:
        yield
        return
    seed = group_seed(tp, device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def _run_or_split(run, ids: torch.Tensor, mask: torch.Tensor, splittable: bool,
                  rows: list[int] | None = None) -> list:
    """[run(ids, mask)]; if the device runs out of memory and `splittable`, the prompts in two
    halves (recursively, down to one prompt), in order, with one warning per split. `rows`: the
    caller's row index of each prompt, handed to `run` (which then streams finished rows)."""
    try:
        return [run(ids, mask) if rows is None else run(ids, mask, rows)]
    except torch.OutOfMemoryError:
        if not splittable or ids.shape[0] == 1:
            raise
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    half = ids.shape[0] // 2
    log.warning("generation: out of device memory for %d prompts at once; generating them in "
                "halves (generation.batch_size=%d or less avoids the retry)", ids.shape[0], half)
    return (_run_or_split(run, ids[:half], mask[:half], splittable,
                          None if rows is None else rows[:half])
            + _run_or_split(run, ids[half:], mask[half:], splittable,
                            None if rows is None else rows[half:]))


def _prompt_chunks(mask: torch.Tensor, size: int) -> list[tuple[list[int], int]]:
    """Generate calls for N left-padded prompts, (row indices, leading columns to drop) each, of
    at most `size` rows. Several calls take the prompts longest first, so each call's rows have
    similar lengths and its prefill and KV cache skip the columns all of them pad. Every rank of
    a collective mode makes the same number of calls (equal shares, same size)."""
    n = mask.shape[0]
    if size >= n:
        return [(list(range(n)), 0)]
    lengths = mask.sum(1).tolist()  # one device read per rollout
    return [(rows, mask.shape[1] - lengths[rows[0]]) for rows in longest_first(lengths, size)]


def _stack_chunks(outs: list[torch.Tensor], pad_id: float) -> torch.Tensor:
    """The chunks' responses (or log-probs, or routes) as one (N, W, ...) tensor, each padded
    to the widest chunk with `pad_id`."""
    width = max(o.shape[1] for o in outs)
    return torch.cat([torch.nn.functional.pad(
        o, (0, 0) * (o.dim() - 2) + (0, width - o.shape[1]), value=pad_id) for o in outs])


@torch.no_grad()
def generate(policy_engine, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
             cfg: GenerationConfig, mode: str, eos_ids: list[int], pad_id: int,
             dtype: torch.dtype, kept_replica: torch.nn.Module | None = None,
             on_done=None) -> Generated:
    """Sample responses for this rank's prompts (B, P) (left-padded) from the current policy.

    With generation.keep_replica, the replica is returned in `Generated.replica` and should be
    passed back as `kept_replica` next time: its weights are refreshed in place. `on_done(rows,
    tokens)`: called with this rank's rows as our loop finishes them (`decode`), in mode
    gathered with loop own; other modes and loops do not call it."""
    module = policy_engine.module
    device = prompt_ids.device
    was_training = module.training
    loop = choose_loop(cfg, mode, module.config)
    tp = tp_group(cfg.tp_size or dist.local_world_size()) if mode == "tensor_parallel" else None
    rows, rows_mask, offset, slots = prompt_ids, prompt_mask, 0, None
    if mode in REPLICA_MODES:
        model = build_replica(module, dtype, device, into=kept_replica, tp=tp)
        if tp is not None:  # the group decodes all its ranks' prompts together
            rows, rows_mask, offset = gather_group_prompts(prompt_ids, prompt_mask, pad_id, tp)
        # tensor_parallel: the group's ranks capture their steps (all-reduces inside) together
        group = tp.group if tp is not None else None
        slots = cfg.batch_size if use_continuous(cfg, loop, rows.shape[0]) else None
        hook = on_done if tp is None and loop == "own" else None
        run = (_own_decode(model, cfg, eos_ids, pad_id, group, slots, None, hook)
               if loop == "own" else
               _hf_generate(model, cfg, eos_ids, pad_id, kept_replica is None, None))
    else:
        model = module
        module.eval()
        module.config.use_cache = True
        run = _hf_generate(model, cfg, eos_ids, pad_id, False, dist.world_size() > 1)
        hook = None
    outs, logprobs, stats, routes = [], [], [], []
    # continuous batching (slots set): one call over every row, its slots take them in turn
    chunks = _prompt_chunks(rows_mask, rows.shape[0] if slots else
                            cfg.batch_size or rows.shape[0])
    with _group_random_stream(tp, device):
        for k, (idx, lead) in enumerate(chunks):
            watchdog.progress(k)
            # a whole replica decodes without collectives: a rank may split alone
            for out, lp, st, rt in _run_or_split(run, rows[idx, lead:], rows_mask[idx, lead:],
                                                 splittable=mode == "gathered" or
                                                 (tp is not None and tp.size == 1),
                                                 rows=idx if hook is not None else None):
                outs.append(out)
                logprobs.append(lp)
                stats.append(st)
                routes.append(rt)
    if mode not in REPLICA_MODES:
        module.config.use_cache = False
        module.train(was_training)
        # generate() leaves prefetched ZeRO-3 parameters in flight; release them before the
        # next gather (the replica build, scoring) or DeepSpeed refuses to partition them
        policy_engine.empty_partition_cache()
    kept = model if mode in REPLICA_MODES and cfg.keep_replica else None
    del model, run  # unless kept, the replica's memory goes back before training resumes
    return _generated(outs, logprobs, stats, routes, chunks, offset, prompt_ids.shape, cfg,
                      eos_ids, pad_id, device, kept, loop)


def _generated(outs: list, logprobs: list, stats: list, routes: list, chunks: list, offset: int,
               shape: torch.Size, cfg: GenerationConfig, eos_ids: list[int], pad_id: int,
               device: torch.device, kept: torch.nn.Module | None, loop: str) -> Generated:
    """The chunks' outputs as this rank's `Generated` (its `shape` = (n, P) prompts: rows
    `offset` .. offset + n of the chunks', a tensor-parallel rank's share of its group's
    responses), in prompt order."""
    n, prompt_width = shape
    order = [i for idx, _ in chunks for i in idx]
    response = in_row_order(_stack_chunks(outs, pad_id), order)
    response = response[offset:offset + n]
    mask = response_mask(response, eos_ids)
    response = response.masked_fill(~mask, pad_id)
    ended = (mask & torch.isin(response, torch.tensor(eos_ids, device=device))).any(dim=1)
    rollout_lp = None
    if all(lp is not None for lp in logprobs):  # loop=own
        rollout_lp = in_row_order(_stack_chunks(logprobs, 0.0), order)
        rollout_lp = rollout_lp[offset:offset + n].masked_fill(~mask, 0.0)
    prompt_routes = response_routes = None
    if routes and all(rt is not None for rt in routes):  # a mixture-of-experts replica
        P = prompt_width  # each chunk's prompts lost `lead` leading pad columns
        prompt_routes = in_row_order(torch.cat([torch.nn.functional.pad(
            p, (0, 0, 0, 0, P - p.shape[1], 0), value=-1) for p, _ in routes]), order)
        response_routes = in_row_order(_stack_chunks([r for _, r in routes], -1), order)
        prompt_routes = prompt_routes[offset:offset + n]
        response_routes = response_routes[offset:offset + n, :response.shape[1]]
    return Generated(response_ids=response, mask=mask, ended=ended, replica=kept, loop=loop,
                     decode_stats=[st for st in stats if st is not None], logprobs=rollout_lp,
                     sampling=sampling_shape(cfg, eos_ids, pad_id),
                     prompt_routes=prompt_routes, response_routes=response_routes)


@torch.no_grad()
def decode_on_replica(replica: torch.nn.Module, prompt_ids: torch.Tensor,
                      prompt_mask: torch.Tensor, cfg: GenerationConfig, eos_ids: list[int],
                      pad_id: int, generator: torch.Generator, on_done=None) -> Generated:
    """Sample responses for this rank's prompts (B, P) (left-padded) on a whole replica that is
    already built (`build_replica`), with our decoding loop, from the random stream
    `generator`: `generate`'s gathered mode without the gather. No collective and no watchdog
    call: safe in a background worker while the training thread runs collectives. `on_done`:
    as `generate`'s."""
    slots = cfg.batch_size if use_continuous(cfg, "own", prompt_ids.shape[0]) else None
    run = _own_decode(replica, cfg, eos_ids, pad_id, None, slots, generator, on_done)
    chunks = _prompt_chunks(prompt_mask, prompt_ids.shape[0] if slots else
                            cfg.batch_size or prompt_ids.shape[0])
    outs, logprobs, stats, routes = [], [], [], []
    for idx, lead in chunks:
        for out, lp, st, rt in _run_or_split(run, prompt_ids[idx, lead:],
                                             prompt_mask[idx, lead:], splittable=True,
                                             rows=idx if on_done is not None else None):
            outs.append(out)
            logprobs.append(lp)
            stats.append(st)
            routes.append(rt)
    return _generated(outs, logprobs, stats, routes, chunks, 0, prompt_ids.shape, cfg, eos_ids,
                      pad_id, prompt_ids.device, None, "own")
