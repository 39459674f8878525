"""zeroio.io.hostmem: exact-size huge-page host tensors, registered with CUDA and unregistered
only after the last view of the storage is gone (CUDA calls recorded by fakes on CPU)."""

import gc
import mmap

import pytest
import torch

from zeroio.io import hostmem
from zeroio.io.buffers import ALIGN, AlignedBuffer


def test_large_tensor_is_exact_page_aligned_and_usable():
    n = (3 << 20) + 5  # not a power of two, not a page multiple
    t = hostmem.host_empty(n, torch.float32, pin=False)
    assert t.shape == (n,) and t.dtype == torch.float32 and t.device.type == "cpu"
    assert t.data_ptr() % mmap.PAGESIZE == 0
    ref = torch.arange(n, dtype=torch.float32)
    t.copy_(ref)
    assert torch.equal(t, ref)
    z = hostmem.host_zeros(n, torch.bfloat16, pin=False)
    assert z.dtype == torch.bfloat16 and not z.any()


def test_small_tensor_uses_torch_allocator():
    t = hostmem.host_empty(10, torch.float32, pin=False)
    assert t.shape == (10,)


def test_view_keeps_memory_alive_after_base_is_dropped():
    t = hostmem.host_zeros(1 << 20, torch.float32, pin=False)
    v = t[100:200]
    del t
    gc.collect()
    v.fill_(3.0)  # would fault if the mapping were gone
    assert float(v.sum()) == 300.0


def test_registration_lasts_exactly_as_long_as_the_storage(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hostmem, "_register", lambda ptr, nbytes: calls.append(("reg", ptr, nbytes)))
    monkeypatch.setattr(hostmem, "_unregister", lambda ptr, mm: calls.append(("unreg", ptr)))
    n = 1 << 20
    t = hostmem.host_empty(n, torch.float32, pin=True)
    ptr = t.data_ptr()
    assert calls == [("reg", ptr, n * 4)]
    view = t[5:]
    del t
    gc.collect()
    assert calls == [("reg", ptr, n * 4)], "unregistered while a view still uses the memory"
    del view
    gc.collect()
    assert calls == [("reg", ptr, n * 4), ("unreg", ptr)]


def test_register_failure_names_the_fix(monkeypatch):
    class FakeCudart:
        @staticmethod
        def cudaHostRegister(ptr, nbytes, flags):
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart)
    with pytest.raises(hostmem.CapacityError, match="cpu_budget_bytes|pin_memory"):
        hostmem.host_empty(1 << 20, torch.float32, pin=True)


def test_aligned_buffer_from_hostmem_is_exact():
    b = AlignedBuffer(5 << 20, pin=False)
    assert b.capacity == 5 << 20 and b.full.data_ptr() % ALIGN == 0
    b.tensor.fill_(7)
    assert int(b.tensor[-1]) == 7
