"""Counters of the tiered store: bytes per tier pair, hits, misses, stall time.

Kept twice: since start and for the current step; ``step_boundary`` freezes
the current step into ``last_step``. Registration traffic (writing ``init`` to
the home) is not counted: these numbers measure swapping.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Counters:
    bytes_moved: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    hits: int = 0
    misses: int = 0
    stall_seconds: float = 0.0
    writebacks: int = 0

    def as_dict(self) -> dict:
        return {
            "bytes_moved": dict(sorted(self.bytes_moved.items())),
            "stall_seconds": self.stall_seconds,
            "hits": self.hits,
            "misses": self.misses,
            "writebacks": self.writebacks,
        }


class TierStats:
    def __init__(self) -> None:
        self.total = Counters()
        self.step = Counters()
        self.last_step: Counters | None = None
        self.steps = 0

    def moved(self, key: str, nbytes: int) -> None:
        self.total.bytes_moved[key] += nbytes
        self.step.bytes_moved[key] += nbytes

    def hit(self) -> None:
        self.total.hits += 1
        self.step.hits += 1

    def miss(self) -> None:
        self.total.misses += 1
        self.step.misses += 1

    def stalled(self, seconds: float) -> None:
        self.total.stall_seconds += seconds
        self.step.stall_seconds += seconds

    def wrote_back(self) -> None:
        self.total.writebacks += 1
        self.step.writebacks += 1

    def step_boundary(self) -> None:
        self.last_step = self.step
        self.step = Counters()
        self.steps += 1

    def as_dict(self) -> dict:
        out = self.total.as_dict()
        out["steps"] = self.steps
        out["step"] = self.step.as_dict()
        out["last_step"] = self.last_step.as_dict() if self.last_step is not None else None
        return out
