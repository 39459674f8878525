"""Adam(W) with its moments (and paged masters) on NVMe, stepped over sub-groups in a pipeline.

Each ShardGroup's local range is cut into sub-groups of ``sub_group_size``
elements (DeepSpeed's unit: ``on_updated`` reports each updated sub-group), and
each sub-group into *pieces* of at most ``MAX_PIECE_ELEMS`` elements, the unit
of swap I/O. Every piece's ``exp_avg`` and ``exp_avg_sq`` are tensors of the
tiered store with their home on NVMe. Adam is elementwise, so updating a
sub-group piece by piece gives the same numbers as updating it at once.

[Note: resident head, streamed tail]
The step sweeps the pieces in the same order every step, so the best use of a
host budget smaller than the moments is known in advance (it is what Belady's
farthest-next-use rule converges to on a cyclic sweep). With
``tiering.policy: trace`` (the default) that is the schedule: the first pieces
that fit in the budget minus a small window stay resident (acquired once,
held, never written back during training), and the rest stream through the
window:

    read(i+1..i+read_ahead)  |  update(i)  |  write-back(i-1)

Each streamed piece is read and written at most once per step, and nothing else
moves: bytes per step = 2 x (moments - resident) at most. A released piece that
still fits in the host room beside the window (a small last piece, for instance)
stays there until its room is needed, and is then neither read nor written. Every piece is homed on NVMe
and a resident piece is written only when the store flushes or closes (a
checkpoint save then links the swap files), unless the NVMe budget cannot hold
all the moments: then the resident head is homed in host memory (no file under
nvme_path), the disk holds only the streamed tail, and the GPU side of a ratio,
the host head and the disk tail hold optimizer state at once (zeroio.estimate
counts it so; a checkpoint save writes such moments from memory).

With ``lru`` or ``fifo`` nothing is held: every piece is acquired, updated and
released, and the store's own lru / fifo eviction decides which released
pieces stay in the budget. On this cyclic sweep both evict the piece needed
soonest, so when the moments do not fit every piece is read and written every
step (2 x moments): the policy changes the bytes moved, never the numbers.

The read-ahead is ``tiering.prefetch_depth`` pieces when set, else 3 with
``pipeline_read`` (else none): the next pieces are requested while piece i is
updated (the window holds them and piece i; the last one starts reading as
soon as the space of piece i-1 is free), and at the end of a step the head of
the next step's stream (it loads during forward and backward).
``pipeline_write`` (trace schedule) starts the write-back of a streamed piece
as soon as it is updated (``TieredStore.evict``) instead of when its space is
next needed; under lru / fifo the policy's victim is written when room is
needed. With a budget that holds all moments there is no swap I/O after the
first step whatever the policy.

[Note: reads before writes]
A step is atomic (zeroio/step_guard.py): it either completes, fails with nothing
changed, or fails after it began changing state, and then the engine refuses to
go on until a checkpoint is loaded. Pieces are updated in place (masters in the
partitioner's host memory or, paged, in the window; moments in the window) and a streamed piece is written
back over its swap file as soon as the window needs its room, so a step that
fails half-way cannot be undone without a pre-step copy of every piece it has
updated: the masters alone are as large again as the master shard, and the moments
already on disk would need a second swap file each. That is not affordable, so
the step orders its reads first where the pipeline allows: the reads of the first
window (the first streamed piece and its read-ahead; that piece alone when reading
on demand) land before piece 0 is updated, and ``touched`` turns True only then. A read that fails
before that point (the first window's pieces; the head of the next step's stream,
read during forward and backward) fails the step with nothing changed, and the
engine rolls the step back; a read of a later piece fails it after the update of
the earlier ones, and the engine refuses to go on. ``abort_step`` releases what a
failed step acquired and forgets its failed reads, so the retry (or the checkpoint
load) reads afresh. A write-back of the last step that failed after it returned lost
nothing ([Note: a write-back that failed] in tiering/mover.py): the step asks the store for
one first (``check_writes``), so it fails with nothing changed and the retry writes it again.

[Note: where the masters live]
Decided once, when the partitioner is built (``offload_optimizer.masters``;
config/zero.py, ``masters_place`` and ``masters_paged``):

- on the host (``host``; ``auto`` when ``tiering.cpu_budget_bytes`` is unset or keeps this
  rank's masters and gradient shard in three quarters of it; always at stage 0, and with
  ``offload_optimizer.ratio`` < 1 or a rule other than Adam(W)): the fp32 master shard stays
  in the partitioner's (pinned) host memory, as with ``device: cpu``, and the 16-bit
  parameters are published from it right after the step. Only the moments (8 of the 12
  bytes per parameter of optimizer state) go to NVMe.
- paged (``nvme``; ``auto`` at stages 1-3 when the budget cannot keep them so): each piece's
  master is a third tensor of the store beside its moments ("master", in the master dtype),
  homed, held, read ahead, written back and counted exactly as they are, so the host keeps
  only the window and the resident head of all three, whatever the model's size: bytes per
  step = 2 x (masters + moments - resident). ``ShardGroup.master`` is then a meta tensor (no
  storage); the initial values reach the store through the partitioner's ``PagedMasters``
  (shard/paged.py, [Note: paged masters]) without a whole fp32 shard in host memory. The
  16-bit parameters are published from each master piece while it is in the window
  (``PagedMasters.publish``), before the piece is put back: at stage 3 into the 16-bit
  shards (``tiering.params_from_master`` "auto" turns off: the gathers would read the disk;
  true is a ConfigError naming it), at stages 1 and 2 into this rank's slices of the 16-bit
  replica, all-gathered after the step as with host masters ([Note: stage 1/2 paged
  masters] in partition/stage12_paged.py).
  Checkpoints read and write kind "fp32" through the store piece by piece (``read_local``,
  ``write_local_range``), or a save links the masters' swap files as it does the moments'
  (``swapped_kinds``), and a load marks the masters ``stale``
  so that ``publish_params`` republishes every piece. The master pieces join the first
  window's reads ([Note: reads before writes]), so a failed read there still rolls the step
  back.

Why "auto" pages only when the host cannot keep the masters: with a host budget of B bytes
for P elements, host masters leave B - 6P of it (4P masters, a 2-byte gradient) to cache the
moments and stream the other 8P - (B - 6P) = 14P - B bytes a step; paged masters stream
12P - (B - 2P), the same. But at stage 3 paging turns ``params_from_master`` off, so a 16-bit
shard of 2P more lives in the budget (or on the disk) and more streams. So "auto" pages only
where host masters would leave the window less than a quarter of the budget
(``MASTERS_ROOM`` in config/zero.py).

With ``bf16.bf16_optimizer_states`` the moments are bf16 in the store, on disk
and in the host window (4 bytes per element, half the swap I/O per step), and the masters
bf16 too ([Note: bf16 optimizer state] in adam.py): 6 bytes per element in all.

[Note: the gradient a piece reads]
The gradient shard is the partitioner's (at stage 3 with paged masters and one micro step, a
fourth tensor of each piece in this store instead: [Note: paged gradients] in
shard/paged_grads.py), in the dtype ``host_grad_dtype``
(shard/host_grads.py) gave it by the rule of ``offload_optimizer cpu``: the compute dtype
(bf16 / fp16) where nothing accumulates on the host and the one-pass CPU Adam
(optim/cpu_adam.py) steps the state, fp32 otherwise. Under that kernel (``one_pass``, decided
by ``cpu_adam.wanted`` as for ``ShardedAdam``) each piece is stepped in one pass that reads the
16-bit gradient and upcasts it in registers (exact), so no fp32 copy of the shard exists: 2
bytes per element instead of 4 in host memory (20B parameters: 40 GB). Stage 1/2's 16-bit
gradients are not averaged (``grad_divisor``, folded into ``grad_scale``). Without the kernel,
``adam_update`` steps the piece with torch's fused kernel (a 16-bit gradient, which the rule
never hands it then, would be upcast per ``UPCAST_PIECE`` of the piece).
"""

