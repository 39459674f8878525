"""The one owner of zeroio's CUDA streams (tiering/streams.py) and its host <-> device copy.

On CPU the owner hands out None and copies run inline; a fake stream factory checks the
owner's bookkeeping (one stream per role, made once, distinct roles) and that stage 3, the
step assist and the tiered store take their streams from it. The ``gpu`` tests check the
real streams and a copy's ordering behind a delayed kernel.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest
import torch

from zeroio.io.engine import IOArgumentError
from zeroio.partition.stage3 import streams as stage3_streams
from zeroio.shard import assist as assist_mod
from zeroio.testing.cuda import need_cuda
from zeroio.tiering import TieredStore
from zeroio.tiering import streams as S
from zeroio.tiering.backend import MemoryBackend


class _FakeStream:
    def __init__(self, device):
        self.device = device
        self.waits: list[object] = []

    def wait_event(self, event):
        self.waits.append(("event", event))

    def wait_stream(self, other):
        self.waits.append(("stream", other))


def _fake_owner(device=torch.device("cuda", 3)):
    made: list[_FakeStream] = []

    def make(dev):
        made.append(_FakeStream(dev))
        return made[-1]

    return S.DeviceStreams(device, make=make), made


# ---- the owner ----------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU owner: a host without CUDA")
def test_cpu_owner_is_one_object_with_no_streams():
    cpu = S.DeviceStreams.of("cpu")
    assert cpu is S.DeviceStreams.of(torch.device("cpu")) is S.DeviceStreams.of(None)
    assert S.DeviceStreams.of(torch.device("cuda", 0)) is cpu  # no CUDA here: no streams
    assert not cpu.cuda and cpu.current() is None
    assert all(cpu.stream(role) is None for role in S.ROLES)
    assert cpu.comm is None and cpu.assist_up is None and cpu.store_h2d is None


def test_each_role_one_stream_made_on_first_use():
    owner, made = _fake_owner()
    assert made == []  # nothing is created before a role is asked for
    first = owner.side
    assert len(made) == 1 and first.device == torch.device("cuda", 3)
    assert owner.side is first and owner.stream("side") is first and len(made) == 1
    streams = {role: getattr(owner, role) for role in S.ROLES}
    assert len(made) == len(S.ROLES)
    assert len({id(s) for s in streams.values()}) == len(S.ROLES)  # distinct roles: distinct streams
    assert all(owner.stream(role) is s for role, s in streams.items())
    with pytest.raises(ValueError, match="unknown stream role 'h2d'"):
        owner.stream("h2d")


def test_threads_asking_at_once_get_the_same_stream():
    owner, made = _fake_owner()
    got: list[object] = []
    barrier = threading.Barrier(8)

    def ask():
        barrier.wait()
        got.append(owner.comm)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and all(s is made[0] for s in got)


# ---- callers take their streams from the owner --------------------------------------------------

def test_stage3_streams_are_the_owners_roles(monkeypatch):
    assert stage3_streams.Streams.for_device(torch.device("cpu")) == stage3_streams.Streams()
    owner, _ = _fake_owner()
    monkeypatch.setattr(stage3_streams.DeviceStreams, "of", staticmethod(lambda device: owner))
    st = stage3_streams.Streams.for_device(torch.device("cuda", 3))
    assert (st.h2d, st.comm, st.d2h) == (owner.param_h2d, owner.comm, owner.grad_d2h)
    assert len({id(st.h2d), id(st.comm), id(st.d2h)}) == 3
    again = stage3_streams.Streams.for_device(torch.device("cuda", 3))
    assert again.h2d is st.h2d and again.comm is st.comm and again.d2h is st.d2h


def test_step_assist_streams_are_the_owners_roles(monkeypatch):
    owner, made = _fake_owner()
    monkeypatch.setattr(assist_mod.DeviceStreams, "of", staticmethod(lambda device: owner))
    a = assist_mod.StepAssist(torch.device("cuda", 3), host_numel=64)
    assert a.up is owner.assist_up and a.down is owner.assist_down and a.up is not a.down
    assert len(made) == 2


def test_store_without_gpu_tier_has_no_streams():
    with TieredStore(None, backend=MemoryBackend(), prefetch_depth=0,
                     cpu_budget_bytes=1 << 20) as store:
        assert store._mover.streams == {}


# ---- ordering helpers and the copy on CPU -------------------------------------------------------

def test_helpers_are_no_ops_without_a_stream():
    t = torch.arange(4.0)
    assert S.record(None) is None
    S.wait_event(None, object())
    S.wait_stream(None, object())
    S.keep_for(t, None)
    S.keep_for(t, _FakeStream(None))  # a CPU tensor is not the allocator's
    with S.on(None):
        t.add_(1)
    assert torch.equal(t, torch.arange(1.0, 5.0))


def test_waits_are_queued_on_the_waiting_stream():
    waiting, other = _FakeStream(None), _FakeStream(None)
    event = object()
    S.wait_event(waiting, event)
    S.wait_event(waiting, None)  # no event: nothing to wait for
    S.wait_stream(waiting, other)
    S.wait_stream(waiting, None)
    assert waiting.waits == [("event", event), ("stream", other)] and other.waits == []
    with pytest.raises(IOArgumentError, match="after= must be"):
        S.order_after(waiting, 42, torch.device("cuda", 3))
    S.order_after(waiting, None, torch.device("cuda", 3))
    assert len(waiting.waits) == 2


def test_cpu_copies_run_inline_in_issue_order():
    a, b, c = torch.randn(257), torch.empty(257), torch.empty(257)
    h1 = S.copy(a, b, None)
    h2 = S.copy(b, c, None)  # reads what the first copy wrote
    assert h1.event is None and h1.done() and h2.done()
    assert torch.equal(c, a)
    S.copy(torch.zeros(257), c, None)  # a later copy into the same destination wins
    assert torch.equal(c, torch.zeros(257)) and torch.equal(b, a)


def test_copy_helpers_cpu_fallback():
    src = torch.randn(1000)
    dst = torch.empty(1000)
    h = S.copy_to_device(src, dst)
    h.wait()
    h.synchronize()
    assert h.done() and torch.equal(src, dst)
    back = torch.empty(10, 100)  # any shape of the same numel: copies are flat
    S.copy_to_host(dst, back).synchronize()
    assert torch.equal(back.view(-1), src)


def test_copy_helpers_name_mismatches():
    with pytest.raises(IOArgumentError, match="src has 4 elements, dst 5"):
        S.copy_to_device(torch.zeros(4), torch.zeros(5))
    with pytest.raises(IOArgumentError, match="torch.float32 != dst dtype torch.float16"):
        S.copy_to_host(torch.zeros(4), torch.zeros(4, dtype=torch.float16))


# ---- CUDA ---------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_owner_one_per_device_distinct_streams():
    need_cuda(1)
    owner = S.DeviceStreams.of(torch.device("cuda", 0))
    assert owner is S.DeviceStreams.of(0) is S.DeviceStreams.of("cuda:0")
    streams = [owner.stream(role) for role in S.ROLES]
    assert len({s.cuda_stream for s in streams}) == len(S.ROLES)
    assert all(s.device == torch.device("cuda", 0) for s in streams)
    assert torch.cuda.current_stream(0).cuda_stream not in {s.cuda_stream for s in streams}
    st = stage3_streams.Streams.for_device(torch.device("cuda", 0))
    assert (st.h2d, st.comm, st.d2h) == (owner.param_h2d, owner.comm, owner.grad_d2h)


@pytest.mark.gpu
def test_cuda_copy_to_host_waits_for_the_producer():
    """The source is written on the compute stream behind a 50 ms sleep: a copy that did not
    order itself after the compute stream would read the old bytes."""
    need_cuda(1)
    from zeroio.io import AlignedBuffer

    n = 1 << 22
    dev = torch.zeros(n, device="cuda")
    host = AlignedBuffer(n * 4)
    assert host.pinned
    out = host.tensor.view(torch.float32)
    torch.cuda._sleep(50_000_000)
    dev.fill_(7.0)  # queued behind the sleep on the compute stream
    h = S.copy_to_host(dev, out)
    h.synchronize()
    assert torch.equal(out, torch.full((n,), 7.0))
    up = torch.empty(n, device="cuda")
    h = S.copy_to_device(out, up)
    assert h.event is not None
    h.wait()  # the compute stream waits for the copy before reading ``up``
    assert torch.equal(up.cpu(), out)


def test_only_the_owner_creates_streams():
    """tools/check_layers.py's stream rule over the source tree, and tiering's file lengths."""
    path = Path(__file__).resolve().parents[1] / "tools" / "check_layers.py"
    spec = importlib.util.spec_from_file_location("check_layers", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    found = check.check_tree()
    assert [v for v in found if "CUDA stream" in v or v.startswith("zeroio/tiering/")] == []
    bad = check.check_file("zeroio/x.py", "import torch\ns = torch.cuda.Stream()\n")
    assert bad == ["zeroio/x.py:2: creates a CUDA stream (only zeroio/tiering/streams.py)"]
