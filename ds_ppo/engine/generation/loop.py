"""Our decoding loop on the generation replica (`generation.loop=own`; gathered or
tensor-parallel).

HF `generate` does per-step Python work the device waits on: it rebuilds the attention mask and
the model inputs, runs its logits processors one by one and asks the device whether every
sequence has ended after every token (a host synchronisation per step). With a compiled static
cache it decodes about 11,000 tok/s for a 0.85B model on an H200 (docs/RESULTS.md), far below the
memory bound. This loop instead:

- decodes in S slots (`generation.batch_size`; default every prompt at once). The prompts of the
  first S rows are prefilled into a static KV cache in one forward; with more prompts than slots
  (continuous batching, `generation.continuous`), every `stop_check_every` steps the slots whose
  responses have ended take the next prompts: their prompts are prefilled (one forward) and
  copied into the slots' cache rows, their state (position, key mask, token index) reset. The
  cache columns form a ring shared by all slots (`engine/generation/slots.py`): each step writes one column, a
  refilled slot's prompt goes into the columns just before it;
- runs each decoding step as a fixed sequence of device ops over persistent buffers (input token,
  per-slot positions and token indices, a key mask that grows by one column, the ring column,
  the ended flags, the outputs), so the step has no host synchronisation and no value-dependent
  shape, also across refills. On CUDA the step is
  captured once as a CUDA graph after two eager warm-up steps and replayed (one launch per token);
  on a tensor-parallel replica the graph holds the step's NCCL all-reduces, and the ranks of the
  group capture together and agree on the outcome (one failing rank sends all of them eager);
- with the sdpa kernel, attends through `grouped_sdpa_attention`: one query token per sequence
  lets grouped-query heads share their K/V without HF's per-head copy of the cache;
- processes logits and samples on the device (`ds_ppo.algo.sampling`, HF's processors in HF's
  order), so greedy outputs equal HF generate's for the same logits, and keeps each sampled
  token's log-prob under the distribution it was drawn from (the rollout log-probs,
  `ds_ppo.ppo.correction`);
- asks whether responses have ended only every `stop_check_every` steps;
- gives the decode up between two steps after a SIGTERM (`ds_ppo.abandon`; not on a
  tensor-parallel replica, whose ranks must take every step together).

The masks are 4D and built here (`ds_ppo.algo.masks.decode_attention_mask`, in `engine/generation/slots.py`), so HF's mask
creation (which may synchronise) never runs inside a step. That limits the loop to models whose
every layer attends to the full causal context, with the sdpa or eager attention kernel;
`ds_ppo.engine.generation.choice.own_loop_unsupported()` says why a model is not served and
`generation.loop=auto` then uses HF generate.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as tdist

from ds_ppo import abandon
from ds_ppo.algo.masks import response_mask
from ds_ppo.algo.distribution import LogitShape, shape_logits
from ds_ppo.algo.sampling import next_tokens_with_logprobs
from ds_ppo.engine import batch_invariant
from ds_ppo.engine.generation.slots import Slots

log = logging.getLogger("ds_ppo")

GROUPED_SDPA = "ds_ppo_grouped_sdpa"  # our attention function for sdpa models (registered lazily)
WARMUP_STEPS = 2  # eager steps before capture (lazy allocations, cuBLAS workspaces)


@dataclass
class DecodeStats:
    """What one decode call did (read by the benchmark and the logs)."""

    steps: int  # decoding steps run (tokens per sequence, the prefill's one included)
    graph: bool  # the steps after the warm-up were replayed from a CUDA graph
    graph_error: str | None = None  # why capturing failed (the loop went on eagerly)
    slots: int = 0  # rows decoded at once
    rows: int = 0  # prompts decoded
    # token positions the slots were given: slots x decoding steps, plus each row's first
    # token (from its prefill); counted tokens / slot_steps is the slots' utilisation
    slot_steps: int = 0
    refills: int = 0  # prompts prefilled into a slot freed mid-run (continuous batching)


def grouped_sdpa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0,
                           scaling: float | None = None, is_causal: bool | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention function: sdpa for one new token per sequence with grouped-query attention,
    without repeating K/V.

    HF's sdpa repeats the cache's K and V for every query head whenever a mask is passed (which
    a static cache always needs): H / KVH times the cache traffic of a decoding step, the
    largest memory traffic of the step at batch 64 x 512 tokens. With one query token, the
    G = H / KVH query heads sharing a KV head can instead stand on SDPA's query axis:
    query (B, H, 1, D) -> (B, KVH, G, D) against key/value (B, KVH, L, D), the (B, 1, 1, L) mask
    broadcast. Head h = kvh * G + g, as repeat_kv orders them. Returns (B, 1, H, D) as HF's
    attention functions do. Any other shape (the prefill, no grouping) goes to HF's sdpa.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, Q, D = query.shape
    kv_heads = key.shape[1]
    if Q != 1 or H == kv_heads or dropout or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(B, kv_heads, H // kv_heads, D), key, value, attn_mask=attention_mask,
        scale=scaling)
    return out.reshape(B, 1, H, D), None


@contextmanager
def _attention_function(model: torch.nn.Module, kernel: str):
    """sdpa models decode through grouped_sdpa_attention (the config's attention setting is
    switched for the call and restored after: the replica may share its config object)."""
    if kernel != "sdpa" or batch_invariant.active():  # its own attention: batch_invariant.py
        yield
        return
    from transformers import AttentionInterface

    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    config = model.config
    config._attn_implementation = GROUPED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = kernel


@dataclass
class Decoded:
    """What one decode call returns (N = prompts, W = the longest response)."""

    response_ids: torch.Tensor  # (N, W) long, pad after each row's first EOS (as HF generate)
    logprobs: torch.Tensor  # (N, W) float32, each token's log-prob where it was sampled; 0 after
    stats: DecodeStats
    # a mixture-of-experts model's expert choices (`routes`; else None): int16 top-k indices
    # per MoE layer, -1 where no token was routed (engine/moe.py)
    prompt_routes: torch.Tensor | None = None  # (N, P, layers, k)
    response_routes: torch.Tensor | None = None  # (N, W, layers, k)


@torch.no_grad()
def decode(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
           max_new_tokens: int, eos_ids: list[int], pad_id: int, min_new_tokens: int = 0,
           temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           suppress_ids: list[int] | tuple[int, ...] = (), cuda_graph: bool = True,
           stop_check_every: int = 8, trim: bool = True, group=None,
           slots: int | None = None, compile_step: bool = False,
           generator: torch.Generator | None = None, routes: bool = False,
           on_done: Callable[[list[int], list[list[int]]], None] | None = None) -> Decoded:
    """Generate up to `max_new_tokens` tokens for left-padded prompts (N, P).

    `slots` (default: N) rows decode at once. With fewer slots than prompts this is continuous
    batching: every `stop_check_every` steps the slots whose responses have ended take the
    next prompts (prefilled into the slot), so no slot idles for long; rows come back in
    prompt order. Returns `Decoded`: (N, W) response ids, W = the longest response (EOS
    included) <= max_new_tokens, pad after each row's first EOS (as HF generate), their
    rollout log-probs (`next_tokens_with_logprobs`) and the call's DecodeStats.
    `suppress_ids` are never generated; EOS is blocked before `min_new_tokens` tokens.
    temperature 0 = greedy. trim=False returns all the columns the steps reached, without the
    final host sync that finds W. `group`: the tensor-parallel process group whose ranks
    decode these prompts together (the step holds its all-reduces): they capture the step
    together, fall back together, and refill alike (they sample the same tokens).
    `compile_step`: the decoding step's forward runs compiled by torch.compile (inductor, static
    shapes: the steps attend to every cache column, as the CUDA graph's do), inside the CUDA
    graph where there is one: fused elementwise kernels (RMSNorm, rotary embeddings, residual
    adds) instead of eager's many small ones. The warm-up steps compile it. `generator`: the
    random stream tokens are sampled from (None: torch's default one). `on_done(rows, tokens)`:
    called on this thread at every check that finds responses ended (and once at the end for
    the rest), with those rows and each one's T token ids (pad after its EOS): what streams a
    response to its reward call while the other rows decode. It costs one device read per
    check that finds some.
    """
    N, P = prompt_ids.shape
    S = N if slots is None else max(1, min(slots, N))
    T = max_new_tokens
    device = prompt_ids.device
    # the distribution sampled from; the trainer shapes its logits with the same LogitShape
    # (`Rollout.sampling`), so its log-probs are of this distribution
    shape = LogitShape(temperature=temperature, top_k=top_k, top_p=top_p,
                       suppress_ids=tuple(sorted(set(suppress_ids))),
                       eos_ids=tuple(sorted(set(eos_ids))), min_new_tokens=min_new_tokens)
    shape.ids(device)  # its id tensors made here, not inside a captured step

    def choose(logits: torch.Tensor, idx: torch.Tensor):
        return next_tokens_with_logprobs(shape_logits(logits.float(), shape, idx), temperature,
                                         generator)

    kernel = getattr(model.config, "_attn_implementation", None) or "eager"
    with _attention_function(model, kernel):
        # eager steps (no CUDA graph to replay) attend only to the cache columns written so far
        eager = not (cuda_graph and _graphs_available(device)) and not compile_step
        run = Slots(model, prompt_ids, prompt_mask.bool(), S, T, choose, eos_ids, pad_id,
                    trim=eager, step_forward=compiled_step(model) if compile_step else None,
                    routes=routes)
        try:
            stats = _run_slots(run, N, S, T, cuda_graph, stop_check_every, group,
                               narrow=slots is not None, on_done=on_done)
        finally:
            if run.tap is not None:
                run.tap.record = False
    width = min(stats.steps, T)
    if trim:
        # as HF generate: as wide as the longest response (the loop may run up to
        # stop_check_every - 1 steps past the last EOS)
        width = int(response_mask(run.result, eos_ids).sum(dim=-1).max())
    if run.tap is None:
        return Decoded(run.result[:, :width], run.result_lp[:, :width], stats)
    return Decoded(run.result[:, :width], run.result_lp[:, :width], stats,
                   run.result_routes[:, :P], run.result_routes[:, P:P + width])


def compiled_step(model: torch.nn.Module):
    """The model's forward compiled for the decoding step (one per model object, kept on it,
    so later generate calls on the same replica reuse the compiled code). Static shapes: a
    step's shapes change only with the slot count (continuous batching's narrower batches)."""
    fn = model.__dict__.get("_ds_ppo_compiled_step")
    if fn is None:  # a plain attribute (not a submodule): the state dict stays the model's
        fn = torch.compile(model.forward, dynamic=False)
        model.__dict__["_ds_ppo_compiled_step"] = fn
    return fn


def _run_slots(run: Slots, N: int, S: int, T: int, cuda_graph: bool, stop_check_every: int,
               group, narrow: bool, on_done=None) -> DecodeStats:
    """Fill the S slots with the first prompts, then run decoding steps; every
    stop_check_every steps (one host read of the ended flags) move the ended rows out and the
    next prompts in, until every row has ended or reached T tokens. `narrow` (continuous
    batching): once no prompt is left and at most 3/4 of the slots are live, the live ones move
    into a narrower batch (`_narrower`), so the draining tail does not step idle slots.
    `on_done`: see `decode`."""
    device = run.ids.device
    queue = list(range(S, N))[::-1]  # popped from the end: prompt order
    row_of: list[int | None] = list(range(S))
    run.fill(list(range(S)), list(range(S)), 0)
    graphs = cuda_graph and T - 1 > WARMUP_STEPS
    stepper = first = _Stepper(run.step, device, graphs, group)
    steps, limit, refills, slot_steps = 0, T - 1, 0, N
    handed: set[int] = set()  # rows given to on_done
    while steps < limit:
        if group is None:  # a host-side flag: no device sync
            abandon.check("generation")
        stepper()
        steps += 1
        slot_steps += len(row_of)
        if steps >= limit and not queue:  # every row has ended or reached T tokens
            break
        if (steps + 1) % stop_check_every and steps < limit:
            continue
        ended = run.done.tolist()  # the check: one host read
        free = [s for s, r in enumerate(row_of) if ended[s] and r is not None]
        if on_done is not None:
            _hand_in(run, on_done, [s for s in free if row_of[s] not in handed],
                     row_of, handed, T)
        if queue and free:
            free = free[:len(queue)]
            run.harvest(free, [row_of[s] for s in free])
            rows = [queue.pop() for _ in free]
            run.fill(free, rows, steps)
            for s, r in zip(free, rows):
                row_of[s] = r
            refills += len(free)
            limit = max(limit, steps + T - 1)
        elif not queue and all(ended):
            break
        elif narrow and not queue and _narrower(ended) is not None:
            run.harvest(free, [row_of[s] for s in free])
            keep = _narrower(ended)
            row_of = [None if ended[s] else row_of[s] for s in keep]
            run.shrink(keep)
            stepper = _Stepper(run.step, device, graphs, group)
    live = [s for s, r in enumerate(row_of) if r is not None]
    run.harvest(live, [row_of[s] for s in live])
    if on_done is not None:  # the rows no check found ended
        rest = [r for r in range(N) if r not in handed]
        if rest:
            on_done(rest, run.result[torch.tensor(rest, device=device)].tolist())
    return DecodeStats(steps=steps + 1, graph=first.graph is not None,
                       graph_error=first.error or stepper.error, slots=S, rows=N,
                       slot_steps=slot_steps, refills=refills)


def _hand_in(run: Slots, on_done, slots: list[int], row_of: list[int | None],
             handed: set[int], T: int) -> None:
    """`on_done` for the ended rows in `slots` (before a refill or a shrink moves them out)."""
    if not slots:
        return
    rows = [row_of[s] for s in slots]
    handed.update(rows)
    on_done(rows, run.out[torch.tensor(slots, device=run.ids.device), :T].tolist())


def _narrower(ended: list[bool]) -> list[int] | None:
    """The live slots, once at most 3/4 of the slots are (a narrower batch then; each width
    is one more step shape, at most log(S) / log(4/3) of them), else None."""
    live = [s for s, e in enumerate(ended) if not e]
    return live if 0 < len(live) <= len(ended) * 3 // 4 else None


class _Stepper:
    """Runs decoding steps as the CUDA-graph schedule says: WARMUP_STEPS eager steps on a side
    stream, one capture (agreed over a tensor-parallel `group`), then replays; eager steps when
    graphs are off, unavailable or failed. The ranks of a group run the same schedule."""

    def __init__(self, step, device: torch.device, cuda_graph: bool, group=None):
        self.step, self.device, self.group = step, device, group
        self.use_graph = cuda_graph and _graphs_available(device) and _CAPTURE_FAILED is None
        self.graph, self.error, self.warm = None, _CAPTURE_FAILED, 0

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        elif self.use_graph and self.warm == WARMUP_STEPS:
            self.graph, self.error = _capture_agreed(self.step, self.device, self.group)
            self.use_graph = self.graph is not None
            (self.graph.replay if self.graph is not None else self.step)()
        elif self.use_graph:
            _on_side_stream(self.step, self.device)  # warm-up outside the capture stream
            self.warm += 1
        else:
            self.step()


def _graphs_available(device: torch.device) -> bool:
    return device.type == "cuda"


def _on_side_stream(fn, device: torch.device) -> None:
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)


_CAPTURE_FAILED: str | None = None  # set by the first failed capture: later calls do not retry


def _capture_agreed(fn, device: torch.device, group=None):
    """`_capture`, with the outcome agreed over a tensor-parallel `group` (None: this rank
    alone): (graph, None) when every rank captured, else (None, the reason) on every rank, and
    then this process decodes eagerly from here on (one warning, no retry per rollout)."""
    global _CAPTURE_FAILED
    graph, error = _capture(fn, device)
    if not _all_agree(graph is not None, device, group):
        graph = None  # another rank failed: replaying here would wait on its all-reduces
        error = error or "another rank of the tensor-parallel group could not capture its step"
    if graph is None:
        _CAPTURE_FAILED = error
        log.warning("generation: capturing the decoding step as a CUDA graph failed (%s); "
                    "decoding eagerly from now on (generation.cuda_graph=false silences this)",
                    error)
    return graph, error


def _all_agree(ok: bool, device: torch.device, group) -> bool:
    """True when `ok` holds on every rank of `group` (one all-reduce; no group: `ok`)."""
    if group is None:
        return ok
    failed = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    tdist.all_reduce(failed, op=tdist.ReduceOp.MAX, group=group)
    return not bool(failed.item())


def _capture(fn, device: torch.device):
    """Record one call of `fn` as a CUDA graph (nothing runs while recording). An all-reduce in
    `fn` is recorded too: torch's NCCL process group issues it on its own stream, which waits
    on an event of the capture stream and is waited on by it, so it joins the capture (the
    warm-up steps have already created the communicator). Returns (graph, None), or (None, the
    error) when the step cannot be captured."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
    except Exception as exc:  # a host sync or an unsupported op inside the model's forward
        torch.cuda.synchronize(device)
        if isinstance(exc, torch.OutOfMemoryError):
            raise  # not the step's fault: the caller retries with fewer prompts, graphs stay on
        return None, f"{type(exc).__name__}: {exc}"
    return graph, None
