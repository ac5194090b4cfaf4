"""Tensor-parallel generation replica (`generation.mode=tensor_parallel`), for policies whose
16-bit copy does not fit one device (a 70B model is 140 GB in bf16).

`tp_size` consecutive ranks (by default the GPUs of one node) hold one replica between them:
Megatron-style sharding of each decoder layer's linear layers, everything else replicated.

- column-parallel (output features split): q_proj, k_proj, v_proj (whole heads: query and KV
  heads split alike, so each rank's query heads find their KV heads locally), gate_proj, up_proj;
- row-parallel (input features split, partial outputs summed by an all-reduce): o_proj,
  down_proj;
- replicated: embeddings, norms, the output head, a mixture-of-experts layer's router;
- a mixture-of-experts layer's fused experts (transformers 5's `(E, 2F, H)` gate_up_proj and
  `(E, H, F)` down_proj, Qwen3-MoE and Mixtral): split by expert, each rank holding E / tp_size
  of them (expert parallelism inside the group). Every rank of the group decodes the same rows
  and routes them alike (the router is whole), so each computes its own experts' weighted
  outputs for every token (tokens routed elsewhere reach its experts as transformers' expert-
  parallel sentinel, weight 0) and one all-reduce sums them: no all-to-all.

With fewer KV heads than ranks (tp_size a multiple of num_key_value_heads, e.g. 4 KV heads
over 8 ranks), each rank keeps the one KV head its query heads read, and the ranks sharing a
KV head hold a copy each (as Megatron does); the attention modules' query-per-KV-head count is
set to the shard's.

HF's attention and MLP modules run unchanged on the shards (they infer the head count from the
projected tensor), so the decoding loop (`engine/generation/loop.py`) and HF generate both work on a
sharded replica. Two all-reduces per layer per step instead of ZeRO-3's gathering of every layer
for every token. Every rank of a group decodes the group's prompts together, with the same
random stream, and keeps its own rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as tdist

from ds_ppo.config.tensor_parallel_shapes import COLUMN, EXPERTS, KV, ROW  # what is split, how


@dataclass(frozen=True)
class TPGroup:
    """This rank's tensor-parallel group: `size` consecutive ranks starting at `first`."""

    group: object | None  # the torch.distributed process group (None when size == 1)
    size: int
    rank: int  # this rank's index in the group
    first: int  # the group's first global rank

    @property
    def index(self) -> int:
        """Which group this is (0, 1, ...): seeds differ between groups."""
        return self.first // self.size


_GROUPS: dict[int, TPGroup] = {}


def tp_group(size: int) -> TPGroup:
    """This rank's group of `size` consecutive ranks. Collective on first use for a size (every
    rank creates every group, as torch.distributed requires); cached after."""
    if size in _GROUPS:
        return _GROUPS[size]
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    if world % size:
        raise ValueError(f"generation.tp_size={size} does not divide the world size {world}")
    first = rank - rank % size
    group = None
    for start in range(0, world, size):  # every rank takes part in creating every group
        g = tdist.new_group(list(range(start, start + size))) if size > 1 else None
        if start == first:
            group = g
    _GROUPS[size] = TPGroup(group=group, size=size, rank=rank - first, first=first)
    return _GROUPS[size]


class RowParallelLinear(torch.nn.Module):
    """y = sum over the group of x_shard @ W_shard^T, then + bias (added once, after the sum)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features))
        self.bias = torch.nn.Parameter(torch.empty(out_features)) if bias else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight)
        if self.group is not None:
            tdist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


def heads_of(model: torch.nn.Module) -> tuple[int | None, int | None]:
    """(attention heads, KV heads) of a model's config (None where it does not say)."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_attention_heads", None)
    return heads, getattr(config, "num_key_value_heads", None) or heads


def pieces(name: str, size: int, kv_heads: int | None = None) -> int:
    """Into how many pieces the weight `name` of a split layer is cut (rank r of `size` holds
    piece r * pieces // size): `size`, or for k_proj / v_proj with fewer KV heads than ranks
    one per KV head (the ranks reading one KV head each hold it)."""
    layer = name.rsplit(".", 2)[-2] if "." in name else ""
    return kv_heads if layer in KV and kv_heads and kv_heads < size else size


def is_fused_experts(m: torch.nn.Module) -> bool:
    """A transformers-5 experts module: `num_experts` and the fused (E, ., .) EXPERTS tensors."""
    return hasattr(m, "num_experts") and all(
        isinstance(getattr(m, p, None), torch.Tensor) and getattr(m, p).dim() == 3
        for p in EXPERTS)