from __future__ import annotations

import os
import threading

import torch

from zeroio.config.policy import Policies, resolve_policies
from zeroio.dtypes import DTYPES
from zeroio.errors import ConfigError
from zeroio.optim import cpu_adam
from zeroio.optim.adam import AdamState, adam_update
from zeroio.optim.interface import EngineOptimizer
from zeroio.optim.swap_plan import SubGroup, SwapPlan, split
from zeroio.optim.swap_state import SwappedStateAccess
from zeroio.shard.paged_grads import PagedGrads
from zeroio.shard.pieces import PieceIndex
from zeroio.shard.swap_rule import _PAGE, MAX_PIECE_ELEMS, READ_AHEAD  # noqa: F401 (re-exported)
from zeroio.shard.types import ShardGroup


def _one_pass(groups: list[ShardGroup], state_dtype: torch.dtype) -> bool:
    """The compiled one-pass CPU Adam steps these host groups (``cpu_adam.wanted`` decides,
    as for ``ShardedAdam``; its variant without output, reading the groups' gradient dtype, is
    built now)."""
    host = [g for g in groups if g.master.numel()]
    if not host or any(g.master.device.type not in ("cpu", "meta") or g.master.dtype not in
                       cpu_adam.STATE_DTYPES for g in host):
        return False
    grads = {g.grad.dtype for g in host}
    if len(grads) != 1:
        return False
    return cpu_adam.wanted(sum(g.master.numel() for g in host), grad_dtype=grads.pop(),
                           out_dtype=None, master_dtype=host[0].master.dtype,
                           state_dtype=state_dtype)


