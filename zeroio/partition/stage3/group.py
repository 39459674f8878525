"""One flat parameter group at run time: its shard, its gathered buffer, its gradient shard.

The group follows [Note: group state machine] (state.py). Holds decide when
it may go back to SHARDED: a forward hold per running forward that needs it,
a backward hold from its pre-backward hook until its gradients are reduced,
and user holds from ``GatheredParameters``.

[Note: releasing by dropping references]
A gather writes into a fresh buffer; a release points every parameter at an
empty placeholder and drops the group's reference to the buffer. Autograd may
still hold a view of the old buffer (an op that saved ``weight.t()``), so the
buffer is never reused in place: its memory returns to the allocator when the
last such view dies, and a saved view always sees the values it was saved with.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zeroio.partition import collectives as comm
from zeroio.partition.stage3.layout import GroupPlan
from zeroio.partition.stage3.state import GroupState, check_transition
from zeroio.partition.stage3.store import ShardStore
from zeroio.partition.stage3.streams import Streams, keep_for, on, record, wait_event, wait_stream


class PendingReduce:
    """A reduce-scatter in flight; ``wait()`` hands the reduced bucket to ``consume`` once,
    on the comm stream (compute waits on comm in ``finalize_gradients``)."""

    def __init__(self, handle: comm.CommHandle, bucket: torch.Tensor,
                 consume: Callable[[torch.Tensor], None], stream: torch.cuda.Stream | None):
        self._handle, self._bucket, self._consume = handle, bucket, consume
        self._stream = stream

    def wait(self) -> None:
        if self._bucket is None:
            return
        with on(self._stream):
            self._handle.wait()
            self._consume(self._bucket)
        self._bucket = None


class ParamGroup:
    def __init__(self, plan: GroupPlan, params: list[nn.Parameter], *, rank: int, world: int,
                 device: torch.device, dtype: torch.dtype, store: ShardStore, pg=None,
                 streams: Streams = Streams()):
        self.plan = plan
        self.params = params
        self.rank, self.world, self.device, self.dtype, self.pg = rank, world, device, dtype, pg
        self.store = store
        self.streams = streams  # [Note: stage-3 streams] in streams.py
        self.state = GroupState.SHARDED
        self.fwd_holds = 0
        self.bwd_hold = False
        self.user_holds = 0
        self._handle: comm.CommHandle | None = None
        self._full: torch.Tensor | None = None
        self._empty = torch.empty(0, dtype=dtype, device=device)
        self._staging: torch.Tensor | None = None
        self._ready: set[int] = set()
        self.trainable = {i for i, (s, p) in enumerate(zip(plan.slots, params, strict=True))
                          if s.opt_group >= 0 and p.requires_grad}
        self.before_fetch: Callable[[int], None] | None = None
        """Called with the group index before its shard is fetched: the partitioner waits
        there for an overlapped optimizer step to publish the shard."""

    # -- identity ---------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def numel(self) -> int:
        return self.plan.numel

    @property
    def held(self) -> bool:
        return self.fwd_holds > 0 or self.bwd_hold or self.user_holds > 0

    @property
    def shard_lo(self) -> int:
        return self.rank * self.plan.shard_numel

    # -- parameters -------------------------------------------------------------------------
    def load_full(self, flat: torch.Tensor) -> None:
        """Keep this rank's slice of a full flat (padded) group as the shard; start SHARDED."""
        self.store.put(self.plan.index, flat.narrow(0, self.shard_lo, self.plan.shard_numel)
                       .to(self.dtype))
        for p in self.params:
            p.data = self._empty

    def start_gather(self) -> None:
        check_transition(self.name, self.state, GroupState.GATHERING)
        if self.before_fetch is not None:
            self.before_fetch(self.plan.index)
        side = self.streams.comm
        with torch.profiler.record_function("zeroio::stage3::all_gather"):
            fetched = self.store.fetch(self.plan.index, self.streams)
            with on(side):
                wait_event(side, fetched.ready)  # the shard's H2D copy (or last update)
                full = torch.empty(self.plan.padded_numel, dtype=self.dtype, device=self.device)
                full.narrow(0, self.shard_lo, self.plan.shard_numel).copy_(fetched.tensor,
                                                                          non_blocking=True)
                keep_for(fetched.tensor, side)
                self._handle = comm.all_gather_inplace(full, self.pg)
        self._full = full
        self.state = GroupState.GATHERING

    def finish_gather(self) -> None:
        if self.state is GroupState.GATHERED:
            return
        if self.state is GroupState.SHARDED:
            self.start_gather()
        side = self.streams.comm
        with on(side):
            self._handle.wait()  # NCCL: comm waits on the collective; gloo: the host waits
        self._handle = None
        compute = self.streams.current()
        wait_event(compute, record(side))  # compute waits only now, when it needs the group
        keep_for(self._full, compute)
        check_transition(self.name, self.state, GroupState.GATHERED)
        for slot, p in zip(self.plan.slots, self.params, strict=True):
            p.data = self._full.narrow(0, slot.offset, slot.numel).view(slot.shape)
        self.state = GroupState.GATHERED

    def release(self) -> bool:
        """Back to SHARDED unless held or persistent (see [Note: releasing by dropping references])."""
        if self.plan.persistent or self.held or self.state is GroupState.SHARDED:
            return False
        if self.state is GroupState.GATHERING:
            self.finish_gather()  # every rank joined this collective; it must complete
        check_transition(self.name, self.state, GroupState.SHARDED)
        for p in self.params:
            p.data = self._empty
        self._full = None
        self.state = GroupState.SHARDED
        return True

    def full_flat(self) -> torch.Tensor:
        """The gathered flat buffer (GATHERED only)."""
        return self._full

    def write_back_full(self) -> None:
        """Store this rank's slice of the current full parameters as its shard (modifier path)."""
        self.store.update_pieces(
            self.plan.index, [(0, self._full.narrow(0, self.shard_lo, self.plan.shard_numel))],
            whole=True)

    def update_shard(self, lo: int, values: torch.Tensor) -> None:
        """Write updated values (fp32 masters) into ``[lo, lo+n)`` of this rank's shard."""
        self.store.update(self.plan.index, values, lo)

    def update_shard_pieces(self, pieces: list[tuple[int, torch.Tensor]], *, whole: bool) -> None:
        """``update_shard`` for each ``(lo, values)``; ``whole``: they cover every element of
        the shard but padding (``ShardStore.update_pieces``)."""
        self.store.update_pieces(self.plan.index, pieces, whole=whole)

    # -- gradients --------------------------------------------------------------------------
    def accept_grad(self, slot_index: int, grad: torch.Tensor) -> bool:
        """Add one parameter's gradient into the staging bucket; True when the group is complete."""
        slot = self.plan.slots[slot_index]
        if self._staging is None:
            self._staging = torch.zeros(self.plan.padded_numel, dtype=torch.float32,
                                        device=self.device)
        self._staging.narrow(0, slot.offset, slot.numel).add_(grad.reshape(-1))
        self._ready.add(slot_index)
        return self._ready >= self.trainable

    @property
    def has_staged_grads(self) -> bool:
        return self._staging is not None

    def launch_reduce(self, consume: Callable[[torch.Tensor], None]) -> PendingReduce:
        """Reduce-scatter the staged bucket; ``consume`` gets it (this rank's slice valid) on wait."""
        bucket, self._staging = self._staging, None
        self._ready = set()
        side = self.streams.comm
        with torch.profiler.record_function("zeroio::stage3::reduce_scatter"):
            wait_stream(side, self.streams.current())  # the bucket was filled on compute
            with on(side):
                handle = comm.reduce_scatter_inplace(bucket, self.pg)
            keep_for(bucket, side)
        return PendingReduce(handle, bucket, consume, side)

    def refresh(self) -> None:
        """Re-gather a gathered group after its shard changed (optimizer step, modifier write)."""
        if self.state is GroupState.SHARDED:
            return
        self.finish_gather()
        check_transition(self.name, self.state, GroupState.SHARDED)
        for p in self.params:
            p.data = self._empty
        self._full = None
        self.state = GroupState.SHARDED
        self.finish_gather()
