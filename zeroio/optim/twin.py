"""``TwinAdam``: one optimizer over a stage-3 shard split between device and host.

With ``zero_optimization.offload_optimizer.ratio`` < 1 the partitioner splits
each optimizer group's shard into a device side and a host side
(partition/stage3/twin.py, [Note: twin placement]). ``TwinAdam`` steps the
device side with a ``ShardedAdam`` on the compute device (torch's fused Adam)
and the host side with the optimizer offload_optimizer.device picks
(``ShardedAdam`` over pinned host memory, or ``SwappedAdam`` over NVMe), with
the same hyperparameter dicts (``param_groups`` is one list both share, so LR
schedules reach both).

To the engine and the checkpoint layer it is one optimizer over the logical
ShardGroups, whose local layout is ``[device part | host part]``: state is
read and written through ``local_tensor`` / ``read_local`` /
``write_local_range`` / ``write_local``, which split each range at the
boundary. ``local_tensor`` of a group with elements on both sides is a host
copy (the checkpoint layer hands such copies back through ``write_local``).
"""

from __future__ import annotations

import torch

from zeroio.optim.adam import ShardedAdam
from zeroio.optim.interface import EngineOptimizer
from zeroio.shard.types import ShardGroup
from zeroio.tiering.copies import Copies
from zeroio.tiering.stats import TierStats


