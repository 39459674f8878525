"""Stage 3 behind the ``Partitioner`` protocol: parameters, gradients and optimizer state sharded.

Construction flattens each group (layout.py), keeps this rank's slice as the
16-bit shard (store.py: device, pinned CPU or NVMe) and its fp32 copy as the
optimizer's master, points every parameter at an empty placeholder, and
installs the hooks (hooks.py). One ``ShardGroup`` per optimizer param group
collects that group's runs of every flat group's shard (layout.ShardPiece), so
the optimizer of stages 1/2 steps stage 3 unchanged. The host step (``run_step``,
``wait_step``) is ``Stage3HostStep`` in host_step.py ([Note: stage-3 host step]).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from zeroio.dtypes import DTYPES
from zeroio.errors import ConfigError, DistributedError
from zeroio.partition import collectives as comm
from zeroio.partition.base import Partitioner, Phase, ShardGroup
from zeroio.partition.grad_norm import cast_overflows, shards_overflow, shards_sq_norm
from zeroio.partition.host_plan import chunk_bounds
from zeroio.partition.stage3 import registry
from zeroio.partition.stage3.grads import GradLanding, Landing
from zeroio.partition.stage3.group import ParamGroup, PendingReduce
from zeroio.partition.stage3.hooks import HookSet
from zeroio.partition.stage3.host_step import Stage3HostStep
from zeroio.partition.stage3.layout import ShardPiece, index_of, plan_groups, shard_pieces
from zeroio.partition.stage3.master_store import MasterShards
from zeroio.partition.stage3.paged import PagedMasters3
from zeroio.partition.stage3.prefetch import Trace
from zeroio.partition.stage3.settings import Stage3Settings
from zeroio.partition.stage3.state import GroupState, PassState
from zeroio.partition.stage3.store import HostShards, make_store
from zeroio.partition.stage3.streams import Streams, wait_stream
from zeroio.partition.stage3.twin import (
    DevicePublish,
    OptimizerSplit,
    Side,
    device_numel,
    logical_group,
    place,
)
from zeroio.partition.step_overlap import PhaseClock, StepRunner
from zeroio.shard.assist import StepAssist
from zeroio.shard.host_grads import host_grad_dtype
from zeroio.shard.paged import PagedMasters
from zeroio.tiering.copies import Copies
from zeroio.tiering.device_accum import (
    accumulation_on_device,
    accumulation_placed,
    gradient_placed,
)
from zeroio.tiering.grad_window import GradWindow
from zeroio.tiering.stats import TierStats

_MAX_INFLIGHT_REDUCES = 4


@dataclass(frozen=True, kw_only=True)
class _PieceRef:
    group: int
    piece: ShardPiece
    base: int
    """Start of this piece inside its side's ShardGroup's master/grad."""
    side: Side = Side.HOST
    """Which side's ShardGroup holds it ([Note: twin placement] in twin.py)."""


