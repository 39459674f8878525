"""Stage 0/1/2 partitioner: flat buffers, bucketed reductions from backward hooks.

Stage 0 = plain data parallel (every rank owns every element, buckets
all-reduced). Stage 1 = buckets all-reduced at the accumulation boundary,
each rank keeps only its slices (see flat.[Note: bucket-wise sharding]).
Stage 2 = buckets reduce-scattered every micro step as soon as their last
gradient is accumulated, each rank summing its slice into its fp32 gradient
shard; the full 16-bit gradient buffer is only a landing zone for autograd.

[Note: gradient flow]
Autograd accumulates into ``grads`` (every ``param.grad`` is a view of it).
A post-accumulate-grad hook counts the bucket's ready parameters; the last one
launches the bucket's collective. Consuming a bucket (its slice, divided by
the world, copied or added into ``ShardGroup.grad``) happens on a side CUDA
stream right after the collective when CUDA is present — so with CPU offload
gradients travel to pinned host memory while backward continues — and at
``finalize_gradients`` otherwise. Consuming zeroes the bucket's landing zone.

[Note: gradient pieces]
A bucket's slice is consumed in pieces of at most ``GRAD_PIECE_NUMEL``
elements: each piece is cast to fp32 (a bounded GPU temporary, not one of the
whole bucket), normed and copied to its place in ``ShardGroup.grad``. With no
one to reduce with (a communication world of 1) a piece is consumed as soon
as every parameter overlapping it has its gradient — a parameter straddling
two pieces is counted in both — so with CPU offload the device-to-host copies
run behind the rest of backward instead of after it, and only the last
pieces' copies are left for ``finalize_gradients``. ``reduce_bucket_size``
stays the upper bound of a collective, as in DeepSpeed; with world > 1 the
pieces of a bucket follow its collective. Pieces nobody's hook completed
(parameters without a gradient this pass) are consumed at
``finalize_gradients``, as buckets are.

[Note: publishing]
With a host master the optimizer steps it in chunks and calls ``stage_range``
after each: the chunk is converted to 16-bit into pinned staging and its
host-to-device copy is queued while the CPU updates the next chunk; then
``publish_params(staged=True)`` only all-gathers. The staging is the host step's pinned
16-bit slots of one chunk ([Note: step publication]), at least two, used in turn, each
reused after an event behind its last copy: a bounded window, never a 16-bit copy of the
whole shard in host memory ([Note: the host floor] in zeroio/placement.py).

[Note: norm while consuming]
When a bucket's consumed slice is already the final gradient (the boundary
micro step of stage 0/1, or stage 2 without accumulation), its squared norm is
taken right there (on the GPU, on the side stream), so the step does not
re-read the whole gradient shard from host memory to clip it. With stage 2
accumulation the norm is taken from the accumulated shards.

[Note: 16-bit host gradients]
With 16-bit parameters, a host optimizer stepped by the one-pass CPU Adam (optim/cpu_adam.py;
offload_optimizer cpu, or nvme, whose swapper steps each piece with it: optim/swap.py;
``host_grad_dtype`` in shard/host_grads.py decides, for every stage) and no accumulation on
the host (stage 1, or stage 2 with ``gradient_accumulation_steps`` 1), the host gradient
shard is kept in the compute dtype: a consumed piece goes to the host as the reduced 16-bit
values themselves (2 bytes per element over PCIe and read by the CPU Adam instead of 4), and
the kernel upcasts them in registers, which is exact. Only the 1/world averaging needed fp32:
it is not applied to the host copy, the optimizer folds it into its ``grad_scale``
(``host_grad_divisor`` -> ``ShardedAdam.grad_divisor`` / ``SwappedAdam.grad_divisor``). The
squared norm is still taken from the fp32, averaged piece on the GPU. Stage 2 with
accumulation keeps fp32 host gradients (the sum of micro steps is taken in fp32), unless the
accumulation is placed on the device tier: the unaveraged 16-bit pieces are then summed in
its fp32 buffer and the boundary casts the sum to the host's 16-bit shard ([Note:
accumulation on the device tier] in tiering/device_accum.py; the norm is then taken from the
host shard, divided by ``host_grad_divisor``). With a ratio the device side's gradient stays
fp32.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch

from zeroio.errors import DistributedError
from zeroio.partition import collectives as comm
from zeroio.partition.base import ParamIndex, Partitioner, Phase, ShardGroup
from zeroio.partition.flat import Bucket, FlatLayout, build_layout, flatten_into_views, grad_view
from zeroio.partition.flat import shard_group as _shard_group
from zeroio.partition.grad_norm import cast_overflows, shards_overflow, shards_sq_norm
from zeroio.partition.home import ShardHome, host_home  # noqa: F401 (imported from here)
from zeroio.partition.landing import GradPiece, StagedAdds, land, plan_pieces
from zeroio.partition.split import Side, cut_segments, device_numel, split_range
from zeroio.partition.stage3.twin import OptimizerSplit
from zeroio.partition.stage12_paged import MastersPaging, PagedPublish12
from zeroio.partition.stage12_step import HostStep12
from zeroio.partition.step_overlap import StepRunner
from zeroio.shard.assist import StepAssist
from zeroio.shard.host_grads import OnePassKernel, host_grad_dtype
from zeroio.shard.host_rule import GRAD_PIECE_NUMEL
from zeroio.tiering.copies import Copies
from zeroio.tiering.device_accum import (
    accumulation_on_device,
    accumulation_placed,
    gradient_placed,
)
from zeroio.tiering.grad_window import GradWindow
from zeroio.tiering.stats import StallTimer, TierStats
from zeroio.tiering.streams import DeviceStreams

STEP_CHUNK_NUMEL = 1 << 26
"""Elements per job of the host step (CPU Adam, then that chunk's publication).

Measured on the H200 machine (16 cores, benchmarks/bench_host_memory.py, 1.364e9 fp32
elements): fused CPU AdamW takes 0.237 s over registered memory in one call, 0.298 s in
16M-element chunks (~0.75 ms of thread start-up and cache refill per chunk). 64M cuts 82 chunks to 21 (~15 ms of
overhead left; a 64M chunk takes ~11 ms) while staying about one Llama layer (51M) or the embedding (65M): the
overlapped step's first forward layers wait for one chunk only, and the fp32 GPU landing zones (two chunks) stay 512 MB."""

# GRAD_PIECE_NUMEL (shard/host_rule.py), [Note: gradient pieces]: 32M elements, a 128 MB fp32
# GPU temporary, a 2.3 ms copy at 55 GB/s (a whole 5e8 bucket's: 2 GB, 36 ms); a staging slot.


class Stage12Partitioner(PagedPublish12, HostStep12, Partitioner):
    """Stages 0, 1 and 2 behind the ``Partitioner`` protocol (partition/base.py)."""

    runs_host_step = True  # run_step: offload_optimizer cpu
    stages_ranges = True  # stage_range: host masters stepped by a whole-step optimizer

    # [Note: readers of an overlapped step]
    # With ``overlap_forward`` the module's parameters are stale from ``run_step`` until the
    # step's worker has published them. Readers wait: a forward (any grad mode) per module
    # through its pre-hook; ``module.state_dict()`` (of any submodule holding parameters)
    # through a state-dict pre-hook; ``zero.GatheredParameters`` through
    # ``wait_overlapped_steps``; the next ``backward`` (``begin_micro_step``), every engine
    # method that reads or writes parameters (checkpoints, ``stats``, ``close``) through
    # ``engine.synchronize()``. Plain attribute reads (``p.data``) cannot be intercepted:
    # docs/engine.md says to call ``engine.synchronize()`` first.

    def __init__(
        self,
        *,
        module: torch.nn.Module,
        param_groups: list[list[torch.nn.Parameter]],
        stage: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        home: ShardHome,
        reduce_bucket_numel: int,
        group=None,
        step_chunk_numel: int | None = None,
        overlap_forward: bool = False,
        grad_piece_numel: int | None = None,
        optimizer_ratio: float = 1.0,
        cpu_optimizer: bool = False,
        nvme_optimizer: bool = False,
        accumulation_steps: int = 1,
        step_assist: bool = False,
        gpu_budget_bytes: int | None = 0,
        accumulate_on_device: bool | None = None,
        gradient_on_device: bool | None = None,
        host_kernel: OnePassKernel | None = None,
        master_dtype: torch.dtype = torch.float32,
        state_dtype: torch.dtype = torch.float32,
        masters: MastersPaging | None = None,
    ):
        """``cpu_optimizer``: the host shards are stepped by ``ShardedAdam`` on the CPU
        (offload_optimizer cpu); with ``accumulation_steps`` it decides [Note: 16-bit host
        gradients]. ``nvme_optimizer``: they are stepped by ``SwappedAdam`` on the CPU
        (offload_optimizer nvme), under the same rule. ``step_assist``: the GPU steps a
        share of the host chunks (shard/assist.py, [Note: step assist]; CUDA with host
        masters only), ``gpu_budget_bytes`` of them resident (None: "auto"; [Note: resident
        chunks]). ``accumulate_on_device``: the engine's placement's decision ([Note:
        accumulation on the device tier]; None: decided here by its rule).
        ``gradient_on_device``: the placement's decision to keep the host optimizer's
        gradient on the device and step through the window ([Note: the gradient's home] in
        config/accum_place.py; None: decided here by its rule). ``host_kernel``:
        the one-pass CPU Adam (the engine passes optim/cpu_adam.py; None: the host gradients
        stay fp32), asked by ``host_grad_dtype``. ``master_dtype`` / ``state_dtype``: of
        masters and gradients ([Note: bf16 shards] in shard/types.py) / of the moments.
        ``masters``: may they page ([Note: stage 1/2 paged masters]); None: host masters."""
        self.stage, self.master_dtype, self._state_dtype = stage, master_dtype, state_dtype
        self.host_grad_dtype = torch.float32
        """The 16-bit compute dtype where [Note: 16-bit host gradients] applies, else fp32."""
        self.host_grad_divisor = 1.0
        """What the host optimizer folds into its grad_scale (the 1/world not applied)."""
        self._cpu_optimizer = cpu_optimizer and home.device.type == "cpu"
        self._nvme_optimizer = nvme_optimizer and home.device.type == "cpu"
        self._accumulation_steps = accumulation_steps
        self._compute_dtype = compute_dtype
        self._host_kernel = host_kernel
        self.group = group
        # host <-> device bytes (gradient D2H, parameter H2D) counted where the copies are
        # issued, and host waits on them: engine.stats() (tiering/stats.py)
        self.transfers = TierStats()
        self.device = device
        self.home = home
        self.index = ParamIndex.from_module(module)
        self.comm_world = comm.world_size(group)
        self.world = 1 if stage == 0 else self.comm_world
        self.rank = 0 if stage == 0 else comm.rank(group)
        self.layout: FlatLayout = build_layout(
            module, param_groups, self.index, reduce_bucket_numel, self.world)
        self.optimizer_split: OptimizerSplit | None = None
        """Both sides' ShardGroups when offload_optimizer.ratio < 1 (engine_build.build_optimizer);
        see [Note: stage 1/2 twin placement] in split.py."""
        # _build_shards places the accumulation first
        self._accum_budget, self._accum_decided = gpu_budget_bytes, accumulate_on_device
        self._grad_decided = gradient_on_device
        self._paging = masters
        try:  # a failed initialize leaves no swap file of the paged masters behind
            self.groups = self._build_shards(len(param_groups), optimizer_ratio)
            self._accum = accumulation_on_device(  # [Note: accumulation on the device tier]
                placed=self._accum_placed and not self.grads_streamed,
                host_grads=[g.grad for g in self._host], device=device)
            self.params, self.grads = flatten_into_views(self.layout, compute_dtype, device,
                                                         Copies(self.transfers))
            in_layout = {id(s.param) for b in self.layout.buckets for s in b.slots}
            for p in module.parameters():  # frozen ones compute in the same dtype as the rest
                if id(p) not in in_layout and p.is_floating_point():
                    p.data = Copies(self.transfers).to(p.data, device, dtype=compute_dtype)
            self._staging_next = 0  # the next pinned slot a publication outside the step uses
            self._side = DeviceStreams.of(device).side  # None on CPU; tiering/streams.py
            self.phase = Phase.IDLE
            self._boundary = True
            self._first_micro = True
            self._ready = [0] * len(self.layout.buckets)
            self._inflight: dict[int, comm.CommHandle] = {}
            self._norm_parts: list[torch.Tensor] = []  # see [Note: norm while consuming]
            # [Note: gradient pieces]: with nobody to reduce with, pieces go as their params are ready
            self._early = self.comm_world == 1
            self._pieces, self._pieces_of = plan_pieces(
                self.layout.buckets, rank=self.rank, world=self.world,
                piece_numel=max(1, grad_piece_numel or GRAD_PIECE_NUMEL), early=self._early)
            self._n_pieces = sum(len(ps) for ps in self._pieces)
            # later writes of a host gradient: [Note: bounded staging] in partition/landing.py
            self._staged = StagedAdds(max((p.numel for ps in self._pieces for p in ps), default=1),
                                      pin=home.pin_memory, transfers=self.transfers)
            if stage == 2 and accumulation_steps > 1 and home.device != device and not \
                    self._accum and not self.grads_streamed:
                self._staged.reserve()  # before the engine splits its host budget
            self._left = [0] * self._n_pieces
            self._consumed = [False] * self._n_pieces
            self._bucket_of = {id(s.param): b for b in self.layout.buckets for s in b.slots}
            self._slot_of = {id(s.param): s for b in self.layout.buckets for s in b.slots}
            self._hooks = [
                s.param.register_post_accumulate_grad_hook(self._on_grad)
                for b in self.layout.buckets for s in b.slots
            ]
            self.overlap_forward = overlap_forward
            self._step_group = (comm.side_group(group) if overlap_forward and self._cpu_optimizer
                                else group)  # the worker's all-gathers: [Note: step collectives]
            self._chunks, ready = self._plan_step(max(1, step_chunk_numel or STEP_CHUNK_NUMEL))
            self._runner = StepRunner(len(self._chunks), device)
            self._window = (GradWindow(numel=max(c.numel for c in self._chunks), device=device,
                                       dtype=self.grad_read_dtype, pin=home.pin_memory,
                                       homes=[g.grad for g in self._host],
                                       transfers=self.transfers)  # [Note: the gradient window]
                            if self.grads_streamed and self._chunks else None)
            self._scratch: list[torch.Tensor] = []
            """fp32 landing zones on the GPU (the master goes up as fp32, cast there)."""
            self._stage_slots: list[torch.Tensor] = []
            """Pinned 16-bit slots the one-pass CPU Adam writes into ([Note: step publication])."""
            self._slot_free: list[torch.cuda.Event] = []
            """Recorded behind each slot's copy to the GPU (waiting on an unrecorded one is a no-op)."""
            self._out_in_pass = False
            self._copy_stream = (DeviceStreams.of(device).copy  # [Note: zeroio's CUDA streams]
                                 if home.device.type == "cpu" and device.type == "cuda" else None)
            self._assist = (StepAssist(device, host_numel=sum(c.numel for c in self._chunks),
                                       transfers=self.transfers, gpu_budget_bytes=gpu_budget_bytes)
                            if step_assist and self._copy_stream is not None and self._cpu_optimizer
                            else None)
            self._assist_step = None  # the ChunkedStep whose chunks the assist may take (run_step)
            if overlap_forward:  # see [Note: readers of an overlapped step]
                for m in module.modules():
                    need = [ready[id(p)] for p in m.parameters(recurse=False) if id(p) in ready]
                    if need:
                        self._hooks.append(m.register_forward_pre_hook(
                            partial(self._await_params, max(need))))
                        self._hooks.append(m.register_state_dict_pre_hook(
                            lambda *_: self.wait_step()))
                _OVERLAPPED.add(self)

        # ---- construction ---------------------------------------------------------------------

        except BaseException:
            self._close_paged()
            raise

    def _build_shards(self, n_groups: int, ratio: float) -> list[ShardGroup]:
        """The logical ShardGroups; with ``ratio`` < 1 also the physical sides ([Note: stage
        1/2 twin placement] in split.py): ``_host``/``_dev`` and ``_dev_len`` (per group, the local
        offset where the host part starts)."""
        self._local_base: dict[int, int] = {}
        layouts = []
        for gi in range(n_groups):
            buckets = self.layout.group_buckets(gi)
            segments, base = [], 0
            for b in buckets:
                self._local_base[b.index] = base
                segments += b.my_segments(self.rank, self.world, base)
                base += b.slice_numel(self.world)
            layouts.append((buckets, segments, base))
        split = ratio < 1.0
        left = device_numel(sum(lay[2] for lay in layouts), ratio) if split else 0
        self._dev_len: list[int] = []
        for _, _, base in layouts:
            self._dev_len.append(min(left, base))
            left -= self._dev_len[-1]
        host_total = sum(lay[2] for lay in layouts) - sum(self._dev_len)
        self._accum_placed = accumulation_placed(  # tiering/device_accum.py: before the dtype
            accumulates=self.stage == 2 and self._accumulation_steps > 1 and
            self.home.device.type == "cpu", host_numel=host_total, device=self.device,
            budget=self._accum_budget, decided=self._accum_decided)
        self.host_grad_dtype = host_grad_dtype(
            stage=self.stage, compute_dtype=self._compute_dtype,
            cpu_optimizer=self._cpu_optimizer or self._nvme_optimizer,
            accumulation_steps=self._accumulation_steps, host_numel=host_total,
            kernel=self._host_kernel,  # nvme: the swapper steps whole, no 16-bit output
            step_out=None if self._nvme_optimizer else self._step_out(),
            master_dtype=self.master_dtype, state_dtype=self._state_dtype,
            device_accumulates=self._accum_placed)
        self._unaveraged = self.host_grad_dtype != torch.float32
        self.host_grad_divisor = float(self.comm_world) if self._unaveraged else 1.0
        host_grad = self.host_grad_dtype if self._unaveraged else self.master_dtype
        self.grad_read_dtype = host_grad
        """What the host step's CPU Adam reads: the host shard's dtype, or the window's."""
        self.grads_streamed = gradient_placed(  # [Note: the gradient's home]
            streams=self._cpu_optimizer and self._host_kernel is not None,
            host_numel=host_total, accumulated=self._accum_placed,
            accumulates_on_host=self.stage == 2 and self._accumulation_steps > 1,
            home_bytes=host_grad.itemsize, device=self.device, budget=self._accum_budget,
            decided=self._grad_decided)
        """The host side's gradient stays on the device (its ``ShardGroup.grad``: the fp32
        accumulation sum, or the host gradient's dtype), read through ``GradWindow``."""
        grad_home = (partial(ShardHome(device=self.device).empty, dtype=torch.float32
                             if self._accum_placed else host_grad) if self.grads_streamed
                     else partial(self.home.empty, dtype=host_grad))
        home = self._master_home([base - d for (_, _, base), d in  # sets self.paged
                                  zip(layouts, self._dev_len, strict=True)], split)
        self._dev: list[ShardGroup] = []
        self._host: list[ShardGroup] = []
        groups = []
        on_device = ShardHome(device=self.device)
        for gi, (buckets, segments, base) in enumerate(layouts):
            d = self._dev_len[gi]
            slots = [s for b in buckets for s in b.slots]
            if split:
                dev_segs, host_segs = cut_segments(segments, d)
                self._dev.append(_shard_group(gi, dev_segs, on_device.empty(d),
                                              on_device.empty(d), slots))
                self._host.append(_shard_group(
                    gi, host_segs, home(base - d), grad_home(base - d), slots))
                groups.append(_shard_group(
                    gi, segments, torch.empty(base, dtype=torch.float32, device="meta"),
                    torch.empty(base, dtype=torch.float32, device="meta"), slots))
            else:
                groups.append(_shard_group(gi, segments, home(base), grad_home(base), slots))
                self._host.append(groups[-1])
            self._initial_masters(gi, buckets)
        if self.paged is not None:
            self.paged.finish_seeding()
        if split:
            self.optimizer_split = OptimizerSplit(device=self._dev, host=self._host)
        return groups

    def _parts(self, gi: int, kind: str, lo: int, n: int) -> list[tuple[int, torch.Tensor]]:
        """Elements [lo, lo + n) of group ``gi``'s local ``kind`` ("master" | "grad") as
        ``(offset in the range, physical view)``: device part first, then host part."""
        return [(off, view) for off, _, view in self._sided_parts(gi, kind, lo, n)]

    def _sided_parts(self, gi: int, kind: str, lo: int, n: int):
        """``_parts`` with the side of each: ``(offset in the range, Side, physical view)``."""
        sides = {Side.DEVICE: self._dev, Side.HOST: self._host}
        return [(off, side, getattr(sides[side][gi], kind).narrow(0, start, k))
                for off, side, start, k in split_range(lo, n, self._dev_len[gi])]

    @property
    def _physical(self) -> list[ShardGroup]:
        """Every ShardGroup holding data (both sides with a ratio)."""
        return self._host + self._dev

    # ---- backward --------------------------------------------------------------------------

    def begin_micro_step(self, boundary: bool) -> None:
        self.wait_step()  # backward reads every parameter and writes the host gradients
        self._boundary = boundary
        self.phase = Phase.ACCUMULATING
        self._ready = [0] * len(self.layout.buckets)
        self._left = [p.params for ps in self._pieces for p in ps]
        self._consumed = [False] * self._n_pieces
        for b in self.layout.buckets:
            for s in b.slots:
                view = grad_view(self.grads, s)
                if s.param.grad is None or s.param.grad.data_ptr() != view.data_ptr():
                    if s.param.grad is not None:  # a user replaced .grad: keep its value
                        view.add_(s.param.grad)
                    s.param.grad = view

    def _reduces_now(self) -> bool:
        return self.stage == 2 or self._boundary

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if self.phase is not Phase.ACCUMULATING or not self._reduces_now():
            return
        b = self._bucket_of[id(param)]
        s = self._slot_of[id(param)]
        view = grad_view(self.grads, s)
        if param.grad.data_ptr() != view.data_ptr():  # autograd allocated a fresh .grad
            view.copy_(param.grad)
            param.grad = view
        if self._early:
            for piece in self._pieces_of.get(id(param), ()):
                self._left[piece.key] -= 1
                if self._left[piece.key] == 0:
                    self._on_side(partial(self._consume_piece, piece))
        self._ready[b.index] += 1
        if self._ready[b.index] == len(b.slots):
            self._launch(b)

    def _on_side(self, consume) -> None:
        """Run ``consume`` on the side stream behind what the compute stream queued so far (the
        gradients it reads), or at once without CUDA."""
        with torch.profiler.record_function("zeroio::consume_gradients"):
            if self._side is None:
                consume()
                return
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                consume()

    def _launch(self, b: Bucket) -> None:
        with torch.profiler.record_function("zeroio::reduce_bucket"):
            if self._early:  # nothing to reduce: the rest of b's pieces go now
                self._inflight[b.index] = comm.CommHandle(None)
                self._on_side(partial(self._consume_bucket, b))
                return
            region = self.grads.narrow(0, b.start, b.numel)
            if self.stage == 2:
                handle = comm.reduce_scatter_inplace(region, self.group)
            else:
                handle = comm.all_reduce(region, self.group)
            self._inflight[b.index] = handle
            if self._side is not None:
                self._on_side(partial(self._consume_bucket, b))
                self._inflight[b.index] = comm.CommHandle(None)

    def _consume_bucket(self, b: Bucket) -> None:
        """Wait for b's collective, consume its pieces not consumed yet, clear its landing zone
        (other ranks' slices and padding included)."""
        self._inflight[b.index].wait()
        for piece in self._pieces[b.index]:
            if not self._consumed[piece.key]:
                self._consume_piece(piece)
        if not self._early:
            self.grads.narrow(0, b.start, b.numel).zero_()

    def _consume_piece(self, piece: GradPiece) -> None:
        """Move a piece of this rank's reduced slice into its ShardGroup.grad ([Note: gradient
        flow], [Note: gradient pieces]); consumed early, it also clears its landing zone."""
        self._consumed[piece.key] = True
        b, k = piece.bucket, piece.numel
        size = b.slice_numel(self.world)
        src = self.grads.narrow(0, b.start + self.rank * size + piece.slice_lo, k)
        scaled = src.float()  # a fresh fp32 piece for 16-bit gradients, src itself for fp32
        if self.comm_world > 1:
            scaled = scaled.mul_(1.0 / self.comm_world)
        if self._boundary and (self._first_micro or self.stage != 2):  # the final value
            self._norm_parts.append(torch.linalg.vector_norm(scaled).double().pow(2))
        first = self._first_micro or self.stage != 2
        lo = self._local_base[b.index] + piece.slice_lo
        staged = []
        for off, side, dst in self._sided_parts(b.group_index, "grad", lo, k):
            # the host side's gradient, unaveraged where [Note: 16-bit host gradients] applies
            # (summed in fp32 where it is accumulated on the device); the device part averaged
            raw = self._unaveraged and side is Side.HOST
            part = (src if raw else scaled).narrow(0, off, dst.numel())
            if (acc := self._accum and self._accum.view_of(dst)) is not None:  # tiering/
                self._accum.land(part, acc, dst, first=first, last=self._boundary,
                                 transfers=self.transfers)  # device_accum.py: an fp32 sum
                continue
            if not first and raw and dst.dtype != torch.float32:
                raise DistributedError(
                    "a second backward before engine.step with 16-bit host gradients (stage 2, "
                    "gradient_accumulation_steps 1): call engine.step after each backward, or "
                    "set gradient_accumulation_steps to the number of backwards per step")
            if not land(part, dst, first=first, transfers=self.transfers):
                staged.append((part, dst))
        if staged:  # one slot for the piece's host parts, added by the worker
            self._staged.stage(staged, torch.cuda.current_stream(self.device)
                               if self.device.type == "cuda" else None)
        if self._early:  # stream order: the copy above has read src (or scaled aliasing it)
            src.zero_()

    def finalize_gradients(self, boundary: bool) -> None:
        with torch.profiler.record_function("zeroio::finalize_gradients"):
            if self._reduces_now():
                for b in self.layout.buckets:  # buckets whose params got no gradient this pass
                    if b.index not in self._inflight:
                        self._launch(b)
                if self._side is None:
                    for b in self.layout.buckets:
                        self._consume_bucket(b)
                else:
                    torch.cuda.current_stream(self.device).wait_stream(self._side)
                    if self.home.device.type == "cpu" and not self.grads_streamed:
                        with StallTimer(self.transfers):  # gradients landing in host memory
                            torch.cuda.current_stream(self.device).synchronize()
                self._staged.drain()  # every later write added into host memory
                self._inflight.clear()
                self._first_micro = False
            self.phase = Phase.REDUCED if boundary else Phase.ACCUMULATING
            if boundary and len(self._ready) and any(
                    r > len(b.slots) for r, b in zip(self._ready, self.layout.buckets, strict=True)):
                raise DistributedError("a parameter's gradient hook fired twice in one backward; "
                                       "call engine.backward once per micro step")

    def local_grad_sq_norm(self) -> torch.Tensor:
        if self.stage == 0 and comm.rank(self.group) != 0:
            # stage 0 shards are replicas: only rank 0 contributes to the sum
            return torch.zeros((), dtype=torch.float32)
        if self._read_overflows():
            return torch.tensor(float("inf"))
        if len(self._norm_parts) == self._n_pieces:
            return Copies(self.transfers).host(torch.stack(self._norm_parts).sum().float())
        # [Note: 16-bit host gradients]: the host side's are unaveraged (16-bit, or their fp32
        # sum where it is accumulated on the device)
        copies = Copies(self.transfers)
        return shards_sq_norm((g.grad for g in self._host), copies,
                              divisor=self.host_grad_divisor) + \
            shards_sq_norm((g.grad for g in self._dev), copies)

    def local_overflow(self) -> bool:
        return self._read_overflows() or shards_overflow((g.grad for g in self._physical),
                                                         Copies(self.transfers))

    def _read_overflows(self) -> bool:
        """A gradient kept on the device as an fp32 sum overflows where the host step reads
        it in fp16 (``cast_overflows``)."""
        return self.grads_streamed and self.grad_read_dtype == torch.float16 and \
            cast_overflows((g.grad for g in self._host), torch.float16, Copies(self.transfers))

    # ---- step ------------------------------------------------------------------------------

    def _copy_out(self, b: Bucket, lo: int, hi: int) -> None:
        """Master -> the rank's slice of the 16-bit buffer, elements [lo, hi) of b's slice.

        A host master goes through the pinned 16-bit staging slots (the conversion runs on the
        CPU threads, the transfer is asynchronous); see [Note: publishing]."""
        size = b.slice_numel(self.world)
        base = b.start + self.rank * size
        for off, src in self._parts(b.group_index, "master", self._local_base[b.index] + lo,
                                    hi - lo):
            dst = self.params.narrow(0, base + lo + off, src.numel())
            if src.device != dst.device and src.dtype != dst.dtype:
                self._staged_copy(dst, src)
            else:
                Copies(self.transfers).into(dst, src, non_blocking=True)

    def _staged_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A host ``src`` cast into ``dst`` on the device through the pinned slots, a slot's
        worth at a time ([Note: publishing])."""
        slots = self._pinned_slots(2)
        n = slots[0].numel()
        for a in range(0, src.numel(), n):
            k = min(n, src.numel() - a)
            i = self._staging_next % len(slots)
            self._staging_next += 1
            with StallTimer(self.transfers):  # the slot's last copy up has read it
                self._slot_free[i].synchronize()
            slot = slots[i].narrow(0, 0, k)
            slot.copy_(src.narrow(0, a, k))
            Copies(self.transfers).into(dst.narrow(0, a, k), slot, non_blocking=True)
            self._slot_free[i].record()

    def stage_range(self, group_index: int, start: int, numel: int) -> None:
        """Publish part of a group as soon as the optimizer has updated it (local offsets)."""
        if self.paged is not None:  # published while in the optimizer's window already
            return
        for b in self.layout.group_buckets(group_index):
            lb, size = self._local_base[b.index], b.slice_numel(self.world)
            lo, hi = max(start, lb), min(start + numel, lb + size)
            if lo < hi:
                self._copy_out(b, lo - lb, hi - lb)

    def publish_params(self, staged: bool = False) -> None:
        """Masters -> this rank's slices (unless ``stage_range`` covered every group already)
        -> in-place all-gather of every bucket. Paged masters: [Note: stage 1/2 paged masters]."""
        self.release_device_state()
        with torch.profiler.record_function("zeroio::publish_params"):
            if self.paged is not None and (self.paged.stale or not staged):
                self._republish_paged(STEP_CHUNK_NUMEL)
            handles = []
            for b in self.layout.buckets:
                if not staged and self.paged is None:
                    self._copy_out(b, 0, b.slice_numel(self.world))
                if self.world > 1:
                    handles.append(comm.all_gather_inplace(self.params.narrow(0, b.start, b.numel),
                                                           self.group))
            for h in handles:
                h.wait()
            self.phase = Phase.IDLE

    def zero_grad(self) -> None:
        # ShardGroup.grad is not cleared: the first reducing micro step of the next
        # accumulation copies (never adds) every bucket's slice into it, padding included, so a
        # memset of the whole host shard each step (GBs) would buy nothing.
        self._norm_parts = []
        self.grads.zero_()
        self._first_micro = True
        self.phase = Phase.IDLE

    def stats_sources(self) -> dict[str, dict]:
        """Transfer counters for ``engine.stats()``."""
        out = {"stage12.copies": self.transfers.as_dict()}
        if self._assist is not None:
            out["stage12.step_assist"] = self._assist.stats()
        return out

    def host_step_timings(self) -> dict[str, float]:
        """Seconds in the host step's phases since start (step_overlap.PhaseClock)."""
        return self._runner.clock.as_dict()

    def held_tensors(self) -> list[torch.Tensor]:
        """Memory held for ``engine.stats()["tiers"]``: fp32 masters and gradient shards, the
        flat 16-bit parameter and gradient buffers, staging and landing buffers."""
        return ([t for sg in self._physical for t in (sg.master, sg.grad)] + [self.params, self.grads]
                + self._staged.held_tensors()
                + list(self._scratch) + list(self._stage_slots)
                + (self._window.held_tensors() if self._window is not None else [])
                + (self._assist.held_tensors() if self._assist is not None else []))

    def close(self) -> None:
        self.wait_step()
        self._staged.close()
        self._close_paged()
        _OVERLAPPED.discard(self)
        for h in self._hooks:
            h.remove()
        self._hooks = []


_OVERLAPPED: weakref.WeakSet[Stage12Partitioner] = weakref.WeakSet()
"""Partitioners whose step may still run after ``step()`` returned (``overlap_forward``)."""


def wait_overlapped_steps() -> None:
    """Wait for every overlapped host step in flight (stage 0-2 parameters are plain tensors,
    so ``zero.GatheredParameters`` cannot tell whose they are): [Note: readers of an
    overlapped step]."""
    for part in list(_OVERLAPPED):
        part.wait_step()
