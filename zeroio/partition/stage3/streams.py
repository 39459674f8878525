"""The CUDA streams stage 3 uses (taken from the one owner, tiering/streams.py) and a fetched shard.

[Note: stage-3 streams]
Three side streams, the device's ``param_h2d``, ``comm`` and ``grad_d2h`` (the
design of FSDP2's copy-in / all-gather / reduce-scatter streams, reduced to what
stage 3 needs):

- ``h2d``: host -> device copies of offloaded shards (pinned CPU shards, or the
  tiered store's pinned buffers for NVMe shards). It overlaps compute *and* the
  collectives of other groups: the shard of group n+1 crosses PCIe while group n
  is all-gathered.
- ``comm``: the copy of a shard into its group's all-gather buffer, the
  all-gather, and the reduce-scatter of gradient buckets with their consumption
  into the gradient shard. It overlaps compute: the next groups are gathered
  while the current module runs, a finished bucket is reduced while backward
  goes on.
- ``d2h``: device -> host copies of reduced gradients into host gradient shards
  (offload_optimizer cpu/nvme). On ``comm`` they queued every later gather behind
  them: the backward's next gathers, and so its compute, waited for each group's
  gradient to cross PCIe (measured: 1.364B Llama, 206 MB per layer, the backward
  stepped at compute + copy per layer, 8.3 ms instead of ~5). On their own stream
  they overlap compute and gathers; ``d2h`` waits on ``comm`` where a bucket is
  consumed, and the host waits on ``d2h`` once, at the end of the backward.

Ordering is by events, never by a device-wide synchronize:
- comm waits on the event of the H2D copy of the shard it gathers (``Fetched.ready``);
- the compute stream waits on a group's gather event only in ``finish_gather``,
  i.e. when it needs the group;
- comm waits on the compute stream before reducing a bucket compute filled, and
  compute waits on comm once, in ``finalize_gradients``, before the optimizer
  reads gradients.

Memory used across streams: a tensor allocated on one stream and used on
another is marked with ``record_stream`` (``keep_for``): shard copies (h2d) used
by comm, gathered buffers (comm) used by compute, gradient buckets (compute)
used by comm, so the caching allocator cannot hand their memory out again
before the other stream is done with it. Pinned host buffers of the tiered store
are released only once the H2D copy's event completes (``release(after=event)``).

The streams are created in tiering/streams.py ([Note: zeroio's CUDA streams]), with
the ordering helpers used here (``on``, ``record``, ``wait_event``, ``wait_stream``,
``keep_for``; re-exported for stage 3's modules). On CPU there are no streams: every
helper is a no-op, events are ``None`` and copies are synchronous, so CPU tests run the
same code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroio.tiering.streams import DeviceStreams, keep_for, on, record, wait_event, wait_stream

__all__ = ["Fetched", "Streams", "keep_for", "on", "record", "wait_event", "wait_stream"]


@dataclass(frozen=True)
class Streams:
    h2d: torch.cuda.Stream | None = None
    """Host -> device shard copies; see [Note: stage-3 streams]."""
    comm: torch.cuda.Stream | None = None
    """All-gathers and reduce-scatters (and their copy-in / consumption)."""
    d2h: torch.cuda.Stream | None = None
    """Device -> host copies of reduced gradients."""

    @staticmethod
    def for_device(device: torch.device) -> Streams:
        """Stage 3's side streams on a CUDA ``device`` (the device's ``param_h2d``, ``comm``
        and ``grad_d2h``); none on CPU."""
        owner = DeviceStreams.of(device)
        if not owner.cuda:
            return Streams()
        return Streams(h2d=owner.param_h2d, comm=owner.comm, d2h=owner.grad_d2h)

    def current(self) -> torch.cuda.Stream | None:
        """The caller's (compute) stream, or None on CPU."""
        if self.comm is None:
            return None
        return torch.cuda.current_stream(self.comm.device)


@dataclass(frozen=True)
class Fetched:
    """A shard on the compute device and the event its copy completes with (None: ready)."""

    tensor: torch.Tensor
    ready: torch.cuda.Event | None
