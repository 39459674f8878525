"""Copy handles: the one way code outside tiering/ moves a tensor between host and device.

A ``Copies`` handle is bound to the ``TierStats`` that counts its traffic (None: nothing is
counted) and, optionally, to a CUDA stream. Each method issues the copy and counts the bytes
that cross under their tier pair ("cpu->gpu" / "gpu->cpu"; the source's bytes, before any
dtype cast the copy makes), so no caller counts by hand and a copy cannot go uncounted.

[Note: what a handle keeps of the call]
A handle is a thin wrapper: ``into(dst, src, non_blocking=...)`` is ``dst.copy_(src,
non_blocking=...)`` with the count issued first, on the current stream unless the handle
names one. It adds no synchronisation, no staging and no cast of its own; a copy between
tensors of one device (a cast on the GPU, a host-to-host copy) is made and not counted.
Making a handle costs one small object, so callers may build one per call from the stats
they hold (``Copies(self.transfers).into(...)``). ``to`` and ``host`` are ``Tensor.to`` and
``Tensor.cpu`` the same way: the tensor itself when nothing changes, else the new one, with
the crossing bytes counted; ``host`` is also how a scalar reaches the host for control flow
(a norm, an overflow flag): its few bytes are counted like any other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from zeroio.tiering.stats import TierStats, count_copy, device_tier

_HOST = torch.device("cpu")


class Copies:
    """Host <-> device copies counted into ``stats`` (see [Note: what a handle keeps of the
    call]); ``stream``: the CUDA stream the copies are issued on (None: the current one)."""

    __slots__ = ("stats", "stream")

    def __init__(self, stats: TierStats | None, stream: torch.cuda.Stream | None = None):
        self.stats = stats
        self.stream = stream

    def _on(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else \
            contextlib.nullcontext()

    def into(self, dst: torch.Tensor, src: torch.Tensor, *,
             non_blocking: bool = False) -> torch.Tensor:
        """``src`` into ``dst`` (same shape; a dtype difference is cast by the copy); ``dst``."""
        count_copy(self.stats, src, dst)
        with self._on():
            return dst.copy_(src, non_blocking=non_blocking)

    def many(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *,
             non_blocking: bool = False) -> None:
        """Each ``srcs[i]`` into ``dsts[i]`` as one ``torch._foreach_copy_`` call (one Python
        call for many copies, for a thread that pays the GIL per call)."""
        if len(dsts) != len(srcs):
            raise ValueError(f"{len(srcs)} sources for {len(dsts)} destinations")
        for src, dst in zip(srcs, dsts, strict=True):
            count_copy(self.stats, src, dst)
        with self._on():
            torch._foreach_copy_(list(dsts), list(srcs), non_blocking=non_blocking)

    def new(self, src: torch.Tensor, device: torch.device, *, dtype: torch.dtype | None = None,
            non_blocking: bool = False) -> torch.Tensor:
        """A new tensor on ``device`` (of ``dtype``, default ``src``'s) holding ``src``; it is
        allocated on the handle's stream, so the caching allocator ties it to that stream."""
        with self._on():
            out = torch.empty(src.shape, dtype=dtype or src.dtype, device=device)
        return self.into(out, src, non_blocking=non_blocking)

    def to(self, src: torch.Tensor, device: torch.device | str, *,
           dtype: torch.dtype | None = None, non_blocking: bool = False,
           copy: bool = False) -> torch.Tensor:
        """``src.to(device, dtype, non_blocking=..., copy=...)`` on the handle's stream:
        ``src`` itself when neither device nor dtype changes (unless ``copy``)."""
        device = torch.device(device)
        if self.stats is not None and src.device.type != device.type:  # as count_copy
            self.stats.moved(f"{device_tier(src.device)}->{device_tier(device)}",
                             src.numel() * src.element_size())
        with self._on():
            return src.to(device, dtype, non_blocking=non_blocking, copy=copy)

    def host(self, src: torch.Tensor, *, non_blocking: bool = False) -> torch.Tensor:
        """``src.cpu()``: ``src`` itself on the host, else a new host tensor (a scalar read
        for control flow included), its bytes counted."""
        return self.to(src, _HOST, non_blocking=non_blocking)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, *,
                  non_blocking: bool = False) -> torch.Tensor:
        """``into`` for a host ``src`` and a device ``dst`` (a ValueError otherwise)."""
        _direction(src, dst, "cpu", "gpu")
        return self.into(dst, src, non_blocking=non_blocking)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, *,
                non_blocking: bool = False) -> torch.Tensor:
        """``into`` for a device ``src`` and a host ``dst`` (a ValueError otherwise)."""
        _direction(src, dst, "gpu", "cpu")
        return self.into(dst, src, non_blocking=non_blocking)


def _direction(src: torch.Tensor, dst: torch.Tensor, frm: str, to: str) -> None:
    if (device_tier(src.device), device_tier(dst.device)) != (frm, to):
        raise ValueError(f"a {frm}->{to} copy got a source on {src.device} and a destination "
                         f"on {dst.device}; use Copies.into for a copy of either direction")


__all__ = ["Copies"]