class TwinAdam(EngineOptimizer):
    """Named for Adam; any elementwise rule's pair (``ShardedRule`` sides: [Note: elementwise
    rules] in rules.py) is stepped the same way; Lamb's sides in two passes (``_lamb_step``)."""

    def __init__(self, *, device: ShardedAdam, host, groups: list[ShardGroup],
                 transfers: TierStats | None = None):
        """``transfers``: the partitioner's host <-> device copy stats (Lamb's device-side
        sums, and the device side's state read or written for checkpoints, cross here)."""
        if device.param_groups is not host.param_groups:
            raise ValueError("TwinAdam: both sides must share one param_groups list")
        self.device, self.host = device, host
        self.transfers = transfers
        self.groups = groups
        """The logical ShardGroups (the partitioner's ``groups``)."""
        self.param_groups = device.param_groups
        self.rule_name = device.rule_name
        self.state_kinds = device.state_kinds

    # ---- the step ----------------------------------------------------------------------------

    touched = True
    """Whether the step began changing state (zeroio/step_guard.py): False only while a Lamb
    step runs its host side's norm pass, which writes nothing (an NVMe read failing there
    rolls the step back); the device side's state changes from its first pass on."""

    def clear_errors(self) -> None:
        """Forget the I/O errors the host side's store keeps (NVMe state), after a rollback
        or a checkpoint load."""
        if self.host.store is not None:
            self.host.clear_errors()

    def step(self, grad_scale: float = 1.0, on_updated=None) -> None:
        """Both sides, device first (its kernels queue while the host side runs). Only Lamb
        (never chunked) takes stage 1/2's ``on_updated``: each logical group, once both sides
        moved."""
        if self.rule_name == "lamb":
            self.touched = False
            self._lamb_step(grad_scale)
            for g in self.groups if on_updated is not None else ():
                i = g.group_index
                on_updated(i, 0, self._split(i) + self._host_numel(i))
            return
        if on_updated is not None:
            raise ValueError("TwinAdam.step: on_updated is a stage 1/2 hook; stage 3 publishes "
                             "through run_step or publish_params")
        self.touched = False
        if self.host.store is not None:  # before the device side moves: [Note: reads before
            self.host.store.check_writes()  # writes] in swap.py
        self.touched = True
        self.device.step(grad_scale=grad_scale)
        self.host.step(grad_scale=grad_scale)

    def _lamb_step(self, grad_scale: float) -> None:
        """Lamb's per-parameter norms add up both sides before either applies: each side's
        first pass gives its sums (the host side's first: a ``SwappedLamb`` reads its NVMe
        moments there), one reduction over the ranks, then both sides apply ([Note: sharded
        trust ratio] in lamb_norms.py)."""
        moves = Copies(self.transfers)
        sums = moves.host(self.host.lamb_sums(grad_scale))
        self.touched = True  # the device side's first pass updates its moments in place
        sums += moves.host(self.device.lamb_sums(grad_scale))
        total = self.device.norms.reduce(sums).sqrt().tolist()
        self.device.lamb_apply(total)
        self.host.lamb_apply(total)

    def begin_chunked_step(self, grad_scale: float = 1.0):
        """Steps the device side now (fused, on the device) and returns the host side's
        ``ChunkedStep``, whose chunks the stage-3 partitioner runs ([Note: stage-3 host step])."""
        with torch.profiler.record_function("zeroio::twin::device_step"):
            self.device.step(grad_scale=grad_scale)
        return self.host.begin_chunked_step(grad_scale)

    # ---- state access (checkpoints) ----------------------------------------------------------

    def _split(self, group_index: int) -> int:
        """Length of the device part: logical local offsets below it are on the device."""
        return self.device.groups[group_index].padded_numel

    def _host_numel(self, group_index: int) -> int:
        return self.host.groups[group_index].padded_numel

    def local_tensor(self, group_index: int, kind: str) -> torch.Tensor:
        """The logical local ``kind`` tensor: a view where one side holds the whole group, else
        a host copy of both parts."""
        d, h = self._split(group_index), self._host_numel(group_index)
        if d == 0:
            return self.host.local_tensor(group_index, kind)
        if h == 0:
            return self.device.local_tensor(group_index, kind)
        moves = Copies(self.transfers)
        return torch.cat([moves.host(self.device.local_tensor(group_index, kind)),
                          moves.host(self.host.local_tensor(group_index, kind))])

    reads_ranges = True

    def read_local(self, group_index: int, kind: str, lo: int, n: int) -> torch.Tensor:
        """Elements [lo, lo + n) of the logical ``kind`` tensor as a host tensor; only the
        overlapped parts are read (NVMe moments piece by piece, through the host optimizer)."""
        d = self._split(group_index)
        if lo < 0 or n < 0 or lo + n > d + self._host_numel(group_index):
            raise IndexError(f"read_local: [{lo}, {lo + n}) outside group {group_index}'s "
                             f"{d + self._host_numel(group_index)} elements")
        parts = []
        if lo < d:
            k = min(n, d - lo)
            parts.append(Copies(self.transfers).host(
                self.device.local_tensor(group_index, kind).narrow(0, lo, k)))
        if lo + n > d:
            a = max(lo, d) - d
            k = lo + n - max(lo, d)
            parts.append(self.host.read_local(group_index, kind, a, k) if self.host.reads_ranges
                         else self.host.local_tensor(group_index, kind).narrow(0, a, k))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def write_local_range(self, group_index: int, kind: str, lo: int,
                          values: torch.Tensor) -> None:
        """Overwrite elements [lo, lo + len(values)) of the logical ``kind`` tensor."""
        d, n = self._split(group_index), values.numel()
        if lo < 0 or lo + n > d + self._host_numel(group_index):
            raise IndexError(f"write_local_range: [{lo}, {lo + n}) outside group "
                             f"{group_index}'s {d + self._host_numel(group_index)} elements")
        if lo < d:
            k = min(n, d - lo)
            dev = self.device.local_tensor(group_index, kind).narrow(0, lo, k)
            Copies(self.transfers).into(dev, values.narrow(0, 0, k))
        if lo + n > d:
            a = max(lo, d)
            rest = values.narrow(0, a - lo, lo + n - a)
            if self.host.reads_ranges:
                self.host.write_local_range(group_index, kind, a - d, rest)
            else:
                self.host.local_tensor(group_index, kind).narrow(0, a - d, rest.numel()).copy_(rest)

    def replacing(self, kinds: tuple[str, ...]):
        """The host side's (NVMe pieces: [Note: a load replaces pieces whole] in
        swap_state.py); the device side's state is plain tensors."""
        return self.host.replacing(kinds)

    def write_local(self, group_index: int, kind: str, values: torch.Tensor) -> None:
        """Overwrite the logical local ``kind`` tensor (checkpoint load)."""
        d = self._split(group_index)
        dev = self.device.local_tensor(group_index, kind)
        if dev.data_ptr() != values.data_ptr():  # not the view local_tensor handed out
            Copies(self.transfers).into(dev, values.narrow(0, 0, d))
        self.host.write_local(group_index, kind, values.narrow(0, d, values.numel() - d))

    def steps_taken(self, group_index: int) -> int:
        return max(self.device.steps_taken(group_index), self.host.steps_taken(group_index))

    def set_steps(self, group_index: int, steps: int) -> None:
        self.device.set_steps(group_index, steps)
        self.host.set_steps(group_index, steps)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are owned by the engine."""

    def held_tensors(self) -> list[torch.Tensor]:
        """Moments held outside a tiered store (``engine.stats()["tiers"]``): the device
        side's, and the host side's when it is a ``ShardedAdam`` (a ``SwappedAdam``'s are in
        its store, reported by it)."""
        return self.device.held_tensors() + self.host.held_tensors()

    @property
    def store(self):
        """The host side's tiered store (NVMe moments), for ``engine.stats()``; else None."""
        return self.host.store

    @property
    def chunked_step(self) -> bool:
        """``begin_chunked_step`` works where the host side has one (a ``ShardedAdam``)."""
        return self.host.chunked_step

    def swap_plan(self) -> dict | None:
        return self.host.swap_plan()

    def drain(self) -> None:
        self.host.drain()

    def close(self) -> None:
        self.host.close()
