"""Where an optimizer step's time goes: ``engine.stats()["breakdown"]`` (docs/tiering.md).

[Note: step breakdown]
A *step record* covers one window of the training thread, from the end of one
optimizer step (``engine.step()`` at the accumulation boundary) to the end of
the next (the first window starts at the first forward), plus the host
optimizer step launched at its end. With ``overlap_step`` that host step runs
into the next window (beside the next forward), so a record is closed lazily:
at the next boundary, or in ``engine.stats()`` (after ``synchronize``), once
its worker has finished and its CUDA events have completed. Nothing here
synchronizes the device on the training path: events are recorded on the
streams in use and read at close, when the step's norm ``.item()`` and the
host step's drain have already waited for them.

What is measured where:
- the training thread (``StepTimeline.span``): forward, backward and step
  seconds (``perf_counter``), each with a pair of CUDA events on the current
  (compute) stream; ``gpu_busy_s`` sums the event spans of forward and
  backward (an estimate: a span includes the stream's own waits).
- the host step (``zeroio.partition.step_overlap.PhaseClock``, the worker's
  clock): the worker's span, seconds per phase (adam, publish, assist), one
  entry per chunk (CPU Adam's pass, or a chunk handed to the GPU by the step
  assist with the CUDA events around its work there), and every host wait of
  the training thread on it, by *reader*: the engine call it happened in
  (``forward``: a pre-hook or a gather waiting for its parameters;
  ``backward``: the next backward's start; ``step``: ``step()`` itself, as
  without overlap; ``synchronize``: ``engine.synchronize()``, ``stats()``, a
  checkpoint; ``other``: outside any engine call).
- ``hidden_s``: the worker's span less the time anybody waited on it: the
  part of the host step overlapped with other work (forward, backward, data).
- bytes over PCIe (``h2d_bytes`` "cpu->gpu", ``d2h_bytes`` "gpu->cpu"): the
  transfer counters' difference over the window ([Note: per-step transfer
  stats] in engine.py), counted when a copy is issued.
Chunk and span offsets are seconds from the record's start. A GPU chunk's
offsets are placed on the host clock through an anchor event recorded right
after the step's norm sync (when the GPU is idle).
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

MAX_ENTRIES = 4096
"""Chunks (and waits) kept per record; beyond, only their sums count (``chunks_dropped``)."""
HISTORY = 64
"""Compact records (no lists) kept in ``recent``."""
READERS = ("forward", "backward", "step", "synchronize", "other")
SUMMED = ("wall_s", "forward_s", "backward_s", "step_s", "other_s", "waited_total_s",
          "host_span_s", "host_worker_s", "host_adam_s", "host_publish_s", "host_assist_s",
          "hidden_s", "numel_cpu", "numel_gpu", "assist_gpu_s", "h2d_bytes", "d2h_bytes")
"""Scalar fields of a record that ``total`` sums (``gpu_busy_s`` too, where measured)."""


@dataclass
class HostRecord:
    """What the host step's clock saw since it was last taken (``PhaseClock.take``)."""

    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase (worker, adam, publish, assist)."""
    worker: tuple[float, float] | None = None
    """perf_counter at the first worker start and the last worker end."""
    chunks: list[tuple[float, float, int, str, Any]] = field(default_factory=list)
    """(t0, t1, numel, "cpu" | "gpu", (start, end) CUDA events of a GPU chunk or None)."""
    numel: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "gpu": 0})
    dropped: int = 0
    waits: list[tuple[str, float, float]] = field(default_factory=list)
    """(reader, t0, t1) of each host wait that blocked."""
    waited: dict[str, float] = field(default_factory=dict)

    def add_chunk(self, t0: float, t1: float, numel: int, where: str, span=None) -> None:
        self.numel[where] += numel
        if len(self.chunks) < MAX_ENTRIES:
            self.chunks.append((t0, t1, numel, where, span))
        else:
            self.dropped += 1

    def add_wait(self, reader: str, t0: float, t1: float) -> None:
        self.waited[reader] = self.waited.get(reader, 0.0) + (t1 - t0)
        if len(self.waits) < MAX_ENTRIES:
            self.waits.append((reader, t0, t1))


@dataclass
class _Window:
    step: int
    start: float
    end: float
    spans: list[tuple[str, float, float, Any, Any]]
    anchor: tuple[float, Any] | None
    moved: dict[str, int]

    def events(self, host: HostRecord | None) -> list:
        out = [e for s in self.spans for e in s[3:] if e is not None]
        if self.anchor is not None:
            out.append(self.anchor[1])
        if host is not None:
            out += [e for c in host.chunks if c[4] is not None for e in c[4]]
        return out


class StepTimeline:
    """The engine's side of [Note: step breakdown]: windows of the training thread, closed
    with the host step's record into step records; ``as_dict`` is ``stats()["breakdown"]``.
    ``clock``: the partitioner's host-step clock (None: no host step)."""

    def __init__(self, device: torch.device, clock=None):
        self._cuda = device.type == "cuda"
        self.clock = clock
        self._start: float | None = None
        self._spans: list[tuple[str, float, float, Any, Any]] = []
        self._anchor: tuple[float, Any] | None = None
        self._pending: _Window | None = None
        self.last: dict | None = None
        self.total: dict[str, Any] = _empty_total()
        self.recent: deque[dict] = deque(maxlen=HISTORY)

    def _event(self):
        if not self._cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    @contextmanager
    def span(self, name: str):
        """Time an engine call on the training thread (its host waits count for ``name``)."""
        t0 = time.perf_counter()
        if self._start is None:
            self._start = t0
        e0 = self._event() if name != "step" else None
        try:
            with self.reading(name):
                yield
        finally:
            e1 = self._event() if e0 is not None else None
            self._spans.append((name, t0, time.perf_counter(), e0, e1))

    def reading(self, name: str):
        """Host waits on the host step inside this block count for reader ``name``."""
        return self.clock.reading(name) if self.clock is not None else nullcontext()

    def anchor(self) -> None:
        """Tie the GPU's clock to the host's (after a device sync: the GPU is idle)."""
        if self._cuda:
            self._anchor = (time.perf_counter(), self._event())

    def boundary(self, step: int, moved: dict[str, int] | None) -> None:
        """The optimizer step ``step`` ended: close the window; the record is finished now if
        its host step is (no overlap), else at the next ``settle``."""
        now = time.perf_counter()
        if self._pending is not None:
            self.settle(force=True)
        self._pending = _Window(step=step, start=self._start if self._start is not None else now,
                                end=now, spans=self._spans, anchor=self._anchor,
                                moved=dict(moved or {}))
        self._start, self._spans, self._anchor = now, [], None
        self.settle()

    @property
    def pending(self) -> bool:
        """A step's record waits for its host step."""
        return self._pending is not None

    def settle(self, force: bool = False) -> None:
        """Close the pending record if its host step's worker is idle and its events are
        done; ``force`` (the caller waited for the host step): wait for the events."""
        w = self._pending
        if w is None or (self.clock is not None and self.clock.busy):
            return
        events = w.events(self.clock.peek() if self.clock is not None else None)
        if force:
            for e in events:
                e.synchronize()
        elif not all(e.query() for e in events):
            return
        host = self.clock.take() if self.clock is not None else HostRecord()
        self._pending = None
        rec = step_record(w, host)
        self.last = rec
        self.recent.append(compact(rec))
        _accumulate(self.total, rec)

    def as_dict(self) -> dict[str, Any]:
        total = dict(self.total)
        total["waited_s"] = dict(self.total["waited_s"])
        span = total["host_span_s"]
        total["hidden_fraction"] = total["hidden_s"] / span if span > 0 else None
        return {"steps": total.pop("steps"), "last": self.last, "total": total,
                "recent": list(self.recent)}


