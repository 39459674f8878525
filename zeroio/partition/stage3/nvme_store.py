"""Parameter shards with home NVMe, moved through the tiered store's pinned CPU tier.

Each group's shard is one named tensor (``stage3.param.<group>``) registered
with home NVMe. Only the tiered store moves its bytes: ``prefetch`` asks it to
bring the next groups' shards (per the recorded trace) into pinned host
memory in the background; ``fetch`` acquires the host copy, copies it to the
compute device on the h2d stream (pinned buffer -> device, non-blocking) and
releases it once the copy's event completes (``release(after=event)``: the
store will not reuse the buffer before), so the host never waits on the copy.

[Note: shards resident in CPU (max_in_cpu)]
As in DeepSpeed, up to ``offload_param.max_in_cpu`` elements of this rank's
shards stay in pinned host memory and never touch NVMe; only the rest is
swapped. They are chosen before any shard is stored (``resident_keys``), in
group order: the plan lists groups in module order, so for a sequential
model these are the first blocks used in forward and the last in backward,
exactly the ones a prefetch cannot hide at the turn of a step (nothing runs
ahead of the first forward groups; the last backward groups' reads would be
followed at once by the optimizer step). Greedy: a shard that does not fit
in what is left is skipped and a later smaller one may still fit. Resident
shards are registered in the same tiered store with home CPU, so fetch and
update take one code path and the store's stats count their bytes as CPU
tier use; its CPU budget is the swap buffers (``buffer_count * buffer_size``
16-bit elements, all NVMe shards go through them) plus the resident shards'
page-rounded bytes, so a resident shard never takes a buffer's room.
``max_in_cpu: 0`` keeps nothing beyond the buffers.

[Note: the parameter store's config]
The store is built from the user's ``zero_optimization.tiering`` and ``aio``
blocks: ``tiering.policy`` picks which cached shard leaves the buffers (trace:
farthest next use in the first step's shard order), ``tiering.prefetch_depth``
(when set) how many upcoming shard accesses the store prefetches on top of the
partitioner's own ``stage3_prefetch_bucket_size`` prefetch, and ``aio`` the
I/O engine. With an explicit ``tiering.cpu_budget_bytes`` the resident shards
are capped so that they and one buffer of the largest shard fit in half of it:
the other half is for the NVMe optimizer's window and resident head and the
windows of what else pages (per byte of host memory, a resident 16-bit shard
saves 3 bytes of disk I/O a step: read for forward and backward, written once;
a cached optimizer piece 2: read and written once), and the engine then lowers
the store's share to what the state outside stores leaves ([Note: budgets in
training] in tiering/budget.py: ``cpu_floor``/``cpu_ask``).

``update_pieces(whole=True)`` (the optimizer's publish, which replaces every
trainable element of the shard) acquires the host copy *for overwrite*: the
tiered store allocates it without reading the old shard from NVMe, so a step
reads each shard for forward and backward only, never to replace it.
"""

from __future__ import annotations

import torch

from zeroio.config import host_split
from zeroio.errors import ResidencyError
from zeroio.partition.stage3.settings import Stage3Settings
from zeroio.partition.stage3.store import OwnCopies
from zeroio.partition.stage3.streams import Fetched, on, record
from zeroio.tiering import Tier, TieredStore
from zeroio.tiering.copies import Copies
from zeroio.tiering.stats import StallTimer, TierStats
from zeroio.tiering.transfer import host_cost


def _name(key: int) -> str:
    return f"stage3.param.{key}"


def resident_keys(shard_numels: dict[int, int], max_in_cpu: int, *,
                  max_bytes: int | None = None, elem_size: int = 2) -> set[int]:
    """Groups whose shard stays in host memory: greedily in group order while the elements
    fit in ``max_in_cpu`` (and their host bytes in ``max_bytes``, when given) ([Note: shards
    resident in CPU (max_in_cpu)])."""
    keep, left = set(), max_in_cpu
    room = max_bytes
    for key in sorted(shard_numels):
        cost = host_cost(shard_numels[key] * elem_size)
        if shard_numels[key] <= left and (room is None or cost <= room):
            keep.add(key)
            left -= shard_numels[key]
            if room is not None:
                room -= cost
    return keep