def _expert_shard(experts: torch.nn.Module, tp: TPGroup) -> None:
    """Make a (meta-device) fused experts module hold experts [r E/tp, (r+1) E/tp) of rank r and
    sum its outputs over the group (module docstring)."""
    n = experts.num_experts // tp.size
    first = tp.rank * n
    for p in EXPERTS:
        full = getattr(experts, p)
        setattr(experts, p, torch.nn.Parameter(torch.empty(n, *full.shape[1:],
                                                           device=full.device)))
    experts.num_experts = n
    experts._is_expert_parallel = True  # transformers' kernels then skip the sentinel n

    def local_routes(_m, args, kwargs):
        args = list(args)
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        weights = args[2] if len(args) > 2 else kwargs["top_k_weights"]
        local = index - first
        elsewhere = (local < 0) | (local >= n)
        local, weights = local.masked_fill(elsewhere, n), weights.masked_fill(elsewhere, 0)
        if len(args) > 2:
            args[1], args[2] = local, weights
        else:
            args, kwargs = args[:1], {**kwargs, "top_k_index": local, "top_k_weights": weights}
        return tuple(args), kwargs

    def summed(_m, _args, out):
        if tp.group is not None:
            tdist.all_reduce(out, group=tp.group)
        return out
    experts.register_forward_pre_hook(local_routes, with_kwargs=True)
    experts.register_forward_hook(summed)


def shard_modules(model: torch.nn.Module, tp: TPGroup) -> None:
    """Replace the sharded linear layers of a (meta-device) model with their shard-sized
    versions, and cut its fused experts to this rank's, in place."""
    heads, kv_heads = heads_of(model)
    for parent in list(model.modules()):
        if is_fused_experts(parent):
            _expert_shard(parent, tp)
        if hasattr(parent, "num_key_value_groups") and heads and kv_heads:
            # query heads per KV head on the shard (fewer KV heads than ranks: each rank keeps one)
            parent.num_key_value_groups = (heads // tp.size) // max(1, kv_heads // tp.size)
        for name, child in list(parent.named_children()):
            if not isinstance(child, torch.nn.Linear) or name not in COLUMN + ROW:
                continue
            bias = child.bias is not None
            if name in COLUMN:
                cut = pieces(f"{name}.weight", tp.size, kv_heads)
                new = torch.nn.Linear(child.in_features, child.out_features // cut,
                                      bias=bias, device=child.weight.device)
            else:
                new = RowParallelLinear(child.in_features // tp.size, child.out_features, bias,
                                        tp.group).to(child.weight.device)
            setattr(parent, name, new)


def split_dim(name: str) -> int | None:
    """The dimension along which the parameter `name` (module path + .weight/.bias) is split:
    0 for column-parallel weights and biases and for fused experts (by expert), 1 for
    row-parallel weights, None when whole."""
    parts = name.rsplit(".", 2)
    layer, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
    if layer in COLUMN or (layer == "experts" and kind in EXPERTS):
        return 0
    if layer in ROW and kind == "weight":
        return 1
    return None


def shard_of(name: str, full: torch.Tensor, tp: TPGroup,
             kv_heads: int | None = None) -> torch.Tensor:
    """This rank's slice of the full parameter `name` (`kv_heads`: the model's, for the KV
    projections' split when it has fewer than the group's ranks)."""
    dim = split_dim(name)
    if dim is None:
        return full
    cut = pieces(name, tp.size, kv_heads)
    n = full.shape[dim] // cut
    return full.narrow(dim, tp.rank * cut // tp.size * n, n)


def gather_group_prompts(ids: torch.Tensor, mask: torch.Tensor, pad_id: int, tp: TPGroup
                         ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The group's prompts (every rank's (B_r, P_r), left-padded to the longest), in group rank
    order on every rank of the group, and where this rank's rows start."""
    if tp.size == 1:
        return ids, mask, 0
    parts: list = [None] * tp.size
    tdist.all_gather_object(parts, (ids.cpu(), mask.cpu()), group=tp.group)
    width = max(p[0].shape[1] for p in parts)
    all_ids, all_mask, offset = [], [], 0
    for r, (pi, pm) in enumerate(parts):
        pad = width - pi.shape[1]
        all_ids.append(torch.nn.functional.pad(pi, (pad, 0), value=pad_id))
        all_mask.append(torch.nn.functional.pad(pm, (pad, 0), value=False))
        if r < tp.rank:
            offset += pi.shape[0]
    return (torch.cat(all_ids).to(ids.device), torch.cat(all_mask).to(mask.device), offset)


def group_seed(tp: TPGroup, device: torch.device) -> int:
    """A seed drawn by the group's first rank from its own random stream and shared with the
    group: the ranks of a group sample the same tokens, different groups different ones."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.long)
    if tp.size > 1:
        seed = seed.to(device)
        tdist.broadcast(seed, src=tp.first, group=tp.group)
    return int(seed.item())
