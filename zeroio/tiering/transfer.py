"""Handles of in-flight moves and the memory behind the GPU and CPU tiers.

Every transfer returns a ``Transfer`` carrying its sync object: a
``concurrent.futures.Future`` for NVMe reads and writes (served by the I/O
engine's threads), a CUDA event for copies between host and device (issued on
the store's copy streams by ``zeroio.tiering.streams.copy``). ``wait`` never
raises; it returns the exception, so the store can attach the tensor's name
before surfacing it.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from zeroio.errors import CapacityError
from zeroio.tiering.tier import Tier

ALIGN = 4096


def host_cost(nbytes: int) -> int:
    """Bytes a CPU-tier copy really holds: the buffer pool hands out whole pages."""
    return max((nbytes + ALIGN - 1) // ALIGN * ALIGN, ALIGN)


class Transfer:
    """One in-flight copy; done() polls, wait() blocks and returns the error or None."""

    __slots__ = ("_future", "_event")

    def __init__(self, *, future: Future | None = None, event: object | None = None):
        self._future = future
        self._event = event

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        return self._event is None or bool(self._event.query())

    def wait(self) -> BaseException | None:
        try:
            if self._future is not None:
                self._future.result()
            elif self._event is not None:
                self._event.synchronize()
        except BaseException as exc:  # surfaced by the store with the tensor's name
            return exc
        return None


@dataclass(eq=False)
class Block:
    """Memory behind one GPU or CPU copy: a typed view and what to free."""

    tensor: torch.Tensor
    cost: int
    owner: object | None = None  # the pool buffer, returned on free


class TierMemory:
    """Allocates copies in one memory tier: CPU from the I/O layer's aligned
    (pinned) ``BufferPool``, GPU from the CUDA caching allocator."""

    def __init__(self, tier: Tier, budget: int, *, pin: bool, device: torch.device | None):
        self.tier = tier
        self.device = device
        self.pool = None
        if tier is Tier.CPU and budget > 0:
            from zeroio.io.buffers import BufferPool

            self.pool = BufferPool(budget, pin=pin and torch.cuda.is_available())

    def cost(self, nbytes: int) -> int:
        return host_cost(nbytes) if self.tier is Tier.CPU else nbytes

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> Block:
        numel = nbytes // max(1, torch.empty((), dtype=dtype).element_size()) if nbytes else 0
        if self.tier is Tier.CPU:
            if self.pool is None:
                raise CapacityError("CPU tier has a budget of 0 bytes; set cpu_budget_bytes")
            buf = self.pool.acquire(nbytes, timeout=30.0)
            return Block(buf.view(dtype, numel).view(shape), self.cost(nbytes), buf)
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        return Block(tensor, self.cost(nbytes), None)

    def free(self, block: Block) -> None:
        if self.pool is not None and block.owner is not None:
            self.pool.release(block.owner)
        block.owner = None

    @property
    def held_bytes(self) -> int:
        return self.pool.used_bytes if self.pool is not None else 0

    def close(self) -> None:
        if self.pool is not None:
            self.pool.clear()
