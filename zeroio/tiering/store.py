"""TieredStore: where every named tensor of training state lives, and moving it.

The partitioner and optimizer register named tensors, then ``acquire`` them in
the tier they compute in (GPU or CPU), ``mark_dirty`` what they changed and
``release`` them. The store keeps each tensor's home copy (GPU, CPU or NVMe)
and cache copies in the other memory tiers, evicts by policy, writes dirty
data back before its space is reused, and moves upcoming tensors ahead of use
on a prefetch thread (prefetcher.py) whose transfers run on the I/O engine's threads and on
CUDA copy streams. Invariants: [Note: copies] in tier.py; sources and waiting
rules: mover.py; where a home goes and what budgets keep room for ([Note:
placement]): placement.py; the streams: [Note: zeroio's CUDA streams] in streams.py.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import replace

import torch

from zeroio.config.policy import TieringPolicy
from zeroio.errors import CapacityError, ResidencyError, SwapIOError
from zeroio.tiering.acquirer import Acquirer
from zeroio.tiering.backend import NvmeBackend
from zeroio.tiering.config import STORE_READ_AHEAD, Budgets, store_policy
from zeroio.tiering.mover import Mover
from zeroio.tiering.placement import ORDER as _ORDER
from zeroio.tiering.placement import NvmeHomes, check_shrink, place_with_room
from zeroio.tiering.policy import PolicyKind, make_policy
from zeroio.tiering.prefetcher import Prefetcher
from zeroio.tiering.state import Copy, Entry, Space
from zeroio.tiering.stats import TierStats
from zeroio.tiering.streams import DeviceStreams
from zeroio.tiering.tier import Event, Residency, Tier
from zeroio.tiering.transfer import TierMemory


class TieredStore:
    """Named tensors over GPU / pinned CPU / NVMe tiers; see the module docstring."""

    def __init__(
        self,
        tiering: TieringPolicy | None = None,
        aio_cfg: object = None,
        nvme_path: str | None = None,
        device: torch.device | str | None = None,
        *,
        backend: NvmeBackend | None = None,
        **overrides: object,
    ):
        if nvme_path is not None:
            overrides.setdefault("nvme_path", str(nvme_path))
        self.cfg = store_policy(tiering, **overrides)
        """The ``TieringPolicy`` this store runs by (zeroio/tiering/config.py, ``store_policy``)."""
        depth = self.cfg.prefetch_depth
        self._depth = STORE_READ_AHEAD if depth is None else depth
        cuda = torch.cuda.is_available()
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if cuda else None)
        if backend is None and self.cfg.nvme_path is not None:
            from zeroio.tiering.nvme import TensorStoreBackend

            backend = TensorStoreBackend(self.cfg.nvme_path, aio_cfg)
        self._backend = backend
        self.budgets = Budgets.resolve(self.cfg, device=self.device, has_nvme=backend is not None)
        self._entries: dict[str, Entry] = {}
        self._nvme_homes = NvmeHomes()  # what the CPU tier keeps room for ([Note: placement])
        self._spaces: dict[Tier, Space] = {}
        for tier in _ORDER:
            budget = self.budgets.of(tier)
            memory = TierMemory(tier, budget, pin=self.cfg.pin_memory, device=self.device) \
                if tier.is_memory else None
            policy = make_policy(self.cfg.policy) if tier.is_memory else None
            self._spaces[tier] = Space(tier, budget, memory, policy)
        # The store's CUDA streams, from the device's owner: "h2d" carries loads to the GPU
        # so they overlap compute; "d2h" carries write-backs, so a load never waits
        # behind one. Completion is tracked per copy with events.
        owner = DeviceStreams.of(self.device) if cuda and self.budgets.gpu > 0 else None
        streams = {} if owner is None or not owner.cuda else {
            "h2d": owner.store_h2d, "d2h": owner.store_d2h}
        # One lock for all bookkeeping; as a Condition it also wakes a demand acquire
        # waiting for another thread's release ([Note: waiting for space] in mover.py).
        self._lock = threading.Condition(threading.Lock())
        self._stats = TierStats()
        self._mover = Mover(self._lock, self._spaces, backend, self._stats, streams, self._entries,
                            acquire_timeout=self.cfg.acquire_timeout_s)
        self._prefetcher = Prefetcher(self._lock, self._entries, self._mover, lambda: self._closed)
        self._acquirer = Acquirer(self._stats)
        self._closed = False

    # -- registration ---------------------------------------------------------

    def register(self, name: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
                 home: Tier | str = Tier.CPU, init: torch.Tensor | None = None) -> Tier:
        """Add a tensor (zeros, or a copy of ``init``); returns the tier its home is in
        ([Note: placement])."""
        shape = tuple(int(s) for s in shape)
        if not isinstance(name, str) or not name:
            raise ResidencyError(f"register: name must be a non-empty string, got {name!r}")
        if not isinstance(dtype, torch.dtype) or any(s < 0 for s in shape):
            raise ResidencyError(f"register({name!r}): bad shape {shape} or dtype {dtype!r}")
        if init is not None and init.numel() != _numel(shape):
            raise ResidencyError(
                f"register({name!r}): init has {init.numel()} elements, shape {shape} needs {_numel(shape)}")
        want = Tier.parse(home)
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            self._check_open()
            if name in self._entries:
                raise ResidencyError(f"register: {name!r} is already registered")
            tier = self._place_with_room(name, nbytes, want)
            entry = Entry(name, shape, dtype, nbytes, tier)
            copy = self._mover.new_copy(entry, tier, Residency.CLEAN, home=True)
            self._entries[name] = entry
            if tier is Tier.NVME:
                self._nvme_homes.add(self._spaces[Tier.CPU].cost(nbytes))
        try:
            self._fill_home(entry, copy, init)
        except BaseException:
            with self._lock:
                self._mover.drop(entry, copy)
                del self._entries[name]
                if tier is Tier.NVME:
                    self._nvme_homes.remove(self._spaces[Tier.CPU].cost(nbytes))
            raise
        return tier

    def _fill_home(self, entry: Entry, copy: Copy, init: torch.Tensor | None) -> None:
        if copy.tier is not Tier.NVME:
            if init is None:
                copy.tensor.zero_()
            else:
                copy.tensor.copy_(init.detach().reshape(entry.shape))
            return
        self._backend.create(entry.name, _numel(entry.shape), entry.dtype)  # type: ignore[union-attr]
        copy.zeros = init is None  # [Note: unwritten homes] in mover.py
        if init is not None:
            flat = init.detach().to("cpu", entry.dtype).contiguous().reshape(-1)
            try:
                self._backend.write(entry.name, flat).result()  # type: ignore[union-attr]
            except BaseException as exc:
                self._backend.delete(entry.name)  # type: ignore[union-attr]
                raise SwapIOError(f"register({entry.name!r}): writing init to NVMe failed: {exc}") from exc

    def _place_with_room(self, name: str, nbytes: int, want: Tier) -> Tier:
        return place_with_room(self._spaces, self._entries, self._nvme_homes, self._mover, name,
                               nbytes, want, has_nvme=self._backend is not None,
                               budgets=self.budgets, cfg=self.cfg)

    # -- acquire / release ----------------------------------------------------

    def acquire(self, name: str, tier: Tier | str, *, overwrite: bool = False) -> torch.Tensor:
        """The tensor resident in ``tier`` (GPU or CPU), stable until ``release``.

        ``overwrite=True``: the caller writes every element before it reads any. With no copy
        in ``tier`` one is allocated *without reading* (contents undefined) instead of loaded;
        either way the tensor comes back marked dirty (as after ``mark_dirty``), so a shard that
        is about to be replaced costs no read from its home."""
        t0 = time.perf_counter()
        self._mover.local.waited = 0.0
        with self._lock:
            try:
                if overwrite:
                    entry, copy = self._begin_overwrite(name, tier)
                else:
                    entry, copy = self._begin_acquire(name, tier)
                    self._finish_acquire(entry, copy)
            finally:
                if self._mover.local.waited:
                    self._stats.stalled(time.perf_counter() - t0)
            self._prefetch_upcoming(copy.tier)
            return copy.tensor

    def _prefetch_upcoming(self, tier: Tier) -> None:
        """Queue the accesses the policy predicts (trace policy; others predict none)."""
        names = self._spaces[tier].policy.upcoming(self._depth)  # type: ignore[union-attr]
        self._prefetcher.enqueue(names, tier)

    def acquire_async(self, name: str, tier: Tier | str) -> Future:
        """Like ``acquire`` but returns at once; the future's result is the tensor. Time a
        caller then blocks in ``result()`` counts as stall ([Note: stall and hidden time]).
        Loads start in call order and several can be in flight ([Note: asynchronous
        acquire] in acquirer.py)."""
        with self._lock:
            entry, tier = self._acquirable(name, tier)
            self._mover.settle_done()  # a write-back that landed has freed its copy by now
            self._mover.reap()
            self._spaces[tier].policy.touch(name)  # type: ignore[union-attr]
            copy = entry.copies.get(tier)
            if copy is not None:
                self._stats.hit()
                self._mover.pin(copy)
                copy.evict_after = False
            else:
                self._stats.miss()

        def start() -> Copy:
            if copy is not None:
                return copy
            with self._lock:
                self._check_open()
                loaded = self._mover.load(entry, tier, prefetch=False)
                self._mover.pin(loaded)  # type: ignore[arg-type]
                loaded.evict_after = False  # type: ignore[union-attr]
                return loaded  # type: ignore[return-value]

        def land(started: Copy) -> torch.Tensor:
            with self._lock:
                self._finish_acquire(entry, started)
                return started.tensor

        return self._acquirer.submit(start, land)

    def _begin_overwrite(self, name: str, tier: Tier | str) -> tuple[Entry, Copy]:
        """``acquire(overwrite=True)`` up to a pinned, DIRTY copy in ``tier`` (lock held)."""
        entry, tier = self._acquirable(name, tier)
        self._mover.reap()
        space = self._spaces[tier]
        space.policy.touch(name)  # type: ignore[union-attr]
        cost = space.cost(entry.nbytes)
        while True:
            copy = entry.copies.get(tier)
            if copy is not None:  # already here (or on its way): use it, then mark it dirty
                self._stats.hit()
                self._mover.pin(copy)
                copy.evict_after = False
                self._finish_acquire(entry, copy)
                try:
                    self._dirty(entry, copy, "acquire")
                except BaseException:
                    self._mover.unpin(copy)
                    raise
                return entry, copy
            # Every other copy is about to be superseded: let their moves land, make room.
            self._mover.quiesce(entry)
            if entry.copies.get(tier) is not None:
                continue
            self._mover.make_room(space, cost, name, prefetch=False)
            if (entry.copies.get(tier) is not None or space.used + cost > space.budget
                    or any(m.entry is entry for m in self._mover.inflight)):
                continue  # another thread acted while we waited
            held = [c.tier.value for c in entry.copies.values() if not c.is_home and c.pins]
            if held:
                raise ResidencyError(f"acquire({name!r}, {tier.value}, overwrite=True): it is "
                                     f"acquired in {held}; release it there first")
            for other in list(entry.copies.values()):
                if not other.is_home:
                    self._mover.drop(entry, other)
            copy = self._mover.new_copy(entry, tier, Residency.ABSENT, home=False)
            copy.fire(Event.OVERWRITE)
            self._stats.overwrote()
            self._mover.pin(copy)
            return entry, copy

    def _acquirable(self, name: str, tier: Tier | str) -> tuple[Entry, Tier]:
        self._check_open()
        tier = Tier.parse(tier)
        entry = self._entry(name)
        if not tier.is_memory:
            raise ResidencyError(f"acquire({name!r}, nvme): tensors are used from gpu or cpu")
        if self._spaces[tier].budget == 0:
            raise CapacityError(
                f"acquire({name!r}, {tier.value}): the {tier.value} tier has a budget of 0 bytes"
                + (" (no CUDA device)" if tier is Tier.GPU and not torch.cuda.is_available() else ""))
        if entry.error is not None:
            err, entry.error = entry.error, None
            raise err
        return entry, tier

    def _begin_acquire(self, name: str, tier: Tier | str) -> tuple[Entry, Copy]:
        entry, tier = self._acquirable(name, tier)
        self._mover.reap()
        self._spaces[tier].policy.touch(name)  # type: ignore[union-attr]
        copy = entry.copies.get(tier)
        if copy is not None:
            self._stats.hit()
        else:
            self._stats.miss()
            copy = self._mover.load(entry, tier, prefetch=False)
        self._mover.pin(copy)  # type: ignore[arg-type]
        copy.evict_after = False  # type: ignore[union-attr]
        return entry, copy  # type: ignore[return-value]

    def _finish_acquire(self, entry: Entry, copy: Copy) -> None:
        """Wait until ``copy`` holds the latest bytes (lock held).

        [Note: a load that failed before it was waited for] An asynchronous acquire pins a
        copy that another load is filling (a hit) and lands it later, on the landing thread.
        If that load fails and another thread settles it first (any ``settle_done`` poll),
        the copy is dropped before the landing thread looks: it is no longer LOADING and no
        longer the entry's copy. That is the load's failure, reported as such, never a
        handed-out tensor of a freed block."""
        try:
            while True:
                if entry.copies.get(copy.tier) is not copy:  # [Note: a load that failed ...]
                    err, entry.error = entry.error, None
                    raise err or SwapIOError(f"acquire({entry.name!r}): its {copy.tier.value} "
                                             "copy was dropped while it was being loaded")
                if copy.state is Residency.LOADING:
                    self._mover.wait(copy.move)  # type: ignore[arg-type]
                    if entry.copies.get(copy.tier) is not copy:
                        err, entry.error = entry.error, None
                        raise err or SwapIOError(f"acquire({entry.name!r}): load failed")
                    continue
                fresh = entry.freshest()
                if copy.is_home and fresh is not None and fresh is not copy:
                    # The home is stale: bring the newer bytes back before handing it out.
                    if fresh.state is Residency.DIRTY:
                        self._mover.writeback(entry, fresh, evict_after=False)
                    move = fresh.move
                    if move is not None:
                        err = self._mover.wait(move)
                        if err is not None:
                            entry.error = None
                            raise err
                    continue
                return
        except BaseException:
            if entry.copies.get(copy.tier) is copy:
                self._mover.unpin(copy)
            raise

    def mark_dirty(self, name: str, tier: Tier | str | None = None) -> None:
        """Record that the acquired tensor was written: other copies are dropped and
        this one is written back before its space is reused."""
        with self._lock:
            entry = self._entry(name)
            self._dirty(entry, self._held(entry, tier, "mark_dirty"), "mark_dirty")

    def _dirty(self, entry: Entry, copy: Copy, what: str) -> None:
        self._mover.quiesce(entry)
        for other in list(entry.copies.values()):
            if other is copy or other.is_home:
                continue
            if other.pins:
                raise ResidencyError(
                    f"{what}({entry.name!r}, {copy.tier.value}): it is also acquired in "
                    f"{other.tier.value}; release that first")
            self._mover.drop(entry, other)
        if not copy.is_home:
            copy.fire(Event.WRITE)

    def release(self, name: str, tier: Tier | str | None = None, *, after: object = None) -> None:
        """Drop one acquire. ``after`` (a CUDA event, or anything with ``query()`` and
        ``synchronize()``): release only once it completes, e.g. when an asynchronous
        copy still reads the tensor; until then the space counts as soon free."""
        with self._lock:
            entry = self._entry(name)
            copy = self._held(entry, tier, "release")
            if after is not None and not after.query():
                self._mover.defer_release(entry, copy, after)
                return
            self._mover.unpin(copy)
            if copy.pins == 0:
                self._prefetch_upcoming(copy.tier)  # it may be the victim a prefetch waited for

    def _held(self, entry: Entry, tier: Tier | str | None, what: str) -> Copy:
        self._check_open()
        if tier is None:
            tiers = entry.pinned_tiers()
            if len(tiers) != 1:
                raise ResidencyError(
                    f"{what}({entry.name!r}): acquired in {[t.value for t in tiers] or 'no tier'}; "
                    f"pass the tier")
            tier = tiers[0]
        tier = Tier.parse(tier)
        copy = entry.copies.get(tier)
        if copy is None or copy.pins == 0:
            raise ResidencyError(f"{what}({entry.name!r}, {tier.value}): it is not acquired there")
        return copy

    def evict(self, name: str, tier: Tier | str) -> None:
        """A hint that ``name``'s copy in ``tier`` is not needed again soon: start writing it
        back if it is dirty and free its space once that lands (clean: at once). Returns
        without waiting; a copy that is acquired, moving or absent is left alone. A caller
        that knows its sweep (the optimizer) writes behind with it, so a later load does
        not first wait for the write-back of its victim."""
        with self._lock:
            self._check_open()
            entry = self._entry(name)
            copy = entry.copies.get(Tier.parse(tier))
            if copy is None or copy.is_home or not copy.evictable or entry.error is not None:
                return
            if copy.tier is Tier.GPU and entry.home is Tier.NVME:
                return  # its write-back needs a CPU copy first (room to make: may wait)
            if copy.state is Residency.CLEAN:
                self._mover.drop(entry, copy)
            else:
                self._mover.writeback(entry, copy, evict_after=True)

    def drop(self, name: str, tier: Tier | str) -> None:
        """``name``'s copy in ``tier`` holds dead bytes (a gradient the step has used, [Note:
        paged gradients] in zeroio/shard/paged_grads.py): free it now without writing it
        back, whatever its state; the home keeps what it held, and the next writer overwrites
        it. A copy that is acquired, moving or absent is left alone."""
        with self._lock:
            self._check_open()
            entry = self._entry(name)
            copy = entry.copies.get(Tier.parse(tier))
            if copy is None or copy.is_home or not copy.evictable:
                return
            self._mover.drop(entry, copy)

    # -- prefetch -------------------------------------------------------------

    def prefetch(self, names: list[str], tier: Tier | str) -> None:
        """Start moving ``names`` into ``tier`` in the background (a hint: a tier with
        no room worth making skips it)."""
        tier = Tier.parse(tier)
        with self._lock:
            self._check_open()
            for name in names:
                self._entry(name)
            if not tier.is_memory or self._spaces[tier].budget == 0:
                return
            self._prefetcher.enqueue(list(names), tier)

    # -- steps, flush, stats, close ---------------------------------------------

    def step_boundary(self) -> None:
        with self._lock:
            self._check_open()
            for space in self._spaces.values():
                if space.policy is not None:
                    space.policy.step_boundary()
            self._stats.step_boundary()

    def drain(self) -> None:
        """Wait until every transfer in flight (loads, write-backs) has landed; starts
        nothing new (``flush`` also writes dirty copies back). Counters are exact after it."""
        with self._lock:
            self._check_open()
            self._mover.quiesce()

    def flush(self) -> None:
        """Write every dirty copy back to its home and wait (homes then hold the
        latest value: what a checkpoint reads)."""
        self._prefetcher.join()
        with self._lock:
            self._check_open()
            self._mover.quiesce()
            errors = []
            for entry in self._entries.values():
                while (fresh := entry.freshest()) is not None:
                    if fresh.state is Residency.DIRTY:
                        self._mover.writeback(entry, fresh, evict_after=False)
                    if fresh.move is None:
                        continue
                    if self._mover.wait(fresh.move) is not None:
                        errors.append(entry.error)
                        entry.error = None
                        break
            if errors:
                raise errors[0]

    def check_writes(self) -> None:
        """Raise the oldest write-back failure not reported to anyone yet, as a ``SwapIOError``
        with its errno, naming the file ([Note: a write-back that failed] in mover.py). A
        caller whose work begins (the NVMe optimizer's step) asks first, so that a failure of
        the write-behind of its previous step fails this one before it changes anything."""
        with self._lock:
            self._check_open()
            self._mover.raise_write_failure("reported when the next step began")

    def clear_errors(self) -> int:
        """Forget every I/O error not yet reported to an acquirer (``Entry.error``): after the
        state they concern has been replaced (a checkpoint load) or the failed step rolled
        back, the next acquire must read or write afresh, not raise an old failure (a full
        disk that has since been freed). Copies are untouched: a dirty copy whose write-back
        failed stays dirty and is written back again. Returns how many errors were dropped."""
        with self._lock:
            self._check_open()
            self._mover.settle_done()
            dropped = 0
            for entry in self._entries.values():
                if entry.error is not None:
                    entry.error = None
                    dropped += 1
            return dropped

    def stats(self) -> dict:
        with self._lock:
            self._mover.settle_done()
            self._mover.reap()
            out = self._stats.as_dict()
            out["tiers"] = {
                t.value: {"budget_bytes": s.budget, "used_bytes": s.used, "home_bytes": s.home_used,
                          "cached": len(s.cache)}
                for t, s in self._spaces.items()
            }
            out["policy"] = PolicyKind.parse(self.cfg.policy).value
            return out

    def home_files(self, name: str) -> list[tuple[str, int, int, int, int]] | None:
        """The files of ``name``'s NVMe home (``NvmeBackend.files_of``), once they hold its
        latest bytes (after ``flush``, no dirty copy since); None when its home is not NVMe
        or not in files. A checkpoint shares them instead of copying the tensor."""
        with self._lock:
            self._check_open()
            entry = self._entry(name)
            if entry.home is not Tier.NVME or self._backend is None:
                return None
            fresh = entry.freshest()
            if fresh is not None and not fresh.is_home:
                raise ResidencyError(f"home_files({name!r}): a {fresh.tier.value} copy is newer "
                                     "than its NVMe home; flush first")
            return self._backend.files_of(name)

    def residency(self, name: str) -> dict[str, str]:
        """{tier: state} of ``name``'s copies, e.g. {"nvme": "clean", "cpu": "dirty"}."""
        with self._lock:
            return {t.value: c.state.value for t, c in self._entry(name).copies.items()}

    def home_of(self, name: str) -> Tier:
        with self._lock:
            return self._entry(name).home

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def close(self) -> None:
        """Free every copy, delete the NVMe arrays and stop the threads; data not
        flushed is gone (the store holds swap, checkpoints are written elsewhere)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._prefetcher.shutdown()
        self._acquirer.shutdown()
        with self._lock:
            while self._mover.deferred:
                self._mover._wait_deferred(self._mover.deferred[0])
            self._mover.quiesce()
            for entry in self._entries.values():
                for copy in list(entry.copies.values()):
                    self._mover.drop(entry, copy)
                if entry.home is Tier.NVME:
                    self._backend.delete(entry.name)  # type: ignore[union-attr]
            self._entries.clear()
            self._nvme_homes = NvmeHomes()
            for space in self._spaces.values():
                if space.memory is not None:
                    space.memory.close()
        if self._backend is not None:
            self._backend.close()

    def shrink_budget(self, tier: Tier | str, nbytes: int) -> None:
        """Lower ``tier``'s budget to ``nbytes`` (the engine's split of a user budget among
        stores, [Note: budgets in training] in budget.py): cache copies beyond it are
        evicted now (dirty ones written back first). ``CapacityError`` when the homes (and,
        for CPU, room for the largest NVMe-homed tensor) do not fit in ``nbytes``."""
        tier = Tier.parse(tier)
        with self._lock:
            self._check_open()
            space = self._spaces[tier]
            if nbytes >= space.budget:
                return
            check_shrink(self._spaces, self._nvme_homes, tier, nbytes)
            if space.used > nbytes:
                self._mover.make_room(space, space.budget - nbytes, "<budget>", prefetch=False)
                self._mover.quiesce()
            space.budget = nbytes
            self.budgets = replace(self.budgets, **{tier.value: nbytes})

    def held_host_bytes(self) -> int:
        """Bytes the CPU tier's buffer pool has handed out (0 after close)."""
        return self._spaces[Tier.CPU].memory.held_bytes  # type: ignore[union-attr]

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _entry(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise ResidencyError(f"tiered store: no tensor named {name!r} is registered") from None

    def _check_open(self) -> None:
        if self._closed:
            raise ResidencyError("tiered store: it is closed")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
