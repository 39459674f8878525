"""Bookkeeping objects of the tiered store: entries, copies, moves, tier spaces.

See [Note: copies] in zeroio/tiering/tier.py for the invariant they keep.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from zeroio.tiering.policy import EvictionPolicy
from zeroio.tiering.tier import Event, Residency, Tier
from zeroio.tiering.transfer import Block, TierMemory, Transfer


class MoveKind(enum.Enum):
    LOAD = "load"  # fill a new cache copy from the freshest copy
    WRITEBACK = "writeback"  # write a DIRTY copy into the home
    HANDDOWN = "handdown"  # GPU copy of an NVMe-homed tensor passes its dirt to a new CPU copy


@dataclass(eq=False)
class Copy:
    tier: Tier
    is_home: bool
    state: Residency
    block: Block | None = None  # None for an NVMe home (the backend holds the bytes)
    pins: int = 0  # callers holding it between acquire and release
    holders: list[int] = field(default_factory=list)  # thread id per pin; DEFERRED once handed over
    readers: int = 0  # in-flight moves reading it
    move: Move | None = None  # in-flight move that will change this copy's state
    evict_after: bool = False  # drop once its write-back lands
    zeros: bool = False
    """An NVMe home never written since ``register`` created it: it reads as zeros, so a load
    fills zeros without reading the disk ([Note: unwritten homes] in mover.py)."""

    @property
    def tensor(self) -> torch.Tensor:
        return self.block.tensor  # type: ignore[union-attr]

    @property
    def cost(self) -> int:
        return self.block.cost if self.block is not None else 0

    def fire(self, event: Event) -> None:
        self.state = self.state.after(event)

    @property
    def evictable(self) -> bool:
        return (
            not self.is_home
            and self.pins == 0
            and self.readers == 0
            and self.state in (Residency.CLEAN, Residency.DIRTY)
        )


@dataclass(eq=False)
class Move:
    kind: MoveKind
    entry: Entry
    src: Copy
    dst: Copy
    transfer: Transfer
    settled: bool = False
    error: BaseException | None = None
    read_nothing: bool = False  # a load from an unwritten NVMe home: zeros, no bytes moved


@dataclass(eq=False)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    home: Tier
    copies: dict[Tier, Copy] = field(default_factory=dict)
    error: BaseException | None = None  # an I/O failure not yet reported to an acquirer

    @property
    def home_copy(self) -> Copy:
        return self.copies[self.home]

    def freshest(self) -> Copy | None:
        """The copy a write-back would come from: DIRTY or being written back."""
        for c in self.copies.values():
            if c.state in (Residency.DIRTY, Residency.WRITING_BACK):
                return c
        return None

    def pinned_tiers(self) -> list[Tier]:
        return [t for t, c in self.copies.items() if c.pins > 0]


@dataclass(eq=False)
class Space:
    """One tier's budget and what occupies it."""

    tier: Tier
    budget: int
    memory: TierMemory | None
    policy: EvictionPolicy | None
    used: int = 0
    home_used: int = 0
    cache: dict[str, Copy] = field(default_factory=dict)  # name -> cache copy in this tier

    def cost(self, nbytes: int) -> int:
        return self.memory.cost(nbytes) if self.memory is not None else nbytes

    @property
    def free(self) -> int:
        return self.budget - self.used

    def pinned_bytes(self) -> int:
        return sum(c.cost for c in self.cache.values() if c.pins or c.readers)

    def pinned_by(self, thread: int) -> int:
        """Bytes of cache copies only ``thread`` holds: no other thread's release frees them."""
        return sum(c.cost for c in self.cache.values()
                   if c.pins and all(h == thread for h in c.holders))


DEFERRED = 0
"""Holder of a pin whose release waits on a sync object (``release(after=event)``)."""


@dataclass(eq=False)
class Deferred:
    """A release that happens once ``event`` completes (a CUDA event: a copy still reads the copy)."""

    entry: Entry
    copy: Copy
    event: object  # .query() -> bool, .synchronize()
