"""The host step of stage 3 with host masters: ``Stage3HostStep`` holds these methods of
``Stage3Partitioner`` (partitioner.py), whose state they use.

[Note: stage-3 host step]
With host masters (offload_optimizer cpu) the engine hands ``run_step`` the
chunked CPU Adam (``ChunkedStep.update``). One job per group, in the order
the forward uses the groups (the recorded trace), runs on a worker thread
(``StepRunner``): Adam over chunks of the group's pieces of at most
``step_chunk_numel`` elements, each chunk cast into the 16-bit shard right
after its update, while it is still warm in cache. Before, the step was one
Adam pass over all masters and then ``publish_params`` read them all again
for the cast (1.364B parameters: ~0.3 s + ~0.12 s on 16 cores).
Every gather fetches its shard through ``ParamGroup.before_fetch``, which
waits for the job of that group, so whatever reads parameters (the next
forward, ``GatheredParameters``) reads published values; at world 1 prefetch
skips groups not published yet rather than wait for them (with more ranks a
gather is a collective that every rank must issue at the same point). Without overlap
``run_step`` waits for the worker before it returns. With overlap
(``Stage3Settings.overlap_step``) it returns at once and the next forward
starts on the first groups while the CPU still updates the last ones; the
masters, moments and host gradients are the worker's until ``wait_step``
(called by the next ``begin_micro_step``, ``publish_params``,
``write_back``, ``close``, and ``engine.synchronize()``).
Only the calling thread issues collectives (every rank must issue them in
the same order): groups that are gathered at step time (persistent ones)
are stepped on the calling thread first and re-gathered there. A store that
is not plain memory (NVMe shards: its tiered store is driven from the
training thread) takes the whole-group path: Adam, then ``publish_params``.
With ``offload_optimizer.ratio`` < 1 ([Note: twin placement] in twin.py) the
device side was stepped before ``run_step`` (``TwinAdam.begin_chunked_step``):
``run_step`` publishes its pieces first, on the calling thread (on CUDA with
host shards without a host wait: [Note: asynchronous device-side publish] in
twin.py), and the jobs update and publish only host pieces.
With the step assist ([Note: step assist] in shard/assist.py; host shards on
CUDA) a job hands some of its chunks to the GPU, which writes their 16-bit
values into the host shard itself; ``_await_shard`` then makes the shard's
fetch wait on the GPU for those copies, and ``wait_step`` waits until the
GPU's chunks of master and moments are back in host memory.
The chunks of a piece follow [Note: host-step chunks] in partition/host_plan.py, the rule
stages 1/2 step by.
"""

from __future__ import annotations

import torch

from zeroio.partition.base import Phase
from zeroio.partition.host_plan import chunk_bounds
from zeroio.partition.stage3.master_store import MasterShards
from zeroio.partition.stage3.state import GroupState
from zeroio.partition.stage3.store import DeviceShards, HostShards
from zeroio.partition.stage3.twin import Side
from zeroio.partition.step_overlap import StepRunner


