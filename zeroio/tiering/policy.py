"""Eviction policies: which cache copy in a full tier gives up its space.

One policy object per memory tier. The store tells it about accesses
(``touch``), arrivals (``admit``) and departures (``forget``), and asks it for a
victim among the copies that may be evicted right now (unpinned, not in
flight). ``upcoming`` names the accesses the policy expects next, which the
store prefetches (only the trace policy predicts anything).

[Note: conservative prefetch] The trace policy evicts the copy whose next use
in the recorded trace is farthest away (Belady's rule). A *prefetch* may only
evict a copy whose next use is after the prefetched tensor's next use; that is
the replacement Belady's rule itself would make when the access arrives, made
earlier: the victim is the copy whose next use *after that access* is farthest,
and if that copy is still needed before the access, or is acquired or in flight
right now, the prefetch waits (it is offered again at the next acquire/release). So
prefetching moves the bytes demand fetching under Belady would, while hiding
latency (Cao, Felten, Karlin, Li 1995, the "conservative" strategy).

One exception, because waiting there hides nothing: when Belady's victim is
*acquired right now*, its release comes only after the compute the prefetch
should overlap (an optimizer sub-group is acquired, updated, released), so a
strictly conservative prefetch would start only when the demand itself does.
Then the prefetch follows the "do no harm" rule of the same paper: it evicts
the evictable copy whose next use is farthest, provided it is used only after
the prefetched access. That may cost a few fetches beyond Belady's count (far
fewer than LRU's) and overlaps each load with the compute before it
(``TracePolicy.busy_fallback``; False keeps the strict rule). ``upcoming``
skips names the tier already holds, so ``prefetch_depth`` counts accesses a
prefetch can still help.
"""

from __future__ import annotations

import bisect
import enum
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable

from zeroio.errors import ConfigError


class PolicyKind(str, enum.Enum):
    LRU = "lru"
    FIFO = "fifo"
    TRACE = "trace"

    @classmethod
    def parse(cls, value: object) -> PolicyKind:
        raw = getattr(value, "value", value)
        try:
            return cls(str(raw).lower())
        except ValueError:
            raise ConfigError(
                f"zero_optimization.tiering.policy: expected 'lru', 'fifo' or 'trace', got {raw!r}",
                key="zero_optimization.tiering.policy",
            ) from None


class EvictionPolicy(ABC):
    """Chooses victims among evictable copies of one tier."""

    def touch(self, name: str) -> None:  # noqa: B027 (optional hook)
        """``name`` was acquired in this tier."""

    def admit(self, name: str) -> None:  # noqa: B027 (optional hook)
        """A copy of ``name`` started occupying this tier."""

    def forget(self, name: str) -> None:  # noqa: B027 (optional hook)
        """The copy of ``name`` left this tier."""

    def step_boundary(self) -> None:  # noqa: B027 (optional hook)
        """A training step ended."""

    def upcoming(self, depth: int) -> list[str]:
        """Names expected to be acquired next, soonest first (at most ``depth``)."""
        return []

    @abstractmethod
    def victim(self, candidates: Iterable[str], for_prefetch_of: str | None = None,
               held: Iterable[str] = ()) -> str | None:
        """The candidate to evict. For a prefetch (``for_prefetch_of`` set) a policy may
        return None: evicting anything would cost more than the prefetch gains.
        ``held`` are copies in the tier that cannot be evicted now (acquired, in flight)."""


