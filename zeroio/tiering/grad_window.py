"""The host step's window onto a gradient that stays on the device.

[Note: the gradient window]
Where the placement keeps the optimizer's gradient on the device ([Note: the gradient's
home] in config/accum_place.py: the accumulation buffer, or a device shard of the host
gradient's dtype), host memory holds no gradient shard. The host step (CPU Adam chunk by
chunk on its worker: partition/stage12_step.py, partition/stage3/host_step.py) reads each
chunk's gradient through ``GradWindow``: ``WINDOW_SLOTS`` pinned slots of the largest chunk.

- ``begin(sources)`` (training thread, at the step): the device views of the chunks'
  gradients in the order the worker steps them, and an event on the current stream, which
  the engine's step ordered after every write of the gradient (the landing streams, the
  norm); every copy below waits for it.
- ``read(k)`` (the worker, before it steps chunk k): queues chunk k's copy if it is not
  queued yet and the next chunk's behind it, then waits for chunk k's alone. So the next
  chunk crosses PCIe while the CPU updates chunk k. The next chunk is the next one the CPU
  will step as far as ``begin``'s ``skip`` knows: chunks resident on the GPU (the step
  assist's, [Note: resident chunks] in shard/assist.py) are stepped there, from the
  gradient where it is, so no copy is made for them. A copy casts on the device first where the
  home's dtype is not the one the CPU Adam reads (an fp32 sum read as 16 bits: the one
  rounding a boundary copy to a 16-bit host shard made; the temporary is allocated on the
  copy's stream, so the caching allocator reuses it only behind that copy).
- a slot is written again two copies later; by then the worker has stepped the chunk it
  held (a chunk the step assist took after all was copied ahead for nothing and is never
  read: the next copy into its slot queues behind it on the same stream).
- ``finish()`` (``wait_step``): host wait for the last copy queued, so the next backward
  never writes a gradient that a copy still reads.

The copies run on the device's ``grad_window`` stream (tiering/streams.py). On a CPU device
(no streams) each copy runs inline: the same path, so the CPU tests run it. The window also
stands for the gradient's home in the GPU tier: fixed state (``gpu_bytes``, the homes it
reads), which resident optimizer chunks yield to, as the accumulation buffer's ([Note:
accumulation on the device tier] in tiering/device_accum.py).
"""

from __future__ import annotations

import torch

from zeroio.config.accum_place import WINDOW_SLOTS
from zeroio.io.hostmem import host_empty
from zeroio.tiering.copies import Copies
from zeroio.tiering.stats import StallTimer, TierStats
from zeroio.tiering.streams import DeviceStreams, on, record, wait_event


class GradWindow:
    """Pinned slots through which the host step reads a device-homed gradient (module note)."""

    def __init__(self, *, numel: int, dtype: torch.dtype, device: torch.device, pin: bool,
                 homes: list[torch.Tensor] = (), transfers: TierStats | None = None,
                 slots: int = WINDOW_SLOTS):
        """``numel``: the largest chunk; ``dtype``: what the CPU Adam reads; ``device``: the
        gradient's; ``pin``: page-locked slots (CUDA); ``homes``: the device tensors it reads
        (their bytes are the GPU tier's fixed state)."""
        if numel < 1 or slots < 2:
            raise ValueError(f"GradWindow needs numel >= 1 and slots >= 2, got {numel}, {slots}")
        self.dtype, self.transfers = dtype, transfers
        self.nbytes = sum(h.numel() * h.element_size() for h in homes)
        self.slots = [host_empty(numel, dtype, pin=pin) for _ in range(slots)]
        self.stream = DeviceStreams.of(device).grad_window  # None on a CPU device
        self._sources: list[torch.Tensor] = []
        self._skip: list[bool] = []
        self._events: dict[int, torch.cuda.Event | None] = {}
        self._slot_of: dict[int, int] = {}
        self._copies = 0
        self._ready: torch.cuda.Event | None = None
        self._last: torch.cuda.Event | None = None

    @property
    def numel(self) -> int:
        return self.slots[0].numel()

    def begin(self, sources: list[torch.Tensor],
              skip: list[bool] | None = None) -> torch.cuda.Event | None:
        """A new step over ``sources`` (1-D device views, each at most ``numel`` long), read in
        this order, none ahead of its turn where ``skip`` says the CPU will not step it; the
        copies follow what the current stream queued so far, the event returned (None on a
        CPU device), which other readers of the gradient wait on too."""
        too_long = [s.numel() for s in sources if s.numel() > self.numel]
        if too_long:
            raise ValueError(f"a gradient chunk of {too_long[0]} elements exceeds the window's "
                             f"{self.numel}")
        self.finish()
        self._sources, self._events, self._slot_of = list(sources), {}, {}
        self._skip = list(skip) if skip is not None else [False] * len(sources)
        self._ready = record(torch.cuda.current_stream(self.stream.device)) \
            if self.stream is not None else None
        return self._ready

    def read(self, k: int) -> torch.Tensor:
        """Chunk ``k``'s gradient in host memory (a slot view, valid until the next read's
        copy after it), in ``dtype``; the next chunk's copy is queued behind it."""
        self._queue(k)
        nxt = next((j for j in range(k + 1, len(self._sources)) if not self._skip[j]), None)
        if nxt is not None:
            self._queue(nxt)
        event = self._events.pop(k, None)
        if event is not None:
            with StallTimer(self.transfers):
                event.synchronize()
        return self.slots[self._slot_of[k]].narrow(0, 0, self._sources[k].numel())

    def _queue(self, k: int) -> None:
        """Chunk ``k``'s copy into the next slot, unless it is queued already."""
        if k in self._slot_of:
            return
        self._slot_of[k] = slot = self._copies % len(self.slots)
        self._copies += 1
        src = self._sources[k]
        dst = self.slots[slot].narrow(0, 0, src.numel())
        with on(self.stream):
            wait_event(self.stream, self._ready)
            if src.dtype != dst.dtype and src.device.type != "cpu":
                src = src.to(dst.dtype)  # the cast on the device (module note)
            Copies(self.transfers).into(dst, src, non_blocking=self.stream is not None)
            self._events[k] = self._last = record(self.stream)

    def finish(self) -> None:
        """Host wait until no copy reads the gradient any more (``wait_step``)."""
        last, self._last = self._last, None
        if last is not None:
            with StallTimer(self.transfers):
                last.synchronize()

    def gpu_bytes(self) -> int:
        """The homes' bytes (the GPU tier's fixed holder protocol)."""
        return self.nbytes

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.slots)


__all__ = ["GradWindow"]
