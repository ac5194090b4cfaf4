"""Our decoding loop on the generation replica (`generation.loop=own`; gathered or
tensor-parallel).

HF `generate` does per-step Python work the device waits on: it rebuilds the attention mask and
the model inputs, runs its logits processors one by one and asks the device whether every
sequence has ended after every token (a host synchronisation per step). With a compiled static
cache the device notes measured 10,450 tok/s for a 0.85B model on an H200, far below the memory
bound. This loop instead:

- decodes in S slots (`generation.batch_size`; default every prompt at once). The prompts of the
  first S rows are prefilled into a static KV cache in one forward; with more prompts than slots
  (continuous batching, `generation.continuous`), every `stop_check_every` steps the slots whose
  responses have ended take the next prompts: their prompts are prefilled (one forward) and
  copied into the slots' cache rows, their state (position, key mask, token index) reset. The
  cache columns form a ring shared by all slots (`_ring_cache`): each step writes one column, a
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
- asks whether responses have ended only every `stop_check_every` steps.

The masks are 4D and built here (`ds_ppo.algo.masks.decode_attention_mask`), so HF's mask
creation (which may synchronise) never runs inside a step. That limits the loop to models whose
every layer attends to the full causal context, with the sdpa or eager attention kernel;
`ds_ppo.engine.generation_choice.own_loop_unsupported()` says why a model is not served and
`generation.loop=auto` then uses HF generate.
"""
from __future__ import annotations

import inspect
import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from ds_ppo.algo.masks import decode_attention_mask, response_mask
from ds_ppo.algo.sampling import block_tokens, next_tokens_with_logprobs
from ds_ppo.engine.forward import position_ids

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
    if kernel != "sdpa":
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


