"""Our decoding loop on the generation replica (`generation.loop=own`; gathered or
tensor-parallel).

HF `generate` does per-step Python work the device waits on: it rebuilds the attention mask and
the model inputs, runs its logits processors one by one and asks the device whether every
sequence has ended after every token (a host synchronisation per step). With a compiled static
cache the device notes measured 10,450 tok/s for a 0.85B model on an H200, far below the memory
bound. This loop instead:

- prefills the prompts into a static KV cache (`transformers.StaticCache`) in one forward;
- runs each decoding step as a fixed sequence of device ops over persistent buffers (input token,
  positions, a key mask that grows by one column, the step counter, the ended flags, the output),
  so the step has no host synchronisation and no value-dependent shape. On CUDA the step is
  captured once as a CUDA graph after two eager warm-up steps and replayed (one launch per token);
  on a tensor-parallel replica the graph holds the step's NCCL all-reduces, and the ranks of the
  group capture together and agree on the outcome (one failing rank sends all of them eager);
- with the sdpa kernel, attends through `grouped_sdpa_attention`: one query token per sequence
  lets grouped-query heads share their K/V without HF's per-head copy of the cache;
- processes logits and samples on the device (`ds_ppo.algo.sampling`, HF's processors in HF's
  order), so greedy outputs equal HF generate's for the same logits;
- asks whether every response has ended only every `stop_check_every` steps.

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
from ds_ppo.algo.sampling import block_tokens, next_tokens
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


@torch.no_grad()
def decode(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
           max_new_tokens: int, eos_ids: list[int], pad_id: int, min_new_tokens: int = 0,
           temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           suppress_ids: list[int] | tuple[int, ...] = (), cuda_graph: bool = True,
           stop_check_every: int = 16, trim: bool = True, group=None
           ) -> tuple[torch.Tensor, DecodeStats]:
    """Generate up to `max_new_tokens` tokens for left-padded prompts (B, P).

    Returns (B, W) long response ids, W = the longest response (EOS included) <= max_new_tokens,
    pad after each row's first EOS (as HF generate), and the call's DecodeStats. `suppress_ids`
    are never generated; EOS is blocked before `min_new_tokens` tokens. temperature 0 = greedy.
    trim=False returns all the steps run, without the final host sync that finds W.
    `group`: the tensor-parallel process group whose ranks decode these prompts together (the
    step holds its all-reduces): they capture the step together and fall back together.
    """
    from transformers import StaticCache

    B, P = prompt_ids.shape
    T = max_new_tokens
    device = prompt_ids.device
    config = model.config
    kernel = getattr(config, "_attn_implementation", None) or "eager"
    dtype = next(model.parameters()).dtype
    cache = StaticCache(config=config, max_cache_len=P + T)
    cache_kw = {_cache_kwarg(model): cache}
    prompt_mask = prompt_mask.bool()
    positions = position_ids(prompt_mask)  # as scoring and training count them

    # persistent state: the decoding step reads and writes only these (capture-safe)
    eos_t = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
    suppress_t = torch.tensor(sorted(set(suppress_ids)), dtype=torch.long, device=device)
    out = torch.full((B, T), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    step = torch.zeros(1, dtype=torch.long, device=device)  # index of the token being chosen
    token = torch.zeros(B, 1, dtype=torch.long, device=device)  # the last chosen token
    pos = positions[:, -1:] + 1  # its position
    keys = decode_attention_mask(prompt_mask, P + T)  # (B, 1, 1, P+T): attended cache columns

    def choose(logits: torch.Tensor) -> None:
        logits = logits.float()
        if suppress_t.numel():
            block_tokens(logits, suppress_t)
        if min_new_tokens > 0:
            block_tokens(logits, eos_t, step < min_new_tokens)
        nxt = next_tokens(logits, temperature, top_k, top_p).masked_fill(done, pad_id)
        out.index_copy_(1, step, nxt[:, None])
        done.logical_or_(nxt[:, None].eq(eos_t).any(dim=-1))
        token.copy_(nxt[:, None])
        step.add_(1)

    def decode_step() -> None:
        keys.index_fill_(-1, step + (P - 1), True)  # the input token's cache column
        logits = model(input_ids=token, attention_mask=_attention_input(keys, dtype, kernel),
                       position_ids=pos, use_cache=True, **cache_kw).logits[:, -1]
        pos.add_(1)
        choose(logits)

    with _attention_function(model, kernel):
        prefill = model(input_ids=prompt_ids,
                        attention_mask=_attention_input(
                            decode_attention_mask(prompt_mask, P + T, prefill=True), dtype,
                            kernel),
                        position_ids=positions, use_cache=True, logits_to_keep=1, **cache_kw)
        choose(prefill.logits[:, -1])
        del prefill
        stats = _run_steps(decode_step, done, T, min_new_tokens, device,
                           cuda_graph=cuda_graph, stop_check_every=stop_check_every,
                           group=group)
    if not trim:
        return out[:, :stats.steps], stats
    # as HF generate: as wide as the longest response (the loop may run up to
    # stop_check_every - 1 steps past the last EOS)
    width = int(response_mask(out[:, :stats.steps], eos_ids).sum(dim=-1).max())
    return out[:, :width], stats


def _run_steps(decode_step, done: torch.Tensor, T: int, min_new_tokens: int,
               device: torch.device, cuda_graph: bool, stop_check_every: int,
               group=None) -> DecodeStats:
    """Run decoding steps until T tokens (the prefill chose the first) or until every row has
    ended (looked at every stop_check_every steps). With CUDA graphs: WARMUP_STEPS eager steps
    on a side stream, one capture, then replays. The ranks of a tensor-parallel `group` run
    the same schedule: same T, same `done` (they sample the same tokens), and an agreed
    capture outcome, so no rank replays a graph while another runs eagerly."""
    stats = DecodeStats(steps=1, graph=False, graph_error=_CAPTURE_FAILED)
    use_graph = (cuda_graph and _graphs_available(device) and T - 1 > WARMUP_STEPS
                 and _CAPTURE_FAILED is None)
    graph = None
    while stats.steps < T:
        if graph is not None:
            graph.replay()
        elif use_graph and stats.steps == 1 + WARMUP_STEPS:
            graph, stats.graph_error = _capture_agreed(decode_step, device, group)
            stats.graph = graph is not None
            use_graph = graph is not None
            (graph.replay if graph is not None else decode_step)()
        elif use_graph:
            _on_side_stream(decode_step, device)  # warm-up outside the capture stream
        else:
            decode_step()
        stats.steps += 1
        if (stats.steps % stop_check_every == 0 and stats.steps >= min_new_tokens
                and bool(done.all())):
            break
    del graph
    return stats


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
