"""A dispatch mode that records the largest tensor any operation creates (forward and backward):
the check that tiled log-probs never materialise (B, T, V) logits."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LargestTensor(TorchDispatchMode):
    """`with LargestTensor() as seen: ...` then `seen.numel`: the most elements of one tensor
    returned by any aten operation inside the block (views included)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out
