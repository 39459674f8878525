"""Transfer counters: bytes per tier pair, hits, misses, stall and busy time.

``TierStats`` is kept by the tiered store (swapping between its tiers) and by
the partitioners (host <-> device copies of shards and gradients, counted
where the copy is issued: ``count_copy``). Each keeps two sets of counters,
since start and for the current step; ``step_boundary`` freezes the current
step into ``last_step``. Registration traffic (writing ``init`` to the home)
is not counted: these numbers measure swapping.

[Note: stall and hidden time]
``stall_seconds`` is time a caller (the training thread, or whoever asked)
blocked on a transfer or on I/O: an acquire waiting for a load or for room,
``Future.result()`` of an ``acquire_async`` that was not done yet, a host
wait on a CUDA copy event. ``busy_seconds`` is the time at least one
transfer of this source was in flight (the union of their intervals; known
for NVMe reads and writes, whose futures say when they end). The fraction of
swap time hidden behind compute is ``1 - stall / busy`` (clamped to [0, 1]):
the part of the time the disk was busy that nobody waited for. Busy time of
copies on CUDA streams is not observed (an event says *whether*, not *when*),
so it is only reported where a source measures it.

``merge`` adds the dicts of several sources (the engine's ``stats()``):
bytes, counts and seconds add up; busy seconds of different sources add up
too, which overstates the union when two sources' transfers overlap.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

_COUNTS = ("hits", "misses", "writebacks", "overwrites")
_SECONDS = ("stall_seconds", "busy_seconds")


@dataclass
class Counters:
    bytes_moved: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    hits: int = 0
    misses: int = 0
    stall_seconds: float = 0.0
    busy_seconds: float = 0.0
    writebacks: int = 0
    overwrites: int = 0
    """Acquires for overwrite that allocated a copy without reading it."""

    def as_dict(self) -> dict:
        out: dict[str, Any] = {"bytes_moved": dict(sorted(self.bytes_moved.items()))}
        for key in _SECONDS:
            out[key] = getattr(self, key)
        for key in _COUNTS:
            out[key] = getattr(self, key)
        out["hidden_fraction"] = hidden_fraction(self.stall_seconds, self.busy_seconds)
        return out


def hidden_fraction(stall: float, busy: float) -> float | None:
    """Share of the in-flight time nobody waited for; None when nothing was measured in flight."""
    if busy <= 0.0:
        return None
    return min(1.0, max(0.0, 1.0 - stall / busy))


class TierStats:
    """Counters since start and for the current step (thread-safe: the I/O engine's threads
    and the step worker count too)."""

    def __init__(self) -> None:
        self.total = Counters()
        self.step = Counters()
        self.last_step: Counters | None = None
        self.steps = 0
        self._lock = threading.Lock()
        self._inflight = 0
        self._busy_since = 0.0

    def _add(self, attr: str, value: float) -> None:
        with self._lock:
            setattr(self.total, attr, getattr(self.total, attr) + value)
            setattr(self.step, attr, getattr(self.step, attr) + value)

    def moved(self, key: str, nbytes: int) -> None:
        with self._lock:
            self.total.bytes_moved[key] += nbytes
            self.step.bytes_moved[key] += nbytes

    def hit(self) -> None:
        self._add("hits", 1)

    def miss(self) -> None:
        self._add("misses", 1)

    def stalled(self, seconds: float) -> None:
        self._add("stall_seconds", seconds)

    def wrote_back(self) -> None:
        self._add("writebacks", 1)

    def overwrote(self) -> None:
        self._add("overwrites", 1)

    # -- busy time: the union of in-flight intervals ([Note: stall and hidden time]) ----------

    def transfer_started(self) -> None:
        with self._lock:
            if self._inflight == 0:
                self._busy_since = time.perf_counter()
            self._inflight += 1

    def transfer_finished(self, *_: object) -> None:
        """Also usable as a ``Future.add_done_callback``."""
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0:
                self._accrue_busy(time.perf_counter())

    def _accrue_busy(self, now: float) -> None:
        busy = now - self._busy_since
        self.total.busy_seconds += busy
        self.step.busy_seconds += busy
        self._busy_since = now

    def step_boundary(self) -> None:
        with self._lock:
            if self._inflight:  # split an interval that spans the boundary
                self._accrue_busy(time.perf_counter())
            self.last_step = self.step
            self.step = Counters()
            self.steps += 1

    def as_dict(self) -> dict:
        with self._lock:
            out = self.total.as_dict()
            out["steps"] = self.steps
            out["step"] = self.step.as_dict()
            out["last_step"] = self.last_step.as_dict() if self.last_step is not None else None
        return out


def device_tier(device: torch.device) -> str:
    """The tier name of a torch device in stats keys: "gpu" or "cpu"."""
    return "cpu" if device.type == "cpu" else "gpu"


def count_copy(stats: TierStats | None, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Count a copy ``src -> dst`` issued now, if it crosses between host and device
    ("cpu->gpu" / "gpu->cpu"; the bytes that cross are the source's)."""
    if stats is None or src.device.type == dst.device.type:
        return
    stats.moved(f"{device_tier(src.device)}->{device_tier(dst.device)}",
                src.numel() * src.element_size())


