"""The host step of stages 0/1/2 with host masters: the optimizer steps them chunk by chunk on a
worker thread (step_overlap.[Note: step overlap]) and each chunk is published into the 16-bit
parameters behind it. ``HostStep12`` holds these methods of ``Stage12Partitioner``
(stage12.py), whose state they use; the chunks follow [Note: host-step chunks] in
host_plan.py, the rule stage 3 steps by.

[Note: stage 1/2 step assist]
With ``step_assist`` ([Note: step assist] in shard/assist.py) ``_step_job``
hands a chunk to the GPU when ``StepAssist.take`` accepts it: the GPU casts
the chunk's new values into the parameter buffer after everything queued on the copy
stream so far (earlier chunks, the backward's last reads), and the copy
stream waits for that cast before later chunks, the bucket's all-gather and
the chunk's event, so ``events[i]`` still means "chunks 0..i are published".
``wait_step`` drains the assist (state back in host memory) after the join.

[Note: step collectives]
With the overlapped step the worker all-gathers finished buckets after ``step()``
returned, while the training thread goes on and may issue collectives of its
own (an all-reduce of the loss for logging, a barrier, the HF Trainer's
gathers). On one group, a rank's all-reduce could pair with another rank's
all-gather and hang (gloo) or corrupt both. So the worker gathers on
``collectives.side_group()``, a second group over the same ranks made at
construction, and the training thread keeps the first: each group sees its
collectives in one order on every rank. The next backward's reductions
(first group) start after the forward has waited for every chunk, gather
included, so the two groups' collectives do not run at once on the GPU.
A partitioner built on a subgroup keeps that group for both (the side
group would need every rank of the world to make it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from zeroio.io.hostmem import host_empty
from zeroio.partition import collectives as comm
from zeroio.partition.base import Phase
from zeroio.partition.flat import Bucket
from zeroio.partition.host_plan import chunk_bounds, chunk_holding
from zeroio.tiering.copies import Copies


@dataclass(frozen=True, kw_only=True)
class StepChunk:
    """One job of the host step: Adam on part of a bucket's slice, then its publication."""

    bucket: Bucket
    slice_lo: int
    """Start inside the bucket's slice (this rank's)."""
    numel: int
    gather: bool
    """Last chunk of its bucket with world > 1: the bucket's all-gather follows."""


