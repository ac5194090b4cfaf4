"""Tensor-parallel generation replica (`generation.mode=tensor_parallel`), for policies whose
16-bit copy does not fit one device (a 70B model is 140 GB in bf16).

`tp_size` consecutive ranks (by default the GPUs of one node) hold one replica between them:
Megatron-style sharding of each decoder layer's linear layers, everything else replicated.

- column-parallel (output features split): q_proj, k_proj, v_proj (whole heads: query and KV
  heads split alike, so each rank's query heads find their KV heads locally), gate_proj, up_proj;
- row-parallel (input features split, partial outputs summed by an all-reduce): o_proj,
  down_proj;
- replicated: embeddings, norms, the output head.

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

from ds_ppo.engine.generation.choice import COLUMN, ROW  # the layers split, and which way


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


def shard_modules(model: torch.nn.Module, tp: TPGroup) -> None:
    """Replace the sharded linear layers of a (meta-device) model with their shard-sized
    versions, in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, torch.nn.Linear) or name not in COLUMN + ROW:
                continue
            bias = child.bias is not None
            if name in COLUMN:
                new = torch.nn.Linear(child.in_features, child.out_features // tp.size,
                                      bias=bias, device=child.weight.device)
            else:
                new = RowParallelLinear(child.in_features // tp.size, child.out_features, bias,
                                        tp.group).to(child.weight.device)
            setattr(parent, name, new)


def split_dim(name: str) -> int | None:
    """The dimension along which the parameter `name` (module path + .weight/.bias) is split:
    0 for column-parallel weights and biases, 1 for row-parallel weights, None when whole."""
    parts = name.rsplit(".", 2)
    layer, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
    if layer in COLUMN:
        return 0
    if layer in ROW and kind == "weight":
        return 1
    return None


def shard_of(name: str, full: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's slice of the full parameter `name`."""
    dim = split_dim(name)
    if dim is None:
        return full
    n = full.shape[dim] // tp.size
    return full.narrow(dim, tp.rank * n, n)


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
