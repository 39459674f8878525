"""Large, long-lived host tensors: exact size, huge pages, pinned by registration.

[Note: host memory]
Optimizer masters, moments and gradient shards are the biggest host buffers
(16 bytes per parameter with CPU offload) and the CPU Adam step streams over
all of them every step. ``torch.empty(..., pin_memory=True)`` serves them from
CUDA's caching host allocator, which (a) rounds every block up to a power of
two, so a 5.4 GB master costs 8 GB of locked memory (about 12 GiB lost at
1.36 B parameters), and (b) maps them in 4 KiB pages. On the H200 machine
(benchmarks/bench_host_memory.py, benchmarks/results/host-memory-h200/) fused CPU AdamW over 1.364e9
elements took 0.317 s on such memory and 0.237 s on memory backed by
transparent huge pages (TLB misses), with the same 55 GB/s copies to and from
the GPU once registered.

So ``host_empty`` maps anonymous memory of exactly the size asked (rounded to
a page), advises huge pages (MADV_HUGEPAGE: the machine's THP mode is
"madvise"), faults it in, and, when pinning is asked and CUDA is present,
registers it with ``cudaHostRegister`` so asynchronous copies work as from
any pinned tensor. The registration is undone when the tensor's storage is
freed: a finalizer on the storage holds the mapping, so unregistering always
happens before the pages are unmapped. Without CUDA the tensor is ordinary
(page-able) huge-page memory.

Only for long-lived buffers (owned by a partitioner, optimizer, store or pool
for the whole run): unlike torch's caching host allocator, nothing here
records CUDA events on a block, so a tensor must not be dropped while an
asynchronous copy still reads or writes it. Every caller keeps its buffers
for the engine's lifetime or reuses them after synchronising.

Every host buffer of the training state is made here (masters, moments, host gradient
shards, host parameter shards, pinned staging and windows), so ``live_bytes`` is what
zeroio holds in host memory now: the bytes of every tensor made here whose storage is
still alive (a finalizer on the storage takes them off). The placement's host rows are
checked against it (tests/test_host_floor.py), not against the process's RSS.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import torch

from zeroio.errors import CapacityError

# Below this, torch's own allocators are as good and registration costs more than it saves.
MIN_BYTES = 1 << 21

_live = [0]  # bytes of the tensors made here whose storage is alive (module note)
_live_lock = threading.Lock()


def live_bytes() -> int:
    """Bytes of the host tensors made here that are still alive (module note)."""
    with _live_lock:
        return _live[0]


def _count(t: torch.Tensor, nbytes: int) -> None:
    with _live_lock:
        _live[0] += nbytes
    weakref.finalize(t.untyped_storage(), _uncount, nbytes)


def _uncount(nbytes: int) -> None:
    with _live_lock:
        _live[0] -= nbytes


def _register(ptr: int, nbytes: int) -> None:
    rc = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
    if rc != 0:
        raise CapacityError(
            f"cudaHostRegister of {nbytes} bytes of host memory failed (cudaError {rc}): the "
            "locked-memory limit (ulimit -l) or free RAM is too small; lower "
            "zero_optimization.tiering.cpu_budget_bytes or set offload_*.pin_memory false")


def _unregister(ptr: int, mm: mmap.mmap) -> None:
    # ``mm`` is an argument only so the mapping outlives the registration (see the note)
    del mm
    torch.cuda.cudart().cudaHostUnregister(ptr)


def host_empty(numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """An uninitialised 1-D host tensor of ``numel`` elements (see [Note: host memory]).
    ``pin``: registered with CUDA for asynchronous copies (a no-op without CUDA)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    pin = pin and torch.cuda.is_available()
    if nbytes < MIN_BYTES:
        t = torch.empty(numel, dtype=dtype, pin_memory=pin)
        _count(t, nbytes)
        return t
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    try:
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise CapacityError(f"could not map {nbytes} bytes of host memory: {e}") from e
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes).view(dtype)
    if pin:
        t.view(torch.uint8)[::mmap.PAGESIZE].zero_()  # fault the pages in before locking them
        _register(t.data_ptr(), nbytes)
        weakref.finalize(t.untyped_storage(), _unregister, t.data_ptr(), mm)
    _count(t, nbytes)
    return t


def host_zeros(numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    return host_empty(numel, dtype, pin=pin).zero_()
