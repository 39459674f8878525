"""Sharded Adam / AdamW over ``ShardGroup``s, with torch's fused kernels (CPU or GPU).

Hyperparameters live in ``param_groups`` (a list of dicts with ``lr``,
``betas``, ``eps``, ``weight_decay``), one per ShardGroup, so LR schedulers —
ours or a client's torch scheduler bound to the client optimizer whose dicts
we share — change them in place between steps.

[Note: grad_scale]
Clipping and loss scaling are folded into one divisor handed to the fused
kernel (``grad_scale``): grad / (loss_scale / clip_coef). zeroio never rewrites
the gradient shard for it, which saves a full pass over it in memory; but on CUDA
torch's fused kernel stores the unscaled (clipped) gradient back into the shard
it steps, so after a step a GPU-side shard (``offload_optimizer.ratio`` < 1, or no
offload) holds grad / grad_scale, not the reduced gradient. Nothing reads it
before the next backward clears it; a test that checks gradients must read them
before the step. A ShardedAdam's
``grad_divisor`` (the communication world where stage 1/2 hand it unaveraged 16-bit host
gradients: partition/stage12.py, [Note: 16-bit host gradients]) is one more factor of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.adam import adam as adam_fn
from torch.optim.adamw import adamw as adamw_fn

from zeroio.errors import ConfigError
from zeroio.io.hostmem import host_zeros
from zeroio.optim import cpu_adam
from zeroio.optim.interface import EngineOptimizer
from zeroio.shard.types import ShardGroup
from zeroio.tiering.copies import Copies
from zeroio.tiering.stats import TierStats

UPCAST_PIECE = 1 << 22
"""Elements of bf16 state upcast to fp32 at once ([Note: bf16 optimizer state])."""


@dataclass(eq=False, kw_only=True)
class AdamState:
    """One ShardGroup's moments; same device and length as its master."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    """float32 scalar on the moments' device (what the fused kernels expect)."""

    @staticmethod
    def zeros_like(master: torch.Tensor, dtype: torch.dtype = torch.float32) -> AdamState:
        """Zero moments of ``dtype`` (fp32, or bf16: [Note: bf16 optimizer state])."""
        def z():
            if master.device.type == "cpu":  # see zeroio.io.hostmem.[Note: host memory]
                return host_zeros(master.numel(), dtype,
                                  pin=master.is_pinned()).view(master.shape)
            return torch.zeros(master.shape, dtype=dtype, device=master.device)

        return AdamState(exp_avg=z(), exp_avg_sq=z(),
                         step=torch.zeros((), dtype=torch.float32, device=master.device))


def fused_supported(device: torch.device) -> bool:
    return device.type in ("cpu", "cuda")


def adam_update(
    *,
    master: torch.Tensor,
    grad: torch.Tensor,
    state: AdamState,
    hyper: dict,
    decoupled: bool,
    grad_scale: float,
    scale_tensor: torch.Tensor | None = None,
) -> None:
    """One Adam(W) step of ``master`` in place (grad divided by ``grad_scale`` first).
    ``scale_tensor``: ``grad_scale`` already as a float32 scalar on the master's device (a
    caller stepping many chunks makes it once). bf16 master, gradient or moments are stepped
    in fp32 and rounded back ([Note: bf16 optimizer state])."""
    if any(t.dtype != torch.float32 for t in (master, grad, state.exp_avg, state.exp_avg_sq)):
        _upcast_update(master=master, grad=grad, state=state, hyper=hyper, decoupled=decoupled,
                       grad_scale=grad_scale, scale_tensor=scale_tensor)
        return
    _fp32_update(master=master, grad=grad, state=state, hyper=hyper, decoupled=decoupled,
                 grad_scale=grad_scale, scale_tensor=scale_tensor)


def _upcast_update(*, master, grad, state: AdamState, hyper, decoupled, grad_scale,
                   scale_tensor) -> None:
    """``adam_update`` of 16-bit tensors, ``UPCAST_PIECE`` elements at a time: fp32 copies of
    the piece (a view where a tensor is fp32 already), the fp32 step, copies back (which round
    to nearest-even)."""
    n = master.numel()
    before = state.step.clone()
    flat = [t.view(-1) for t in (master, grad, state.exp_avg, state.exp_avg_sq)]
    for lo in range(0, n, UPCAST_PIECE):
        k = min(UPCAST_PIECE, n - lo)
        views = [t.narrow(0, lo, k) for t in flat]
        p, g, m, v = (t.float() for t in views)
        _fp32_update(master=p, grad=g, state=AdamState(exp_avg=m, exp_avg_sq=v,
                                                       step=before.clone()),
                     hyper=hyper, decoupled=decoupled, grad_scale=grad_scale,
                     scale_tensor=scale_tensor)
        for dst, src in ((views[0], p), (views[2], m), (views[3], v)):
            if dst.dtype != torch.float32:
                dst.copy_(src)
    if n:
        state.step.copy_(before + 1)


def _fp32_update(*, master, grad, state: AdamState, hyper, decoupled, grad_scale,
                 scale_tensor) -> None:
    beta1, beta2 = hyper["betas"]
    fn = adamw_fn if decoupled else adam_fn
    fused = fused_supported(master.device)
    scale = None
    if grad_scale != 1.0:
        if fused:
            scale = scale_tensor if scale_tensor is not None else torch.tensor(
                grad_scale, dtype=torch.float32, device=master.device)
        else:
            grad = grad / grad_scale
    fn([master], [grad], [state.exp_avg], [state.exp_avg_sq], [], [state.step],
       foreach=None if fused else False, fused=fused or None,
       grad_scale=scale, found_inf=None, amsgrad=False,
       beta1=beta1, beta2=beta2, lr=float(hyper["lr"]),
       weight_decay=float(hyper["weight_decay"]), eps=float(hyper["eps"]), maximize=False)


class ChunkedStep:
    """One optimizer step of every group, cut into chunks that the caller runs (in any order,
    on any one thread). Made by ``ShardedAdam.begin_chunked_step``, which snapshots the
    hyperparameters and advances the step counters at once, so the LR schedule may step and
    checkpoints read ``steps_taken`` while the chunks still run."""

    def __init__(self, opt: ShardedAdam, grad_scale: float):
        grad_scale *= opt.grad_divisor
        self._opt = opt
        self._grad_scale = grad_scale
        self._hyper: dict[int, dict] = {}
        self._before: dict[int, torch.Tensor] = {}
        self._state: dict[int, AdamState] = {}
        self._scale: dict[int, torch.Tensor] = {}
        self._one_pass: dict[int, torch.Tensor] = {}
        self._on_device: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        for g, st in zip(opt.groups, opt.group_states, strict=True):
            self._hyper[g.group_index] = dict(opt.param_groups[g.group_index])
            self._state[g.group_index] = st
            self._before[g.group_index] = st.step.clone()
            if g.master.numel():  # as ``step``: an empty group's counter does not move
                st.step.add_(1)
            self._scale[g.group_index] = torch.tensor(grad_scale, dtype=torch.float32,
                                                      device=g.master.device)
            if opt.one_pass:
                self._one_pass[g.group_index] = opt.hyper_tensor(
                    g.group_index, int(self._before[g.group_index].item()) + 1, grad_scale)

    @property
    def out_in_pass(self) -> bool:
        """``update``'s ``out`` is written within the pass over the master (no extra pass)."""
        return self._opt.one_pass

    def host_views(self, group_index: int, lo: int, numel: int) -> tuple[torch.Tensor, ...]:
        """Elements [lo, lo + numel) of a group's master, gradient and moments (a GPU step of
        this chunk reads and writes them: shard/assist.py)."""
        g, st = self._opt.groups_by_index[group_index], self._state[group_index]
        return tuple(t.narrow(0, lo, numel) for t in (g.master, g.grad, st.exp_avg,
                                                      st.exp_avg_sq))

    def adam(self, group_index: int, master: torch.Tensor, grad: torch.Tensor,
             exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """torch's fused Adam(W) with this step's hyperparameters on a chunk's tensors, on
        whatever device they are: the group's own (``update``) or a GPU slot of the step
        assist (shard/assist.py). The step counter and ``grad_scale`` tensors it needs on
        another device are made once per step, on the caller's current stream."""
        before, scale = self._before[group_index], self._scale[group_index]
        if master.device != before.device:
            key = (group_index, master.device)
            if key not in self._on_device:
                moves = Copies(self._opt.transfers)
                self._on_device[key] = (moves.to(before, master.device),
                                        moves.to(scale, master.device))
            before, scale = self._on_device[key]
        adam_update(master=master, grad=grad,
                    state=AdamState(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                                    step=before.clone()),  # the fused kernel increments it
                    hyper=self._hyper[group_index], decoupled=self._opt.decoupled,
                    grad_scale=self._grad_scale, scale_tensor=scale)

    def update(self, group_index: int, lo: int, numel: int,
               out: torch.Tensor | None = None, grad: torch.Tensor | None = None) -> None:
        """Adam(W) on elements [lo, lo + numel) of group ``group_index``'s local tensors;
        ``out`` (``numel`` long, e.g. a 16-bit shard slice) gets the updated values. ``grad``:
        the chunk's gradient in host memory where the group's own stays on the device (the
        host step's window: [Note: the gradient window] in tiering/grad_window.py)."""
        master, own, exp_avg, exp_avg_sq = self.host_views(group_index, lo, numel)
        grad = own if grad is None else grad
        with torch.profiler.record_function("zeroio::adam_chunk"):
            h = self._one_pass.get(group_index)
            if h is not None:  # [Note: one-pass CPU Adam]
                cpu_adam.step_chunk(master=master, grad=grad, exp_avg=exp_avg,
                                    exp_avg_sq=exp_avg_sq, hyper=h, out=out)
                return
            self.adam(group_index, master, grad, exp_avg, exp_avg_sq)
            if out is not None:
                out.copy_(master)


class ShardedAdam(EngineOptimizer):
    """Adam (L2 weight decay) or AdamW (decoupled) over this rank's ShardGroups.

    ``param_groups[i]`` holds the hyperparameters of ShardGroup i. States are
    created on the master's device (GPU or pinned CPU). States homed on NVMe are
    ``zeroio.optim.swap.SwappedAdam``'s, which steps them piece by piece with the same
    update (``adam_update`` or the one-pass CPU Adam)."""

    chunked_step = True

    def __init__(self, groups: list[ShardGroup], param_groups: list[dict], *, decoupled: bool,
                 grad_divisor: float = 1.0, state_dtype: torch.dtype = torch.float32,
                 state_gate=None, transfers: TierStats | None = None,
                 grad_dtype: torch.dtype | None = None):
        """``state_dtype``: the moments' dtype, fp32 or bf16 ([Note: bf16 optimizer
        state]); the masters' is the partitioner's (``ShardGroup.master``). ``state_gate``:
        called before ``local_tensor`` hands out a tensor (the engine passes the
        partitioner's ``release_device_state``: state the step keeps on the GPU between steps
        comes back first, [Note: resident chunks] in shard/assist.py). ``transfers``: the
        partitioner's host <-> device copy stats (the step counter and scale a chunk stepped on
        another device needs cross once per step). ``grad_dtype``: the dtype of the gradient
        the host step hands ``ChunkedStep.update`` (the partitioner's ``grad_read_dtype``;
        None: the groups' own gradients')."""
        self.state_gate, self.transfers = state_gate, transfers
        self.groups = groups
        self.param_groups = param_groups
        self.decoupled = decoupled
        self.grad_divisor = grad_divisor
        """Folded into every step's ``grad_scale`` ([Note: grad_scale])."""
        self.state_dtype = state_dtype
        self.group_states: list[AdamState] = [AdamState.zeros_like(g.master, state_dtype)
                                       for g in groups]
        self.groups_by_index = {g.group_index: g for g in groups}
        host = [g.master for g in groups if g.master.numel()]
        low = {grad_dtype or g.grad.dtype for g in groups if g.master.numel()} - {torch.float32}
        master_dtype = host[0].dtype if host else torch.float32
        self.one_pass = bool(host) and all(
            t.device.type == "cpu" and t.dtype in cpu_adam.STATE_DTYPES for t in host) and \
            cpu_adam.wanted(sum(t.numel() for t in host),
                            grad_dtype=next(iter(low), torch.float32),
                            master_dtype=master_dtype, state_dtype=state_dtype)
        """Host masters stepped by the compiled one-pass kernel (cpu_adam.py)."""
        low_state = master_dtype != torch.float32 or state_dtype != torch.float32
        if low and not self.one_pass and not low_state:  # the partitioner decided by the same
            raise ConfigError(f"host gradients in {sorted(map(str, low))} need the one-pass CPU "
                              "Adam kernel, which is not in use: set ZEROIO_CPU_ADAM the same "
                              "when the engine is built and the optimizer is",
                              key="ZEROIO_CPU_ADAM")

    def hyper_tensor(self, group_index: int, step: int, grad_scale: float) -> torch.Tensor:
        """``cpu_adam.hyper_tensor`` of a group's current hyperparameters for update ``step``."""
        hyper = self.param_groups[group_index]
        return cpu_adam.hyper_tensor(lr=float(hyper["lr"]), betas=tuple(hyper["betas"]),
                                     eps=float(hyper["eps"]),
                                     weight_decay=float(hyper["weight_decay"]),
                                     decoupled=self.decoupled, step=step, grad_scale=grad_scale)

    def begin_chunked_step(self, grad_scale: float = 1.0) -> ChunkedStep:
        """A step whose chunks the caller runs (see ``ChunkedStep``); the partitioner's
        overlapped step runs them in publication order."""
        return ChunkedStep(self, grad_scale)

    def step(self, grad_scale: float = 1.0, on_updated=None, chunk_numel: int = 1 << 24) -> None:
        """One step of every group (a ``ChunkedStep`` run here, whole groups or chunks). With
        ``on_updated(group_index, start, numel)`` the groups are stepped in chunks and the
        callback runs after each (the partitioner publishes that chunk while the next one is
        updated)."""
        with torch.profiler.record_function("zeroio::optimizer_step"):
            chunked = ChunkedStep(self, grad_scale)
            for g in self.groups:
                n = g.master.numel()
                if on_updated is None:
                    if n:
                        chunked.update(g.group_index, 0, n)
                    continue
                for lo in range(0, n, chunk_numel):
                    k = min(chunk_numel, n - lo)
                    chunked.update(g.group_index, lo, k)
                    on_updated(g.group_index, lo, k)

    def held_tensors(self) -> list[torch.Tensor]:
        """Moments and step counters: plain tensors, outside any tiered store."""
        return [t for st in self.group_states for t in (st.exp_avg, st.exp_avg_sq, st.step)]

    def local_tensor(self, group_index: int, kind: str) -> torch.Tensor:
        """The local 1-D tensor of ``kind`` ("fp32" | "exp_avg" | "exp_avg_sq") of a group
        (current: ``state_gate`` first)."""
        if self.state_gate is not None:
            self.state_gate()
        if kind == "fp32":
            return self.groups[group_index].master
        return getattr(self.group_states[group_index], kind)

    def steps_taken(self, group_index: int) -> int:
        return int(self.group_states[group_index].step.item())

    def set_steps(self, group_index: int, steps: int) -> None:
        self.group_states[group_index].step.fill_(float(steps))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are owned by the engine; kept for client code calling optimizer.zero_grad()."""

    def write_local(self, group_index: int, kind: str, values: torch.Tensor) -> None:
        """Overwrite the group's local ``kind`` tensor (checkpoint load: host values, into
        state that may live on the device)."""
        Copies(self.transfers).into(self.local_tensor(group_index, kind), values)
