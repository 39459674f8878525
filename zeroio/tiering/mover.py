"""Moves bytes between tiers: loads, write-backs, eviction, settling.

Every method here is called with the store's lock held. A method that must
wait for a transfer releases the lock while it waits (``wait``), so callers
re-read state after any call that can wait: another thread may have acted.

[Note: sources] A new cache copy is filled from the freshest copy: a DIRTY (or
being written back) copy if one exists, else a memory copy (GPU and CPU are
faster sources than NVMe), else the home. A GPU copy of an NVMe-homed tensor
is staged through a CPU copy, which stays as a clean cache copy.

[Note: waiting for space] A *prefetch* never waits and never fails for lack
of space: it is a hint, dropped when the policy finds nothing worth evicting.
A *demand* (acquire) evicts what the policy allows, waits for in-flight moves
and for releases that wait on a sync object (``release(after=event)``: the
event will complete), and then, if the rest of the tier is held by other
threads, waits on the store's condition for one of them to release, up to
``acquire_timeout_s``. It raises ``CapacityError`` (naming budget, homes and
holders) only when waiting cannot help: the tensor is larger than what homes
leave of the budget, or the copies in the way are held by the calling thread
itself (it cannot release while it waits), or the bounded wait ran out.

[Note: a write-back that failed] A write-back that fails loses nothing: its copy goes back to
DIRTY and keeps the only current bytes, so it is kept (never dropped, never a victim) until
someone has been told. Its error is the entry's (``Entry.error``) and is listed in
``write_failures`` until it is reported: to the caller that waits for that write-back (a
demand that needed the room, ``flush``), to the next acquire of the tensor, or else to the
first demand that finds no room without it (``make_room`` raises it instead of waiting
``acquire_timeout_s`` for a release that cannot come and then blaming the budget), or to
whoever asks (``TieredStore.check_writes``: the NVMe optimizer, as its step begins). Once
reported, the copy is an ordinary dirty copy again and is written back anew when room is
needed: after the disk has room again, nothing was lost. The error carries the OS's errno and
names it with the file (the I/O layer's message), and is raised as a ``SwapIOError`` with
that errno.

[Note: unwritten homes] A tensor registered with an NVMe home and no ``init`` is zeros, and
its preallocated array reads back as zeros (backend.py's contract), so its first load fills
the cache copy with zeros instead of reading the disk: the first step of an optimizer whose
moments are homed on NVMe does not read tens of GB of zeros. The home stops counting as
unwritten when the first write-back into it starts; from then on loads read the disk (while
that write is in flight, loads come from the copy being written: [Note: sources]). Such a
load moves no bytes, so it is not counted in ``bytes_moved``.
"""

from __future__ import annotations

import errno
import threading
import time

from zeroio.errors import CapacityError, SwapIOError
from zeroio.tiering.backend import NvmeBackend
from zeroio.tiering.state import DEFERRED, Copy, Deferred, Entry, Move, MoveKind, Space
from zeroio.tiering.stats import TierStats
from zeroio.tiering.streams import copy
from zeroio.tiering.tier import Event, Residency, Tier, pair
from zeroio.tiering.transfer import Transfer