class SwappedAdam(SwappedStateAccess, EngineOptimizer):
    """Same update as ``ShardedAdam``; moments in a ``TieredStore`` homed on NVMe. A subclass
    swaps another rule's state (optim/swapped_rule.py): ``state_kinds`` names the swapped
    tensors, ``_update`` steps one piece, ``compiled_kernel`` False skips the CPU Adam kernel."""

    compiled_kernel = True
    """Pieces may be stepped by the compiled one-pass CPU Adam (cpu_adam.py)."""
    pages_masters = True
    """The masters may page through the store with the state ([Note: where the masters
    live]); a subclass whose update reads ``g.master`` directly sets it False."""
    _window_master = None
    _window_grad = None

    def __init__(self, groups: list[ShardGroup], param_groups: list[dict], *, decoupled: bool,
                 cfg=None, policies: Policies | None = None, aio=None, backend=None,
                 piece_elems: int | None = None, cpu_budget_bytes: int | None = None,
                 nvme_budget_bytes: int | None = None, rank: int = 0,
                 grad_divisor: float = 1.0, masters=None):
        """``policies`` (config/policy.py) and ``aio``: the resolved offload and tiering
        blocks and the I/O engine's settings, as the engine passes them; or ``cfg``, a
        ``Config`` they are resolved from. ``cpu_budget_bytes`` / ``nvme_budget_bytes``: this
        optimizer's share of the tier budgets (the engine's split, [Note: budgets in training]
        in tiering/budget.py); None: ``zero_optimization.tiering``'s value (or derived, as
        DeepSpeed's buffer_count). ``rank``: this process's global rank, which names its swap
        folder (``zeroio-optim-rank<rank>`` under ``nvme_path``). ``grad_divisor``: folded into
        every step's ``grad_scale``, as ``ShardedAdam``'s (stage 1/2's unaveraged 16-bit host
        gradients: [Note: 16-bit host gradients] in partition/stage12.py). ``masters``: the
        partitioner's ``PagedMasters`` when the masters page through NVMe with the moments
        ([Note: where the masters live]); None: they are the ShardGroups' host tensors."""
        from zeroio.tiering import PolicyKind, Tier

        if policies is None:
            if cfg is None:
                raise TypeError("SwappedAdam needs policies= (and aio=) or cfg=")
            policies = resolve_policies(cfg.zero_optimization,
                                        accumulation_steps=cfg.gradient_accumulation_steps,
                                        bf16=cfg.bf16)
            aio = cfg.aio if aio is None else aio
        off, tiering = policies.optimizer, policies.tiering
        self.state_dtype = DTYPES[policies.precision.states]
        """The moments' dtype in the store and on disk (bf16 optimizer states: bf16)."""
        if off.nvme_path is None and backend is None:
            raise ConfigError("offload_optimizer.device is \"nvme\" but no nvme_path is set",
                              key="zero_optimization.offload_optimizer.nvme_path")
        self.groups = groups
        self.param_groups = param_groups
        self.paged = masters
        if masters is not None and not self.pages_masters:
            raise ConfigError(f"{type(self).__name__} keeps its masters on the host: set "
                              'offload_optimizer.masters to "host"',
                              key="zero_optimization.offload_optimizer.masters")
        self._grads = None if masters is None else masters.grads  # [Note: paged gradients]
        self._kinds = ((("master",) if masters is not None else ()) +
                       ((PagedGrads.KIND,) if self._grads is not None else ()) +
                       tuple(self.state_kinds))
        """The store's tensors per piece: the state kinds, and the master (and the gradient)
        when paged."""
        self._written = tuple(k for k in self._kinds if k != PagedGrads.KIND)
        """The kinds a step updates (written back); a paged gradient is only read."""
        self._dtypes = {k: self.state_dtype for k in self.state_kinds}
        if masters is not None:
            self._dtypes["master"] = masters.dtype
        if self._grads is not None:
            self._dtypes[PagedGrads.KIND] = self._grads.dtype
        self.decoupled = decoupled
        self.grad_divisor = grad_divisor
        self.one_pass = self.compiled_kernel and _one_pass(groups, self.state_dtype)
        """Pieces stepped by the compiled one-pass CPU Adam ([Note: the gradient a piece
        reads])."""
        self.pipeline_read = bool(off.pipeline_read)
        self.pipeline_write = bool(off.pipeline_write)
        self.subs = split(groups, off.sub_group_size)
        self.policy = PolicyKind.parse(tiering.policy)
        if cpu_budget_bytes is None:
            cpu_budget_bytes = tiering.cpu_budget_bytes
        if masters is not None:  # the cut the initial masters were written in
            piece_elems = masters.cut.piece_elems
        self.plan = SwapPlan.make(self.subs, cpu_budget=cpu_budget_bytes,
                                  buffer_count=off.buffer_count, pipeline_read=self.pipeline_read,
                                  piece_elems=piece_elems, read_ahead=tiering.prefetch_depth,
                                  hold=self.policy is PolicyKind.TRACE,
                                  itemsize=self.state_dtype.itemsize,
                                  kinds=len(self.state_kinds),
                                  itemsizes=tuple(self._dtypes[k].itemsize for k in self._kinds)
                                  if masters is not None else (),
                                  landing=0 if self._grads is None else
                                  self._dtypes[PagedGrads.KIND].itemsize)
        # write-behind is the trace schedule's: under lru / fifo the policy picks the victim
        self._write_behind = self.pipeline_write and self.policy is PolicyKind.TRACE
        self.pieces = list(self.plan.pieces)
        self.index = PieceIndex(self.pieces)
        """The pieces by group and element ([Note: pieces stay large] in shard/swap_rule.py:
        every lookup is O(log n), so nothing here scans every piece per piece)."""
        self._tier = Tier.CPU
        self.store = self._open_store(off, tiering, aio, backend, rank, nvme_budget_bytes)
        try:
            self._register_pieces()
        except BaseException:
            if masters is None:  # the paged masters' store is closed by their owner
                self._close_store()
            raise
        if masters is not None:
            masters.adopt(self)
        self.steps = {p: torch.zeros((), dtype=torch.float32) for p in self.pieces}
        self._last_of_sub = self._last_pieces()
        self._held: dict[int, list[torch.Tensor]] = {}  # resident pieces: acquired once, kept
        self._pending: dict[int, dict] = {}  # piece index -> {kind: future} of reads in flight
        self._taken: set[int] = set()  # streamed pieces acquired by this step, not put back yet
        self.touched = False
        """This step has begun changing state (a piece's masters or moments): a failure from
        then on cannot be rolled back ([Note: reads before writes])."""
        # checkpoint threads pin pieces in the store (thread-safe, pin-counted) at most two at
        # a time, inside the window the plan leaves next to the read-ahead
        self._state_pins = threading.BoundedSemaphore(2)

    def _open_store(self, off, tiering, aio, backend, rank: int, nvme_budget_bytes: int | None):
        """The store the pieces live in: the paged masters' (their cut, seeded already), its
        budgets set to this plan; else a fresh one under ``zeroio-optim-rank<rank>``."""
        from zeroio.tiering import TieredStore

        if self.paged is not None:
            store = self.paged.store
            if [(p.group_index, p.start, p.numel) for p in self.paged.pieces] != \
                    [(p.group_index, p.start, p.numel) for p in self.pieces]:
                raise RuntimeError("SwappedAdam: the paged masters were cut into other pieces "
                                   "than this optimizer's groups give")
            store.shrink_budget("cpu", self.plan.cpu_budget)
            if nvme_budget_bytes is not None:
                store.shrink_budget("nvme", nvme_budget_bytes)
            self._folder = self.paged.folder  # its folder is this optimizer's to remove
            return store
        path = None if off.nvme_path is None else os.path.join(str(off.nvme_path),
                                                               f"zeroio-optim-rank{rank}")
        self._folder: str | None = None  # the folder made here: removed again at close
        if path is not None:
            from zeroio.io import swapdir

            swapdir.remove_stale(off.nvme_path)  # crashed runs' folders, any rank's
            self._folder = swapdir.own_folder(path)
        # The optimizer reads ahead itself (exactly its sweep): no policy prefetch on top. The
        # store evicts by tiering.policy (under trace the head is held, so its only
        # candidates are the window's released pieces).
        extra = {} if nvme_budget_bytes is None else {"nvme_budget_bytes": nvme_budget_bytes}
        return TieredStore(tiering, aio, nvme_path=path, backend=backend, gpu_budget_bytes=0,
                           cpu_budget_bytes=self.plan.cpu_budget, prefetch_depth=0,
                           policy=self.policy, **extra)

    def _register_pieces(self) -> None:
        """Every piece's state tensors (the paged masters and gradients are registered
        already)."""
        from zeroio.tiering import Tier

        head = self._host_homed_head()
        for i, piece in enumerate(self.pieces):
            home = Tier.CPU if i < head else Tier.NVME
            for kind in self.state_kinds:
                self.store.register(piece.name(kind), (piece.numel,), self._dtypes[kind],
                                    home=home)

    def _last_pieces(self) -> dict[int, SubGroup]:
        """Piece index -> the sub-group it ends (``on_updated`` is reported after it)."""
        ends = {(s.group_index, s.start + s.numel): s for s in self.subs}
        return {i: ends[(p.group_index, p.start + p.numel)] for i, p in enumerate(self.pieces)
                if (p.group_index, p.start + p.numel) in ends}

    def _close_store(self) -> None:
        self.store.close()
        from zeroio.io import swapdir

        if self._folder is not None:
            swapdir.remove_if_empty(self._folder)

    def _host_homed_head(self) -> int:
        """Pieces of the resident head homed in host memory: all of it when the NVMe budget
        cannot hold every piece's moments, else none ([Note: resident head, streamed tail])."""
        if self.plan.fits or not self.plan.resident:
            return 0
        disk = sum(p.numel for p in self.pieces) * sum(self._dtypes[k].itemsize
                                                       for k in self._kinds)
        return self.plan.resident if disk > self.store.budgets.nvme else 0

    # ---- the step ---------------------------------------------------------------------------

    def _read_ahead(self, start: int, count: int, kinds: tuple[str, ...] | None = None) -> None:
        """Make sure the next ``count`` pieces from ``start`` that are not held are being read
        (``kinds``: these of their tensors; None: all)."""
        j, found = start, 0
        if len(self._held) == self.plan.resident:  # the head, all held: nothing to scan
            j = max(j, self.plan.resident)
        while j < len(self.pieces) and found < count:
            if j not in self._held:
                found += 1
                self._request(j, self._kinds if kinds is None else kinds)
            j += 1

    def _request(self, i: int, kinds: tuple[str, ...]) -> dict:
        """Piece ``i``'s reads in flight, started now for ``kinds`` not requested yet."""
        pending = self._pending.setdefault(i, {})
        p = self.pieces[i]
        for k in kinds:
            if k not in pending:
                pending[k] = self.store.acquire_async(p.name(k), self._tier)
        return pending

    def _take(self, i: int) -> list[torch.Tensor]:
        """Piece ``i``'s tensors in ``_kinds`` order, acquired (held for the resident head)."""
        held = self._held.get(i)
        if held is not None:
            return held
        self._request(i, self._kinds)
        futures = self._pending.pop(i)
        try:
            tensors = [futures[k].result() for k in self._kinds]
        except BaseException:
            self._release_landed(i, futures)
            raise
        if i < self.plan.resident:
            self._held[i] = tensors
        else:
            self._taken.add(i)
        return tensors

    def _release_landed(self, i: int, futures: dict) -> None:
        """Release the tensors of piece ``i`` whose reads landed (a failed step's pieces: the
        store must not keep them pinned)."""
        p = self.pieces[i]
        for kind, f in futures.items():
            if f.exception() is None and i not in self._held:
                self.store.release(p.name(kind), self._tier)

    def _verify_first_reads(self) -> None:
        """[Note: reads before writes] Wait for the reads of the first window (the first
        streamed piece and its read-ahead: the resident head is in memory already) to land
        before any piece is updated: a read that fails there fails the step with nothing
        changed yet. The window has room for them whatever the head's size."""
        self._read_ahead(0, 1 + self.plan.read_ahead)
        for futures in list(self._pending.values()):
            for f in futures.values():
                f.result()

    def abort_step(self) -> None:
        """Undo the bookkeeping of a step that raised: wait for its reads in flight and
        release every piece it acquired and did not put back (none stays pinned, so a
        retried step or a checkpoint load can use the window), and forget failed reads (a
        retry reads afresh). The state itself is what the step left: see ``touched``."""
        pending, self._pending = self._pending, {}
        for i, futures in pending.items():
            self._release_landed(i, futures)
        taken, self._taken = self._taken, set()
        for i in taken:
            for kind in self._kinds:
                self.store.release(self.pieces[i].name(kind), self._tier)

    def clear_errors(self) -> None:
        """Forget I/O errors the store keeps for a later acquire (after a checkpoint load
        replaced the state they concern, or a failed step was rolled back)."""
        self.abort_step()
        self.store.clear_errors()

    def _put_back(self, i: int) -> None:
        """The updated piece back to the store: its state dirty (written back when its room
        is needed, or at once with write-behind); its gradient, when paged, dead."""
        p = self.pieces[i]
        for k in self._written:
            self.store.mark_dirty(p.name(k), self._tier)
        if i in self._held:
            return
        self._taken.discard(i)
        for k in self._kinds:
            self.store.release(p.name(k), self._tier)
            if k == PagedGrads.KIND:  # [Note: paged gradients]: never written back
                self.store.drop(p.name(k), self._tier)
            elif self._write_behind:
                self.store.evict(p.name(k), self._tier)  # write behind: it is used again next step

    def step(self, grad_scale: float = 1.0, on_updated=None) -> None:
        grad_scale *= self.grad_divisor
        hypers: dict[tuple[int, int], torch.Tensor] = {}  # (group, update number): this step's
        self.touched = False
        with torch.profiler.record_function("zeroio::optimizer_step_nvme"):
            try:
                self.store.check_writes()  # [Note: reads before writes]: the last write-behind
                self._verify_first_reads()
                for i, p in enumerate(self.pieces):
                    if self.plan.read_ahead:  # piece i first: requests are served in order
                        self._read_ahead(i, 1 + self.plan.read_ahead)
                    state = self._take(i)
                    self.touched = True
                    if self.paged is not None:  # [Note: where the masters live]
                        self._window_master, state = state[0], state[1:]
                    if self._grads is not None:  # [Note: paged gradients]
                        self._window_grad, state = state[0], state[1:]
                    with torch.profiler.record_function("zeroio::adam_subgroup"):
                        self._update(p, *state, grad_scale, hypers)
                    if self.paged is not None:  # published while it is in the window
                        self.paged.publish(p.group_index, p.start, self._window_master)
                        self._window_master = self._window_grad = None
                    self._put_back(i)
                    sub = self._last_of_sub.get(i)
                    if sub is not None and on_updated is not None:
                        on_updated(sub.group_index, sub.start, sub.numel)
            except BaseException:
                self.abort_step()
                raise
            if self.plan.read_ahead:  # the next step's stream starts loading (not the gradients
                # the next backward writes)
                self._read_ahead(0, self.plan.read_ahead, self._written)
            self.store.step_boundary()

    def _update(self, p: SubGroup, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                grad_scale: float, hypers: dict) -> None:
        """Adam(W) of one piece, reading its gradient as the partitioner keeps it ([Note: the
        gradient a piece reads])."""
        g = self.groups[p.group_index]
        master = self._master_of(p)
        grad = self._window_grad if self._grads is not None else g.grad.narrow(0, p.start,
                                                                                   p.numel)
        step = self.steps[p]
        if not self.one_pass:
            adam_update(master=master, grad=grad,
                        state=AdamState(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, step=step),
                        hyper=self.param_groups[g.group_index], decoupled=self.decoupled,
                        grad_scale=grad_scale)
            return
        key = (g.group_index, int(step.item()) + 1)
        if key not in hypers:
            hyper = self.param_groups[g.group_index]
            hypers[key] = cpu_adam.hyper_tensor(
                lr=float(hyper["lr"]), betas=tuple(hyper["betas"]), eps=float(hyper["eps"]),
                weight_decay=float(hyper["weight_decay"]), decoupled=self.decoupled,
                step=key[1], grad_scale=grad_scale)
        cpu_adam.step_chunk(master=master, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                            hyper=hypers[key])
        step.add_(1)  # torch's fused kernel counts it itself

    def _master_of(self, p: SubGroup) -> torch.Tensor:
        """Piece ``p``'s masters: the window's tensor when paged, else a view of the host
        master."""
        if self.paged is not None:
            return self._window_master
        return self.groups[p.group_index].master.narrow(0, p.start, p.numel)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are owned by the engine."""

    def swap_plan(self) -> dict:
        """The plan's figures ([Note: resident head, streamed tail]): what a benchmark checks
        the disk bytes of a step against."""
        p = self.plan
        return {"pieces": len(p.pieces), "resident_pieces": p.resident,
                "read_ahead": p.read_ahead, "cpu_budget_bytes": p.cpu_budget,
                "kinds": list(self._kinds), "streamed_bytes_each_way": p.streamed_bytes}

    def drain(self) -> None:
        """Wait for the swap I/O in flight (read-ahead, write-behind) to land; the store's
        byte counters are exact afterwards. The read-ahead stays acquired for the next step."""
        for futures in self._pending.values():
            for f in futures.values():
                f.exception()
        self.store.drain()

    def close(self) -> None:
        for futures in self._pending.values():
            for f in futures.values():
                f.exception()  # let reads in flight land before the store goes away
        self._pending.clear()
        self._held.clear()
        self._close_store()
