"""An exponential moving average (EMA) of the policy's weights (policy.ema_decay; DeepSpeed-Chat's
--enable_ema), kept where the policy keeps its weights and never gathered to update it.

After each policy optimizer step, for every trained parameter: ema = d x ema + (1 - d) x param.
Under ZeRO-3 each rank keeps the EMA of its own partition of each parameter (`ds_tensor`, the
slice [rank x s, (rank + 1) x s) of the flattened, padded parameter, s = the partition size), on
the partition's device (CPU with an offloaded policy), in float32: 4 bytes per parameter divided
by the ZeRO group, no communication per step. DeepSpeed-Chat instead gathers every parameter of
the policy and of a second, ZeRO-3-sharded EMA model at each step (`moving_average`); here the
update is local, one fused lerp over the rank's partitions. Without ZeRO-3 (stages 0-2) every
rank holds the whole parameter and so the whole EMA.

`swapped_in()` puts the EMA into the parameters' local storage (and puts the weights back
after): an export or an evaluation inside it sees the EMA model through the ordinary ZeRO-3
gathers. Checkpoints hold each rank's pieces with their offsets in the flattened parameter, so a
resume on the same ranks is exact and one on another world size re-cuts the pieces.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import torch

from ds_ppo.engine import dist

log = logging.getLogger("ds_ppo")


def _local(p: torch.nn.Parameter) -> torch.Tensor:
    """This rank's storage of a parameter: its ZeRO-3 partition (flat), else the whole weight."""
    ds_tensor = getattr(p, "ds_tensor", None)
    return ds_tensor if ds_tensor is not None else p.data


def _offset(p: torch.nn.Parameter) -> int:
    """Where this rank's storage starts in the flattened parameter (0 without ZeRO-3)."""
    if getattr(p, "ds_tensor", None) is None:
        return 0
    import torch.distributed as tdist

    group = getattr(p, "ds_process_group", None)
    return tdist.get_rank(group=group) * p.ds_tensor.numel() if tdist.is_initialized() else 0


def _numel(p: torch.nn.Parameter) -> int:
    """The full parameter's element count (ZeRO-3 keeps it in ds_numel)."""
    return int(getattr(p, "ds_numel", p.numel()))


class ParamEMA:
    """The EMA of a module's trained parameters on this rank (module docstring)."""

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shadow: list[torch.Tensor] = []
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        """The EMA := the current weights (at the start, as DeepSpeed-Chat copies the actor)."""
        self.shadow = [_local(p).detach().float().clone() for p in self.params]

    def numel(self) -> int:
        """Elements this rank keeps (its partitions; 4 bytes each)."""
        return sum(s.numel() for s in self.shadow)

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: ema += (1 - decay) x (param - ema), on every rank's own
        storage (no communication)."""
        current = [_local(p).float() for p in self.params]
        torch._foreach_lerp_(self.shadow, current, 1.0 - self.decay)

    @torch.no_grad()
    def distance(self) -> float:
        """||EMA - weights||_2 over all trained parameters (collective: the ZeRO-3 partitions'
        squares are summed over the ranks, a padded partition's tail left out)."""
        partitioned = torch.zeros((), dtype=torch.float64)
        whole = 0.0
        for p, s in zip(self.params, self.shadow):
            diff = (s.view(-1) - _local(p).view(-1).float())
            if getattr(p, "ds_tensor", None) is None:
                whole += float(diff.double().pow(2).sum())
                continue
            valid = max(0, min(diff.numel(), _numel(p) - _offset(p)))
            partitioned += diff[:valid].double().pow(2).sum().cpu()
        if any(getattr(p, "ds_tensor", None) is not None for p in self.params):
            # ZeRO partitions over every rank, also those of a sequence-parallel group
            partitioned = dist.all_reduce_sum(partitioned, over_world=True)
        return (float(partitioned) + whole) ** 0.5

    @contextmanager
    def swapped_in(self):
        """The EMA in place of the weights for the body (collective only in what the body
        does); the weights, bit-exact, afterwards. No optimizer step may run inside."""
        saved = [_local(p).detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.shadow):
                _local(p).copy_(s)
        _refresh_gathered(self.params)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, w in zip(self.params, saved):
                    _local(p).copy_(w)
            _refresh_gathered(self.params)

    # --------------------------------------------------------------------- checkpoints
    def save(self, directory: Path) -> None:
        """This rank's pieces into directory/rank_NNNNN.pt (the directory must exist)."""
        state = {}
        for name, p, s in zip(self.names, self.params, self.shadow):
            state[f"ema.{name}"] = s
            state[f"at.{name}"] = torch.tensor([_offset(p), _numel(p)], dtype=torch.int64)
        torch.save(state, directory / f"rank_{dist.rank():05d}.pt")

    def load(self, directory: Path, same_world: bool) -> None:
        """Restore from `save`'s files: this rank's own file when the world size is the same,
        else this rank's slices cut from every saved piece (files memory-mapped)."""
        files = [directory / f"rank_{dist.rank():05d}.pt"] if same_world else \
            sorted(directory.glob("rank_*.pt"))
        if not files or not files[0].exists():
            raise FileNotFoundError(directory / f"rank_{dist.rank():05d}.pt")
        states = [torch.load(f, weights_only=True, mmap=True, map_location="cpu")
                  for f in files]
        with torch.no_grad():
            for name, p, s in zip(self.names, self.params, self.shadow):
                if f"ema.{name}" not in states[0]:
                    raise KeyError(f"{name} has no EMA in {directory}")
                _fill(s, _offset(p), _numel(p), [(int(st[f"at.{name}"][0]), st[f"ema.{name}"])
                                                 for st in states])


def _refresh_gathered(params: list[torch.nn.Parameter]) -> None:
    """After a write into ZeRO-3 partitions: parameters whose whole copy is materialised (those
    below stage3_param_persistence_threshold stay gathered between steps, as the optimizer
    re-gathers them after its step) are released and the persistent ones gathered again from
    the new partitions. Collective under ZeRO-3 (every rank holds the same parameters)."""
    partitioned = [p for p in params if getattr(p, "ds_tensor", None) is not None]
    if not partitioned:  # no ZeRO-3: the weights are the storage
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    stale = [p for p in partitioned if p.ds_status == ZeroParamStatus.AVAILABLE]
    if not stale:
        return
    stale[0].partition(stale)  # frees each whole copy, keeps the partitions
    persistent = [p for p in stale if getattr(p, "ds_persist", False)]
    if persistent:
        persistent[0].all_gather(persistent)


def _fill(target: torch.Tensor, start: int, numel: int,
          pieces: list[tuple[int, torch.Tensor]]) -> None:
    """Copy into `target` (flat view of this rank's storage, starting at `start` of the flattened
    parameter of `numel` elements) the overlapping parts of saved `pieces` (offset, tensor)."""
    flat = target.view(-1)
    end = min(start + flat.numel(), numel)
    for offset, piece in pieces:
        piece = piece.reshape(-1)
        lo, hi = max(start, offset), min(end, offset + piece.numel())
        if lo < hi:
            flat[lo - start:hi - start].copy_(piece[lo - offset:hi - offset])
