"""Adam(W) whose moments live on NVMe, stepped over sub-groups with a read/update/write pipeline.

Each ShardGroup's local range is cut into sub-groups of ``sub_group_size``
elements. Every sub-group's ``exp_avg`` and ``exp_avg_sq`` are tensors of the
tiered store with their home on NVMe; the step walks the sub-groups in order:

    read(i+1)  |  update(i)  |  write-back(i-1)

``pipeline_read`` starts the read of sub-group i+1 (``acquire_async``) before
updating i; ``pipeline_write`` leaves the write-back of i to the store, which
writes a dirty copy back asynchronously before its host space is reused,
instead of flushing after each update. The store's host budget holds
``buffer_count`` moment tensors, so host memory for moments is bounded by the
config, not by the model.

[Note: masters stay on the host]
The fp32 master shard stays in the partitioner's (pinned) host memory, as with
``device: cpu``: the 16-bit parameters are published from it right after the
step. Only the moments (8 of the 12 bytes per parameter of optimizer state)
go to NVMe.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

from zeroio.errors import ConfigError
from zeroio.optim.adam import AdamState, adam_update
from zeroio.partition.base import ShardGroup

KINDS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True, kw_only=True)
class SubGroup:
    group_index: int
    start: int
    numel: int

    def name(self, kind: str) -> str:
        return f"adam.g{self.group_index}.o{self.start}.{kind}"


def split(groups: list[ShardGroup], sub_group_size: int) -> list[SubGroup]:
    size = max(1, sub_group_size)
    return [SubGroup(group_index=g.group_index, start=s, numel=min(size, g.padded_numel - s))
            for g in groups for s in range(0, g.padded_numel, size)]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


class SwappedAdam:
    """Same update as ``ShardedAdam``; moments in a ``TieredStore`` homed on NVMe."""

    def __init__(self, groups: list[ShardGroup], param_groups: list[dict], *, decoupled: bool,
                 cfg, backend=None):
        from zeroio.tiering import Tier, TieredStore

        off = cfg.zero_optimization.offload_optimizer
        if off.nvme_path is None and backend is None:
            raise ConfigError("offload_optimizer.device is \"nvme\" but no nvme_path is set",
                              key="zero_optimization.offload_optimizer.nvme_path")
        self.groups = groups
        self.param_groups = param_groups
        self.decoupled = decoupled
        self.pipeline_read = bool(off.pipeline_read)
        self.pipeline_write = bool(off.pipeline_write)
        self.subs = split(groups, cfg.zero_optimization.sub_group_size)
        largest = -(-max((s.numel for s in self.subs), default=1) * 4 // 4096) * 4096  # pages
        tiering = cfg.zero_optimization.tiering
        # buffer_count host buffers of the largest moment tensor, at least the 4 that the
        # pipeline holds at once (2 moments of i being updated, 2 of i+1 being read)
        total = sum(-(-s.numel * 4 // 4096) * 4096 for s in self.subs) * len(KINDS)
        cpu_budget = tiering.cpu_budget_bytes or min(total, max(4, off.buffer_count) * largest)
        path = None if off.nvme_path is None else os.path.join(str(off.nvme_path),
                                                               f"zeroio-optim-rank{_rank()}")
        if path is not None:
            os.makedirs(path, exist_ok=True)
        self.store = TieredStore(cfg, cfg.aio, nvme_path=path, backend=backend,
                                 gpu_budget_bytes=0, cpu_budget_bytes=cpu_budget)
        self._tier = Tier.CPU
        for sub in self.subs:
            for kind in KINDS:
                self.store.register(sub.name(kind), (sub.numel,), torch.float32, home=Tier.NVME)
        self.steps = {sub: torch.zeros((), dtype=torch.float32) for sub in self.subs}
        # checkpoint threads pin sub-groups in the store (thread-safe, pin-counted) at most
        # two at a time, well inside its host budget of >= 4 largest sub-groups
        self._state_pins = threading.BoundedSemaphore(2)

    def _fetch(self, sub: SubGroup):
        return [self.store.acquire_async(sub.name(k), self._tier) for k in KINDS]

    def step(self, grad_scale: float = 1.0, on_updated=None) -> None:
        with torch.profiler.record_function("zeroio::optimizer_step_nvme"):
            pending = self._fetch(self.subs[0]) if self.subs else None
            for i, sub in enumerate(self.subs):
                exp_avg, exp_avg_sq = (f.result() for f in pending)
                nxt = self.subs[i + 1] if i + 1 < len(self.subs) else None
                if nxt is not None and self.pipeline_read:
                    pending = self._fetch(nxt)
                g = self.groups[sub.group_index]
                with torch.profiler.record_function("zeroio::adam_subgroup"):
                    adam_update(master=g.master.narrow(0, sub.start, sub.numel),
                                grad=g.grad.narrow(0, sub.start, sub.numel),
                                state=AdamState(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                                                step=self.steps[sub]),
                                hyper=self.param_groups[g.group_index],
                                decoupled=self.decoupled, grad_scale=grad_scale)
                if on_updated is not None:
                    on_updated(sub.group_index, sub.start, sub.numel)
                for k in KINDS:
                    self.store.mark_dirty(sub.name(k), self._tier)
                    self.store.release(sub.name(k), self._tier)
                if not self.pipeline_write:
                    self.store.flush()
                if nxt is not None and not self.pipeline_read:
                    pending = self._fetch(nxt)
            self.store.step_boundary()

    # ---- state access (checkpoints) --------------------------------------------------------

    def local_tensor(self, group_index: int, kind: str) -> torch.Tensor:
        """A host copy of the group's local ``kind`` tensor (moments gathered from the store).

        Checkpoint saves use ``read_local`` instead (piece by piece, no whole copy)."""
        g = self.groups[group_index]
        if kind == "fp32":
            return g.master
        out = torch.empty(g.padded_numel, dtype=torch.float32)  # the sub-groups tile it: no fill
        for sub in self.subs:
            if sub.group_index == group_index:
                with self._state_pins:
                    t = self.store.acquire(sub.name(kind), self._tier)
                    out.narrow(0, sub.start, sub.numel).copy_(t)
                    self.store.release(sub.name(kind), self._tier)
        return out

    def read_local(self, group_index: int, kind: str, lo: int, n: int) -> torch.Tensor:
        """Elements [lo, lo + n) of the group's local ``kind`` tensor, as a new host tensor.

        Reads only the sub-groups that overlap the range (from the store's CPU or
        NVMe tier, never via a GPU), so a checkpoint writer holds one piece per
        thread, not a copy of every moment. Safe to call from several threads.
        """
        g = self.groups[group_index]
        if lo < 0 or n < 0 or lo + n > g.padded_numel:
            raise IndexError(f"read_local: [{lo}, {lo + n}) outside group {group_index}'s "
                             f"{g.padded_numel} elements")
        if kind == "fp32":
            return g.master.narrow(0, lo, n)
        out = torch.empty(n, dtype=torch.float32)
        for resident, at in self._resident_pieces(group_index, kind, lo, n, dirty=False):
            out.narrow(0, at, resident.numel()).copy_(resident)
        return out

    def _resident_pieces(self, group_index: int, kind: str, lo: int, n: int, *, dirty: bool):
        """For each sub-group overlapping [lo, lo + n) of the group's ``kind`` state: its
        overlapping slice, resident and pinned while the caller uses it, and where that slice
        starts within the range. ``dirty``: the caller writes it (written back later)."""
        for sub in self.subs:
            if sub.group_index != group_index:
                continue
            a, b = max(lo, sub.start), min(lo + n, sub.start + sub.numel)
            if a >= b:
                continue
            with self._state_pins:
                t = self.store.acquire(sub.name(kind), self._tier)
                try:
                    yield t.narrow(0, a - sub.start, b - a), a - lo
                    if dirty:
                        self.store.mark_dirty(sub.name(kind), self._tier)
                finally:
                    self.store.release(sub.name(kind), self._tier)

    def write_local_range(self, group_index: int, kind: str, lo: int, values: torch.Tensor) -> None:
        """Overwrite elements [lo, lo + len(values)) of the group's local ``kind`` tensor
        (checkpoint load, chunk by chunk: no whole host copy). Safe from several threads."""
        g = self.groups[group_index]
        n = values.numel()
        if lo < 0 or lo + n > g.padded_numel:
            raise IndexError(f"write_local_range: [{lo}, {lo + n}) outside group {group_index}'s "
                             f"{g.padded_numel} elements")
        if kind == "fp32":
            g.master.narrow(0, lo, n).copy_(values)
            return
        for resident, at in self._resident_pieces(group_index, kind, lo, n, dirty=True):
            resident.copy_(values.narrow(0, at, resident.numel()))

    def write_local(self, group_index: int, kind: str, values: torch.Tensor) -> None:
        """Overwrite the group's local ``kind`` tensor (checkpoint load)."""
        g = self.groups[group_index]
        if kind == "fp32":
            g.master.copy_(values)
            return
        for sub in self.subs:
            if sub.group_index == group_index:
                t = self.store.acquire(sub.name(kind), self._tier)
                t.copy_(values.narrow(0, sub.start, sub.numel))
                self.store.mark_dirty(sub.name(kind), self._tier)
                self.store.release(sub.name(kind), self._tier)

    def steps_taken(self, group_index: int) -> int:
        return max((int(v.item()) for s, v in self.steps.items() if s.group_index == group_index),
                   default=0)

    def set_steps(self, group_index: int, steps: int) -> None:
        for s, v in self.steps.items():
            if s.group_index == group_index:
                v.fill_(float(steps))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are owned by the engine."""

    def close(self) -> None:
        self.store.close()