class Stage3HostStep:
    """The host step of ``Stage3Partitioner`` (module doc); mixed into it, not used alone."""

    def run_step(self, update, *, out_in_pass: bool = False, step=None) -> None:
        """The optimizer step of host masters: ``update(opt_group, local_start, numel)`` (CPU
        Adam, ``ChunkedStep.update``) over every piece, each chunk published behind it; see
        the note for the threads and when it returns. ``step``: the ``ChunkedStep`` behind
        ``update``, whose chunks the GPU may step instead ([Note: step assist])."""
        self.wait_step()
        if self._assist is not None:  # [Note: resident chunks] in shard/assist.py
            if step is None or not (out_in_pass and isinstance(self.store, HostShards)):
                self._assist.release()  # the CPU steps every chunk below
            self._assist.begin_step()
        if not isinstance(self.store, (HostShards, DeviceShards, MasterShards)):
            self._step_whole(update)
            return
        self._publish_device_side()
        order = list(dict.fromkeys(gi for gi in self.trace.order if gi in self._pieces))
        order += [gi for gi in sorted(self._pieces) if gi not in order]
        # every rank has the same groups gathered and re-gathers them in the same order, also
        # one whose shard on this rank holds nothing to update
        now = [g.plan.index for g in self.pgroups if g.state is not GroupState.SHARDED]
        later = [gi for gi in order if self.pgroups[gi].state is GroupState.SHARDED]
        self._begin_window([gi for gi in now if gi in self._pieces] + later)
        into_shard = out_in_pass and isinstance(self.store, HostShards)
        # the gathered groups below are stepped here, on the CPU (counted as such)
        self._assist_step = step if self._assist is not None and into_shard else None
        with torch.profiler.record_function("zeroio::stage3::step_gathered"):
            for gi in now:
                if gi in self._pieces:
                    self._step_group(update, gi, into_shard)
                self.pgroups[gi].refresh()
        self._job_of = {gi: i for i, gi in enumerate(later)}
        self._unpublished = set(later)
        self._runner = StepRunner(len(later), torch.device("cpu"),  # host writes: no events
                                  clock=self._clock)
        self._runner.start(lambda i: self._step_group(update, later[i], into_shard))
        if not self.settings.overlap_step:
            self.wait_step()
        self.phase = Phase.IDLE

    def _step_whole(self, update) -> None:
        """A store that is not plain memory (NVMe shards, driven from this thread): Adam over
        every host piece here, then ``publish_params``."""
        if self._window is None:
            for sg in self._sides[Side.HOST]:
                if sg.master.numel():
                    with self._clock.phase("adam", numel=sg.master.numel()):
                        update(sg.group_index, 0, sg.master.numel())
        else:  # chunk by chunk through the gradient window
            order = sorted(self._pieces)
            self._begin_window(order)
            for gi in order:
                self._step_group(update, gi, step_only=True)
            self._window.finish()
        self.publish_params()

    def _begin_window(self, groups: list[int]) -> None:
        """The gradient window's chunks for a step over ``groups`` in this order ([Note: the
        gradient window] in tiering/grad_window.py); the step assist reads the device gradient
        after the same event."""
        if self._window is None:
            return
        sources, keys = self._window_sources(groups)
        skip = [self._assist is not None and self._assist.holds(*k) for k in keys]
        ready = self._window.begin(sources, skip)  # resident chunks are stepped on the GPU
        if self._assist is not None:
            self._assist.after(ready)

    def _publish_device_side(self) -> None:
        """Twin placement: the device side's pieces (stepped already) into the 16-bit shards."""
        if self.optimizer_split is None:
            return
        with torch.profiler.record_function("zeroio::stage3::publish_device_side"):
            for gi, refs in self._pieces.items():
                pieces = [(ref.piece.lo, self._master(ref)) for ref in refs
                          if ref.side is Side.DEVICE]
                if not pieces:
                    continue
                if self._publisher is not None:  # no host wait: [Note: asynchronous ...]
                    self._publisher.publish(gi, self.store.host_shard(gi), pieces,
                                            after=self.streams.current())
                else:
                    self.pgroups[gi].update_shard_pieces(pieces, whole=False)

    def _settle_publish(self) -> None:
        """Host wait for the device-side publish (host code is about to touch host shards)."""
        if self._publisher is not None:
            self._publisher.settle()

    def _step_group(self, update, gi: int, into_shard: bool = False,
                    step_only: bool = False) -> None:
        """Adam over group ``gi``'s host pieces, chunk by chunk, each chunk cast into the
        shard: by the optimizer's own pass (``into_shard``, the one-pass CPU Adam writing the
        host shard's slice) or by a copy behind it (none with ``step_only``: the caller
        publishes). A gradient kept on the device is read through the window, chunk ``k``
        of the step's list (``_window_sources``)."""
        g, chunk = self.pgroups[gi], self.settings.step_chunk_numel
        k = self._window_base.get(gi, 0) if self._window is not None else 0
        with torch.profiler.record_function("zeroio::stage3::step_group"):
            for ref in self._pieces[gi]:
                if ref.side is Side.DEVICE:
                    continue  # stepped and published before the jobs started
                n = ref.piece.hi - ref.piece.lo
                master = self._sides[Side.HOST][ref.piece.opt_group].master
                for lo, hi in chunk_bounds(0, n, chunk):  # [Note: host-step chunks]
                    k += 1
                    out = None
                    if into_shard:  # publishing is the wait for readers of the shard
                        with self._clock.phase("publish"):
                            out = self.store.writable(gi, ref.piece.lo + lo, hi - lo)
                        if self._assisting(gi, ref.piece.opt_group, ref.base + lo, hi - lo, out):
                            continue
                    self._update_chunk(update, ref.piece.opt_group, ref.base + lo, hi - lo,
                                       out, k - 1)
                    if not into_shard and not step_only:
                        with self._clock.phase("publish"):
                            g.update_shard(ref.piece.lo + lo,
                                           master.narrow(0, ref.base + lo, hi - lo))
        self._unpublished.discard(gi)

    def _update_chunk(self, update, opt_group: int, lo: int, numel: int,
                      out: torch.Tensor | None, k: int) -> None:
        """CPU Adam over one chunk (``out``: where it writes the 16-bit values, or None); a
        gradient kept on the device comes through the window (chunk ``k``)."""
        kw = {} if out is None else {"out": out}
        if self._window is not None:
            with self._clock.phase("window"):
                kw["grad"] = self._window.read(k)
        with self._clock.phase("adam", numel=numel):
            update(opt_group, lo, numel, **kw)

    def _assisting(self, gi: int, opt_group: int, lo: int, numel: int,
                   out: torch.Tensor) -> bool:
        """Hand the chunk to the GPU if the assist takes it (the worker's jobs only;
        ``_await_shard`` orders the shard's fetch after the copies into it)."""
        if self._assist_step is None:
            return False
        if self._runner is None or not self._runner.on_worker():
            # the calling thread's groups (gathered ones, re-gathered right after) stay on it
            self._assist.release_chunk(opt_group, lo, numel)
            self._assist.cpu(numel)
            return False
        with self._clock.phase("assist"):
            done = self._assist.take(self._assist_step, opt_group, lo, numel, out)
        if done is None:
            return False
        self._clock.gpu_chunk(numel, self._assist.last_span)
        self._assisted.setdefault(gi, []).append(done)
        return True

    def step_clock(self):
        """The host step's clock ([Note: step breakdown] in tiering/breakdown.py)."""
        return self._clock

    def _await_shard(self, gi: int) -> None:
        """``ParamGroup.before_fetch``: the device side's copies of ``gi`` are ordered before
        its fetch, and the overlapped step's job of ``gi`` has finished."""
        if self._publisher is not None:
            self._publisher.before_fetch(gi, self.streams.h2d)
        runner = self._runner
        if runner is not None and gi in self._unpublished:
            with torch.profiler.record_function("zeroio::stage3::await_step"):
                runner.wait_for(self._job_of[gi])
        for e in self._assisted.pop(gi, ()):  # the job is done: its list is complete; the
            self.streams.h2d.wait_event(e)     # shard's copy up follows the GPU's copies down

    def wait_step(self) -> None:
        """Wait for a step started by ``run_step`` (re-raising its worker's error); later
        writes of the device masters on the caller's stream follow the device-side publish,
        and no fetch still reads a master ([Note: shards read from the master]: the caller
        may write them next)."""
        self._settle_master_reads()
        self.join_step()

    def join_step(self) -> None:
        """``wait_step`` without the wait for fetches reading the masters: for a caller that
        writes no master (``begin_micro_step``, whose backward would otherwise start only once
        the forward's last copy is done)."""
        if self._publisher is not None:
            self._publisher.order_writers(self.streams.current())
        runner = self._runner  # kept while joined: the worker's jobs still ask it (_assisting)
        if runner is None:
            return
        try:
            with torch.profiler.record_function("zeroio::stage3::await_step"):
                runner.join()
        finally:
            self._runner = None
            self._unpublished = set()
            self._job_of = {}
            if self._assist is not None:  # the GPU's chunks are back in host memory
                self._assist.drain()
                self._assisted = {}
            self._assist_step = None
            if self._window is not None:  # no copy reads the gradient the backward writes
                self._window.finish()
