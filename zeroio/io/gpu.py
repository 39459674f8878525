"""Pinned host <-> GPU copies on a dedicated CUDA stream, returned as handles with events.

[Note: copy stream] Each device gets one copy stream, created here and only
here, so a swap NVMe -> pinned -> GPU (or back) overlaps the compute stream
and the NCCL streams. Each copy records a CUDA event on the copy stream;
the handle carries it, and the consumer calls ``handle.wait()`` (its
current stream waits on the event, no host sync) or ``handle.synchronize()``
(the host waits, e.g. before reusing a pinned buffer for the next read).

Ordering rules, because the streams are independent:
- host -> device: the copy does not wait for the compute stream (that is
  the point: prefetch while compute runs). The caller must hand a ``dst``
  that compute no longer touches; pass ``after=`` (an event or stream) to
  order the copy after some other work. ``dst`` is marked as used on the
  copy stream (``record_stream``) so the caching allocator cannot reuse
  its memory before the copy ends.
- device -> host: ``src`` was produced on the caller's current stream, so by
  default the copy stream first waits on it (``after="current"``).
- ``handle.wait()`` also marks GPU tensors as used by the waiting stream.
On a host without CUDA the copies are plain synchronous copies and the
handles are already complete, so the same code runs in CPU tests.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from zeroio.io.engine import IOArgumentError

_streams: dict[int, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def copy_stream(device: torch.device | int | None = None) -> torch.cuda.Stream:
    """The dedicated copy stream of ``device`` (created on first use)."""
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device or "cuda")
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        stream = _streams.get(index)
        if stream is None:
            # Overlaps the compute stream and collectives; see [Note: copy stream].
            stream = torch.cuda.Stream(device=index)
            _streams[index] = stream
        return stream


@dataclass
class CopyHandle:
    """A copy in flight: ``event`` completes when it is done (None: already done)."""

    event: torch.cuda.Event | None
    tensors: tuple[torch.Tensor, ...] = field(default_factory=tuple)  # kept alive until done

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait for the copy; no host sync."""
        if self.event is None:
            return
        stream = stream or torch.cuda.current_stream()
        stream.wait_event(self.event)
        for t in self.tensors:
            if t.is_cuda:
                t.record_stream(stream)

    def synchronize(self) -> None:
        """Block the host until the copy is done (before reusing a pinned buffer)."""
        if self.event is not None:
            self.event.synchronize()

    def done(self) -> bool:
        return self.event is None or self.event.query()


def _order_after(stream: torch.cuda.Stream, after: object, device: torch.device) -> None:
    if after is None:
        return
    if after == "current":
        stream.wait_stream(torch.cuda.current_stream(device))
    elif isinstance(after, torch.cuda.Event):
        stream.wait_event(after)
    elif isinstance(after, torch.cuda.Stream):
        stream.wait_stream(after)
    else:
        raise IOArgumentError(f"copy: after= must be None, 'current', an Event or a Stream, got {after!r}")


def _check(src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.numel() != dst.numel():
        raise IOArgumentError(f"copy: src has {src.numel()} elements, dst {dst.numel()}")
    if src.dtype != dst.dtype:
        raise IOArgumentError(f"copy: src dtype {src.dtype} != dst dtype {dst.dtype}")


def _copy(src, dst, gpu: torch.Tensor, stream, after) -> CopyHandle:
    _check(src, dst)
    if not gpu.is_cuda:
        dst.view(-1).copy_(src.view(-1))
        return CopyHandle(None, ())
    stream = stream or copy_stream(gpu.device)
    _order_after(stream, after, gpu.device)
    with torch.cuda.stream(stream):
        dst.view(-1).copy_(src.view(-1), non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    gpu.record_stream(stream)
    return CopyHandle(event, (src, dst))


def copy_to_device(
    src_pinned: torch.Tensor,
    dst_gpu: torch.Tensor,
    stream: torch.cuda.Stream | None = None,
    *,
    after: object = None,
) -> CopyHandle:
    """Copy pinned host memory into ``dst_gpu`` on the copy stream; see the module note."""
    if dst_gpu.is_cuda and not src_pinned.is_pinned():
        raise IOArgumentError("copy_to_device: src must be pinned host memory for an async copy")
    return _copy(src_pinned, dst_gpu, dst_gpu, stream, after)


def copy_to_host(
    src_gpu: torch.Tensor,
    dst_pinned: torch.Tensor,
    stream: torch.cuda.Stream | None = None,
    *,
    after: object = "current",
) -> CopyHandle:
    """Copy ``src_gpu`` into pinned host memory on the copy stream; see the module note."""
    if src_gpu.is_cuda and not dst_pinned.is_pinned():
        raise IOArgumentError("copy_to_host: dst must be pinned host memory for an async copy")
    return _copy(src_gpu, dst_pinned, src_gpu, stream, after)
