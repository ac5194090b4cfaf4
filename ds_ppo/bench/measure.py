"""Measurements of `ds-ppo bench`: wall time and peak memory of a phase (device synchronised),
the device's own matmul peak (the MFU denominator), torch.compile's graph count, and what the run
ran on (device, versions)."""
from __future__ import annotations

import os
import platform
import sys
import time
from contextlib import contextmanager


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def measured(device, into: dict):
    """Wall seconds (device synchronised) and, on CUDA, the peak allocated memory in GiB."""
    import torch

    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    yield into
    _sync(device)
    into["seconds"] = time.perf_counter() - t0
    into["peak_mem_gib"] = (torch.cuda.max_memory_allocated(device) / 2**30
                            if device.type == "cuda" else None)


def measure_peak_tflops(device, dtype, size: int | None = None, reps: int = 10) -> float:
    """TFLOP/s of a (size x size) @ (size x size) matmul in `dtype`: the MFU denominator.
    8192 on a GPU (~1.1 TFLOP per product), 1024 on a CPU."""
    import torch

    size = size or (8192 if device.type == "cuda" else 1024)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    seconds = (time.perf_counter() - t0) / reps
    return 2 * size**3 / seconds / 1e12


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (0 if it never ran)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


def device_info(device) -> dict:
    """The device the run ran on: its name and memory (CUDA) or cores and threads (CPU)."""
    import torch

    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device),
                "memory_gib": torch.cuda.get_device_properties(device).total_memory / 2**30}
    return {"type": "cpu", "name": f"CPU ({os.cpu_count()} cores, {platform.machine()})",
            "threads": torch.get_num_threads()}


def versions() -> dict:
    """Python's version and those of the packages the numbers depend on (None: not installed)."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "deepspeed", "ds-ppo"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out