class HostStep12:
    """The host step of ``Stage12Partitioner`` (module doc); mixed into it, not used alone."""

    forward_rerunnable = True  # its forward hooks only wait for published chunks

    def _plan_step(self, chunk_numel: int) -> tuple[list[StepChunk], dict[int, int]]:
        """Chunks in the order a forward reads parameters (buckets by their first global
        offset), and per parameter the last chunk its published value depends on."""
        order = sorted(self.layout.buckets,
                       key=lambda b: min((s.global_offset for s in b.slots), default=0))
        chunks: list[StepChunk] = []
        ready: dict[int, int] = {}
        self._device_gathers: list[Bucket] = []
        """Buckets with no host element (world > 1): all-gathered by ``run_step`` itself."""
        for b in order:
            size, first = b.slice_numel(self.world), len(chunks)
            h0 = self._host_start(b)  # host chunks only: [Note: stage 1/2 twin placement] in split.py
            bounds = chunk_bounds(h0, size, chunk_numel)  # [Note: host-step chunks]
            chunks += [StepChunk(bucket=b, slice_lo=lo, numel=hi - lo,
                                 gather=self.world > 1 and hi == size) for lo, hi in bounds]
            if h0 == size and self.world > 1 and size:
                self._device_gathers.append(b)
            for s in b.slots:
                end = s.flat_offset - b.start + s.numel
                if h0 == size or (self.world == 1 and end <= h0):
                    ready[id(s.param)] = -1  # published before any host chunk
                elif self.world > 1:  # usable after the bucket's all-gather
                    ready[id(s.param)] = len(chunks) - 1
                else:  # world 1: the slice is the bucket
                    ready[id(s.param)] = first + chunk_holding(bounds, end - 1) if s.numel else -1
        return chunks, ready

    def _host_start(self, b: Bucket) -> int:
        """Where the host side starts inside ``b``'s slice (its size: all device-side)."""
        d = self._dev_len[b.group_index] - self._local_base[b.index]
        return max(0, min(b.slice_numel(self.world), d))

    def _publish_device(self) -> None:
        """The device side's new masters -> the 16-bit parameters (a cast copy on the compute
        stream), then the all-gather of every bucket with no host element."""
        with torch.profiler.record_function("zeroio::publish_device_side"):
            for b in self.layout.buckets:
                h0 = self._host_start(b)
                if h0:
                    lb = self._local_base[b.index]
                    self.params.narrow(0, b.start + self.rank * b.slice_numel(self.world),
                                       h0).copy_(self._dev[b.group_index].master.narrow(0, lb, h0))
            handles = [comm.all_gather_inplace(self.params.narrow(0, b.start, b.numel), self.group)
                       for b in self._device_gathers]
            for h in handles:
                h.wait()

    def run_step(self, update, *, out_in_pass: bool = False, step=None) -> None:
        """The optimizer step of host masters, chunk by chunk on a worker thread: ``update(
        group_index, local_start, numel, out=...)`` (CPU Adam) then that chunk's publication
        ([Note: step publication]; all-gather after a bucket's last chunk). ``out_in_pass``:
        ``update`` writes ``out`` within its pass over the master (the one-pass CPU Adam),
        so a 16-bit copy costs no extra pass. Without ``overlap_forward`` it returns when all
        is published (in stream order); with it, at once, and forward pre-hooks wait for each
        module's chunks. ``step``: the ``ChunkedStep`` behind ``update``, whose chunks the GPU
        may step instead ([Note: step assist])."""
        self.wait_step()
        self._assist_step = step if self._assist is not None else None
        if self._assist is not None:  # [Note: resident chunks] in shard/assist.py
            if step is None:  # the CPU steps every chunk: the host state must be current
                self._assist.release()
            self._assist.begin_step()
        if self._window is not None:  # [Note: the gradient window] in tiering/grad_window.py
            skip = [self._assist is not None and self._assist.holds(*self._host_key(c))
                    for c in self._chunks]  # resident chunks are stepped on the GPU
            ready = self._window.begin([self._host_grad(c) for c in self._chunks], skip)
            if self._assist is not None:  # the GPU's chunks read the gradient there too
                self._assist.after(ready)
        if self.optimizer_split is not None:
            self._publish_device()
        if self._copy_stream is not None:  # the backward's last reads of the buffers come first
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            self._out_in_pass = out_in_pass and self.params.dtype != torch.float32
            self._make_landing()
        self._runner.start(partial(self._step_job, update))
        if not self.overlap_forward:
            self.wait_step()
        self.phase = Phase.IDLE

    def _host_key(self, c: StepChunk) -> tuple[int, int, int]:
        """(group, host-side local offset, elements) of chunk ``c``: how the assist knows it."""
        b = c.bucket
        return (b.group_index,
                self._local_base[b.index] + c.slice_lo - self._dev_len[b.group_index], c.numel)

    def _host_grad(self, c: StepChunk) -> torch.Tensor:
        """Chunk ``c``'s gradient on the host side (where it lives: host or device)."""
        gi, hlo, n = self._host_key(c)
        return self._host[gi].grad.narrow(0, hlo, n)

    def _make_landing(self) -> None:
        if self.params.dtype == torch.float32 or not self._chunks:
            return
        n = max(c.numel for c in self._chunks)
        if self._out_in_pass:
            # with the assist, a CPU chunk's copy may queue behind GPU chunks: more slots
            self._pinned_slots(4 if self._assist is not None else 2)
        if not self._out_in_pass and not self._scratch:
            self._scratch = [torch.empty(n, dtype=torch.float32, device=self.device)
                             for _ in range(2)]

    def _pinned_slots(self, k: int) -> list[torch.Tensor]:
        """At least ``k`` pinned 16-bit slots of the largest chunk, each with the event behind
        its last copy up ([Note: step publication]; publications outside the step use them
        too: [Note: publishing] in stage12.py)."""
        n = max((c.numel for c in self._chunks), default=1)
        while len(self._stage_slots) < k:
            self._stage_slots.append(host_empty(n, self.params.dtype, pin=True))
            self._slot_free.append(torch.cuda.Event())
        return self._stage_slots

    def _step_out(self) -> torch.dtype | None:
        """What ``_step_job`` hands ``update`` as ``out`` under the one-pass CPU Adam: the
        parameters themselves when they live in host memory (no CUDA), else a pinned 16-bit
        slot, or nothing for fp32 parameters ([Note: step publication])."""
        if self.device.type != "cuda" or self._compute_dtype != torch.float32:
            return self._compute_dtype
        return None

    def _step_job(self, update, i: int) -> None:
        c = self._chunks[i]
        b, lb, size = c.bucket, self._local_base[c.bucket.index], c.bucket.slice_numel(self.world)
        dst = self.params.narrow(0, b.start + self.rank * size + c.slice_lo, c.numel)
        hlo = lb + c.slice_lo - self._dev_len[b.group_index]  # host-side local offset
        if self._assist_step is not None and self._assisted_job(c, i, b, hlo, dst):
            return
        out = None
        if self._copy_stream is None:  # parameters in host memory: written in the pass
            out = dst
        elif self._out_in_pass:
            k = i % len(self._stage_slots)
            self._slot_free[k].synchronize()  # the slot's last copy to the GPU read it
            out = self._stage_slots[k].narrow(0, 0, c.numel)
        if self._window is not None:  # the gradient stays on the device: read chunk i's
            with self._runner.clock.phase("window"):
                grad = self._window.read(i)
            with self._runner.clock.phase("adam", numel=c.numel):
                update(b.group_index, hlo, c.numel, out=out, grad=grad)
        else:
            with self._runner.clock.phase("adam", numel=c.numel):
                update(b.group_index, hlo, c.numel, out=out)
        with self._runner.clock.phase("publish"):
            self._publish_chunk(c, i, b, hlo, dst, out)

    def _publish_chunk(self, c: StepChunk, i: int, b: Bucket, hlo: int, dst: torch.Tensor,
                       out: torch.Tensor | None) -> None:
        """[Note: step publication] The chunk's new values reach the 16-bit parameters by one
        of three paths: parameters in host memory are ``out`` itself (no copy); with the
        one-pass CPU Adam the kernel wrote them into a pinned 16-bit slot (two, alternating,
        each reused after an event behind its copy) that goes up as is (2 bytes per
        element over PCIe); otherwise the fp32 master goes up into a GPU landing zone and is
        cast there (no extra CPU pass). fp32 parameters take the master directly."""
        if self._copy_stream is None:
            self._chunk_published(c, i, b)
            return
        src = self._host[b.group_index].master.narrow(0, hlo, c.numel)
        with torch.cuda.device(self.device), torch.cuda.stream(self._copy_stream):
            if out is not None:
                Copies(self.transfers).into(dst, out, non_blocking=True)
                self._slot_free[i % len(self._stage_slots)].record(self._copy_stream)
            elif src.dtype == dst.dtype:
                Copies(self.transfers).into(dst, src, non_blocking=True)
            else:
                landing = self._scratch[i % 2].narrow(0, 0, c.numel)
                Copies(self.transfers).into(landing, src, non_blocking=True)
                dst.copy_(landing)
            self._chunk_published(c, i, b)

    def _assisted_job(self, c: StepChunk, i: int, b: Bucket, hlo: int, dst: torch.Tensor) -> bool:
        """Chunk ``i`` stepped on the GPU ([Note: stage 1/2 step assist]): its 16-bit values are
        cast into ``dst`` there, after every earlier chunk's publication; the copy stream
        (later chunks, the bucket's all-gather, ``events[i]``) waits for them. False where
        the assist does not take it (``StepAssist.take``): the caller steps it."""
        with self._runner.clock.phase("assist"):
            done = self._assist.take(self._assist_step, b.group_index, hlo, c.numel, dst,
                                     after=self._copy_stream)
        if done is None:
            return False
        self._runner.clock.gpu_chunk(c.numel, self._assist.last_span)
        with torch.cuda.device(self.device), torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(done)
            self._chunk_published(c, i, b)
        return True

    def _chunk_published(self, c: StepChunk, i: int, b: Bucket) -> None:
        """After chunk ``i``'s values are in place (queued on the copy stream, the current one
        here, when there is one): the bucket's all-gather after its last chunk, and
        ``events[i]``."""
        if c.gather:
            comm.all_gather_inplace(self.params.narrow(0, b.start, b.numel),
                                    self._step_group).wait()
        if self._copy_stream is not None:
            self._runner.events[i].record(self._copy_stream)

    def step_clock(self):
        """The host step's clock ([Note: step breakdown] in tiering/breakdown.py)."""
        return self._runner.clock

    def _await_params(self, need: int, module, args) -> None:
        """Forward pre-hook (``overlap_forward``): this module's parameters are published."""
        if not self._runner.running or need < 0:
            return
        self._runner.wait_for(need)
        if self._runner.events is not None:
            torch.cuda.current_stream(self.device).wait_event(self._runner.events[need])

    def wait_step(self) -> None:
        """Wait for a host step started by ``run_step`` (re-raising its error); afterwards the
        current stream is ordered after every publication."""
        if not self._runner.running:
            return
        try:
            self._runner.join()
        finally:
            if self._assist is not None:  # the GPU's chunks are back in host memory
                self._assist.drain()
            if self._window is not None:  # no copy reads the gradient the backward writes
                self._window.finish()
        if self._runner.events is not None and self._chunks:
            torch.cuda.current_stream(self.device).wait_event(self._runner.events[-1])
