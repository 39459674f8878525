"""The GPU's share of a host optimizer step: chunks of host Adam state stepped on the GPU.

[Note: step assist]
With ``offload_optimizer.device: cpu`` the optimizer state lives in pinned host
memory and the host step is CPU Adam over chunks (step_overlap.py). On the H200
machine that pass is bound by what 16 cores can pull through host memory
(28 bytes per element at ~107 GB/s: 0.36 s for 1.364e9 elements, benchmarks/train_peers.py),
while the GPU waits for it and the PCIe link is idle. ``StepAssist`` lets the
GPU take chunks of the same step: the chunk's master, moments and 16-bit
gradient go up (14 bytes per element over PCIe, read by DMA, not by a core),
torch's fused Adam(W) steps them in a GPU slot, the 16-bit copy is written
where the parameters are read (the GPU parameter buffer, or a host shard at
stage 3 with parameter offload), and master and moments go back down (12
bytes). The state's home stays host memory: between steps the GPU holds
nothing of it, during the step only ``slots`` x ``slot_numel`` elements of
scratch (four slots of 16M elements: 1.1 GiB with a 16-bit gradient).

The host worker decides chunk by chunk (in publication order, one thread, so
collectives keep their order on every rank): while the GPU's backlog of
submitted, unfinished elements is below ``backlog_numel`` the next chunk goes
to the GPU, otherwise the worker steps it on the CPU itself. Nothing on the
GPU side blocks the worker: a slot is reused after a stream wait on the event
behind its last copy down. Each side runs at its own rate and the split
follows, whatever the host's memory bandwidth or the link's.

The math is torch's fused Adam(W) with the step's ``grad_scale``, as on the
device side of ``offload_optimizer.ratio`` (the one-pass CPU kernel is the same
formula; results agree to float32 rounding).

[Note: resident chunks]
Where the GPU has room, chunks stay: their fp32 master and moments are kept in
GPU buffers from one step to the next, so a resident chunk costs only its
16-bit gradient up (2 bytes per element) and, at stage 3 with parameter
offload, its 16-bit result down, instead of 26 bytes of state over PCIe and
back. The budget is ``zero_optimization.tiering.gpu_budget_bytes``: 0 keeps
nothing (DeepSpeed's placement), a number is a cap, unset ("auto") is
``resident_budget``: half of what training leaves free at its peak so far,
less a reserve, decided before each host step (``begin_step``) by the GPU tier
the chunks register with (``StepAssist`` is its ``Resident`` holder: ``evict``,
``claim_bytes``, ``set_budget``), which also evicts them inside a step, before
a forward or backward that needs their room ([Note: resident state yields] in
tiering/gpu_tier.py). Chunks are admitted in publication order, the first that fit.

A resident chunk's host copy is stale: its GPU buffers are the state. The host
copy is made current (``release``: the buffers go back down, and the chunk is
loaded again on its next step) before anything other than the step reads or
writes host state: the optimizer's ``local_tensor`` (checkpoint save and
load, the 16-bit model), a republish from the masters, stage 3's write-back
of a modified gathered group, and a CPU step of that chunk
(``release_chunk``). The numbers do not change: the step is the same fused
Adam(W) either way.

[Note: resident gradients]
At stage 3 with 16-bit host gradients (``device_grads``: the partitioner's
``host_grad_dtype``, gradient accumulation 1), a resident chunk also has a
16-bit GPU gradient buffer (2 more bytes per element). The gradient landing
(partition/stage3/grads.py) copies a reduced bucket's slice of every
resident chunk wholly inside it there, on the comm stream, instead of down
to the host gradient shard: the same fp32 -> 16-bit cast, so the step reads
the same bits, and the chunk costs no PCIe bytes on its gradient at all
(1.364B: 2.7 GB less each way per step). The host slice is then stale; it is
made current (``grads_to_host``, or with the state on eviction and
``release``) before the host reads it: the norm's fallback over host
gradients, a CPU step of the chunk. Which chunks' gradients the step reads
from the GPU is fixed at ``begin_step`` (``zero_grad`` of an overlapped step
may run while the worker still submits); the next backward writes the
buffers only after ``drain`` (the next micro-step's ``join_step``).

Ordering contract (the caller's): a submitted chunk's host state is the GPU's
until ``drain()`` (a resident one's until ``release``); ``submit`` returns the event behind the chunk's 16-bit
copy (what readers of the parameters wait on), and every later chunk, GPU or
CPU, must be published after it (``after`` orders the GPU's copy behind the
caller's publication stream).
"""

