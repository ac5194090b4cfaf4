"""The process's long-lived worker pools: one per purpose and size, whoever asks first."""
from concurrent.futures import ThreadPoolExecutor

from ds_ppo.ppo import reward_stream
from ds_ppo.thread_pools import shared_pool


def test_one_pool_per_name_and_size_even_when_threads_race():
    with ThreadPoolExecutor(8) as racers:
        got = list(racers.map(lambda _: shared_pool("test-race", 3), range(64)))
    assert all(p is got[0] for p in got)
    assert shared_pool("test-race", 2) is not got[0]
    assert shared_pool("test-other", 3) is not got[0]
    assert got[0].submit(lambda: 7).result() == 7


def test_reward_calls_reuse_the_process_pool():
    assert reward_stream._pool(2) is reward_stream._pool(2) is shared_pool("reward-stream", 2)
