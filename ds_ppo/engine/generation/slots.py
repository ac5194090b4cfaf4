"""The slots of our decoding loop (engine/generation/loop.py): the persistent state a decoding step reads
and writes, the prefill that puts prompts into slots, and the KV cache whose columns form a ring
shared by all slots (so a slot refilled mid-run keeps the step's shapes fixed)."""
from __future__ import annotations

import inspect

import torch

from ds_ppo.algo.masks import decode_attention_mask
from ds_ppo.engine import moe
from ds_ppo.engine.forward import position_ids


def cache_kwarg(model: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` in newer transformers 5 releases,
    `past_key_values` before (still accepted, with a deprecation warning)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def attention_input(keep: torch.Tensor, dtype: torch.dtype, kernel: str) -> torch.Tensor:
    """A bool keep-mask in the format the attention kernel adds: sdpa takes it as it is, eager
    adds a float bias (0 where kept, the dtype's minimum elsewhere)."""
    if kernel == "sdpa":
        return keep
    bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return bias.masked_fill_(~keep, torch.finfo(dtype).min)

def _ring_layer_class():
    """A transformers StaticLayer that writes a one-token step at a shared column (a (1,) long
    device tensor the decoding step advances, modulo the cache width) and a prefill of n tokens
    at columns 0..n-1: a ring of columns, so a slot given a new prompt mid-run writes its
    prompt into the columns just before the shared one (which its previous row no longer
    needs). Attention reads columns through the mask, positions come in `position_ids`, so the
    order of the columns does not matter. `span` (a one-element list shared by the layers, or
    None: every column) is how many leading columns attention reads (`Slots.trim`)."""
    global _RING_LAYER
    if _RING_LAYER is None:
        from transformers.cache_utils import StaticLayer

        class RingLayer(StaticLayer):
            def __init__(self, max_cache_len: int, column: torch.Tensor,
                         span: list[int] | None = None):
                super().__init__(max_cache_len=max_cache_len)
                self.column, self.span = column, span

            def update(self, key_states, value_states, *args, **kwargs):
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                n = key_states.shape[-2]
                cols = self.column if n == 1 else torch.arange(n, device=self.device)
                self.keys.index_copy_(2, cols, key_states)
                self.values.index_copy_(2, cols, value_states)
                if self.span is None:
                    return self.keys, self.values
                return self.keys[:, :, :self.span[0]], self.values[:, :, :self.span[0]]

        _RING_LAYER = RingLayer
    return _RING_LAYER


_RING_LAYER = None


def ring_cache(config, width: int, column: torch.Tensor, span: list[int] | None = None):
    """A StaticCache of `width` columns whose layers are ring layers (`_ring_layer_class`)."""
    from transformers import StaticCache

    cache = StaticCache(config=config, max_cache_len=width)
    layer = _ring_layer_class()
    cache.layers = [layer(width, column, span) for _ in cache.layers]
    return cache


class Slots:
    """The persistent state of a decoding run over S slots, each decoding one prompt at a time
    (B = S rows of every buffer). The decoding step (`step`) reads and writes only these
    buffers with fixed shapes, so it can be captured once as a CUDA graph; `fill` (a prefill,
    eager, between steps) puts new prompts into slots; `harvest` copies finished rows out.

    Cache columns: W = P + T, a ring (`ring_cache`). The step writes its input token at the
    shared column `col` and advances it; a slot filled after k steps holds its prompt in the P
    columns before (k .. k + P - 1 mod W), and its row never lives long enough (P + T - 1
    columns) to be overwritten by itself.

    `trim` (eager decoding only: it changes the step's shapes, so no CUDA graph): attention
    reads only the columns written so far, P + k + 1 at step k until the ring wraps (a refill
    writes the columns just before the shared one, so those too), instead of all W: the
    columns left out are masked, so the outputs are the same; the attention's cost per step
    then grows with the tokens decoded, as HF generate's dynamic cache does.

    A mixture-of-experts model's expert choices (`routes`, engine/moe.py) are kept per slot
    like its tokens: the prefill's for the prompt columns, each step's for the token it fed
    (response token idx - 1), -1 where nothing was routed (pads, the last token)."""

    def __init__(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, S: int,
                 T: int, choose, eos_ids: list[int], pad_id: int, trim: bool = False,
                 step_forward=None, routes: bool = False):
        N, P = prompt_ids.shape
        device = prompt_ids.device
        self.model, self.P, self.T, self.W, self.pad_id = model, P, T, P + T, pad_id
        # the decoding step's forward: the model, or a compiled copy of its forward
        # (generation.compile_step; the prefill always runs the model itself)
        self.step_forward = step_forward or model
        self.ids, self.mask, self.choose = prompt_ids, prompt_mask, choose
        self.kernel = getattr(model.config, "_attn_implementation", None) or "eager"
        self.dtype = next(model.parameters()).dtype
        self.cache_kw = cache_kwarg(model)
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
        self.col = torch.zeros(1, dtype=torch.long, device=device)  # P % W once filled
        self.col0 = torch.zeros(1, dtype=torch.long, device=device)  # a one-token prefill's
        self.trim, self.steps_run = trim, 0
        self.span = [self.W]  # leading cache columns attention reads (trim: those written)
        self.cache = ring_cache(model.config, self.W, self.col, self.span)
        self.token = torch.zeros(S, 1, dtype=torch.long, device=device)  # last chosen token
        self.pos = torch.zeros(S, 1, dtype=torch.long, device=device)  # its position
        self.keys = torch.zeros(S, 1, 1, self.W, dtype=torch.bool, device=device)
        self.idx = torch.zeros(S, dtype=torch.long, device=device)  # token index chosen next
        self.done = torch.ones(S, dtype=torch.bool, device=device)
        self.out = torch.full((S, T + 1), pad_id, dtype=torch.long, device=device)  # T: spill
        self.lp = torch.zeros(S, T + 1, dtype=torch.float32, device=device)
        self.result = torch.full((N, T), pad_id, dtype=torch.long, device=device)
        self.result_lp = torch.zeros(N, T, dtype=torch.float32, device=device)
        self.tap = moe.tap(model) if routes else None
        if self.tap is not None:
            self.tap.record, self.tap.routes = True, None
            shape = (self.tap.layers, self.tap.top_k)
            self.slot_routes = torch.full((S, P + T + 1, *shape), -1, dtype=moe.ROUTE_DTYPE,
                                          device=device)  # prompt, response, spill column
            self.result_routes = torch.full((N, P + T, *shape), -1, dtype=moe.ROUTE_DTYPE,
                                            device=device)

    def _seen_routes(self) -> torch.Tensor:
        """(tokens, layers, k) the expert choices of the forward just run (flattened B x L)."""
        return torch.stack(self.tap.seen, dim=1).to(moe.ROUTE_DTYPE)

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
        """One decoding step of every slot (no host sync; no value-dependent shape, and with
        `trim` off a fixed one)."""
        if self.trim:
            self.span[0] = min(self.W, self.P + self.steps_run + 1)
        self.steps_run += 1
        self.keys.index_fill_(-1, self.col, True)  # the input token's cache column
        logits = self.step_forward(input_ids=self.token, attention_mask=attention_input(
            self.keys[..., :self.span[0]], self.dtype, self.kernel), position_ids=self.pos,
            use_cache=True, **{self.cache_kw: self.cache}).logits[:, -1]
        self.col.add_(1).remainder_(self.W)
        if self.tap is not None:  # the fed token is response token idx - 1 (an ended row's: -1)
            S = self.idx.shape[0]
            chosen = self._seen_routes().masked_fill(self.done[:, None, None], -1)
            at = (self.P + self.idx - 1).clamp(min=self.P)[:, None, None, None]
            self.slot_routes.scatter_(1, at.expand(S, 1, *chosen.shape[1:]), chosen[:, None])
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
        width = self.W if first and not self.trim else self.P
        if first:  # trim: the first prefill reads the P columns it writes
            self.span[0] = width
        cache = self.cache if first else ring_cache(self.model.config, self.P, self.col0)
        prompt_mask = decode_attention_mask(mask, width, prefill=True)
        logits = self.model(input_ids=ids, attention_mask=attention_input(
            prompt_mask, self.dtype, self.kernel), position_ids=position_ids(mask),
            use_cache=True, logits_to_keep=1, **{self.cache_kw: cache}).logits[:, -1]
        cols = (torch.arange(self.P, device=device) + steps_run) % self.W
        if self.tap is not None:  # the prompt's routes; no response token routed yet
            chosen = self._seen_routes().view(len(slots), self.P, *self.slot_routes.shape[2:])
            fresh = torch.full((len(slots), *self.slot_routes.shape[1:]), -1,
                               dtype=moe.ROUTE_DTYPE, device=device)
            fresh[:, :self.P] = chosen.masked_fill(~mask[:, :, None, None], -1)
            self.slot_routes.index_copy_(0, s_t, fresh)
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
        for name in ("token", "pos", "keys", "idx", "done", "out", "lp") + (
                ("slot_routes",) if self.tap is not None else ()):
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
        if self.tap is not None:
            self.result_routes.index_copy_(
                0, r_t, self.slot_routes.index_select(0, s_t)[:, :self.P + self.T])