def _empty_total() -> dict[str, Any]:
    out: dict[str, Any] = dict.fromkeys(SUMMED, 0.0)
    for k in ("numel_cpu", "numel_gpu", "h2d_bytes", "d2h_bytes"):
        out[k] = 0
    out["waited_s"] = dict.fromkeys(READERS, 0.0)
    out["gpu_busy_s"] = None
    out["steps"] = 0
    return out


def _accumulate(total: dict, rec: dict) -> None:
    for k in SUMMED:
        total[k] += rec[k]
    for k, v in rec["waited_s"].items():
        total["waited_s"][k] = total["waited_s"].get(k, 0.0) + v
    if rec["gpu_busy_s"] is not None:
        total["gpu_busy_s"] = (total["gpu_busy_s"] or 0.0) + rec["gpu_busy_s"]
    total["steps"] += 1


def compact(rec: dict) -> dict:
    """A record without its lists (spans, waits, chunks)."""
    return {k: v for k, v in rec.items() if k not in ("spans", "waits", "chunks")}


def _union_s(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _gpu_offsets(w: _Window, span) -> tuple[float, float] | None:
    """A GPU chunk's (start, end) seconds from the record's start, through the anchor."""
    if w.anchor is None or span is None:
        return None
    t, ev = w.anchor
    base = t - w.start
    return base + ev.elapsed_time(span[0]) / 1e3, base + ev.elapsed_time(span[1]) / 1e3


def step_record(w: _Window, host: HostRecord) -> dict[str, Any]:
    """One record of [Note: step breakdown] from a closed window and its host step."""
    sums = {name: sum(t1 - t0 for n, t0, t1, *_ in w.spans if n == name)
            for name in ("forward", "backward", "step")}
    wall = w.end - w.start
    busy = [e0.elapsed_time(e1) / 1e3 for n, _, _, e0, e1 in w.spans
            if n in ("forward", "backward") and e0 is not None]
    span = host.worker[1] - host.worker[0] if host.worker else 0.0
    waited = {k: host.waited.get(k, 0.0) for k in READERS}
    waited.update(host.waited)
    waited_total = sum(waited.values())
    chunks, gpu = [], []
    for t0, t1, numel, where, ev in host.chunks:
        off = _gpu_offsets(w, ev) if where == "gpu" else None
        start, end = off if off is not None else (t0 - w.start, t1 - w.start)
        if where == "gpu" and off is not None:
            gpu.append(off)
        chunks.append({"start": start, "end": end, "numel": numel, "device": where})
    return {
        "step": w.step, "wall_s": wall, "forward_s": sums["forward"],
        "backward_s": sums["backward"], "step_s": sums["step"],
        "other_s": max(0.0, wall - sum(sums.values())),
        "waited_s": waited, "waited_total_s": waited_total,
        "host_start_s": host.worker[0] - w.start if host.worker else None,
        "host_end_s": host.worker[1] - w.start if host.worker else None,
        "host_span_s": span, "host_worker_s": host.phases.get("worker", 0.0),
        "host_adam_s": host.phases.get("adam", 0.0),
        "host_publish_s": host.phases.get("publish", 0.0),
        "host_assist_s": host.phases.get("assist", 0.0),
        "hidden_s": max(0.0, span - waited_total),
        "hidden_fraction": max(0.0, span - waited_total) / span if span > 0 else None,
        "numel_cpu": host.numel["cpu"], "numel_gpu": host.numel["gpu"],
        "assist_gpu_s": _union_s(gpu),
        "h2d_bytes": int(w.moved.get("cpu->gpu", 0)), "d2h_bytes": int(w.moved.get("gpu->cpu", 0)),
        "gpu_busy_s": sum(busy) if busy else None,
        "chunks_dropped": host.dropped,
        "spans": [{"name": n, "start": t0 - w.start, "end": t1 - w.start}
                  for n, t0, t1, *_ in w.spans],
        "waits": [{"reader": r, "start": t0 - w.start, "end": t1 - w.start}
                  for r, t0, t1 in host.waits],
        "chunks": chunks,
    }


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}GB" if n >= 1e7 else f"{n / 1e6:.2f}MB"