from __future__ import annotations

import warnings

import torch

from zeroio.tiering.copies import Copies
from zeroio.tiering.gpu_tier import DeviceMemory, GpuTier, cuda_memory
from zeroio.tiering.stats import TierStats
from zeroio.tiering.streams import DeviceStreams

SLOT_NUMEL = 1 << 24
"""Elements per GPU slot (16M: 288 MB with fp32 master, moments and a 16-bit gradient)."""
SLOTS = 4
BACKLOG_NUMEL = 1 << 27
"""Submitted, unfinished elements above which the next chunk is stepped on the CPU (two of
the host step's 64M-element chunks)."""
RESIDENT_ELEMENT_BYTES = 12
"""GPU bytes per resident element: fp32 master and two fp32 moments."""
RESIDENT_FRACTION = 0.5
"""Share of the GPU memory training leaves free at its peak that "auto" lets resident chunks
use ([Note: resident chunks])."""
RESIDENT_RESERVE_BYTES = 2 << 30
"""Bytes "auto" leaves free beyond that share (as the tiered store's ``gpu_reserve_bytes``)."""


def resident_budget(*, total: int, free: int, reserved: int, peak_reserved: int,
                    resident: int, pending: int = 0) -> int:
    """Bytes "auto" lets resident chunks hold ([Note: resident chunks]). ``total`` / ``free``:
    the device's memory and what is free of it now (``torch.cuda.mem_get_info``);
    ``reserved`` / ``peak_reserved``: this process's allocator, now and at its peak;
    ``resident``: what resident chunks hold now (inside both); ``pending``: bytes the assist
    is about to allocate that are in neither (its slots before the first step). Other
    processes' memory (``total - free - reserved``) is left alone."""
    others = max(0, total - free - reserved)
    training = max(peak_reserved, reserved) - resident + pending
    headroom = total - others - training
    return max(0, int(RESIDENT_FRACTION * headroom) - RESIDENT_RESERVE_BYTES)


def auto_budget(*, memory: DeviceMemory, resident: int, pending: int = 0) -> int:
    """``resident_budget`` of one device reading (the GPU tier's "auto")."""
    return resident_budget(total=memory.total, free=memory.free, reserved=memory.reserved,
                           peak_reserved=memory.peak_reserved, resident=resident,
                           pending=pending)


class _Resident:
    """One resident chunk: GPU master and moments, and whether they hold its state now; with
    device gradients, its gradient's GPU buffer ([Note: resident gradients])."""

    __slots__ = ("p", "m", "v", "host", "valid", "g16", "host_grad", "grad_here")

    def __init__(self, numel: int, device: torch.device, grad_dtype: torch.dtype | None = None):
        self.p, self.m, self.v = (torch.empty(numel, dtype=torch.float32, device=device)
                                  for _ in range(3))
        self.host: tuple[torch.Tensor, ...] = ()
        """The host master and moments it stands for (set at each step)."""
        self.valid = False
        """The GPU buffers are the chunk's state (the host copy is stale)."""
        self.g16 = (None if grad_dtype is None else
                    torch.empty(numel, dtype=grad_dtype, device=device))
        """Where the chunk's reduced gradient lands, instead of its host gradient shard."""
        self.host_grad: torch.Tensor | None = None
        """The host gradient slice it stands for (set where a gradient lands)."""
        self.grad_here = False
        """``g16`` holds this accumulation's gradient (the host slice is stale)."""

    @staticmethod
    def element_bytes(grad_dtype: torch.dtype | None) -> int:
        """GPU bytes per element of a resident chunk (with a gradient buffer of that dtype)."""
        return RESIDENT_ELEMENT_BYTES + (0 if grad_dtype is None else grad_dtype.itemsize)

    @property
    def nbytes(self) -> int:
        return self.p.numel() * self.element_bytes(None if self.g16 is None else self.g16.dtype)


