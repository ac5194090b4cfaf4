"""The worker's CUDA stream hand-offs (engine/side_stream.py), checked against a stand-in for
torch.cuda that records what is called on which stream, in order; and the no-op on a CPU."""
import threading
from dataclasses import dataclass

import torch

from ds_ppo.engine.side_stream import SideStream


class _FakeCuda:
    """torch.cuda's stream API as SideStream uses it, logging every call."""

    def __init__(self):
        self.log, self.local = [], threading.local()
        self.default = _Stream(self, "default")

    def Stream(self, device):  # noqa: N802 (torch.cuda.Stream)
        return _Stream(self, "side", device)

    def current_stream(self, device=None):
        return getattr(self.local, "stream", self.default)

    def stream(self, s):
        cuda = self

        class _Ctx:
            def __enter__(self):
                cuda.local.stream = s

            def __exit__(self, *exc):
                cuda.local.stream = cuda.default
        return _Ctx()


class _Stream:
    def __init__(self, cuda, name, device=None):
        self.cuda, self.name, self.device = cuda, name, device

    def record_event(self):
        self.cuda.log.append(("record", self.name))
        return ("event", self.name, len(self.cuda.log))

    def wait_event(self, event):
        self.cuda.log.append(("wait", self.name, event))

    def synchronize(self):
        self.cuda.log.append(("synchronize", self.name))


class _CudaTensor:
    """A tensor that says it is on a GPU and logs record_stream."""

    def __init__(self, cuda, name):
        self.cuda, self.name, self.device = cuda, name, torch.device("cuda")

    def record_stream(self, stream):
        self.cuda.log.append(("record_stream", self.name, stream.name))


def test_worker_waits_for_the_training_stream_and_finishes_before_handing_back():
    cuda = _FakeCuda()
    side = SideStream(torch.device("cuda", 0), cuda=cuda)
    side.handoff()  # training thread, after the weight sync
    event = side.ready
    seen = {}

    def work(x):
        seen["stream"] = cuda.current_stream().name
        cuda.log.append(("work", x))
        return x + 1

    out = []
    t = threading.Thread(target=lambda: out.append(side.run(work, 41)))
    t.start()
    t.join()
    assert out == [42] and seen["stream"] == "side"
    assert cuda.log == [("record", "default"), ("wait", "side", event), ("work", 41),
                        ("synchronize", "side")]
    assert cuda.current_stream().name == "default"  # the training thread's stream unchanged


def test_taken_rollouts_tensors_are_marked_used_by_the_training_stream():
    cuda = _FakeCuda()
    side = SideStream(torch.device("cuda", 0), cuda=cuda)

    @dataclass
    class Inner:
        ids: object
        note: str = "x"

    @dataclass
    class Outer:
        inner: Inner
        many: list
        nothing: object = None

    a, b, c = (_CudaTensor(cuda, n) for n in "abc")
    side.adopt(Outer(Inner(a), [b, (c, 3)]), None)
    assert sorted(cuda.log) == [("record_stream", n, "default") for n in "abc"]


def test_on_a_cpu_every_step_is_a_no_op():
    side = SideStream(torch.device("cpu"))
    assert side.stream is None
    side.handoff()
    assert side.run(lambda x: x * 2, 4) == 8
    side.adopt(torch.zeros(2))  # no record_stream on a CPU tensor