class Stage3Partitioner(Stage3HostStep, PagedMasters3, Partitioner):
    """See the module docstring; the protocol is ``zeroio.partition.base.Partitioner``."""

    stage = 3
    runs_host_step = True  # run_step: host shards stepped chunk by chunk

    def __init__(self, *, module: nn.Module, param_groups: list[list[nn.Parameter]],
                 compute_dtype: torch.dtype, device: torch.device, home,
                 settings: Stage3Settings, group=None, host_kernel=None):
        """``host_kernel``: the one-pass CPU Adam ``host_grad_dtype`` asks (the engine passes
        optim/cpu_adam.py; None: the host gradients stay fp32)."""
        self.module, self.dtype, self.device, self.home = module, compute_dtype, device, home
        self.settings, self.pg = settings, group
        self.group = group
        self._host_kernel = host_kernel
        self.rank, self.world = comm.rank(group), comm.world_size(group)
        self.index = index_of(module, registry.true_shape)
        opt_group_of = {id(p): gi for gi, ps in enumerate(param_groups) for p in ps}
        self.plan = plan_groups(module, world=self.world,
                                persistence_threshold=settings.persistence_threshold,
                                opt_group_of=opt_group_of, index=self.index,
                                shape_of=registry.true_shape)
        self.transfers = TierStats()  # host <-> device copies, counted where issued
        self._pages = self._masters_page(settings)  # [Note: paged masters] in shard/paged.py
        self.paged: PagedMasters | None = None  # built once the shard sizes are known
        self.store = make_store(settings, device, rank=self.rank,
                                shard_numels={gp.index: gp.shard_numel for gp in self.plan.groups},
                                dtype=compute_dtype, transfers=self.transfers)
        try:
            self._assemble(module, param_groups, compute_dtype, device, settings)
        except BaseException:  # a failed initialize leaves no swap file behind
            self.store.close()
            if self.paged is not None:
                self.paged.close()
            raise

    def _assemble(self, module: nn.Module, param_groups: list[list[nn.Parameter]],
                  compute_dtype: torch.dtype, device: torch.device,
                  settings: Stage3Settings) -> None:
        """The rest of construction, once the parameter store exists: groups, shards (and the
        paged masters' store), gradient landing, hooks."""
        if settings.params_from_master and not self._pages:  # [Note: shards read from
            self.store = MasterShards(self.store, device, compute_dtype, self.transfers)
        self.streams = Streams.for_device(device)  # the device's, from tiering/streams.py
        by_id = {id(p): p for p in module.parameters()}
        self.pgroups: list[ParamGroup] = []
        for gp in self.plan.groups:
            params = [by_id[pid] for pid, _ in sorted(
                ((pid, loc) for pid, loc in self.plan.slot_of.items() if loc[0] == gp.index),
                key=lambda x: x[1][1])]
            self.pgroups.append(ParamGroup(gp, params, rank=self.rank, world=self.world,
                                           device=device, dtype=compute_dtype,
                                           store=self.store, pg=self.pg, streams=self.streams))
        n_opt = len(param_groups)
        self._sides, self._pieces = self._build_shards(n_opt)
        if self.paged is not None:
            self.paged.publish = self._publish_piece
        host, dev = self._sides[Side.HOST], self._sides[Side.DEVICE]
        self.optimizer_split: OptimizerSplit | None = None
        """Both sides' ShardGroups when offload_optimizer.ratio < 1 (engine_build.build_optimizer)."""
        if settings.optimizer_ratio < 1.0:
            self.optimizer_split = OptimizerSplit(device=dev, host=host)
            self.groups = [logical_group(d, h) for d, h in zip(dev, host, strict=True)]
        else:
            self.groups = host
        physical = host + dev  # the landing's targets: host og -> og, device og -> n_opt + og
        if self._grads_page:
            self.paged.grads = self._paged_grads()
        self.landing = GradLanding(  # [Note: landing reduced gradients] in grads.py
            physical,
            {gi: [Landing(lo=r.piece.lo, numel=r.piece.hi - r.piece.lo,
                          target=r.piece.opt_group + (n_opt if r.side is Side.DEVICE else 0),
                          base=r.base) for r in refs]
             for gi, refs in self._pieces.items()},
            device, pin=getattr(self.home, "pin_memory", False), transfers=self.transfers,
            d2h=self.streams.d2h, paged=None if self.paged is None else self.paged.grads)
        self._accum = self.landing.accum = accumulation_on_device(  # tiering/device_accum.py
            placed=self._accum_placed and not self.grads_streamed,
            host_grads=[sg.grad for sg in host], device=device)
        if settings.accumulation_steps > 1 and self._accum is None and \
                not self.grads_streamed:  # in the host budget's split (engine.py)
            self.landing.reserve_staging()
        self._whole = {gi: _covers_shard(self.pgroups[gi].plan, self.rank, refs)
                       for gi, refs in self._pieces.items()}
        for p in by_id.values():
            registry.OWNERS[p] = self
        self.trace = Trace(settings, [g.numel for g in self.pgroups])
        self.pass_state = PassState.IDLE
        self.phase = Phase.IDLE
        self._boundary = True
        self._pending: list[PendingReduce] = []
        # with streams a reduce-scatter's wait only queues stream work: consume at once, so
        # the gradient's D2H starts as soon as it is reduced; gloo (CPU) waits on the host
        self._max_inflight = 0 if self.streams.comm is not None else _MAX_INFLIGHT_REDUCES
        self._runner: StepRunner | None = None  # [Note: stage-3 host step]
        self._clock = PhaseClock()  # host step phases for engine.stats()["timings"]
        self._job_of: dict[int, int] = {}
        self._unpublished: set[int] = set()
        self._publisher: DevicePublish | None = None  # [Note: asynchronous device-side publish]
        if self.optimizer_split is not None and self.streams.d2h is not None and \
                isinstance(self.store, HostShards):
            self._publisher = DevicePublish(stream=self.streams.d2h, dtype=compute_dtype,
                                            transfers=self.transfers)
        host_numel = sum(sg.master.numel() for sg in self._sides[Side.HOST])
        self._assist = (StepAssist(device, host_numel=host_numel, transfers=self.transfers,
                                   gpu_budget_bytes=settings.tiering.gpu_budget_bytes,
                                   device_grads=self.host_grad_dtype  # not beside an
                                   if self.host_grad_dtype.itemsize == 2 and  # fp32 sum,
                                   self._accum is None and  # nor where the gradient stays
                                   not self.grads_streamed else None)  # on the device
                        if settings.step_assist and isinstance(self.store, HostShards) and
                        self.paged is None else None)  # [Note: step assist] in shard/assist.py
        if self._assist is not None and self._assist.device_grads is not None:
            self.landing.router = self._assist  # [Note: resident gradients] in shard/assist.py
        self._assist_step = None
        self._assisted: dict[int, list[torch.cuda.Event]] = {}
        """Per group, the events behind the GPU's copies into its host shard (this step)."""
        self._window = self._gradient_window()  # [Note: the gradient window]
        for g in self.pgroups:
            g.before_fetch = self._await_shard
        for g in self.pgroups:
            if g.plan.persistent:
                g.finish_gather()
        self.hooks = HookSet(self, module, self.plan.users)

    # -- construction -----------------------------------------------------------------------
    def _full_flat(self, g: ParamGroup) -> torch.Tensor:
        """The group's full padded flat in the original precision (one group at a time)."""
        dtype = next((p.dtype for p in g.params if p not in registry.INIT_SHARDS),
                     None) or registry.INIT_SHARDS[g.params[0]].dtype
        flat = torch.zeros(g.plan.padded_numel, dtype=dtype, device=self.device)
        for slot, p in zip(g.plan.slots, g.params, strict=True):
            rec = registry.INIT_SHARDS.get(p)
            dst = flat.narrow(0, slot.offset, slot.numel)
            if rec is None:  # on the device already when the engine moved the model there
                Copies(self.transfers).into(dst, p.detach().reshape(-1))
                continue
            n = rec.shard.numel()  # zero.Init's slice, in host memory
            full = torch.empty(n * rec.world, dtype=rec.dtype, device=self.device)
            Copies(self.transfers).into(full.narrow(0, self.rank * n, n), rec.shard)
            comm.all_gather_inplace(full, self.pg).wait()
            dst.copy_(full.narrow(0, 0, slot.numel))
        return flat

    def _build_shards(self, n_opt_groups: int):
        """Each side's ShardGroups (one per optimizer group) and every group's pieces."""
        ordered = [(g.plan.index, pc) for g in self.pgroups
                   for pc in shard_pieces(g.plan, self.rank)]
        total = sum(pc.hi - pc.lo for _, pc in ordered)
        placed = place(ordered, device_numel(total, self.settings.optimizer_ratio))
        pieces = {side: [[] for _ in range(n_opt_groups)] for side in Side}
        sizes = {side: [0] * n_opt_groups for side in Side}
        by_group: dict[int, list[_PieceRef]] = {}
        for gi, pc, side in placed:
            ref = _PieceRef(group=gi, piece=pc, base=sizes[side][pc.opt_group], side=side)
            pieces[side][pc.opt_group].append(ref)
            by_group.setdefault(gi, []).append(ref)
            sizes[side][pc.opt_group] += pc.hi - pc.lo
        self._index_host_refs(by_group, n_opt_groups)  # paged.py: _publish_piece's lookup
        mdt, sdt = DTYPES[self.settings.master_dtype], DTYPES[self.settings.state_dtype]
        if self._pages:
            self.paged = self._paged_masters(sizes[Side.HOST])
        homes = {Side.HOST: lambda n: self.home.empty(n, mdt) if self.paged is None else
                 torch.empty(n, dtype=mdt, device="meta"), Side.DEVICE: lambda n: torch.zeros(
            n, dtype=torch.float32, device=self.device)}
        masters = {side: [homes[side](n) for n in sizes[side]] for side in Side}
        self._accum_placed = accumulation_placed(  # tiering/device_accum.py: before the dtype
            accumulates=self.settings.accumulation_steps > 1 and
            getattr(self.home, "device", None) == torch.device("cpu"),
            host_numel=sum(sizes[Side.HOST]), device=self.device,
            budget=self.settings.tiering.gpu_budget_bytes,
            decided=self.settings.accumulate_on_device)
        self.host_grad_dtype = host_grad_dtype(
            stage=3, compute_dtype=self.dtype,
            cpu_optimizer=self.settings.cpu_optimizer or self.settings.nvme_optimizer,
            accumulation_steps=self.settings.accumulation_steps,
            host_numel=sum(sizes[Side.HOST]), kernel=self._host_kernel,
            # as run_step (nvme: the swapper's whole step, then publish_params)
            step_out=self.dtype if isinstance(self.store, HostShards) and
            not self.settings.nvme_optimizer else None,
            master_dtype=mdt, state_dtype=sdt, device_accumulates=self._accum_placed)
        """dtype of the host side's gradient shards ([Note: 16-bit host gradients at stage 3]
        in grads.py; bf16 with bf16 masters: [Note: bf16 shards] in shard/types.py); the
        device side's are fp32."""
        if self.host_grad_dtype == torch.float32:
            self.host_grad_dtype = mdt
        self.grad_read_dtype = self.host_grad_dtype
        host_numel = sum(sizes[Side.HOST])
        self.grads_streamed = gradient_placed(  # [Note: the gradient's home]
            streams=self.settings.cpu_optimizer and self._host_kernel is not None and
            self.paged is None, host_numel=host_numel, accumulated=self._accum_placed,
            accumulates_on_host=self.settings.accumulation_steps > 1,
            home_bytes=self.host_grad_dtype.itemsize, device=self.device,
            budget=self.settings.tiering.gpu_budget_bytes,
            decided=self.settings.gradient_on_device)
        """The host side's gradient stays on the device (the fp32 accumulation sum, or the
        host gradient's dtype), read by the host step through ``GradWindow``."""
        # [Note: paged gradients] in shard/paged_grads.py: with the masters, where nothing
        # accumulates on the host (never streamed: that needs host masters)
        self._grads_page = self.paged is not None and self.settings.accumulation_steps == 1
        streamed = torch.float32 if self._accum_placed else self.host_grad_dtype
        if self.grads_streamed:
            host_home = lambda n: torch.zeros(n, dtype=streamed, device=self.device)  # noqa: E731
        elif self._grads_page:
            host_home = lambda n: torch.empty(n, dtype=self.host_grad_dtype, device="meta")  # noqa: E731
        else:
            host_home = lambda n: self.home.empty(n, self.host_grad_dtype)  # noqa: E731
        grad_homes = {Side.HOST: host_home,
                      Side.DEVICE: lambda n: torch.zeros(n, dtype=torch.float32,
                                                         device=self.device)}
        if isinstance(self.store, MasterShards):
            self._attach_masters(by_group, masters)
        for g in self.pgroups:
            flat = self._full_flat(g)
            for ref in by_group.get(g.plan.index, []):
                src = flat.narrow(0, g.shard_lo + ref.piece.lo, ref.piece.hi - ref.piece.lo)
                if self.paged is not None and ref.side is Side.HOST:
                    self.paged.seed(ref.piece.opt_group, ref.base, src)
                    continue
                Copies(self.transfers).into(
                    masters[ref.side][ref.piece.opt_group].narrow(0, ref.base, src.numel()), src)
            g.load_full(flat)
            del flat
        if self.paged is not None:
            self.paged.finish_seeding()
        for p in {id(p): p for g in self.pgroups for p in g.params}.values():
            registry.INIT_SHARDS.pop(p, None)
        groups: dict[Side, list[ShardGroup]] = {}
        for side in Side:
            groups[side] = []
            for og in range(n_opt_groups):
                segs = []
                for ref in pieces[side][og]:
                    segs += [type(s)(local_offset=s.local_offset + ref.base,
                                     global_offset=s.global_offset, numel=s.numel)
                             for s in ref.piece.segments]
                names = tuple(dict.fromkeys(n for ref in pieces[side][og]
                                            for n in ref.piece.names))
                groups[side].append(ShardGroup(
                    group_index=og, master=masters[side][og],
                    grad=grad_homes[side](sizes[side][og]), numel=sum(s.numel for s in segs),
                    segments=tuple(segs), params=names))
        return groups, by_group

    def _window_sources(self, groups: list[int]):
        """The host pieces' gradients of ``groups``, chunk by chunk, in the order the host
        step steps them (``_step_group``), and each chunk's (optimizer group, local offset,
        elements); ``self._window_base`` records where each group's chunks start."""
        out: list[torch.Tensor] = []
        keys: list[tuple[int, int, int]] = []
        self._window_base = {}
        for gi in groups:
            self._window_base[gi] = len(out)
            for ref in self._pieces.get(gi, []):
                if ref.side is Side.DEVICE:
                    continue
                og = ref.piece.opt_group
                grad = self._sides[Side.HOST][og].grad
                for lo, hi in chunk_bounds(0, ref.piece.hi - ref.piece.lo,
                                           self.settings.step_chunk_numel):
                    out.append(grad.narrow(0, ref.base + lo, hi - lo))
                    keys.append((og, ref.base + lo, hi - lo))
        return out, keys

    def _gradient_window(self) -> GradWindow | None:
        """The host step's window onto the device-homed gradient, of the largest chunk."""
        if not self.grads_streamed:
            return None
        chunks, _ = self._window_sources(sorted(self._pieces))
        if not chunks:
            return None
        return GradWindow(numel=max(c.numel() for c in chunks), dtype=self.grad_read_dtype,
                          device=self.device, pin=getattr(self.home, "pin_memory", False),
                          homes=[sg.grad for sg in self._sides[Side.HOST]],
                          transfers=self.transfers)

    def _attach_masters(self, by_group: dict[int, list[_PieceRef]], masters) -> None:
        """Bind each sharded group whose master pieces cover every element that matters to
        them ([Note: shards read from the master] in master_store.py)."""
        for g in self.pgroups:
            refs = by_group.get(g.plan.index, [])
            if g.plan.persistent or not _covers_shard(g.plan, self.rank, refs):
                continue
            self.store.attach(g.plan.index, g.plan.shard_numel, [
                (r.piece.lo, masters[r.side][r.piece.opt_group].narrow(
                    0, r.base, r.piece.hi - r.piece.lo)) for r in refs])

    def _settle_master_reads(self) -> None:
        """Before the masters are written: no fetch still reads them (a no-op unless the
        store reads the masters: MasterShards)."""
        self.store.order_writers(self.streams.current())
        self.store.settle_reads()

    def _master(self, ref: _PieceRef) -> torch.Tensor:
        """The fp32 masters of one piece, on its side."""
        return self._sides[ref.side][ref.piece.opt_group].master.narrow(
            0, ref.base, ref.piece.hi - ref.piece.lo)

    @property
    def _physical(self) -> list[ShardGroup]:
        """Both sides' ShardGroups (the logical ones of twin placement hold no data)."""
        return self._sides[Side.HOST] + self._sides[Side.DEVICE]

    # -- gathering (called by hooks and GatheredParameters) --------------------------------
    def live_numel(self) -> int:
        return sum(g.numel for g in self.pgroups
                   if not g.plan.persistent and g.state is not GroupState.SHARDED)

    def use(self, gi: int) -> None:
        """Group ``gi`` is needed now: gather it (and the next ones, per the trace)."""
        g = self.pgroups[gi]
        self.trace.record(gi)
        if g.state is GroupState.SHARDED:
            g.start_gather()
        upcoming = self.trace.upcoming()
        self.store.prefetch(upcoming)
        for nxt in upcoming:
            ng = self.pgroups[nxt]
            if self.world == 1 and nxt in self._unpublished:
                continue  # the step is still on it: gather it when used (with more ranks
                # the gathers are collectives, in the same order on every rank: wait)
            if ng.state is GroupState.SHARDED and not ng.plan.persistent and \
                    self.live_numel() + ng.numel <= self.settings.max_live_parameters:
                ng.start_gather()
        g.finish_gather()

    def maybe_release(self, gi: int) -> None:
        g = self.pgroups[gi]
        if g.held or g.plan.persistent:
            return
        if self.trace.reused_soon(gi) and self.live_numel() <= self.settings.max_live_parameters:
            return
        g.release()

    def release_all(self) -> None:
        for g in self.pgroups:
            g.bwd_hold = False
            g.fwd_holds = 0
            g.release()

    def begin_forward(self) -> None:
        self.pass_state = PassState.FORWARD
        if self.trace.frozen:
            self.trace.cursor, self.trace.lost = 0, False

    def end_inference(self) -> None:
        self.release_all()
        self.pass_state = PassState.IDLE

    # -- gradients --------------------------------------------------------------------------
    def on_grad(self, param: nn.Parameter) -> None:
        gi, si = self.plan.slot_of[id(param)]
        grad, param.grad = param.grad, None
        if grad is None:
            return
        g = self.pgroups[gi]
        self.phase = Phase.ACCUMULATING
        if g.accept_grad(si, grad):
            self._launch(g)
            g.bwd_hold = False
            self.maybe_release(gi)

    def _launch(self, g: ParamGroup) -> None:
        gi, scale, boundary = g.plan.index, 1.0 / self.world, self._boundary

        def consume(bucket: torch.Tensor) -> None:  # on the comm stream, no host wait
            self.landing.consume(gi, bucket.narrow(0, g.shard_lo, g.plan.shard_numel), scale,
                                 boundary)

        self._pending.append(g.launch_reduce(consume))
        while len(self._pending) > self._max_inflight:
            self._pending.pop(0).wait()

    # -- Partitioner protocol ---------------------------------------------------------------
    def begin_micro_step(self, boundary: bool) -> None:
        self.join_step()  # backward writes the host gradients the step reads
        self._boundary = boundary
        self.phase = Phase.ACCUMULATING

    def finalize_gradients(self, boundary: bool) -> None:
        with torch.profiler.record_function("zeroio::stage3::finalize_gradients"):
            for g in self.pgroups:
                if g.has_staged_grads:
                    self._launch(g)
            for pr in self._pending:
                pr.wait()
            self._pending = []
            wait_stream(self.streams.current(), self.streams.comm)  # gradients land on comm
            if self._publisher is not None:  # the step writes masters the last publish reads
                self._publisher.order_writers(self.streams.current())
            self._settle_master_reads()  # ... and the last fetches, with MasterShards
            self.landing.settle(boundary, self.streams.comm)
            self.release_all()
            self.pass_state = PassState.IDLE
            if not self.trace.frozen:
                self.trace.step_boundary()
            self.phase = Phase.REDUCED if boundary else Phase.ACCUMULATING

    def local_grad_sq_norm(self) -> torch.Tensor:
        # the engine's step starts here: a fetch since finalize_gradients (GatheredParameters)
        # may still read masters the optimizer is about to write
        self._settle_master_reads()
        if self._read_overflows():
            return torch.tensor(float("inf"))
        taken = self.landing.sq_norm()  # [Note: landing reduced gradients]
        if taken is not None:
            return taken
        self.grads_to_host()
        # fp32 norms of 16-bit host shards too; no float64 copy of a shard (that doubled host
        # memory and took seconds)
        norm = shards_sq_norm((sg.grad for sg in self._physical if not sg.grad.is_meta),
                              Copies(self.transfers))
        if self.paged is not None and self.paged.grads is not None:
            norm = norm + self.paged.grads.sq_norm()  # read back: a group reduced twice
        return norm

    def grads_to_host(self) -> None:
        """Gradients held in resident chunks' GPU buffers into the host shards (the host is
        about to read them: [Note: resident gradients] in shard/assist.py)."""
        if self.landing.router is not None:
            self.landing.router.grads_to_host()

    def local_overflow(self) -> bool:
        self.grads_to_host()
        return self._read_overflows() or shards_overflow((sg.grad for sg in self._physical),
                                                         Copies(self.transfers))

    def _read_overflows(self) -> bool:
        """A gradient kept on the device as an fp32 sum overflows where the host step reads
        it in fp16 (``cast_overflows`` in partition/grad_norm.py)."""
        return self.grads_streamed and self.grad_read_dtype == torch.float16 and \
            cast_overflows((sg.grad for sg in self._sides[Side.HOST]), torch.float16,
                           Copies(self.transfers))

    def publish_params(self) -> None:
        """Masters -> this rank's 16-bit shards; gathered groups (persistent) re-gathered."""
        self.release_device_state()
        self._settle_publish()
        with torch.profiler.record_function("zeroio::stage3::publish_params"):
            if self.paged is not None:  # published per piece in the step ([Note: paged masters])
                self._republish_paged()
                self.phase = Phase.IDLE
                return
            for gi, refs in self._pieces.items():
                pieces = [(ref.piece.lo, self._master(ref)) for ref in refs]
                self.pgroups[gi].update_shard_pieces(pieces, whole=self._whole[gi])
            for g in self.pgroups:
                g.refresh()
            self.phase = Phase.IDLE

    def zero_grad(self) -> None:
        # no memset of the gradient shards: the next accumulation's first write of each group
        # overwrites, unwritten groups are zeroed at the boundary ([Note: landing reduced
        # gradients])
        self.landing.reset()
        for p in self.module.parameters():
            p.grad = None
        self.phase = Phase.IDLE

    def close(self) -> None:
        self.wait_step()
        self._settle_publish()
        self.hooks.remove()
        self.landing.close()
        self.store.close()
        if self.paged is not None:
            self.paged.close()

    def host_step_timings(self) -> dict[str, float]:
        """Seconds in the host step's phases since start (step_overlap.PhaseClock)."""
        return self._clock.as_dict()

    def stats_sources(self) -> dict[str, dict]:
        """Transfer counters for ``engine.stats()``: host <-> device copies of shards and
        gradients, and the NVMe parameter store's own swapping (offload_param nvme)."""
        out = {"stage3.copies": self.transfers.as_dict()}
        store_stats = getattr(self.store, "stats", None)
        if store_stats is not None:
            out["stage3.params"] = store_stats()
        if self._assist is not None:
            out["stage3.step_assist"] = self._assist.stats()
        return out

    def held_tensors(self) -> list[torch.Tensor]:
        """Memory this partitioner holds outside tiered stores, for ``engine.stats()["tiers"]``:
        the ShardGroups' fp32 masters and gradients, shards of the device/host stores (an NVMe
        store's tensors are reported by that store), gathered groups (persistent ones), and the
        gradient landing's staging buffers."""
        out = [t for sg in self._physical for t in (sg.master, sg.grad) if not t.is_meta]
        out += self.store.held_tensors()
        out += [g.full_flat() for g in self.pgroups if g.state is not GroupState.SHARDED]
        out += self.landing.held_tensors()
        if self._publisher is not None:
            out += self._publisher.held_tensors()
        if self._assist is not None:
            out += self._assist.held_tensors()
        if self._window is not None:
            out += self._window.held_tensors()
        return out

    # -- GatheredParameters -----------------------------------------------------------------
    def groups_of(self, params) -> list[int]:
        out = []
        for p in params:
            loc = self.plan.slot_of.get(id(p))
            if loc is None:
                raise DistributedError(f"parameter of shape {tuple(p.shape)} is not managed by "
                                       "this stage 3 partitioner")
            if loc[0] not in out:
                out.append(loc[0])
        return out

    def write_back(self, gi: int) -> None:
        """After a modifier changed the gathered group: new shard and new fp32 masters."""
        self.release_device_state()
        self._settle_publish()
        g = self.pgroups[gi]
        flat = g.full_flat()
        for ref in self._pieces.get(gi, []):
            n = ref.piece.hi - ref.piece.lo
            src = flat.narrow(0, g.shard_lo + ref.piece.lo, n)
            if self.paged is not None and ref.side is Side.HOST:
                self.paged.write(ref.piece.opt_group, ref.base, src)
                continue
            Copies(self.transfers).into(self._master(ref), src)
        g.write_back_full()  # after the masters: MasterShards orders its next fetch behind it

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of parameter storage this rank holds now, per place (shards + gathered)."""
        out = dict(self.store.resident_bytes())
        gathered = sum(g.plan.padded_numel * g._empty.element_size() for g in self.pgroups
                       if g.state is not GroupState.SHARDED)
        key = "device" if self.device.type != "cpu" else "cpu"
        out["gathered"] = gathered
        out[key] = out.get(key, 0)
        return out


def _covers_shard(plan, rank: int, refs: list[_PieceRef]) -> bool:
    """Whether the optimizer's pieces of this rank's shard include every element of a frozen
    parameter too, i.e. publishing replaces all that matters and the rest is padding: then the
    old shard need not be read to update it ([Note] in nvme_store.py)."""
    lo, hi = rank * plan.shard_numel, (rank + 1) * plan.shard_numel
    spans = sorted((r.piece.lo, r.piece.hi) for r in refs)
    for s in plan.slots:
        a, b = max(lo, s.offset) - lo, min(hi, s.offset + s.numel) - lo
        if a >= b or s.opt_group >= 0:
            continue
        if not any(x <= a and b <= y for x, y in spans):
            return False
    return True


def build_stage3_partitioner(*, cfg, module: nn.Module, spec, device: torch.device,
                             compute_dtype: torch.dtype, home, policies,
                             host_kernel=None,
                             accumulate_on_device: bool | None = None,
                             gradient_on_device: bool | None = None) -> Stage3Partitioner:
    """What ``engine_build.build_partitioner`` calls for ``zero_optimization.stage: 3``; ``policies``:
    the offload and tiering blocks resolved for ``device`` (config/policy.py);
    ``accumulate_on_device`` / ``gradient_on_device``: the engine's placement's decisions
    (``Stage3Settings``)."""
    settings = dataclasses.replace(
        Stage3Settings.from_policies(policies, zero=cfg.zero_optimization, aio=cfg.aio),
        accumulate_on_device=accumulate_on_device, gradient_on_device=gradient_on_device)
    if spec.rule != "adam" and settings.masters != "host":  # only Adam pages its masters
        if settings.masters == "nvme":
            raise ConfigError(f'zero_optimization.offload_optimizer.masters = "nvme" with the '
                              f"{spec.rule} optimizer: only Adam(W) pages its masters through "
                              'NVMe; set it to "host" or "auto"',
                              key="zero_optimization.offload_optimizer.masters")
        settings = dataclasses.replace(settings, masters="host")
    return Stage3Partitioner(module=module, param_groups=spec.param_groups,
                             compute_dtype=compute_dtype, device=device, home=home,
                             settings=settings, host_kernel=host_kernel)