class FIFOPolicy(EvictionPolicy):
    """Evict the copy that arrived in the tier first, whatever its use since."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()  # oldest first

    def admit(self, name: str) -> None:
        if name not in self._order:
            self._order[name] = None

    def forget(self, name: str) -> None:
        self._order.pop(name, None)

    def victim(self, candidates: Iterable[str], for_prefetch_of: str | None = None,
               held: Iterable[str] = ()) -> str | None:
        cands = set(candidates)
        for name in self._order:
            if name in cands:
                return name
        return min(cands) if cands else None


class LRUPolicy(FIFOPolicy):
    """Evict the copy acquired least recently (copies never acquired count by arrival):
    FIFO whose order is refreshed on every access."""

    def touch(self, name: str) -> None:
        self._order[name] = None
        self._order.move_to_end(name)


class TracePolicy(EvictionPolicy):
    """Belady's rule over the access trace recorded during the first step.

    Until the first ``step_boundary`` it records accesses and behaves as LRU.
    Afterwards a cursor follows the trace; an access that does not match the
    next trace entry resynchronises to that name's next occurrence, and names
    never seen in the trace count as never used again (evicted first).
    """

    busy_fallback = True
    """Prefetch past a busy Belady victim by the "do no harm" rule (see the note)."""

    def __init__(self) -> None:
        self._lru = LRUPolicy()
        self._recording: list[str] | None = []
        self._trace: list[str] = []
        self._positions: dict[str, list[int]] = {}
        self._cursor = 0  # index of the next expected access, counting across repeats

    @property
    def trace(self) -> list[str]:
        return list(self._trace)

    def touch(self, name: str) -> None:
        self._lru.touch(name)
        if self._recording is not None:
            self._recording.append(name)
            return
        if not self._trace:
            return
        dist = self._distance(name)
        if math.isfinite(dist):
            self._cursor += int(dist) + 1

    def admit(self, name: str) -> None:
        self._lru.admit(name)

    def forget(self, name: str) -> None:
        self._lru.forget(name)

    def step_boundary(self) -> None:
        if self._recording is not None:
            if self._recording:
                self._trace = self._recording
                self._positions = {}
                for i, name in enumerate(self._trace):
                    self._positions.setdefault(name, []).append(i)
                self._recording = None
                self._cursor = 0
            return
        if self._trace:
            # A step that ended early or late: the next step starts the trace over.
            period = len(self._trace)
            self._cursor = -(-self._cursor // period) * period

    def upcoming(self, depth: int) -> list[str]:
        if not self._trace or depth <= 0:
            return []
        out: list[str] = []
        period = len(self._trace)
        resident = self._lru._order  # admitted, not yet forgotten: already in this tier
        for i in range(period):
            name = self._trace[(self._cursor + i) % period]
            # Skip what the tier holds: depth counts accesses a prefetch can still help.
            if name not in out and name not in resident:
                out.append(name)
                if len(out) == depth:
                    break
        return out

    def victim(self, candidates: Iterable[str], for_prefetch_of: str | None = None,
               held: Iterable[str] = ()) -> str | None:
        cands = list(candidates)
        if not cands:
            return None
        if not self._trace:
            return None if for_prefetch_of is not None else self._lru.victim(cands)
        lru_rank = {n: i for i, n in enumerate(self._lru._order)}
        if for_prefetch_of is None:
            # Farthest next use; ties (e.g. several never used again) by LRU order.
            return max(cands, key=lambda n: (self._distance(n), -lru_rank.get(n, -1)))
        # A prefetch makes now the replacement Belady would make when the prefetched
        # tensor is accessed: farthest next use as seen from just after that access.
        # If that victim is itself used before then, wait (see [Note: conservative prefetch]).
        d_new = self._distance(for_prefetch_of)
        if not math.isfinite(d_new):
            return None
        after = self._cursor + int(d_new) + 1
        everyone = cands + [n for n in held if n != for_prefetch_of]
        best = max(everyone, key=lambda n: (self._distance(n, after), -lru_rank.get(n, -1)))
        if best in cands:
            return best if self._distance(best) >= d_new else None  # still needed first: not yet
        if self.busy_fallback:
            # Belady's victim is acquired right now (its release comes only after the
            # compute the prefetch should overlap): "do no harm" instead, see the note.
            harmless = [n for n in cands if self._distance(n) > d_new]
            if harmless:
                return max(harmless, key=lambda n: (self._distance(n, after), -lru_rank.get(n, -1)))
        return None

    def _distance(self, name: str, start: int | None = None) -> float:
        """Accesses from ``start`` (default: the cursor) until ``name`` is next used
        (0 = it is next)."""
        pos = self._positions.get(name)
        if not pos:
            return math.inf
        period = len(self._trace)
        offset = (self._cursor if start is None else start) % period
        i = bisect.bisect_left(pos, offset)
        nxt = pos[i] if i < len(pos) else pos[0] + period
        return float(nxt - offset)


def make_policy(kind: PolicyKind | str) -> EvictionPolicy:
    kind = PolicyKind.parse(kind)
    return {PolicyKind.LRU: LRUPolicy, PolicyKind.FIFO: FIFOPolicy, PolicyKind.TRACE: TracePolicy}[kind]()