def format_breakdown(rec: dict | None) -> str:
    """One short table of a step record (``wall_clock_breakdown`` prints it), e.g.::

        step 12: wall 1.234s
          phase        seconds  share  waited on host step
          forward        0.300  24.3%  0.120
          ...
    """
    if not rec:
        return "no step recorded yet"
    wall = rec["wall_s"] or 1e-12
    waited = rec["waited_s"]
    lines = [f"step {rec['step']}: wall {rec['wall_s']:.3f}s",
             f"  {'phase':<10} {'seconds':>8} {'share':>6}  waited on host step"]
    for name in ("forward", "backward", "step", "other"):
        s = rec[f"{name}_s"]
        w = waited.get(name, 0.0)
        lines.append(f"  {name:<10} {s:8.3f} {s / wall:6.1%}  {w:.3f}" if w or name != "other"
                     else f"  {name:<10} {s:8.3f} {s / wall:6.1%}")
    if rec["host_span_s"]:
        hf = rec["hidden_fraction"] or 0.0
        lines.append(f"  host step  {rec['host_span_s']:8.3f}         worker "
                     f"{rec['host_worker_s']:.3f} (adam {rec['host_adam_s']:.3f}, publish "
                     f"{rec['host_publish_s']:.3f}), hidden {rec['hidden_s']:.3f} ({hf:.0%})")
        n_cpu, n_gpu = rec["numel_cpu"], rec["numel_gpu"]
        share = n_gpu / max(1, n_cpu + n_gpu)
        lines.append(f"  chunks     {len(rec.get('chunks', ()))}: cpu {n_cpu:,} el, gpu {n_gpu:,} "
                     f"el ({share:.0%}) in {rec['assist_gpu_s']:.3f}s")
    busy = rec["gpu_busy_s"]
    lines.append(f"  pcie       h2d {_gb(rec['h2d_bytes'])} d2h {_gb(rec['d2h_bytes'])}"
                 + (f", gpu busy {busy:.3f}s" if busy is not None else ""))
    return "\n".join(lines)
