"""Model states per rank and per node (weights, gradients, optimizer state) of trained and frozen
roles: DeepSpeed's ZeRO estimators, reproduced term by term."""
from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30
BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor for CPU memory


@dataclass(frozen=True)
class ModelStates:
    """One role's model states under its ZeRO stage and offload."""

    gpu_bytes_per_rank: int  # DeepSpeed's per-GPU figure: resident partition + gather buffer
    gather_bytes: int  # the largest-layer gather buffer (only while the role runs)
    cpu_bytes_per_node: int

    @property
    def resident_bytes(self) -> int:
        """Bytes that stay on each GPU between the role's forward/backward passes."""
        return self.gpu_bytes_per_rank - self.gather_bytes


def zero3_train_states(total_params: int, largest_layer_params: int, num_gpus_per_node: int,
                       num_nodes: int, offload_optimizer: bool, offload_param: bool,
                       zero_init: bool = True,
                       additional_buffer_factor: float = BUFFER_FACTOR) -> ModelStates:
    """ZeRO-3 model states of a trained role, as DeepSpeed's
    estimate_zero3_model_states_mem_needs computes them (same expressions, same rounding).

    Param offload without optimizer offload, which that estimator does not model, keeps the
    16 bytes/param of optimizer state and gradients on the GPU and the 2 of weights on CPU.
    """
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params  # 16-bit weights + 16-bit grads of it
    if offload_optimizer:
        if offload_param:
            gpu_mem = largest_layer_memory
            per_param = 18
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            per_param = 16
        if zero_init:
            cpu_mem = total_params * per_param * gpus_factor * additional_buffer_factor
        else:
            cpu_mem = (total_params * max(4 * num_gpus_per_node, per_param * gpus_factor)
                       * additional_buffer_factor)
    elif offload_param:
        gpu_mem = largest_layer_memory + int(16 * total_params / total_gpus)
        cpu_mem = total_params * 2 * gpus_factor * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return ModelStates(int(gpu_mem), largest_layer_memory, int(cpu_mem))


def train_states(params: int, largest: int, gpus_per_node: int, nodes: int, zero_stage: int,
                 offload_optimizer: bool, offload_param: bool) -> ModelStates:
    """Model states of a trained role (16-bit weights, fp32 AdamW) under any ZeRO stage."""
    if zero_stage == 3:
        return zero3_train_states(params, largest, gpus_per_node, nodes, offload_optimizer,
                                  offload_param)
    total_gpus = nodes * gpus_per_node
    # Per param: 2 weights16 + 2 grads16 + 4 grads32 + 4 master32 + 8 Adam = 20 bytes, the
    # split DeepSpeed's estimate_zero2_model_states_mem_needs documents.
    if zero_stage == 2 or (zero_stage == 1 and offload_optimizer):
        if offload_optimizer:
            return ModelStates(2 * params, 0,
                               int(params * max(4 * total_gpus, 16) * BUFFER_FACTOR))
        gpu = 2 * params + int(18 * params / total_gpus)
    elif zero_stage == 1:  # optimizer states and fp32 copies partitioned, 16-bit grads not
        gpu = 4 * params + int(16 * params / total_gpus)
    else:
        gpu = 20 * params
    return ModelStates(gpu, 0, int(params * 4 * gpus_per_node * BUFFER_FACTOR))


def inference_states(params: int, largest: int, gpus_per_node: int, nodes: int, zero_stage: int,
                     offload_param: bool) -> ModelStates:
    """Model states of a frozen role: 16-bit weights only, partitioned under ZeRO-3."""
    total_gpus = nodes * gpus_per_node
    if zero_stage < 3:  # ZeRO 1/2 partition nothing of a model without an optimizer
        return ModelStates(2 * params, 0, int(params * 2 * gpus_per_node * BUFFER_FACTOR))
    gather = 2 * largest
    if offload_param:
        return ModelStates(gather, gather, int(params * 2 / nodes * BUFFER_FACTOR))
    return ModelStates(gather + int(2 * params / total_gpus), gather,
                       int(largest * 2 * gpus_per_node * BUFFER_FACTOR))
