"""Tiled MLP (policy.tiled_mlp / value.tiled_mlp): DeepSpeed ALST's `TiledMLP` on every gated MLP
of a model, for the update's forwards.

A gated MLP's intermediates are (B, L, intermediate) tensors, several of them (gate, up, the
activation, their product): for a 32k-token row of an 8B Llama (intermediate 14336) about 0.9
GiB each in bf16, alive together in the recomputation of a checkpointed layer. TiledMLP runs the
MLP on slices of about hidden_size tokens under no_grad and recomputes each slice in backward
(Bekman et al. 2025), so only one slice's intermediates exist at a time; the price is one more
MLP forward per layer.

Only training forwards are tiled (grad enabled and the module in train mode: the update); scoring
and generation keep the plain MLP. Under ZeRO-3 every rank must call the MLP's linear layers the
same number of times (each call gathers their weights), so the ranks agree on the slice count
(the largest any needs: one all-reduce per MLP call).
"""
from __future__ import annotations

import math
import types

import torch

_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def _mlp(self, x: torch.Tensor) -> torch.Tensor:
    """The gated MLP of Llama, Mistral, Qwen2 and their kin: down(act(gate(x)) * up(x))."""
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _tiled_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not (torch.is_grad_enabled() and self.training):
        return _mlp(self, x)
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    shards = math.ceil(x.shape[-2] / x.shape[-1])  # slices of about hidden_size tokens
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        count = torch.tensor([float(shards)], device=x.device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        shards = int(count.item())
    params = [p for name in _PARTS[:3] for p in getattr(self, name).parameters()]
    return TiledMLP.apply(_mlp, self, x, max(1, shards), params)


def tile_mlps(model: torch.nn.Module) -> int:
    """Route every gated MLP of `model` (a module with gate_proj, up_proj, down_proj and act_fn)
    through TiledMLP in training forwards; returns how many. Raises ValueError when the model
    has none (another MLP layout: the option cannot apply)."""
    count = 0
    for module in model.modules():
        if all(hasattr(module, part) for part in _PARTS):
            module.forward = types.MethodType(_tiled_forward, module)
            count += 1
    if count == 0:
        raise ValueError(f"tiled_mlp: {type(model).__name__} has no gated MLP (gate_proj, "
                         "up_proj, down_proj, act_fn) to tile")
    return count
