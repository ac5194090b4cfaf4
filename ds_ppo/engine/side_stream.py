"""The colocated placement's generation stream (docs/ASYNC.md): on a GPU the background worker's
decoding runs on a CUDA stream of its own, so its kernels overlap the training thread's scoring
and update instead of queueing behind them on the default stream. On a CPU every step is a
no-op.

The hand-offs, in order:
- `handoff` (training thread, after the weight sync): an event on the training stream; the
  worker's stream waits for it, so the replica's new weights, and every use of tensors freed
  before it, come first;
- `run` (worker thread): the worker's code on the side stream, which is synchronized before
  `run` returns, so what it gives back is complete;
- `adopt` (training thread, on taking a rollout): each of its tensors is marked as used by the
  training stream (`record_stream`), so the caching allocator does not hand its memory back to
  the worker's stream while a queued training kernel still reads it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


class SideStream:
    """One worker's CUDA stream and the event it waits for (no-ops off CUDA). `cuda` is the
    torch.cuda namespace (a stand-in in the tests)."""

    def __init__(self, device: torch.device, cuda=torch.cuda) -> None:
        self.cuda = cuda
        self.stream = cuda.Stream(device=device) if device.type == "cuda" else None
        self.ready = None  # the training stream's event the next `run` waits for

    def handoff(self) -> None:
        """Training thread: what is queued on its stream so far comes before the next `run`."""
        if self.stream is not None:
            self.ready = self.cuda.current_stream(self.stream.device).record_event()

    def run(self, fn: Callable[..., Any], *args) -> Any:
        """Worker thread: `fn(*args)` on the side stream, after the last `handoff`; its results
        complete on return."""
        if self.stream is None:
            return fn(*args)
        with self.cuda.stream(self.stream):
            if self.ready is not None:
                self.stream.wait_event(self.ready)
            out = fn(*args)
        self.stream.synchronize()
        return out

    def adopt(self, *values) -> None:
        """Training thread: the tensors in `values` (tensors, dataclasses holding them, lists
        of either) are used on its stream from now on."""
        if self.stream is None:
            return
        current = self.cuda.current_stream(self.stream.device)
        for t in _tensors(values):
            if t.device.type == "cuda":
                t.record_stream(current)


def _tensors(value) -> list[torch.Tensor]:
    """The tensors inside `value`: itself, a dataclass's fields, a list's or tuple's items
    (a tensor: whatever has record_stream)."""
    if hasattr(value, "record_stream"):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in _tensors(getattr(value, f.name))]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
