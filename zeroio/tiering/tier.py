"""Tiers and the residency state machine of one copy of a tensor in one tier.

[Note: copies] A registered tensor has one *home* copy (its backing store,
in the tier chosen at registration) and at most one *cache* copy in each other
memory tier (GPU, CPU). Invariant: every cache copy that exists holds the
latest value; at most one copy is DIRTY; the home holds the latest value
exactly when no copy is DIRTY. So a clean cache copy can be dropped without
any I/O, and a DIRTY one is written back (to the home, or for a GPU copy of an
NVMe-homed tensor, handed down to a CPU copy) before its space is reused.

Transitions are named events; ``Residency.after(event)`` raises
``ResidencyError`` on an event the state does not allow, so a bug in the store
shows up as a clear error instead of silently wrong data.
"""

from __future__ import annotations

import enum

from zeroio.errors import ResidencyError


class Tier(str, enum.Enum):
    """Where a copy lives; ordered fastest first."""

    GPU = "gpu"
    CPU = "cpu"
    NVME = "nvme"

    @property
    def is_memory(self) -> bool:
        """GPU and CPU hold tensors a caller can use; NVMe only backs them."""
        return self is not Tier.NVME

    @classmethod
    def parse(cls, value: Tier | str) -> Tier:
        try:
            return value if isinstance(value, Tier) else cls(str(value).lower())
        except ValueError:
            raise ResidencyError(f"unknown tier {value!r}; expected one of gpu, cpu, nvme") from None


def pair(src: Tier, dst: Tier) -> str:
    """The stats key of a transfer, e.g. ``"nvme->cpu"``."""
    return f"{src.value}->{dst.value}"


class Event(str, enum.Enum):
    START_LOAD = "start_load"
    LOAD_DONE = "load_done"
    LOAD_FAILED = "load_failed"
    WRITE = "write"
    START_WRITEBACK = "start_writeback"
    WRITEBACK_DONE = "writeback_done"
    WRITEBACK_FAILED = "writeback_failed"
    EVICT = "evict"
    DISCARD = "discard"
    OVERWRITE = "overwrite"


class Residency(str, enum.Enum):
    """State of one copy.

    ABSENT -start_load-> LOADING -load_done-> CLEAN -write-> DIRTY
    DIRTY -start_writeback-> WRITING_BACK -writeback_done-> CLEAN -evict-> ABSENT
    LOADING -load_failed-> ABSENT;  WRITING_BACK -writeback_failed-> DIRTY
    DIRTY -discard-> ABSENT (a newer write in another tier superseded it)
    ABSENT -overwrite-> DIRTY (acquired for overwrite: allocated, not read)
    """

    ABSENT = "absent"
    LOADING = "loading"
    CLEAN = "clean"
    DIRTY = "dirty"
    WRITING_BACK = "writing_back"

    @property
    def holds_data(self) -> bool:
        """The copy's memory holds the latest value (a usable source)."""
        return self in (Residency.CLEAN, Residency.DIRTY, Residency.WRITING_BACK)

    @property
    def in_flight(self) -> bool:
        return self in (Residency.LOADING, Residency.WRITING_BACK)

    def after(self, event: Event) -> Residency:
        try:
            return _TRANSITIONS[(self, event)]
        except KeyError:
            raise ResidencyError(
                f"residency: event {event.value!r} is not allowed in state {self.value!r}"
            ) from None


_TRANSITIONS: dict[tuple[Residency, Event], Residency] = {
    (Residency.ABSENT, Event.START_LOAD): Residency.LOADING,
    (Residency.LOADING, Event.LOAD_DONE): Residency.CLEAN,
    (Residency.LOADING, Event.LOAD_FAILED): Residency.ABSENT,
    (Residency.CLEAN, Event.WRITE): Residency.DIRTY,
    (Residency.DIRTY, Event.WRITE): Residency.DIRTY,
    (Residency.DIRTY, Event.START_WRITEBACK): Residency.WRITING_BACK,
    (Residency.WRITING_BACK, Event.WRITEBACK_DONE): Residency.CLEAN,
    (Residency.WRITING_BACK, Event.WRITEBACK_FAILED): Residency.DIRTY,
    (Residency.CLEAN, Event.EVICT): Residency.ABSENT,
    (Residency.DIRTY, Event.DISCARD): Residency.ABSENT,
    (Residency.ABSENT, Event.OVERWRITE): Residency.DIRTY,
}