def _cache_kwarg(model: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` in newer transformers 5 releases,
    `past_key_values` before (still accepted, with a deprecation warning)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _attention_input(keep: torch.Tensor, dtype: torch.dtype, kernel: str) -> torch.Tensor:
    """A bool keep-mask in the format the attention kernel adds: sdpa takes it as it is, eager
    adds a float bias (0 where kept, the dtype's minimum elsewhere)."""
    if kernel == "sdpa":
        return keep
    bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return bias.masked_fill_(~keep, torch.finfo(dtype).min)


@dataclass
class Decoded:
    """What one decode call returns (N = prompts, W = the longest response)."""

    response_ids: torch.Tensor  # (N, W) long, pad after each row's first EOS (as HF generate)
    logprobs: torch.Tensor  # (N, W) float32, each token's log-prob where it was sampled; 0 after
    stats: DecodeStats


def _ring_layer_class():
    """A transformers StaticLayer that writes a one-token step at a shared column (a (1,) long
    device tensor the decoding step advances, modulo the cache width) and a prefill of n tokens
    at columns 0..n-1: a ring of columns, so a slot given a new prompt mid-run writes its
    prompt into the columns just before the shared one (which its previous row no longer
    needs). Attention reads columns through the mask, positions come in `position_ids`, so the
    order of the columns does not matter."""
    global _RING_LAYER
    if _RING_LAYER is None:
        from transformers.cache_utils import StaticLayer

        class RingLayer(StaticLayer):
            def __init__(self, max_cache_len: int, column: torch.Tensor):
                super().__init__(max_cache_len=max_cache_len)
                self.column = column

            def update(self, key_states, value_states, *args, **kwargs):
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                n = key_states.shape[-2]
                cols = self.column if n == 1 else torch.arange(n, device=self.device)
                self.keys.index_copy_(2, cols, key_states)
                self.values.index_copy_(2, cols, value_states)
                return self.keys, self.values

        _RING_LAYER = RingLayer
    return _RING_LAYER


_RING_LAYER = None


def _ring_cache(config, width: int, column: torch.Tensor):
    """A StaticCache of `width` columns whose layers are ring layers (`_ring_layer_class`)."""
    from transformers import StaticCache

    cache = StaticCache(config=config, max_cache_len=width)
    layer = _ring_layer_class()
    cache.layers = [layer(width, column) for _ in cache.layers]
    return cache


class _Slots:
    """The persistent state of a decoding run over S slots, each decoding one prompt at a time
    (B = S rows of every buffer). The decoding step (`step`) reads and writes only these
    buffers with fixed shapes, so it can be captured once as a CUDA graph; `fill` (a prefill,
    eager, between steps) puts new prompts into slots; `harvest` copies finished rows out.

    Cache columns: W = P + T, a ring (`_ring_cache`). The step writes its input token at the
    shared column `col` and advances it; a slot filled after k steps holds its prompt in the P
    columns before (k .. k + P - 1 mod W), and its row never lives long enough (P + T - 1
    columns) to be overwritten by itself."""

    def __init__(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, S: int,
                 T: int, choose, eos_ids: list[int], pad_id: int):
        N, P = prompt_ids.shape
        device = prompt_ids.device
        self.model, self.P, self.T, self.W, self.pad_id = model, P, T, P + T, pad_id
        self.ids, self.mask, self.choose = prompt_ids, prompt_mask, choose
        self.kernel = getattr(model.config, "_attn_implementation", None) or "eager"
        self.dtype = next(model.parameters()).dtype
        self.cache_kw = _cache_kwarg(model)
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
        self.col = torch.zeros(1, dtype=torch.long, device=device)  # P % W once filled
        self.col0 = torch.zeros(1, dtype=torch.long, device=device)  # a one-token prefill's
        self.cache = _ring_cache(model.config, self.W, self.col)
        self.token = torch.zeros(S, 1, dtype=torch.long, device=device)  # last chosen token
        self.pos = torch.zeros(S, 1, dtype=torch.long, device=device)  # its position
        self.keys = torch.zeros(S, 1, 1, self.W, dtype=torch.bool, device=device)
        self.idx = torch.zeros(S, dtype=torch.long, device=device)  # token index chosen next
        self.done = torch.ones(S, dtype=torch.bool, device=device)
        self.out = torch.full((S, T + 1), pad_id, dtype=torch.long, device=device)  # T: spill
        self.lp = torch.zeros(S, T + 1, dtype=torch.float32, device=device)
        self.result = torch.full((N, T), pad_id, dtype=torch.long, device=device)
        self.result_lp = torch.zeros(N, T, dtype=torch.float32, device=device)

    def _record(self, logits: torch.Tensor) -> None:
        """Each live slot's next token (index `idx`) from its (S, V) logits; a slot whose row
        ended writes pad to its spill column onwards and keeps its position."""
        nxt, lp = self.choose(logits, self.idx)
        nxt = nxt.masked_fill(self.done, self.pad_id)
        at = self.idx[:, None]
        self.out.scatter_(1, at, nxt[:, None])
        self.lp.scatter_(1, at, lp.masked_fill(self.done, 0.0)[:, None])
        self.done.logical_or_(nxt[:, None].eq(self.eos).any(dim=-1) | (self.idx >= self.T - 1))
        self.token.copy_(nxt[:, None])
        self.idx.add_(1).clamp_(max=self.T)

    def step(self) -> None:
        """One decoding step of every slot (no host sync, no value-dependent shape)."""
        self.keys.index_fill_(-1, self.col, True)  # the input token's cache column
        logits = self.model(input_ids=self.token, attention_mask=_attention_input(
            self.keys, self.dtype, self.kernel), position_ids=self.pos, use_cache=True,
            **{self.cache_kw: self.cache}).logits[:, -1]
        self.col.add_(1).remainder_(self.W)
        self.pos.add_((~self.done)[:, None].long())  # an ended row's position stays in range
        self._record(logits)

    def fill(self, slots: list[int], rows: list[int], steps_run: int) -> None:
        """Prefill prompts `rows` into `slots` after `steps_run` decoding steps and choose their
        first tokens. The first fill (every slot, no step run yet) prefills into the ring cache
        itself; later ones into a cache of P columns, copied into the slots' ring columns."""
        device = self.ids.device
        s_t = torch.tensor(slots, dtype=torch.long, device=device)
        r_t = torch.tensor(rows, dtype=torch.long, device=device)
        ids, mask = self.ids.index_select(0, r_t), self.mask.index_select(0, r_t)
        first = steps_run == 0 and len(slots) == self.keys.shape[0]
        width = self.W if first else self.P
        cache = self.cache if first else _ring_cache(self.model.config, self.P, self.col0)
        prompt_mask = decode_attention_mask(mask, width, prefill=True)
        logits = self.model(input_ids=ids, attention_mask=_attention_input(
            prompt_mask, self.dtype, self.kernel), position_ids=position_ids(mask),
            use_cache=True, logits_to_keep=1, **{self.cache_kw: cache}).logits[:, -1]
        cols = (torch.arange(self.P, device=device) + steps_run) % self.W
        if first:  # a one-token prompt went to column 0 (col's start); steps start at P
            self.col.fill_(self.P % self.W)
        else:
            for ring, new in zip(self.cache.layers, cache.layers):
                for big, small in ((ring.keys, new.keys), (ring.values, new.values)):
                    big.index_copy_(0, s_t, big.index_select(0, s_t).index_copy_(2, cols, small))
        keep = torch.zeros(len(slots), 1, 1, self.W, dtype=torch.bool, device=device)
        keep.index_copy_(-1, cols, mask[:, None, None, :])
        self.keys.index_copy_(0, s_t, keep)
        self.pos.index_copy_(0, s_t, mask.sum(dim=-1, keepdim=True))
        nxt, lp = self.choose(logits, torch.zeros(len(slots), dtype=torch.long, device=device))
        out = torch.full((len(slots), self.T + 1), self.pad_id, dtype=torch.long, device=device)
        out[:, 0] = nxt
        self.out.index_copy_(0, s_t, out)
        lps = torch.zeros(len(slots), self.T + 1, dtype=torch.float32, device=device)
        lps[:, 0] = lp
        self.lp.index_copy_(0, s_t, lps)
        self.token.index_copy_(0, s_t, nxt[:, None])
        self.done.index_copy_(0, s_t, nxt[:, None].eq(self.eos).any(dim=-1) | (self.T == 1))
        self.idx.index_fill_(0, s_t, 1)

    def shrink(self, keep: list[int]) -> None:
        """Keep only the slots `keep`, in this order: every per-slot buffer and the cache's rows
        are gathered into new, narrower tensors (a captured step must be captured again)."""
        k = torch.tensor(keep, dtype=torch.long, device=self.ids.device)
        for name in ("token", "pos", "keys", "idx", "done", "out", "lp"):
            setattr(self, name, getattr(self, name).index_select(0, k))
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, k)
            layer.values = layer.values.index_select(0, k)
            layer.batch_size = len(keep)

    def harvest(self, slots: list[int], rows: list[int]) -> None:
        """Copy the responses of `slots` (rows `rows`) into the result, in row order."""
        device = self.ids.device
        s_t = torch.tensor(slots, dtype=torch.long, device=device)
        r_t = torch.tensor(rows, dtype=torch.long, device=device)
        self.result.index_copy_(0, r_t, self.out.index_select(0, s_t)[:, :self.T])
        self.result_lp.index_copy_(0, r_t, self.lp.index_select(0, s_t)[:, :self.T])


@torch.no_grad()
def decode(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
           max_new_tokens: int, eos_ids: list[int], pad_id: int, min_new_tokens: int = 0,
           temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           suppress_ids: list[int] | tuple[int, ...] = (), cuda_graph: bool = True,
           stop_check_every: int = 16, trim: bool = True, group=None,
           slots: int | None = None) -> Decoded:
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
    """
    N, P = prompt_ids.shape
    S = N if slots is None else max(1, min(slots, N))
    T = max_new_tokens
    device = prompt_ids.device
    eos_t = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
    suppress_t = torch.tensor(sorted(set(suppress_ids)), dtype=torch.long, device=device)

    def choose(logits: torch.Tensor, idx: torch.Tensor):
        logits = logits.float()
        if suppress_t.numel():
            block_tokens(logits, suppress_t)
        if min_new_tokens > 0:
            block_tokens(logits, eos_t, (idx < min_new_tokens)[:, None])
        return next_tokens_with_logprobs(logits, temperature, top_k, top_p)

    kernel = getattr(model.config, "_attn_implementation", None) or "eager"
    with _attention_function(model, kernel):
        run = _Slots(model, prompt_ids, prompt_mask.bool(), S, T, choose, eos_ids, pad_id)
        stats = _run_slots(run, N, S, T, cuda_graph, stop_check_every, group,
                           narrow=slots is not None)
    width = min(stats.steps, T)
    if trim:
        # as HF generate: as wide as the longest response (the loop may run up to
        # stop_check_every - 1 steps past the last EOS)
        width = int(response_mask(run.result, eos_ids).sum(dim=-1).max())
    return Decoded(run.result[:, :width], run.result_lp[:, :width], stats)


def _run_slots(run: _Slots, N: int, S: int, T: int, cuda_graph: bool, stop_check_every: int,
               group, narrow: bool) -> DecodeStats:
    """Fill the S slots with the first prompts, then run decoding steps; every
    stop_check_every steps (one host read of the ended flags) move the ended rows out and the
    next prompts in, until every row has ended or reached T tokens. `narrow` (continuous
    batching): once no prompt is left and at most 3/4 of the slots are live, the live ones move
    into a narrower batch (`_narrower`), so the draining tail does not step idle slots."""
    device = run.ids.device
    queue = list(range(S, N))[::-1]  # popped from the end: prompt order
    row_of: list[int | None] = list(range(S))
    run.fill(list(range(S)), list(range(S)), 0)
    graphs = cuda_graph and T - 1 > WARMUP_STEPS
    stepper = first = _Stepper(run.step, device, graphs, group)
    steps, limit, refills, slot_steps = 0, T - 1, 0, N
    while steps < limit:
        stepper()
        steps += 1
        slot_steps += len(row_of)
        if steps >= limit and not queue:  # every row has ended or reached T tokens
            break
        if (steps + 1) % stop_check_every and steps < limit:
            continue
        ended = run.done.tolist()  # the check: one host read
        free = [s for s, r in enumerate(row_of) if ended[s] and r is not None]
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
    return DecodeStats(steps=steps + 1, graph=first.graph is not None,
                       graph_error=first.error or stepper.error, slots=S, rows=N,
                       slot_steps=slot_steps, refills=refills)


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
