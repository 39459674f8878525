"""Page-aligned host buffers and a pool with a hard byte budget.

[Note: alignment] O_DIRECT needs the memory address, the file offset and the
length of every request to be multiples of the logical block size. 4096 covers
every NVMe and filesystem we target, so every ``AlignedBuffer`` starts on a
4096-byte boundary and its capacity is rounded up to a multiple of 4096.

[Note: budget] ``BufferPool`` never holds more than ``budget_bytes`` of buffer
capacity, counting buffers handed out *and* buffers cached for reuse. A request
that cannot fit waits (first come, first served, so a large request is not
starved by small ones); a request larger than the whole budget fails at once
with ``CapacityError`` because no amount of waiting would satisfy it.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from zeroio.errors import CapacityError
from zeroio.io.hostmem import host_empty

ALIGN = 4096


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def _pin_available() -> bool:
    return torch.cuda.is_available()


class AlignedBuffer:
    """``nbytes`` of 4096-aligned host memory (pinned when CUDA is present).

    ``tensor`` is a uint8 view of exactly ``nbytes``; ``capacity`` (a multiple
    of 4096) is what the allocation really holds, so an O_DIRECT request may
    round the tail up into it.
    """

    __slots__ = ("nbytes", "capacity", "pinned", "_raw", "_full")

    def __init__(self, nbytes: int, *, pin: bool | None = None):
        if nbytes < 0:
            raise CapacityError(f"AlignedBuffer: nbytes must be >= 0, got {nbytes}")
        self.nbytes = int(nbytes)
        self.capacity = max(round_up(self.nbytes), ALIGN)
        self.pinned = _pin_available() if pin is None else bool(pin)
        # hostmem maps large buffers page aligned and exactly sized (no power-of-two rounding,
        # see zeroio.io.hostmem); a small one from torch's allocators may come back unaligned
        # (the CPU allocator aligns to 64 bytes): then over-allocate one page and slice.
        raw = host_empty(self.capacity, torch.uint8, pin=self.pinned)  # page aligned when large
        if raw.data_ptr() % ALIGN:
            raw = torch.empty(self.capacity + ALIGN, dtype=torch.uint8, pin_memory=self.pinned)
        skip = (-raw.data_ptr()) % ALIGN
        self._raw = raw
        self._full = raw[skip : skip + self.capacity]

    @property
    def tensor(self) -> torch.Tensor:
        """uint8 view of the first ``nbytes`` bytes."""
        return self._full[: self.nbytes]

    @property
    def full(self) -> torch.Tensor:
        """uint8 view of the whole ``capacity`` (for rounded-up O_DIRECT I/O)."""
        return self._full

    def data_ptr(self) -> int:
        return self._full.data_ptr()

    def view(self, dtype: torch.dtype, numel: int | None = None) -> torch.Tensor:
        """The first ``numel`` elements of ``dtype`` (default: as many as fit in nbytes)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel is None:
            numel = self.nbytes // itemsize
        need = numel * itemsize
        if need > self.capacity:
            raise CapacityError(
                f"AlignedBuffer.view: {numel} x {dtype} needs {need} bytes, "
                f"buffer capacity is {self.capacity}"
            )
        return self._full[:need].view(dtype)

    def resize(self, nbytes: int) -> None:
        """Reuse for a request of ``nbytes`` <= capacity (used by the pool)."""
        if nbytes > self.capacity:
            raise CapacityError(f"AlignedBuffer.resize: {nbytes} > capacity {self.capacity}")
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"AlignedBuffer(nbytes={self.nbytes}, capacity={self.capacity}, pinned={self.pinned})"


class BufferPool:
    """Aligned buffers under a hard budget; see [Note: budget]."""

    def __init__(self, budget_bytes: int, *, pin: bool | None = None):
        if budget_bytes <= 0:
            raise CapacityError(f"BufferPool: budget_bytes must be > 0, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self._pin = pin
        self._cond = threading.Condition()
        self._free: dict[int, list[AlignedBuffer]] = {}  # capacity -> cached buffers
        self._cached_bytes = 0
        self._used_bytes = 0
        self._queue: deque[object] = deque()  # FIFO tickets of waiting acquirers
        self._out: set[int] = set()  # id() of buffers handed out
        self.peak_bytes = 0  # highest used + cached ever seen (tests check <= budget)

    @property
    def used_bytes(self) -> int:
        """Capacity of buffers currently handed out."""
        return self._used_bytes

    @property
    def held_bytes(self) -> int:
        """Capacity allocated by the pool: handed out plus cached for reuse."""
        return self._used_bytes + self._cached_bytes

    def acquire(self, nbytes: int, timeout: float | None = None) -> AlignedBuffer:
        cap = max(round_up(int(nbytes)), ALIGN)
        if cap > self.budget_bytes:
            raise CapacityError(
                f"BufferPool: a request of {nbytes} bytes ({cap} aligned) exceeds the pool "
                f"budget of {self.budget_bytes} bytes; raise the budget or split the request"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                while not (self._queue[0] is ticket and self._make_room(cap)):
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise CapacityError(
                            f"BufferPool: waited {timeout} s for {cap} bytes; "
                            f"{self._used_bytes} of {self.budget_bytes} bytes are in use"
                        )
                    self._cond.wait(remaining)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()
            buf = self._take_cached(cap)
            self._used_bytes += cap
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        if buf is None:
            # Allocate outside the lock (pinning is slow); the bytes are
            # already counted, so the budget holds while we do.
            try:
                buf = AlignedBuffer(cap, pin=self._pin)
            except BaseException:
                with self._cond:
                    self._used_bytes -= cap
                    self._cond.notify_all()
                raise
        buf.resize(int(nbytes))
        with self._cond:
            self._out.add(id(buf))
        return buf

    def release(self, buf: AlignedBuffer) -> None:
        with self._cond:
            if id(buf) not in self._out:
                raise CapacityError(f"BufferPool.release: {buf!r} was not acquired from this pool")
            self._out.discard(id(buf))
            self._used_bytes -= buf.capacity
            self._free.setdefault(buf.capacity, []).append(buf)
            self._cached_bytes += buf.capacity
            self._cond.notify_all()

    def clear(self) -> None:
        """Drop cached (not handed out) buffers."""
        with self._cond:
            self._free.clear()
            self._cached_bytes = 0

    # -- internals (called with the lock held) --------------------------------

    def _make_room(self, cap: int) -> bool:
        """True when a buffer of ``cap`` can be handed out within the budget."""
        if self._free.get(cap):
            return True
        # Evict cached buffers of other sizes until the new allocation fits.
        while self.held_bytes + cap > self.budget_bytes and self._cached_bytes:
            size = next(s for s, lst in self._free.items() if lst)
            self._free[size].pop()
            if not self._free[size]:
                del self._free[size]
            self._cached_bytes -= size
        return self.held_bytes + cap <= self.budget_bytes

    def _take_cached(self, cap: int) -> AlignedBuffer | None:
        cached = self._free.get(cap)
        if not cached:
            return None
        buf = cached.pop()
        if not cached:
            del self._free[cap]
        self._cached_bytes -= cap
        return buf
