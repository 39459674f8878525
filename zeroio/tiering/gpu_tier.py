"""The GPU tier in training: state kept on the GPU between steps, yielding to training.

[Note: resident state yields]
Host optimizer state the step assist keeps on the GPU between steps (resident chunks,
[Note: resident chunks] in shard/assist.py) takes memory the forward and backward may need.
``GpuTier`` is where that state is registered (``register``: a ``Resident`` holder) and what
gives it back before training's allocations fail:

- before each forward and each backward (``before_forward`` / ``before_backward``, from the
  engine, so also between micro-batches of one accumulation), the micro step's peak is
  predicted from its size (``PeakModel``: the peaks measured at earlier micro steps less the
  resident bytes then, scaled in proportion from the sizes up to it) plus ``margin`` and
  ``reserve_bytes``; where the prediction does not fit beside what is resident (and what
  the step in flight may still admit: ``Resident.claim_bytes``), the step in flight is
  finished (``quiesce``: the partitioner's ``wait_step``) and holders evict, last admitted
  first, until it fits. Eviction makes the host copies current first (the holder's job), so
  no value changes: the next step loads the chunk from host memory again.
- a forward that runs out of memory anyway (``forward``: a re-runnable forward) evicts
  everything, empties the allocator's cache and runs again, once. A backward cannot be
  re-run, which is why the prediction covers the whole micro step (its peak is measured
  after the backward) and is checked again before the backward.
- before each host step, ``step_budget`` says what resident state may hold: 0, a cap, or
  "auto" (half of what training leaves free at its peak, less a reserve: shard/assist.py's
  ``resident_budget``), and never more than the room the last micro step's prediction
  leaves: a longer batch keeps chunks out, and chunks come back once the room does (other
  processes' memory gone, a shorter prediction).

The device is read through ``memory`` (a ``DeviceMemory`` snapshot: ``cuda_memory`` on a
GPU); tests inject one whose capacity shrinks. ``stats`` is ``engine.stats()["tiers"]
["gpu"]``'s resident share plus the eviction counters.

State that cannot yield (the accumulation buffer of [Note: accumulation on the device tier] in
tiering/device_accum.py) is registered as fixed (``register_fixed``): it is counted in
``used_bytes`` and ``stats``, but as part of training's memory (the peak model measures it,
"auto" leaves it out of the headroom), and a ``gpu_budget_bytes`` cap covers it first:
resident chunks get what is left.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

PREDICT_MARGIN = 0.15
"""Share added to a predicted peak: memory grows faster than tokens where attention's
scores are materialised (quadratic in the sequence)."""
RESERVE_BYTES = 2 << 30
"""Bytes left free beyond the prediction (as "auto"'s reserve)."""


@dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    """One reading of the device: ``total`` / ``free`` (the driver's), ``reserved`` /
    ``peak_reserved`` (this process's caching allocator, now and at its peak so far)."""

    total: int
    free: int
    reserved: int
    peak_reserved: int

    @property
    def others(self) -> int:
        """Bytes other processes (and the driver) hold."""
        return max(0, self.total - self.free - self.reserved)


def cuda_memory(device: torch.device) -> Callable[[], DeviceMemory]:
    """The ``memory`` function of a CUDA device."""
    def read() -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(total=total, free=free, reserved=torch.cuda.memory_reserved(device),
                            peak_reserved=torch.cuda.max_memory_reserved(device))
    return read


def batch_size(args: tuple, kwargs: dict) -> int:
    """A forward's size for ``PeakModel``: the elements of its ``input_ids`` (tokens), else of
    its first tensor argument; 1 where it has none."""
    first = kwargs.get("input_ids")
    if not isinstance(first, torch.Tensor):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return max(1, first.numel()) if isinstance(first, torch.Tensor) else 1


class Resident(Protocol):
    """What a holder of state resident on the GPU gives the tier."""

    def gpu_bytes(self) -> int:
        """GPU bytes it holds now."""

    def claim_bytes(self) -> int:
        """GPU bytes it may hold before the step in flight ends (its budget while a step may
        still admit, else ``resident_bytes``)."""

    def evict(self, nbytes: int) -> int:
        """Give back at least ``nbytes`` (all it holds if less), last admitted first, each
        host copy made current first; the bytes freed. Called with no step in flight."""

    def set_budget(self, nbytes: int) -> None:
        """What it may hold until the next ``step_budget`` (admission stops above it)."""


class PeakModel:
    """Training's peak GPU bytes (without resident state) as a function of a micro step's
    size in tokens, from the measured micro steps ``(t_i, peak_i)``: ``predict(t)`` is the
    largest ``peak_i * t / t_i`` over the sizes ``t_i <= t`` (in proportion from a smaller
    batch: an overestimate wherever part of the peak does not grow with tokens), and for a
    batch smaller than every one measured, the smallest one's peak (fewer tokens never need
    more). So a shorter batch after a longer one is predicted from its own size again, and
    chunks may come back. The allocator's peak only grows, so a micro step is measured where
    it raised it."""

    def __init__(self) -> None:
        self.samples: dict[int, int] = {}
        """Tokens -> the largest training peak measured at that size."""

    def add(self, tokens: int, peak: int) -> None:
        tokens = max(1, int(tokens))
        self.samples[tokens] = max(peak, self.samples.get(tokens, 0))

    def predict(self, tokens: int) -> int | None:
        """None before any measurement."""
        if not self.samples:
            return None
        tokens = max(1, int(tokens))
        below = [int(p * tokens / t) for t, p in self.samples.items() if t <= tokens]
        return max(below) if below else self.samples[min(self.samples)]


class GpuTier:
    """Budget, used bytes and eviction of the state resident on one GPU between steps
    ([Note: resident state yields])."""

    def __init__(self, *, cap_bytes: int | None = 0,
                 memory: Callable[[], DeviceMemory] | None = None,
                 margin: float = PREDICT_MARGIN, reserve_bytes: int = RESERVE_BYTES,
                 auto_budget: Callable[..., int] | None = None,
                 empty_cache: Callable[[], None] | None = None):
        """``cap_bytes``: ``zero_optimization.tiering.gpu_budget_bytes`` (None: "auto",
        ``auto_budget(memory=..., resident=..., pending=...)``; 0: nothing resident).
        ``memory``: reads the device (None: no device to fit, nothing is ever evicted for
        training). ``empty_cache``: hands the allocator's free blocks back (the OOM retry)."""
        self.cap_bytes = cap_bytes
        self.memory = memory
        self.margin = margin
        self.reserve_bytes = reserve_bytes
        self.auto_budget = auto_budget
        self.empty_cache = empty_cache or (lambda: None)
        self.quiesce: Callable[[], None] = lambda: None
        """Finishes the step in flight (the partitioner's ``wait_step``) before an eviction."""
        self.holders: list[Resident] = []
        self.fixed: list = []
        """Holders that never evict (``gpu_bytes`` only): part of training's memory."""
        self.model = PeakModel()
        self.budget_bytes = 0
        """What resident state may hold this step (``step_budget``)."""
        self._tokens = 1
        self._resident_seen = 0
        self._peak_seen = 0
        self.evictions = 0
        """Times state was given back for training (a fit or an OOM retry that freed bytes)."""
        self.evicted_bytes = 0
        self.oom_retries = 0
        self.last_prediction: int | None = None

    # ---- holders -----------------------------------------------------------------------------

    def register(self, holder: Resident) -> None:
        self.holders.append(holder)

    def register_fixed(self, holder) -> None:
        """State that stays on the GPU (a ``gpu_bytes()``; see the module note)."""
        self.fixed.append(holder)

    @property
    def fixed_bytes(self) -> int:
        return sum(h.gpu_bytes() for h in self.fixed)

    @property
    def used_bytes(self) -> int:
        return self._movable_bytes() + self.fixed_bytes

    def _movable_bytes(self) -> int:
        return sum(h.gpu_bytes() for h in self.holders)

    def _claimed(self) -> int:
        return sum(h.claim_bytes() for h in self.holders)

    def evict(self, nbytes: int) -> int:
        """At least ``nbytes`` given back (the step in flight finished first); bytes freed."""
        if nbytes <= 0 or not self.holders or self._claimed() == 0:
            return 0
        self.quiesce()
        freed = 0
        for h in reversed(self.holders):  # the last registered gives back first
            if freed >= nbytes:
                break
            freed += h.evict(nbytes - freed)
            h.set_budget(h.gpu_bytes())  # nothing is admitted again before the next step
        if freed:
            self.evictions += 1
            self.evicted_bytes += freed
        return freed

    # ---- the engine's yield points ------------------------------------------------------------

    def before_forward(self, tokens: int) -> int:
        """A micro step of ``tokens`` begins: make room for its predicted peak; bytes freed."""
        self._tokens = max(1, int(tokens))
        freed = self.fit(self._tokens)
        self._resident_seen = self._movable_bytes()
        return freed

    def before_backward(self) -> int:
        """The backward of the micro step ``before_forward`` announced: check again (other
        allocations may have come since); bytes freed."""
        return self.fit(self._tokens)

    def after_backward(self) -> None:
        """Measure the micro step where it raised the allocator's peak (``PeakModel``): the
        peak less the most that was resident at the forward's start or now. A step in flight
        admits chunks during the micro step (never frees them), so the resident bytes at the
        peak are at most that; a micro step measured with nothing resident is exact, and the
        model keeps the largest measurement."""
        if self.memory is None:
            return
        mem = self.memory()
        if mem.peak_reserved > self._peak_seen:
            self._peak_seen = mem.peak_reserved
            resident = max(self._resident_seen, self._movable_bytes())
            self.model.add(self._tokens, mem.peak_reserved - resident)

    def forward(self, run: Callable[[], object], tokens: int, *, rerunnable: bool):
        """``run()`` (a forward of ``tokens``) after ``before_forward``; where it runs out of
        GPU memory and ``rerunnable``, everything resident is given back, the allocator's
        cache emptied and ``run()`` called once more."""
        self.before_forward(tokens)
        try:
            return run()
        except torch.cuda.OutOfMemoryError:
            if not rerunnable or self._claimed() == 0:
                raise
        self.oom_retries += 1
        self.evict(self._claimed())
        self.empty_cache()
        return run()

    def fit(self, tokens: int) -> int:
        """Evict until the predicted peak of a micro step of ``tokens`` fits; bytes freed."""
        room = self.room_for(tokens)
        if room is None:
            return 0
        over = self._claimed() - max(0, room)
        if over <= 0:
            return 0
        freed = self.evict(over)
        if freed:  # the chunks' blocks back to the device, not kept in the cache in their
            self.empty_cache()  # sizes (training's own allocations are not cut from them)
        return freed

    def room_for(self, tokens: int) -> int | None:
        """GPU bytes resident state may hold beside a micro step of ``tokens`` (None: nothing
        measured yet, or no device)."""
        if self.memory is None:
            return None
        need = self.model.predict(tokens)
        self.last_prediction = need
        if need is None:
            return None
        mem = self.memory()
        return mem.total - mem.others - int(need * (1 + self.margin)) - self.reserve_bytes

    # ---- before a host step -------------------------------------------------------------------

    def step_budget(self, pending: int = 0) -> int:
        """What resident state may hold in the coming host step (``pending``: bytes the holder
        is about to allocate besides, for "auto"); set on every holder too."""
        want = self.cap_bytes
        if want is None:
            if self.memory is None or self.auto_budget is None:
                want = 0
            else:
                want = self.auto_budget(memory=self.memory(), resident=self._movable_bytes(),
                                        pending=pending)
        elif want:  # a cap covers the fixed state first
            want = max(0, want - self.fixed_bytes)
        room = self.room_for(self._tokens) if want else None
        self.budget_bytes = max(0, int(want if room is None else min(want, room)))
        for h in self.holders:
            h.set_budget(self.budget_bytes)
        return self.budget_bytes

    def stats(self) -> dict:
        """A stats source: the GPU tier's budget and resident bytes (no tier where nothing is
        registered), and what it gave back."""
        tiers = {"gpu": {"budget_bytes": self.budget_bytes, "used_bytes": self.used_bytes}}
        return {"tiers": tiers if self.holders or self.fixed else {},
                "evictions": self.evictions, "evicted_bytes": self.evicted_bytes,
                "oom_retries": self.oom_retries, "predicted_peak_bytes": self.last_prediction}
