"""Every CUDA stream zeroio uses, made in one place, and the helpers that order them.

[Note: zeroio's CUDA streams]
One ``DeviceStreams`` per device (``DeviceStreams.of(device)``; the shape of FSDP2's
``FSDPCommContext``) creates each side stream on first use, one stream per role,
so a role's work overlaps the compute stream and the other roles' work:

- ``param_h2d`` (stage 3): host -> device copies of offloaded parameter shards
  (pinned CPU shards, or the tiered store's pinned buffers for NVMe shards). It
  overlaps compute and the collectives of other groups: the shard of group n+1
  crosses PCIe while group n is all-gathered.
- ``comm`` (stage 3): the copy of a shard into its group's all-gather buffer, the
  all-gather, and the reduce-scatter of gradient buckets with their consumption
  into the gradient shard. It overlaps compute: the next groups are gathered
  while the current module runs, a finished bucket is reduced while backward
  goes on.
- ``grad_d2h`` (stage 3): device -> host copies of reduced gradients into host
  gradient shards (offload_optimizer cpu/nvme), and the device-side publish of
  the ratio split. Kept apart from ``comm`` so the backward's next gathers do not
  queue behind each group's gradient crossing PCIe ([Note: stage-3 streams] in
  partition/stage3/streams.py has the measurement).
- ``grad_window`` (the host step, offload_optimizer cpu): a gradient kept on the device
  copied down chunk by chunk into the host step's pinned window, one chunk ahead of the CPU
  Adam ([Note: the gradient window] in tiering/grad_window.py). Its own stream, so those
  copies never queue behind the next forward's shard copies or the step assist's.
- ``side`` (stage 1/2): a bucket's consumption right after its collective (its
  slice divided, cast, normed and copied into the fp32 or host gradient shard),
  so with CPU offload gradients travel to pinned host memory while backward
  goes on ([Note: gradient flow] in partition/stage12.py).
- ``copy`` (stage 1/2, host master weights): the 16-bit parameters the host step
  publishes go up to the GPU parameter buffer chunk by chunk while the host steps
  the next chunk, and the next forward overlaps what is left ([Note: step
  publication] in partition/stage12.py).
- ``assist_up`` / ``assist_down`` (the step assist, shard/assist.py): a chunk's
  host Adam state going up, its GPU Adam and 16-bit copy, then master and
  moments going back down. Two streams, so the next chunk's copies up overlap
  the previous chunk's copies down ([Note: step assist]).
- ``store_h2d`` / ``store_d2h`` (the tiered store): loads into the GPU tier
  overlap compute; write-backs from it run on their own stream, so a load never
  queues behind a write-back. Also the default streams of ``copy_to_device`` /
  ``copy_to_host``.

On a host without CUDA (or for a CPU device) every role is ``None``, the helpers
below are no-ops and copies run inline, so CPU tests run the same code path.

Ordering is by events, never by a device-wide synchronize: ``record`` an event on
a stream, ``wait_event`` / ``wait_stream`` queue a wait on another (the host does
not block). A tensor allocated on one stream and used on another is marked with
``record_stream`` (``keep_for``), so the caching allocator cannot hand its memory
out again before the other stream is done with it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zeroio.io.engine import IOArgumentError

ROLES = ("param_h2d", "comm", "grad_d2h", "grad_window", "side", "copy", "assist_up",
         "assist_down", "store_h2d", "store_d2h")
"""Every side stream's role; see [Note: zeroio's CUDA streams]."""


def _cuda_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


class DeviceStreams:
    """The side streams of one device, each created on first use; see the module note."""

    _registry: dict[object, DeviceStreams] = {}
    _registry_lock = threading.Lock()

    def __init__(self, device: torch.device | None,
                 make: Callable[[torch.device], object] | None = None):
        """``device``: a CUDA device (None: no streams, every role is None). ``make`` creates
        one stream for ``device`` (default ``torch.cuda.Stream``; a test may count them)."""
        self.device = device
        self._make = make or _cuda_stream
        self._streams: dict[str, object] = {}
        self._lock = threading.Lock()

    @classmethod
    def of(cls, device: torch.device | str | int | None) -> DeviceStreams:
        """The one ``DeviceStreams`` of ``device``; the stream-less one for a CPU device or
        a host without CUDA."""
        key = _key(device)
        with cls._registry_lock:
            owner = cls._registry.get(key)
            if owner is None:
                owner = cls._registry[key] = cls(
                    None if key == "cpu" else torch.device("cuda", key))
            return owner

    @property
    def cuda(self) -> bool:
        """Whether this owner hands out streams."""
        return self.device is not None

    def stream(self, role: str) -> torch.cuda.Stream | None:
        """The stream of ``role`` (one of ``ROLES``), the same one on every call."""
        if role not in ROLES:
            raise ValueError(f"DeviceStreams: unknown stream role {role!r}; one of {ROLES}")
        if self.device is None:
            return None
        with self._lock:
            stream = self._streams.get(role)
            if stream is None:
                stream = self._streams[role] = self._make(self.device)
            return stream  # type: ignore[return-value]

    def current(self) -> torch.cuda.Stream | None:
        """The caller's (compute) stream on this device, or None on CPU."""
        return None if self.device is None else torch.cuda.current_stream(self.device)

    # One property per role, so a caller names its stream (see [Note: zeroio's CUDA streams]).
    param_h2d = property(lambda self: self.stream("param_h2d"))
    comm = property(lambda self: self.stream("comm"))
    grad_d2h = property(lambda self: self.stream("grad_d2h"))
    grad_window = property(lambda self: self.stream("grad_window"))
    side = property(lambda self: self.stream("side"))
    copy = property(lambda self: self.stream("copy"))
    assist_up = property(lambda self: self.stream("assist_up"))
    assist_down = property(lambda self: self.stream("assist_down"))
    store_h2d = property(lambda self: self.stream("store_h2d"))
    store_d2h = property(lambda self: self.stream("store_d2h"))