class StallTimer:
    """``with StallTimer(stats):`` around a host wait on a transfer adds its time as stall."""

    __slots__ = ("stats", "t0")

    def __init__(self, stats: TierStats | None):
        self.stats = stats
        self.t0 = 0.0

    def __enter__(self) -> StallTimer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stats is not None:
            self.stats.stalled(time.perf_counter() - self.t0)


# -- combining sources (engine.stats) ----------------------------------------------------------

def _sum_counters(parts: list[dict]) -> dict:
    moved: defaultdict[str, int] = defaultdict(int)
    out: dict[str, Any] = {}
    for key in _SECONDS:
        out[key] = 0.0
    for key in _COUNTS:
        out[key] = 0
    for p in parts:
        for k, v in p.get("bytes_moved", {}).items():
            moved[k] += v
        for key in _SECONDS + _COUNTS:
            out[key] += p.get(key, 0)
    out["bytes_moved"] = dict(sorted(moved.items()))
    out["hidden_fraction"] = hidden_fraction(out["stall_seconds"], out["busy_seconds"])
    return out


def held_bytes(tensors) -> dict[str, int]:
    """Bytes of the distinct storages behind ``tensors``, per tier ("cpu" / "gpu"): memory a
    partitioner or optimizer holds outside any tiered store ([Note: tiers outside stores]).
    Views of one buffer count once, with the whole buffer's bytes."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        st = t.untyped_storage()
        if st.nbytes():
            seen[(device_tier(t.device), st.data_ptr())] = st.nbytes()
    out: dict[str, int] = {}
    for (tier, _), n in seen.items():
        out[tier] = out.get(tier, 0) + n
    return out


def held_source(tensors) -> dict:
    """A stats source for memory held outside stores: only ``tiers``, with no budget (null:
    nothing bounds it but the machine) and the held bytes as ``used_bytes``."""
    return {"tiers": {tier: {"budget_bytes": None, "used_bytes": n}
                      for tier, n in held_bytes(tensors).items()}}


def merge(sources: dict[str, dict]) -> dict:
    """One stats dict from several sources' ``as_dict``/``TieredStore.stats`` dicts (keyed by
    source name): summed totals, summed tiers (budget and used bytes), and each source as is
    under ``"sources"``.

    [Note: tiers outside stores]
    A tier's ``used_bytes`` is the sum over sources: stores report what their tiers hold, and
    ``held_source`` what partitioners and optimizers keep outside any store (masters, moments,
    gradient shards, flat buffers). ``budget_bytes`` sums the budgets sources give; a source
    with no budget gives None, and a tier that only such sources report has budget None."""
    parts = list(sources.values())
    out = _sum_counters(parts)
    tiers: dict[str, dict[str, int | None]] = {}
    for p in parts:
        for tier, t in p.get("tiers", {}).items():
            acc = tiers.setdefault(tier, {"budget_bytes": None, "used_bytes": 0})
            budget = t.get("budget_bytes")
            if budget is not None:
                acc["budget_bytes"] = (acc["budget_bytes"] or 0) + budget
            acc["used_bytes"] += t.get("used_bytes", 0)
    out["tiers"] = tiers
    out["sources"] = sources
    return out


def diff(now: dict, before: dict | None) -> dict:
    """``now - before`` of two ``_sum_counters``-shaped dicts (bytes, counts, seconds)."""
    if before is None:
        before = {}
    moved = {k: v - before.get("bytes_moved", {}).get(k, 0)
             for k, v in now.get("bytes_moved", {}).items()}
    out: dict[str, Any] = {"bytes_moved": {k: v for k, v in moved.items() if v}}
    for key in _SECONDS + _COUNTS:
        out[key] = now.get(key, 0) - before.get(key, 0)
    out["hidden_fraction"] = hidden_fraction(out["stall_seconds"], out["busy_seconds"])
    return out