class Mover:
    def __init__(self, lock: threading.Condition, spaces: dict[Tier, Space], backend: NvmeBackend | None,
                 stats: TierStats, streams: dict[str, object], entries: dict[str, Entry],
                 acquire_timeout: float = 120.0):
        self.lock = lock  # a Condition: notified whenever space may have been freed
        self.acquire_timeout = acquire_timeout
        self.deferred: list[Deferred] = []
        self.entries = entries
        self.spaces = spaces
        self.backend = backend
        self.stats = stats
        # Host-to-device copies overlap compute on one stream, device-to-host
        # write-backs on another, so a load never queues behind a write-back.
        self.streams = streams
        self.inflight: set[Move] = set()
        self.write_failures: list[Move] = []  # [Note: a write-back that failed]
        self.local = threading.local()  # per-thread seconds spent waiting (stall accounting)

    # -- waiting and settling ---------------------------------------------------

    def wait(self, move: Move) -> BaseException | None:
        """Wait for ``move`` with the lock released, then settle it; returns its error."""
        if not move.settled:
            t0 = time.perf_counter()
            self.lock.release()
            try:
                move.transfer.wait()
            finally:
                self.lock.acquire()
                self.local.waited = getattr(self.local, "waited", 0.0) + time.perf_counter() - t0
            self.settle(move)
        return move.error

    def settle(self, move: Move) -> None:
        if move.settled:
            return
        exc = move.transfer.wait()  # done already: returns at once
        move.settled = True
        self.inflight.discard(move)
        entry, src, dst = move.entry, move.src, move.dst
        src.readers -= 1
        if move.kind is MoveKind.LOAD:
            dst.move = None
            if exc is None:
                dst.fire(Event.LOAD_DONE)
                if not move.read_nothing:
                    self.stats.moved(pair(src.tier, dst.tier), entry.nbytes)
            else:
                move.error = entry.error = io_error(
                    f"tiered store: loading {entry.name!r} {pair(src.tier, dst.tier)}", exc)
                dst.fire(Event.LOAD_FAILED)
                self.drop(entry, dst)
        else:
            src.move = None
            if exc is None:
                src.fire(Event.WRITEBACK_DONE)
                self.stats.moved(pair(src.tier, dst.tier), entry.nbytes)
                self.stats.wrote_back()
                if move.kind is MoveKind.HANDDOWN:
                    dst.move = None
                    dst.fire(Event.LOAD_DONE)
                    dst.fire(Event.WRITE)
                if src.evict_after and src.evictable:
                    self.drop(entry, src)
            else:
                move.error = entry.error = io_error(
                    f"tiered store: writing back {entry.name!r} {pair(src.tier, dst.tier)}", exc)
                self.write_failures.append(move)  # [Note: a write-back that failed]
                src.fire(Event.WRITEBACK_FAILED)
                if move.kind is MoveKind.HANDDOWN:
                    dst.move = None
                    dst.fire(Event.LOAD_FAILED)
                    self.drop(entry, dst)
            src.evict_after = False
            if dst.is_home and dst.tier is not Tier.NVME:
                dst.readers -= 1  # the home was held while being written into

    def settle_done(self) -> None:
        """Settle every move that has finished (cheap poll)."""
        for move in [m for m in self.inflight if m.transfer.done()]:
            self.settle(move)

    def raise_write_failure(self, where: str, tier: Tier | None = None) -> None:
        """Raise the oldest write-back failure (of a copy in ``tier``; any tier: None) that no
        one was told of yet, as reported to this caller ([Note: a write-back that failed])."""
        self.settle_done()
        # reported elsewhere meanwhile (a waiter, an acquire, clear_errors): no longer pending
        self.write_failures = [m for m in self.write_failures if m.entry.error is m.error]
        for move in self.write_failures:
            if tier is None or move.src.tier is tier:
                self.write_failures.remove(move)
                move.entry.error = None
                raise reraised(move.error, where) from move.error

    def quiesce(self, entry: Entry | None = None) -> None:
        """Wait until no move (of ``entry``, or of any entry) is in flight."""
        while True:
            moves = [m for m in self.inflight if entry is None or m.entry is entry]
            if not moves:
                return
            self.wait(moves[0])

    # -- pins -----------------------------------------------------------------

    def pin(self, copy: Copy) -> None:
        copy.pins += 1
        copy.holders.append(threading.get_ident())

    def unpin(self, copy: Copy, holder: int | None = None) -> None:
        """Drop one pin: ``holder``'s, else the calling thread's, else the oldest."""
        me = threading.get_ident() if holder is None else holder
        if me in copy.holders:
            copy.holders.remove(me)
        elif copy.holders:
            copy.holders.pop(0)
        copy.pins -= 1
        self.lock.notify_all()

    def defer_release(self, entry: Entry, copy: Copy, event: object) -> None:
        """Release once ``event`` completes; until then the pin counts as freeable."""
        me = threading.get_ident()
        idx = copy.holders.index(me) if me in copy.holders else 0
        if copy.holders:
            copy.holders[idx] = DEFERRED
        self.deferred.append(Deferred(entry, copy, event))

    def reap(self) -> None:
        """Carry out deferred releases whose event has completed (cheap poll)."""
        for d in [d for d in self.deferred if d.event.query()]:
            self._finish_deferred(d)

    def _finish_deferred(self, d: Deferred) -> None:
        if d in self.deferred:
            self.deferred.remove(d)
            if d.entry.copies.get(d.copy.tier) is d.copy and d.copy.pins:
                self.unpin(d.copy, DEFERRED)

    def _wait_deferred(self, d: Deferred) -> None:
        t0 = time.perf_counter()
        self.lock.release()
        try:
            d.event.synchronize()
        finally:
            self.lock.acquire()
            self.local.waited = getattr(self.local, "waited", 0.0) + time.perf_counter() - t0
        self._finish_deferred(d)

    def _holders(self, space: Space) -> str:
        names = {t.ident: t.name for t in threading.enumerate()}
        held = []
        for name, c in space.cache.items():
            if c.pins:
                who = ", ".join("a pending copy" if h == DEFERRED else names.get(h, f"thread {h}")
                                for h in c.holders)
                held.append(f"{name!r} ({c.cost} bytes, held by {who})")
        return "; ".join(held) or "none"

    # -- copies -------------------------------------------------------------

    def new_copy(self, entry: Entry, tier: Tier, state: Residency, *, home: bool) -> Copy:
        space = self.spaces[tier]
        cost = space.cost(entry.nbytes)
        if space.used + cost > space.budget:  # callers make room first; this is a bug guard
            raise CapacityError(
                f"tiered store: {tier.value} tier would hold {space.used + cost} bytes, "
                f"over its budget of {space.budget} (placing {entry.name!r})"
            )
        block = None
        if tier is not Tier.NVME:
            block = space.memory.allocate(entry.shape, entry.dtype, entry.nbytes)  # type: ignore[union-attr]
        copy = Copy(tier=tier, is_home=home, state=state, block=block)
        space.used += cost
        if home:
            space.home_used += cost
        else:
            space.cache[entry.name] = copy
            space.policy.admit(entry.name)  # type: ignore[union-attr]
        entry.copies[tier] = copy
        return copy

    def drop(self, entry: Entry, copy: Copy) -> None:
        """Free a copy's space (its data must be elsewhere or be worthless)."""
        space = self.spaces[copy.tier]
        if entry.copies.get(copy.tier) is copy:
            del entry.copies[copy.tier]
        if copy.state is Residency.CLEAN:
            copy.fire(Event.EVICT)
        elif copy.state is Residency.DIRTY:
            copy.fire(Event.DISCARD)  # superseded by a newer write elsewhere
        elif copy.state is not Residency.ABSENT:
            copy.fire(Event.EVICT)  # in flight: a bug; raises ResidencyError
        space.used -= copy.cost
        if copy.is_home:
            space.home_used -= copy.cost
        elif space.cache.get(entry.name) is copy:
            del space.cache[entry.name]
            space.policy.forget(entry.name)  # type: ignore[union-attr]
        if copy.block is not None and space.memory is not None:
            space.memory.free(copy.block)
        copy.block = None
        self.lock.notify_all()

    # -- transfers -----------------------------------------------------------

    def _transfer(self, entry: Entry, src: Copy, dst: Copy) -> Transfer:
        if src.tier is Tier.NVME or dst.tier is Tier.NVME:
            # disk I/O: its future says when it ends, so its busy time is known
            # ([Note: stall and hidden time] in stats.py)
            self.stats.transfer_started()
            try:
                future = (self.backend.read_into(entry.name, dst.tensor)  # type: ignore[union-attr]
                          if src.tier is Tier.NVME else
                          self.backend.write(entry.name, src.tensor))  # type: ignore[union-attr]
            except BaseException:
                self.stats.transfer_finished()
                raise
            future.add_done_callback(self.stats.transfer_finished)
            return Transfer(future=future)
        # Between pinned host memory and the GPU: the copy stream first waits for the compute
        # stream, since the destination's memory may have just been freed by kernels still
        # queued there, and the source may have just been written by them.
        stream = self.streams["h2d" if dst.tier is Tier.GPU else "d2h"]
        handle = copy(src.tensor, dst.tensor, stream, after="current")  # type: ignore[arg-type]
        return Transfer(event=handle.event)

    def _start(self, kind: MoveKind, entry: Entry, src: Copy, dst: Copy) -> Move:
        src.readers += 1
        read_nothing = src.tier is Tier.NVME and src.zeros  # [Note: unwritten homes]
        try:
            if read_nothing:
                dst.tensor.zero_()
                transfer = Transfer()
            else:
                transfer = self._transfer(entry, src, dst)
        except BaseException as exc:
            # A transfer that cannot even start is a failed transfer.
            fut_err = exc

            class _Failed(Transfer):
                def done(self) -> bool:
                    return True

                def wait(self) -> BaseException | None:
                    return fut_err

            transfer = _Failed()
        move = Move(kind, entry, src, dst, transfer, read_nothing=read_nothing)
        self.inflight.add(move)
        if kind is MoveKind.LOAD:
            dst.move = move
        else:
            src.move = move
            if kind is MoveKind.HANDDOWN:
                dst.move = move
            if dst.is_home and dst.tier is not Tier.NVME:
                dst.readers += 1
        return move

    # -- loading ---------------------------------------------------------------

    def source(self, entry: Entry, target: Tier) -> Copy | None:
        """Where a new copy in ``target`` is filled from; see [Note: sources].
        None: a GPU target of an NVMe-homed tensor needs a CPU copy first."""
        fresh = entry.freshest()
        if fresh is not None:
            return fresh
        for tier in (Tier.GPU, Tier.CPU):
            c = entry.copies.get(tier)
            if tier is not target and c is not None and c.state is not Residency.ABSENT:
                return c  # may be LOADING: the caller waits for it
        if target is Tier.GPU and entry.home is Tier.NVME:
            return None
        return entry.home_copy

    def load(self, entry: Entry, tier: Tier, *, prefetch: bool) -> Copy | None:
        """Start filling a cache copy of ``entry`` in ``tier``; returns it (maybe still
        LOADING), or None when a prefetch declines (no room worth making)."""
        while True:
            existing = entry.copies.get(tier)
            if existing is not None:
                return existing
            src = self.source(entry, tier)
            if src is None:
                staged = self.load(entry, Tier.CPU, prefetch=prefetch)
                if staged is None:
                    return None
                if staged.move is not None and staged.state is Residency.LOADING:
                    self.wait(staged.move)
                continue
            if src.state is Residency.LOADING:
                self.wait(src.move)  # type: ignore[arg-type]
                continue
            space = self.spaces[tier]
            if not self.make_room(space, space.cost(entry.nbytes), entry.name, prefetch=prefetch):
                return None
            if entry.copies.get(tier) is not None or self.source(entry, tier) is not src:
                continue  # another thread acted while make_room waited
            if space.used + space.cost(entry.nbytes) > space.budget:
                continue
            dst = self.new_copy(entry, tier, Residency.ABSENT, home=False)
            dst.fire(Event.START_LOAD)
            self._start(MoveKind.LOAD, entry, src, dst)
            return dst

    # -- write-back and eviction -------------------------------------------

    def writeback(self, entry: Entry, copy: Copy, *, evict_after: bool) -> Move | None:
        """Start writing a DIRTY copy down (None: it finished at once)."""
        if copy.tier is Tier.GPU and entry.home is Tier.NVME:
            return self._hand_down(entry, copy, evict_after)
        copy.fire(Event.START_WRITEBACK)
        copy.evict_after = evict_after
        entry.home_copy.zeros = False  # from now on the disk holds written bytes
        return self._start(MoveKind.WRITEBACK, entry, copy, entry.home_copy)

    def _hand_down(self, entry: Entry, copy: Copy, evict_after: bool) -> Move | None:
        """A GPU copy of an NVMe-homed tensor is written back by passing its dirt to a
        CPU copy (the disk is reached from pinned host memory only)."""
        space = self.spaces[Tier.CPU]
        cost = space.cost(entry.nbytes)
        while True:
            cpu = entry.copies.get(Tier.CPU)
            if cpu is not None and cpu.state is Residency.LOADING:
                self.wait(cpu.move)  # type: ignore[arg-type]
            elif cpu is not None:
                # By [Note: copies] it already holds the latest bytes: hand over the dirt.
                cpu.fire(Event.WRITE)
                copy.fire(Event.START_WRITEBACK)
                copy.fire(Event.WRITEBACK_DONE)
                self.stats.wrote_back()
                if evict_after and copy.evictable:
                    self.drop(entry, copy)
                return None
            else:
                self.make_room(space, cost, entry.name, prefetch=False)
                if entry.copies.get(Tier.CPU) is None and space.used + cost <= space.budget:
                    break
            if entry.copies.get(Tier.GPU) is not copy or copy.state is not Residency.DIRTY:
                return None  # another thread acted while we waited
        dst = self.new_copy(entry, Tier.CPU, Residency.ABSENT, home=False)
        dst.fire(Event.START_LOAD)
        copy.fire(Event.START_WRITEBACK)
        copy.evict_after = evict_after
        return self._start(MoveKind.HANDDOWN, entry, copy, dst)

    def make_room(self, space: Space, cost: int, for_name: str, *, prefetch: bool) -> bool:
        """Evict until ``cost`` bytes fit in ``space``; see [Note: waiting for space].
        A prefetch gives up (False) rather than wait or evict against the policy; a
        demand waits as the note says, SwapIOError when a write-back it needed failed."""
        if cost > space.budget - space.home_used:
            if prefetch:
                return False
            raise CapacityError(
                f"tiered store: {for_name!r} needs {cost} bytes in the {space.tier.value} tier; "
                f"its budget is {space.budget} bytes of which homes hold {space.home_used}; "
                f"raise zero_optimization.tiering.{space.tier.value}_budget_bytes"
            )
        deadline = None
        started: list[Move] = []  # write-backs of victims this call started
        while space.used + cost > space.budget:
            self.settle_done()
            self.reap()
            failed = next((m for m in started if m.settled and m.error is not None), None)
            if failed is not None:
                # settled by the poll above, not by _wait_eviction: report it the same way
                started.remove(failed)
                if not prefetch:
                    failed.entry.error = None
                    raise reraised(failed.error, f"while making room in the {space.tier.value} "
                                   "tier") from failed.error
            if space.used + cost <= space.budget or for_name in space.cache:
                break  # room now, or another thread brought the tensor in meanwhile
            leaving = [c for c in space.cache.values() if c.evict_after and c.move is not None]
            if leaving and space.used - sum(c.cost for c in leaving) + cost <= space.budget:
                self._wait_eviction(leaving[0], prefetch=prefetch)
                continue
            # A copy whose entry holds an unreported I/O error is kept (it may be the
            # only good copy) until its owner has seen the error.
            cands = [n for n, c in space.cache.items()
                     if n != for_name and c.evictable and self.entries[n].error is None]
            held = [n for n in space.cache if n not in cands]
            wanted = for_name if prefetch else None
            victim = space.policy.victim(cands, wanted, held) if cands else None  # type: ignore[union-attr]
            if victim is not None:
                copy = space.cache[victim]
                entry = self.entries[victim]
                if copy.state is Residency.CLEAN:
                    self.drop(entry, copy)
                else:
                    move = self.writeback(entry, copy, evict_after=True)
                    if move is not None:
                        started.append(move)
                continue
            if leaving:
                self._wait_eviction(leaving[0], prefetch=prefetch)
                continue
            if prefetch:
                return False
            moving = [c.move for c in space.cache.values() if c.move is not None]
            if moving:
                self.wait(moving[0])
                continue
            pending = [d for d in self.deferred if d.copy.tier is space.tier]
            if pending:
                self._wait_deferred(pending[0])
                continue
            # a copy kept for its failed write-back may be what is in the way: say so now
            # instead of waiting for a release that cannot come ([Note: a write-back that failed])
            self.raise_write_failure(f"while making room for {for_name!r} in the "
                                     f"{space.tier.value} tier", space.tier)
            deadline = self._wait_release(space, cost, for_name, deadline)
        return True

    def _wait_release(self, space: Space, cost: int, for_name: str, deadline: float | None) -> float:
        """Wait on the condition for another thread's release; raise when it cannot come."""
        mine = space.pinned_by(threading.get_ident())
        now = time.monotonic()
        deadline = now + self.acquire_timeout if deadline is None else deadline
        if cost > space.budget - space.home_used - mine or now >= deadline:
            why = (f"waited {self.acquire_timeout:.0f} s for a release" if now >= deadline else
                   f"the calling thread itself holds {mine} bytes of it")
            raise CapacityError(
                f"tiered store: no room for {for_name!r} ({cost} bytes) in the {space.tier.value} "
                f"tier ({why}): budget {space.budget} bytes, homes {space.home_used}, acquired or "
                f"in use {space.pinned_bytes()}, free {space.free}; holders: {self._holders(space)}; "
                f"release tensors first or raise zero_optimization.tiering.{space.tier.value}_budget_bytes"
            )
        t0 = time.perf_counter()
        self.lock.wait(deadline - now)
        self.local.waited = getattr(self.local, "waited", 0.0) + time.perf_counter() - t0
        return deadline

    def _wait_eviction(self, copy: Copy, *, prefetch: bool) -> None:
        move = copy.move
        err = self.wait(move)  # type: ignore[arg-type]
        if err is not None and not prefetch:
            move.entry.error = None  # reported here, to the caller that needed the space
            raise reraised(err, f"while making room in the {copy.tier.value} tier") from err


def io_error(what: str, exc: BaseException) -> SwapIOError:
    """``what`` failed because of ``exc``, as a ``SwapIOError`` with ``exc``'s errno, named
    (``ENOSPC``) beside the I/O layer's message, which names the file."""
    code = getattr(exc, "errno", None)
    if not code:
        return SwapIOError(f"{what} failed: {exc}")
    name = errno.errorcode.get(code, str(code))
    return SwapIOError(code, f"{what} failed ({name}): {_message(exc)}")


def reraised(err: BaseException, where: str) -> SwapIOError:
    """``err`` reported to a caller ``where`` (its errno kept)."""
    code = getattr(err, "errno", None)
    if not code:
        return SwapIOError(f"{err} ({where})")
    return SwapIOError(code, f"{_message(err)} ({where})")


def _message(exc: BaseException) -> str:
    """An OSError's words without the ``[Errno N]`` prefix ``str`` adds."""
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
