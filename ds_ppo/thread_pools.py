"""The process's long-lived worker threads: one pool per purpose and size, made on first use and
kept for the process (a run makes its calls through them iteration after iteration; creating
threads per rollout would cost more than the calls it overlaps)."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

_POOLS: dict[tuple[str, int], ThreadPoolExecutor] = {}
_LOCK = threading.Lock()


def shared_pool(name: str, size: int) -> ThreadPoolExecutor:
    """The pool of `size` threads named ds_ppo-<name>, the same object on every call (safe from
    any thread)."""
    with _LOCK:
        key = (name, size)
        if key not in _POOLS:
            _POOLS[key] = ThreadPoolExecutor(size, thread_name_prefix=f"ds_ppo-{name}")
        return _POOLS[key]