def slot_layout(grad_dtype: torch.dtype,
                host_out: torch.dtype | None) -> list[tuple[str, torch.dtype]]:
    """A slot's buffers: fp32 master, moments and gradient; the host gradient as it comes up
    when it is not fp32; the 16-bit result bound for host memory (``host_out``: stage 3's host
    shards; a GPU ``out`` is written directly)."""
    names = [("p", torch.float32), ("m", torch.float32), ("v", torch.float32),
             ("g", torch.float32)]
    if grad_dtype != torch.float32:
        names.append(("g16", grad_dtype))
    if host_out is not None:
        names.append(("out", host_out))
    return names


def slot_element_bytes(grad_dtype: torch.dtype, host_out: torch.dtype | None) -> int:
    """GPU bytes per slot element (``zeroio.estimate`` counts ``SLOTS`` slots of them)."""
    return sum(dtype.itemsize for _, dtype in slot_layout(grad_dtype, host_out))


class StepAssist:
    """GPU slots and two streams (up: copies in, Adam, the 16-bit copy; down: state back)."""

    def __init__(self, device: torch.device, *, host_numel: int,
                 slot_numel: int | None = None, slots: int | None = None,
                 backlog_numel: int | None = None, transfers: TierStats | None = None,
                 gpu_budget_bytes: int | None = 0, device_grads: torch.dtype | None = None,
                 tier: GpuTier | None = None):
        """``host_numel``: elements of the host optimizer state (no slot is larger). Sizes
        default to the module's ``SLOT_NUMEL``, ``SLOTS``, ``BACKLOG_NUMEL`` (read now, so a
        test or benchmark may set them). ``gpu_budget_bytes``: what resident chunks may hold
        (0: none; None: "auto", ``resident_budget``; [Note: resident chunks]).
        ``device_grads``: the 16-bit dtype of the host gradients whose resident chunks'
        gradients land on the GPU ([Note: resident gradients]); None: none do. ``tier``: the
        GPU tier its resident chunks register with ([Note: resident state yields] in
        tiering/gpu_tier.py; default: one of its own over this device, capped by
        ``gpu_budget_bytes``)."""
        if device.type != "cuda":
            raise ValueError(f"StepAssist needs a CUDA device, got {device}")
        self.device = device
        self.slot_numel = max(1, min(slot_numel or SLOT_NUMEL, host_numel))
        self.n_slots = slots or SLOTS
        self.backlog_numel = backlog_numel or BACKLOG_NUMEL
        self.transfers = transfers
        streams = DeviceStreams.of(device)  # [Note: zeroio's CUDA streams] in tiering/streams.py
        self.up = streams.assist_up
        self.down = streams.assist_down
        self._bufs: list[dict[str, torch.Tensor]] = [{} for _ in range(self.n_slots)]
        self._free: list[torch.cuda.Event | None] = [None] * self.n_slots
        self._next = 0
        self._ready: set[tuple[torch.dtype, torch.dtype | None]] = set()
        """(gradient dtype, host output dtype) pairs whose slot buffers all exist."""
        self._pending: list[tuple[torch.cuda.Event, int]] = []
        self.numel_gpu = 0
        """Elements stepped on the GPU since start (``stats``)."""
        self.numel_cpu = 0
        """Elements the caller stepped on the CPU beside it (counted by ``cpu``)."""
        self.off_reason: str | None = None
        """Why the assist stopped taking chunks (its slots did not fit the GPU), else None."""
        self.tier = tier if tier is not None else GpuTier(
            cap_bytes=gpu_budget_bytes, memory=cuda_memory(device), auto_budget=auto_budget,
            empty_cache=torch.cuda.empty_cache)
        self.tier.register(self)
        self.budget_bytes = 0
        """What resident chunks may hold this step (``begin_step``; lowered by an eviction)."""
        self._admitting = False
        """Between ``begin_step`` and ``drain``: the step may still admit chunks."""
        self._resident: dict[tuple[int, int, int], _Resident] = {}
        """(group, first element, elements) -> the chunk's GPU state, in admission order."""
        self.resident_bytes = 0
        self._admit_off: str | None = None
        """Why no chunk is admitted any more (an allocation failed), else None."""
        self.numel_resident = 0
        """Elements stepped as resident chunks since start (``stats``)."""
        self.device_grads = device_grads
        self._grads_written: torch.cuda.Event | None = None
        """Behind the last gradient written into a resident chunk's buffer (comm stream)."""
        self._step_grads: set[tuple[int, int, int]] = set()
        """Chunks whose gradient this step reads from the GPU (fixed at ``begin_step``)."""
        self.numel_grad_gpu = 0
        """Elements stepped from a gradient that landed on the GPU since start (``stats``)."""
        self.last_span: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        """Timing events around the last submitted chunk's GPU work: after its slot is free,
        and behind its state's copies down ([Note: step breakdown] in tiering/breakdown.py)."""

    # ---- the caller's decision ---------------------------------------------------------------

    def take(self, step, group_index: int, lo: int, numel: int, out: torch.Tensor,
             after: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
        """``submit`` the chunk if it is resident (or is admitted now: [Note: resident chunks])
        or the GPU's backlog has room for it now; None, counted as the CPU's, where the caller
        steps it itself (the backlog is full, or the assist is off)."""
        res = self._resident_for(group_index, lo, numel)
        if res is not None:
            done = self.submit(step, group_index, lo, numel, out, after, resident=res)
            if done is not None:
                return done
            self.release_chunk(group_index, lo, numel)  # the caller steps it on the CPU
        if self._has_room(numel):
            done = self.submit(step, group_index, lo, numel, out, after)
            if done is not None:
                return done
        self.cpu(numel)
        return None

    def cpu(self, numel: int) -> None:
        """The caller stepped ``numel`` elements on the CPU (``stats``)."""
        self.numel_cpu += numel

    # ---- resident chunks ([Note: resident chunks]) -------------------------------------------

    def begin_step(self) -> None:
        """Before a host step (no GPU chunk in flight): this step's budget (the GPU tier's
        ``step_budget``), and chunks given back from the last admitted while the resident
        ones hold more than it."""
        if self.off_reason is not None:
            return
        pending = 0 if self._ready else self.n_slots * self.slot_numel * slot_element_bytes(
            torch.bfloat16, torch.bfloat16)
        self.tier.step_budget(pending)  # sets budget_bytes (set_budget)
        self.evict(self.resident_bytes - self.budget_bytes)
        self._admitting = True
        self._step_grads = {k for k, r in self._resident.items() if r.grad_here}
        if self._step_grads and self._grads_written is not None:
            self.up.wait_event(self._grads_written)  # the landing's copies are done first

    def holds(self, group_index: int, lo: int, numel: int) -> bool:
        """Whether the chunk is resident on the GPU now (its next step is taken here)."""
        return (group_index, lo, numel) in self._resident

    def after(self, event: torch.cuda.Event | None) -> None:
        """Chunks submitted from now on read their state only after ``event`` (a gradient
        kept on the device: its last writes, [Note: the gradient window] in
        tiering/grad_window.py)."""
        if event is not None:
            self.up.wait_event(event)

    @property
    def gpu_budget_bytes(self) -> int | None:
        """``zero_optimization.tiering.gpu_budget_bytes`` (the tier's cap; None: "auto")."""
        return self.tier.cap_bytes

    @gpu_budget_bytes.setter
    def gpu_budget_bytes(self, value: int | None) -> None:
        self.tier.cap_bytes = value

    # ---- the GPU tier's holder protocol ([Note: resident state yields]) ----------------------

    def gpu_bytes(self) -> int:
        return self.resident_bytes

    def claim_bytes(self) -> int:
        return max(self.resident_bytes, self.budget_bytes if self._admitting else 0)

    def set_budget(self, nbytes: int) -> None:
        self.budget_bytes = int(nbytes)

    def evict(self, nbytes: int) -> int:
        """Chunks given back to host memory, last admitted first, until ``nbytes`` are freed
        (their state and gradients brought down first: ``_flush``); the bytes freed. No chunk
        may be in flight (after ``drain``)."""
        freed = 0
        while freed < nbytes and self._resident:
            key = next(reversed(self._resident))
            freed += self._resident[key].nbytes
            self._evict(key)
        return freed

    # ---- resident gradients ([Note: resident gradients]) -------------------------------------

    def grad_parts(self, group_index: int, lo: int, numel: int) -> list[tuple[int, _Resident]]:
        """The resident chunks of group ``group_index`` with a gradient buffer lying wholly
        inside elements [lo, lo + numel), as (offset from ``lo``, chunk), by offset."""
        return sorted(((k[1] - lo, r) for k, r in list(self._resident.items())
                       if k[0] == group_index and r.g16 is not None and lo <= k[1]
                       and k[1] + k[2] <= lo + numel), key=lambda x: x[0])

    def grads_written(self, event: torch.cuda.Event | None) -> None:
        """The landing wrote gradients into chunk buffers, on the stream ``event`` is in."""
        if event is not None:
            self._grads_written = event

    def forget_grads(self) -> None:
        """A new accumulation (``zero_grad``): no chunk buffer holds its gradient yet."""
        for r in list(self._resident.values()):
            r.grad_here = False

    def grads_to_host(self) -> None:
        """Every gradient held in a chunk buffer copied into its host slice (host wait): before
        the host reads the gradients itself. The chunks' state stays resident."""
        chunks = [(k, r) for k, r in list(self._resident.items())
                  if r.grad_here or k in self._step_grads]
        if not chunks:
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.down):
            self._grads_down(chunks)
        self.down.synchronize()

    def _grads_down(self, chunks) -> None:
        """On ``down`` (current): each chunk's gradient buffer into its host slice."""
        if self._grads_written is not None:
            self.down.wait_event(self._grads_written)
        for k, r in chunks:
            _copies(self.transfers, (r.g16,), (r.host_grad,))
            r.grad_here = False
            self._step_grads.discard(k)

    def _resident_for(self, group_index: int, lo: int, numel: int) -> _Resident | None:
        key = (group_index, lo, numel)
        res = self._resident.get(key)
        if res is not None or self.off_reason is not None or self._admit_off is not None:
            return res
        need = numel * _Resident.element_bytes(self.device_grads)
        if self.resident_bytes + need > self.budget_bytes:
            return None
        try:
            res = _Resident(numel, self.device, self.device_grads)
        except torch.cuda.OutOfMemoryError as e:
            self._admit_off = f"a resident chunk of {numel} elements did not fit ({e})"
            warnings.warn(f"zeroio: no more optimizer state is kept on the GPU this run: "
                          f"{self._admit_off}; set zero_optimization.tiering.gpu_budget_bytes "
                          "to cap it (0: none)", RuntimeWarning, stacklevel=3)
            return None
        self._resident[key] = res
        self.resident_bytes += res.nbytes
        return res

    def release(self) -> None:
        """Every resident chunk's state back into host memory (host wait), to be loaded again
        on its next step: before the host reads or writes optimizer state outside the step.
        No chunk may be in flight (after ``drain``). Gradients held on the GPU go down too."""
        self._flush(list(self._resident))

    def release_chunk(self, group_index: int, lo: int, numel: int) -> None:
        """Give the chunk's GPU state back (it is about to be stepped on the CPU)."""
        if (group_index, lo, numel) in self._resident:
            self._evict((group_index, lo, numel))

    def _evict(self, key: tuple[int, int, int]) -> None:
        self._flush([key])
        self.resident_bytes -= self._resident.pop(key).nbytes

    def _flush(self, keys: list[tuple[int, int, int]]) -> None:
        """The state of the chunks ``keys`` that holds it, and gradients that landed in their
        buffers, into host memory (host wait)."""
        state = [self._resident[k] for k in keys if self._resident[k].valid]
        grads = [(k, self._resident[k]) for k in keys
                 if self._resident[k].grad_here or k in self._step_grads]
        if not state and not grads:
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.down):
            self.down.wait_stream(self.up)
            for r in state:
                _copies(self.transfers, (r.p, r.m, r.v), r.host)
                r.valid = False
            if grads:
                self._grads_down(grads)
        self.down.synchronize()

    def _has_room(self, numel: int) -> bool:
        if self.off_reason is not None:
            return False
        self._pending = [(e, n) for e, n in self._pending if not e.query()]
        backlog = sum(n for _, n in self._pending)  # submitted, 16-bit copy not finished
        return backlog + min(numel, self.backlog_numel) <= self.backlog_numel

    # ---- a chunk on the GPU -----------------------------------------------------------------

    def _slots_for(self, grad_dtype: torch.dtype, host_out: torch.dtype | None) -> bool:
        """Every slot's buffers for this gradient dtype and output, allocated at once: a GPU
        too full for them turns the assist off before any copy is queued (no chunk is left
        half stepped), instead of failing the step."""
        key = (grad_dtype, host_out)
        if self.off_reason is not None:
            return False
        if key in self._ready:
            return True
        try:
            for k in range(self.n_slots):
                for name, dtype in slot_layout(grad_dtype, host_out):
                    self._buf(k, name, dtype, 0)
        except torch.cuda.OutOfMemoryError as e:
            self._bufs = [{} for _ in range(self.n_slots)]
            self._ready.clear()
            self.off_reason = (f"its {self.n_slots} GPU slots of {self.slot_numel} elements did "
                               f"not fit ({e})")
            warnings.warn(f"zeroio: the step assist is off for this run: {self.off_reason}; the "
                          "CPU steps every chunk. Set zero_optimization.tiering.step_assist to "
                          "false to skip it, or free GPU memory.", RuntimeWarning, stacklevel=2)
            return False
        self._ready.add(key)
        return True

    def _buf(self, k: int, name: str, dtype: torch.dtype, n: int) -> torch.Tensor:
        """Slot ``k``'s buffer ``name`` (allocated on first use), its first ``n`` elements."""
        buf = self._bufs[k].get(name)
        if buf is None or buf.dtype != dtype:
            buf = self._bufs[k][name] = torch.empty(self.slot_numel, dtype=dtype,
                                                    device=self.device)
        return buf.narrow(0, 0, n)

    def submit(self, step, group_index: int, lo: int, numel: int, out: torch.Tensor,
               after: torch.cuda.Stream | None = None,
               resident: _Resident | None = None) -> torch.cuda.Event:
        """Step elements [lo, lo + numel) of ``step``'s (a ``ChunkedStep``) group on the GPU,
        the 16-bit result into ``out`` (``numel`` long, on the GPU or pinned host memory).
        ``after``: the 16-bit copies wait for the work queued on that stream so far (GPU
        ``out``: the stream that ordered itself after the last readers of the parameters). Returns
        the event behind the 16-bit copy; ``drain`` before the host touches the state.
        None, with nothing queued, where the slots do not fit the GPU (the caller steps the
        chunk itself; the assist stays off from then on, with one warning). ``resident``: the
        chunk's GPU state ([Note: resident chunks]), loaded first if it is not valid."""
        master, grad, exp_avg, exp_avg_sq = step.host_views(group_index, lo, numel)
        if not self._slots_for(grad.dtype, None if out.device.type == "cuda" else out.dtype):
            return None
        done, k = None, self._next
        start = torch.cuda.Event(enable_timing=True)
        key = (group_index, lo, numel)
        on_gpu = resident is not None and key in self._step_grads  # [Note: resident gradients]
        with torch.cuda.device(self.device):
            for a in range(0, numel, self.slot_numel):
                n = min(self.slot_numel, numel - a)
                k, self._next = self._next, (self._next + 1) % self.n_slots
                done = self._piece(
                    k, [t.narrow(0, a, n) for t in (master, grad, exp_avg, exp_avg_sq, out)],
                    step, group_index, after, start if a == 0 else None,
                    None if resident is None else
                    (resident.valid, *(t.narrow(0, a, n) for t in (resident.p, resident.m,
                                                                    resident.v)),
                     resident.g16.narrow(0, a, n) if on_gpu else None))
        if on_gpu:
            self._step_grads.discard(key)
            self.numel_grad_gpu += numel
        self.last_span = (start, self._free[k]) if numel else None
        if resident is None:
            self._pending.append((done, numel))
        else:  # 2 bytes up per element instead of 14: a seventh of a streamed chunk's backlog
            resident.host, resident.valid = (master, exp_avg, exp_avg_sq), True
            self._pending.append((done, numel // 7))
            self.numel_resident += numel
        self.numel_gpu += numel
        return done

    def _piece(self, k, views, step, group_index: int, after,
               start: torch.cuda.Event | None = None, resident=None) -> torch.cuda.Event:
        """One slot's worth of a chunk. ``resident``: (valid, p, m, v, g16) of a resident
        chunk's GPU state: loaded from the host only where not valid, never copied back here;
        ``g16``: its gradient on the GPU (None: it comes up from the host)."""
        master, grad, exp_avg, exp_avg_sq, out = views
        n = master.numel()
        g = self._buf(k, "g", torch.float32, n)
        if resident is None:
            p, m, v = (self._buf(k, name, torch.float32, n) for name in ("p", "m", "v"))
            load, g_here = True, None
        else:
            valid, p, m, v, g_here = resident
            load = not valid
        up, down = self.up, self.down
        with torch.cuda.stream(up):
            if self._free[k] is not None:
                up.wait_event(self._free[k])  # the slot's last copies down have read it
            if start is not None:  # the chunk's GPU work begins ([Note: step breakdown])
                start.record(up)
            if g_here is not None:  # [Note: resident gradients]: nothing comes up for it
                low_grad = g_here
                if load:
                    _copies(self.transfers, (master, exp_avg, exp_avg_sq), (p, m, v))
            else:
                low_grad = (self._buf(k, "g16", grad.dtype, n) if grad.dtype != torch.float32
                            else g)
                if load:
                    _copies(self.transfers, (master, exp_avg, exp_avg_sq, grad),
                            (p, m, v, low_grad))
                else:
                    _copies(self.transfers, (grad,), (low_grad,))
            if low_grad is not g:
                g.copy_(low_grad)
            step.adam(group_index, p, g, m, v)
            if after is not None:  # earlier chunks are published first, and the work
                up.wait_stream(after)  # queued there before (the backward's reads) is done
            low = out if out.device.type == "cuda" else self._buf(k, "out", out.dtype, n)
            low.copy_(p)  # the 16-bit cast, on the GPU
            stepped = torch.cuda.Event()
            stepped.record(up)
        with torch.cuda.stream(down):
            down.wait_event(stepped)
            done = stepped
            if low is not out:  # a host 16-bit shard (stage 3, parameter offload)
                Copies(self.transfers).into(out, low, non_blocking=True)
                done = torch.cuda.Event()
                done.record(down)
            if resident is None:
                _copies(self.transfers, (p, m, v), (master, exp_avg, exp_avg_sq))
            free = torch.cuda.Event(enable_timing=True)  # also the chunk's end on the GPU
            free.record(down)
        self._free[k] = free
        return done

    # ---- the end of a step --------------------------------------------------------------------

    def drain(self) -> None:
        """Host wait until every chunk's state is back in host memory (before the host reads
        or writes it: the next step, a checkpoint, the next backward's gradients)."""
        for e in self._free:
            if e is not None:
                e.synchronize()
        self._pending = []
        self._step_grads = set()  # every chunk of the step was submitted or released
        self._admitting = False

    def held_tensors(self) -> list[torch.Tensor]:
        """The slots (resident chunks are the GPU tier's: ``engine.stats()["tiers"]["gpu"]``
        counts them through it)."""
        return [t for slot in self._bufs for t in slot.values()]

    def stats(self) -> dict[str, int | bool]:
        return {"numel_gpu": self.numel_gpu, "numel_cpu": self.numel_cpu,
                "numel_resident": self.numel_resident, "numel_grad_gpu": self.numel_grad_gpu,
                "resident_bytes": self.resident_bytes, "resident_budget_bytes": self.budget_bytes,
                "resident_chunks": len(self._resident), "off": self.off_reason is not None}


def _copies(transfers: TierStats | None, srcs, dsts) -> None:
    """``dst.copy_(src, non_blocking=True)`` for each pair, as one call (the worker thread
    pays Python and the GIL per call, beside a training thread that also wants it)."""
    Copies(transfers).many(dsts, srcs, non_blocking=True)
