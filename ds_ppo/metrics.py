"""Metrics of an iteration, reduced across the data-parallel group before anyone logs them.

Three kinds, so that a logged number describes the whole job and not rank 0's shard:
- mean:       (sum, count) pairs summed over ranks, reported as sum / count (token- or
              sequence-weighted global means);
- max:        the largest value over ranks (memory, seconds);
- sum:        summed over ranks (token counts);
- replicated: already identical on every rank (e.g. a loss all-reduced per step); averaged
              over the calls made on one rank.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch

from ds_ppo.engine import dist


class Accumulator:
    def __init__(self) -> None:
        self._sum: dict[str, float] = defaultdict(float)
        self._count: dict[str, float] = defaultdict(float)
        self._max: dict[str, float] = {}
        self._rep: dict[str, list[float]] = defaultdict(list)
        self._total: dict[str, float] = defaultdict(float)

    def add_sum(self, name: str, value: float) -> None:
        self._total[name] += float(value)

    def add_mean(self, name: str, total: float, count: float) -> None:
        self._sum[name] += float(total)
        self._count[name] += float(count)

    def add_tensor_mean(self, name: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add every (masked) element of x to a global mean."""
        if mask is None:
            self.add_mean(name, float(x.float().sum()), x.numel())
        else:
            self.add_mean(name, float((x.float() * mask).sum()), float(mask.sum()))

    def add_max(self, name: str, value: float) -> None:
        self._max[name] = max(self._max.get(name, -math.inf), float(value))

    def add_replicated(self, name: str, value: float) -> None:
        self._rep[name].append(float(value))

    def reduce(self) -> dict[str, float]:
        """Collective: every rank must call it, with the same metric names in the same order."""
        names, totals = sorted(self._sum), sorted(self._total)
        packed = torch.tensor([self._sum[n] for n in names] + [self._count[n] for n in names]
                              + [self._total[n] for n in totals], dtype=torch.float64)
        packed = dist.all_reduce_sum(packed)
        out: dict[str, float] = {}
        k = len(names)
        for i, n in enumerate(totals):
            out[n] = packed[2 * k + i].item()
        for i, n in enumerate(names):
            c = packed[k + i].item()
            out[n] = packed[i].item() / c if c > 0 else math.nan
        max_names = sorted(self._max)
        if max_names:
            m = dist.all_reduce_max(torch.tensor([self._max[n] for n in max_names],
                                                 dtype=torch.float64))
            out.update({n: m[i].item() for i, n in enumerate(max_names)})
        out.update({n: sum(v) / len(v) for n, v in self._rep.items()})
        return out


def std_from_moments(mean: float, mean_sq: float) -> float:
    return math.sqrt(max(mean_sq - mean * mean, 0.0))