class TieredShards(OwnCopies):
    def __init__(self, settings: Stage3Settings, device: torch.device, *, rank: int,
                 shard_numels: dict[int, int], dtype: torch.dtype,
                 transfers: TierStats | None = None):
        import os

        self.device = device
        self.transfers = transfers
        size = torch.empty((), dtype=dtype).element_size()
        tiering = settings.tiering
        user_cpu = tiering.cpu_budget_bytes
        largest = max((host_cost(n * size) for n in shard_numels.values()), default=0)
        self.resident = resident_keys(  # the rules of shard/host_split.py, as zeroio.estimate's
            shard_numels, settings.max_in_cpu, elem_size=size,
            max_bytes=host_split.resident_cap(user_cpu, largest))
        resident_cost = sum(host_cost(shard_numels[k] * size) for k in self.resident)
        from zeroio.io import swapdir

        swapdir.remove_stale(settings.nvme_path)  # crashed runs' folders, any rank's
        swapped = sum(host_cost(n * size) for k, n in shard_numels.items() if k not in self.resident)
        self._floor = host_split.param_floor(resident_cost, largest, swapped)
        # DeepSpeed's buffers, at most what the swapped shards need ([Note: budgets in training])
        self._ask = host_split.param_ask(resident_cost, settings.host_buffer_bytes, swapped)
        budget = self._ask if user_cpu is None else min(self._ask, user_cpu)
        depth = tiering.prefetch_depth
        path = os.path.join(settings.nvme_path, f"stage3-params-rank{rank}")
        self._folder = swapdir.own_folder(path)  # removed again at close, when empty
        self.store = TieredStore(tiering, settings.aio, nvme_path=path,
                                 device=device if device.type == "cuda" else None,
                                 gpu_budget_bytes=0, cpu_budget_bytes=budget,
                                 prefetch_depth=0 if depth is None else depth,
                                 pin_memory=settings.pin_memory)
        self._bytes: dict[int, int] = {}
        self._reading: dict[int, torch.cuda.Event] = {}  # H2D copies still reading a buffer

    def put(self, key, shard):
        home = Tier.CPU if key in self.resident else Tier.NVME
        placed = self.store.register(_name(key), tuple(shard.shape), shard.dtype, home=home,
                                     init=Copies(self.transfers).host(shard.detach()))
        if placed is not home:  # a shard_numels/put mismatch would silently swap or pin
            raise ResidencyError(f"stage 3 shard {key} ({shard.numel()} elements) was placed in "
                                 f"{placed.value}, planned {home.value}: shard sizes given to "
                                 "the store differ from the shards put")
        self._bytes[key] = shard.numel() * shard.element_size()

    def fetch(self, key, streams):
        host = self.store.acquire(_name(key), Tier.CPU)
        ready = None
        try:
            with on(streams.h2d):
                dev = Copies(self.transfers).new(host, self.device,
                                                 non_blocking=host.is_pinned())
                ready = record(streams.h2d)
        finally:
            self.store.release(_name(key), Tier.CPU, after=ready)
        if ready is not None:
            self._reading[key] = ready
        return Fetched(dev, ready)

    def update(self, key, values, lo):
        self.update_pieces(key, [(lo, values)], whole=False)

    def update_pieces(self, key, pieces, *, whole):
        reading = self._reading.pop(key, None)
        if reading is not None:
            with StallTimer(self.transfers):
                reading.synchronize()  # the buffer about to be written may still feed a copy
        host = self.store.acquire(_name(key), Tier.CPU, overwrite=whole)
        try:
            if whole:  # contents undefined: zero what no piece covers (padding)
                at = 0
                for lo, values in sorted(pieces, key=lambda p: p[0]):
                    if lo > at:
                        host.narrow(0, at, lo - at).zero_()
                    at = max(at, lo + values.numel())
                if at < host.numel():
                    host.narrow(0, at, host.numel() - at).zero_()
            for lo, values in pieces:
                dst = host.narrow(0, lo, values.numel())
                Copies(self.transfers).into(dst, values)
            if not whole:
                self.store.mark_dirty(_name(key), Tier.CPU)
        finally:
            self.store.release(_name(key), Tier.CPU)

    def prefetch(self, keys):
        self.store.prefetch([_name(k) for k in keys], Tier.CPU)

    def cpu_floor(self) -> int:
        """Least host bytes this store can run in: resident shards + one largest shard."""
        return self._floor

    def cpu_ask(self) -> int:
        """Host bytes ``offload_param`` asks for: resident shards + swap buffers."""
        return self._ask

    def resident_bytes(self):
        st = self.store.stats()["tiers"]
        return {"cpu": st.get("cpu", {}).get("used_bytes", 0),
                "nvme": sum(n for k, n in self._bytes.items() if k not in self.resident)}

    def held_tensors(self):
        return []  # every shard, resident or swapped, is in the store: its stats report them

    def stats(self) -> dict:
        return self.store.stats()

    def close(self):
        from zeroio.io import swapdir

        self.store.close()
        if self._folder is not None:
            swapdir.remove_if_empty(self._folder)
