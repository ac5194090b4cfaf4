"""SIGTERM gives up the waits on user code at once (ds_ppo.abandon): a reward function's call, a
reward service's requests and environment calls, in-process; the run's exit is
tests/dist/test_preemption.py's."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ds_ppo import abandon
from ds_ppo.envs.runner import run_calls
from ds_ppo.rewards.call import call_reward_function
from ds_ppo.run.preemption import Preempted, StopRequests, abandoned


@pytest.fixture(autouse=True)
def _no_request_left():
    yield
    abandon.clear()


def hangs(*args, **kwargs):
    threading.Event().wait()


def _request_in(seconds: float) -> None:
    threading.Timer(seconds, abandon.request, args=(signal.SIGTERM,)).start()


def test_a_hung_reward_call_is_given_up_at_once_not_after_its_timeout():
    _request_in(0.3)
    t0 = time.monotonic()
    with pytest.raises(abandon.Abandoned) as e:
        call_reward_function(hangs, "m:hangs", ["p"], ["r"], {}, timeout_s=600)
    assert time.monotonic() - t0 < 2
    assert (e.value.signum, e.value.phase) == (signal.SIGTERM, "reward call")


def test_a_reward_call_started_after_the_request_is_given_up_too():
    abandon.request(signal.SIGTERM)
    with pytest.raises(abandon.Abandoned):
        call_reward_function(hangs, "m:hangs", ["p"], ["r"], {}, timeout_s=600)


def test_a_reward_service_gives_its_requests_up():
    """reward.url (and env.url): the requests run in threads the call waits on."""
    from ds_ppo.rewards.service import RewardService

    service = RewardService("http://127.0.0.1:9/score", timeout_s=600)
    service._post = lambda *args: hangs()
    _request_in(0.3)
    t0 = time.monotonic()
    with pytest.raises(abandon.Abandoned) as e:
        call_reward_function(service, service.shown, ["p"], ["r"], {}, timeout_s=None)
    assert time.monotonic() - t0 < 2 and e.value.phase == "reward call"


def test_hung_environment_calls_are_given_up():
    _request_in(0.3)
    t0 = time.monotonic()
    with pytest.raises(abandon.Abandoned) as e:
        run_calls([hangs, lambda: 1], 1, None, "env.function = 'm:f'", str)
    assert time.monotonic() - t0 < 2 and e.value.phase == "environment step"


def test_without_a_request_the_waits_run_to_the_end():
    assert call_reward_function(lambda p, r: [1.0], "m:f", ["p"], ["r"], {}, 600) == [1.0]
    assert run_calls([lambda: 1, lambda: 2], 1, 5, "env", str) == [1, 2]


def test_sigterm_requests_the_stop_sigusr1_does_not():
    """SIGTERM comes with a short grace period; SIGUSR1 is an advance notice: the iteration
    finishes, reward calls and decodes included. The request ends with the handlers."""
    with StopRequests() as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.signum == signal.SIGUSR1 and not abandon.requested()
    with StopRequests() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert abandon.requested() == signal.SIGTERM
    assert not abandon.requested()
    with StopRequests() as stop:  # the advance notice, then the kill's own warning
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGUSR1 and abandon.requested() == signal.SIGTERM


def test_the_abandoned_run_names_the_phase_and_its_resume_point():
    e = abandoned(abandon.Abandoned(signal.SIGTERM, "reward call"), 6, "out/checkpoints/iter_6")
    assert isinstance(e, Preempted) and e.exit_code == 143
    assert str(e).startswith("SIGTERM during reward call: abandoned; resume from checkpoint "
                             "iteration 6 (out/checkpoints/iter_6)")
    assert "starts the run over" in str(abandoned(abandon.Abandoned(15, "generation"), 0, None))