def _key(device: torch.device | str | int | None) -> object:
    """The registry key: a CUDA device index, or "cpu" (no streams)."""
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda" or not torch.cuda.is_available():
        return "cpu"
    return device.index if device.index is not None else torch.cuda.current_device()


# ---- ordering helpers (no-ops on CPU) ----------------------------------------------------------

def on(stream: torch.cuda.Stream | None):
    """Make ``stream`` current inside the block (nothing on CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event marking the work queued on ``stream`` so far (None on CPU)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_event(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
    """Queue a wait for ``event`` on ``stream`` (the host does not block)."""
    if stream is not None and event is not None:
        stream.wait_event(event)


def wait_stream(stream: torch.cuda.Stream | None, other: torch.cuda.Stream | None) -> None:
    """Queue on ``stream`` a wait for the work queued on ``other`` so far."""
    if stream is not None and other is not None:
        stream.wait_stream(other)


def keep_for(tensor: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
    """Tell the allocator ``tensor`` is used on ``stream`` (see the module note)."""
    if stream is not None and tensor.is_cuda:
        tensor.record_stream(stream)


def order_after(stream: torch.cuda.Stream, after: object, device: torch.device) -> None:
    """Queue on ``stream`` a wait for ``after``: None (nothing), "current" (the caller's
    stream on ``device``), an event or a stream."""
    if after is None:
        return
    if isinstance(after, str) and after == "current":
        stream.wait_stream(torch.cuda.current_stream(device))
    elif isinstance(after, torch.cuda.Event):
        stream.wait_event(after)
    elif isinstance(after, torch.cuda.Stream):
        stream.wait_stream(after)
    else:
        raise IOArgumentError(f"copy: after= must be None, 'current', an Event or a Stream, got {after!r}")


# ---- the host <-> device copy -------------------------------------------------------------------

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
            keep_for(t, stream)

    def synchronize(self) -> None:
        """Block the host until the copy is done (before reusing a pinned buffer)."""
        if self.event is not None:
            self.event.synchronize()

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())


def copy(src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream | None, *,
         after: object = None, keep: torch.Tensor | None = None) -> CopyHandle:
    """``dst.copy_(src)`` on ``stream`` once ``after`` (see ``order_after``) is done, with an
    event behind it. ``keep``: a GPU tensor marked as used on ``stream`` (``keep_for``); the
    handle keeps ``src`` and ``dst`` alive. With no stream the copy runs inline and the
    handle is already done."""
    if stream is None:
        dst.copy_(src)
        return CopyHandle(None, ())
    order_after(stream, after, stream.device)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    if keep is not None:
        keep_for(keep, stream)
    return CopyHandle(event, (src, dst))


def _check(src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.numel() != dst.numel():
        raise IOArgumentError(f"copy: src has {src.numel()} elements, dst {dst.numel()}")
    if src.dtype != dst.dtype:
        raise IOArgumentError(f"copy: src dtype {src.dtype} != dst dtype {dst.dtype}")


def copy_to_device(src_pinned: torch.Tensor, dst_gpu: torch.Tensor,
                   stream: torch.cuda.Stream | None = None, *, after: object = None) -> CopyHandle:
    """Copy pinned host memory into ``dst_gpu`` (default stream: the device's ``store_h2d``).
    It does not wait for the compute stream (that is the overlap): the caller hands a
    ``dst_gpu`` compute no longer touches, or passes ``after=``. ``dst_gpu`` is marked as
    used on the copy stream. Without CUDA: a synchronous copy, the handle complete."""
    _check(src_pinned, dst_gpu)
    if not dst_gpu.is_cuda:
        return copy(src_pinned.view(-1), dst_gpu.view(-1), None)
    if not src_pinned.is_pinned():
        raise IOArgumentError("copy_to_device: src must be pinned host memory for an async copy")
    stream = stream or DeviceStreams.of(dst_gpu.device).store_h2d
    return copy(src_pinned.view(-1), dst_gpu.view(-1), stream, after=after, keep=dst_gpu)


def copy_to_host(src_gpu: torch.Tensor, dst_pinned: torch.Tensor,
                 stream: torch.cuda.Stream | None = None, *, after: object = "current") -> CopyHandle:
    """Copy ``src_gpu`` into pinned host memory (default stream: the device's ``store_d2h``);
    by default the copy first waits for the caller's stream, which produced ``src_gpu``."""
    _check(src_gpu, dst_pinned)
    if not src_gpu.is_cuda:
        return copy(src_gpu.view(-1), dst_pinned.view(-1), None)
    if not dst_pinned.is_pinned():
        raise IOArgumentError("copy_to_host: dst must be pinned host memory for an async copy")
    stream = stream or DeviceStreams.of(src_gpu.device).store_d2h
    return copy(src_gpu.view(-1), dst_pinned.view(-1), stream, after=after, keep=src_gpu)
