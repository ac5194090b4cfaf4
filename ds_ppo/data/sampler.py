"""The sampler that hands each data-parallel rank its share of every rollout batch, and the
left padding of its prompts for generation."""
from __future__ import annotations

import torch


class PromptSampler:
    """Which prompts each data-parallel rank takes at each iteration; no state to save.

    The stream of prompt indices is the concatenation of one permutation per epoch
    (epoch e shuffled by a ``torch.Generator`` seeded with ``seed + e``; the identity when
    ``shuffle`` is False). Iteration i's global batch is ``stream[i*B:(i+1)*B]``, cut into
    groups of ``group_size`` G (the PPO mini-batch; default B); rank r takes the slice
    ``[r*G/W, (r+1)*G/W)`` of every group, in group order. So mini-batch j (the j-th G/W
    samples of every rank) holds the same prompts for any world size W, and a 1-rank run and a
    2-rank run train on the same mini-batches. Every epoch covers each prompt exactly
    once over all ranks; a batch may straddle an epoch boundary (its tail comes from the next
    epoch's permutation), so no prompt is ever dropped or repeated within an epoch. Resuming
    at iteration i needs nothing but i.
    """

    def __init__(self, num_prompts: int, global_batch_size: int, rank: int, world_size: int,
                 seed: int, shuffle: bool = True, group_size: int | None = None) -> None:
        if num_prompts <= 0:
            raise ValueError(f"num_prompts must be > 0, got {num_prompts}")
        if global_batch_size <= 0 or world_size <= 0:
            raise ValueError(f"global_batch_size ({global_batch_size}) and world_size "
                             f"({world_size}) must be > 0")
        if global_batch_size % world_size:
            raise ValueError(f"global batch size {global_batch_size} is not divisible by the "
                             f"world size {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        self.num_prompts, self.global_batch_size = num_prompts, global_batch_size
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.group_size = group_size or global_batch_size
        if global_batch_size % self.group_size or self.group_size % world_size:
            raise ValueError(f"group size {self.group_size} must divide the global batch size "
                             f"{global_batch_size} and be divisible by the world size "
                             f"{world_size}")
        self.per_rank = global_batch_size // world_size
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # consecutive batches need the last one or two epochs
                self._perms.pop(min(self._perms))
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._perms[epoch] = torch.randperm(self.num_prompts, generator=g).tolist()
            else:
                self._perms[epoch] = list(range(self.num_prompts))
        return self._perms[epoch]

    def _at(self, positions: range) -> list[int]:
        n = self.num_prompts
        return [self._perm(p // n)[p % n] for p in positions]

    def global_indices(self, iteration: int) -> list[int]:
        """The whole global batch of iteration ``iteration``: B prompt indices."""
        b = self.global_batch_size
        return self._at(range(iteration * b, (iteration + 1) * b))

    def indices(self, iteration: int) -> list[int]:
        """This rank's B/W prompt indices of iteration ``iteration`` (0-based)."""
        return self.indices_at(iteration * self.global_batch_size)

    def indices_at(self, position: int) -> list[int]:
        """This rank's B/W prompt indices of the B prompts at ``position`` of the stream, laid
        out as an iteration's (ppo.dynamic_sampling draws rounds of B from a saved position)."""
        g, w = self.group_size, self.world_size
        share = g // w
        out: list[int] = []
        for start in range(position, position + self.global_batch_size, g):
            first = start + self.rank * share
            out.extend(self._at(range(first, first + share)))
        return out


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists for generation.

    Args:
        seqs: B lists of token ids, each non-empty.
        pad_id: the id written into padding positions.

    Returns:
        ``input_ids`` (B, P) long and ``attention_mask`` (B, P) long (1 = real token,
        0 = padding), P = the longest sequence; real tokens are right-aligned.
    """
    if not seqs:
        raise ValueError("left_pad needs at least one sequence")
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        if s:
            input_ids[b, width - len(s):] = torch.tensor(s, dtype=torch.long)
            attention_mask[b, width - len(s):] = 1
    return input_ids, attention_mask
