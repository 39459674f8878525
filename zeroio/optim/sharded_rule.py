"""``ShardedRule``: SGD, Adagrad, Lion or Lamb (rules.py) over this rank's ShardGroups.

The counterpart of ``ShardedAdam`` for the other rules: state tensors of the rule's ``kinds``
on the master's device (the GPU without offload, host memory with ``offload_optimizer cpu``),
hyperparameters in ``param_groups`` (one dict per ShardGroup, shared with schedulers), one
step counter per group. The whole local group is stepped at once with torch ops (no compiled
kernel; the elementwise rules step chunk by chunk through ``begin_chunked_step`` as Adam's
host step does, Lamb whole groups at once). Lamb's per-parameter trust ratio is computed over the unsharded parameters
([Note: sharded trust ratio] in lamb_norms.py).
"""

from __future__ import annotations

import torch

from zeroio.io.hostmem import host_zeros
from zeroio.optim.interface import EngineOptimizer
from zeroio.optim.lamb_norms import ParamRuns, reduce_sums
from zeroio.optim.rules import LambRule, Rule
from zeroio.shard.types import ParamIndex, ShardGroup
from zeroio.tiering.copies import Copies
from zeroio.tiering.stats import TierStats


def state_like(master: torch.Tensor, value: float) -> torch.Tensor:
    """An fp32 state tensor beside ``master`` (pinned host memory where the master is)."""
    if master.device.type == "cpu":
        t = host_zeros(master.numel(), torch.float32, pin=master.is_pinned())
    else:
        t = torch.zeros(master.numel(), dtype=torch.float32, device=master.device)
    return t.fill_(value) if value else t


def scaled_grad(grad: torch.Tensor, grad_scale: float) -> torch.Tensor:
    """The step's gradient in fp32, divided by ``grad_scale`` (a new tensor: the shard is
    never rewritten)."""
    g = grad.float() if grad.dtype != torch.float32 else grad
    return g / grad_scale if grad_scale != 1.0 else g.clone()


class LambNorms:
    """What a Lamb step needs to reduce its per-parameter norms: each group's ``ParamRuns``,
    the parameter count, and the sum over ranks ([Note: sharded trust ratio])."""

    def __init__(self, groups: list[ShardGroup], index: ParamIndex, *, all_reduce,
                 comm_device: torch.device, transfers: TierStats | None = None):
        """``all_reduce``: sums a tensor in place over the ranks (None at stage 0);
        ``transfers``: the partitioner's host <-> device copy stats (the sums' round trip)."""
        self.runs = {g.group_index: ParamRuns(g, index) for g in groups}
        self.count = len(index.entries)
        self.all_reduce, self.comm_device = all_reduce, comm_device
        self.transfers = transfers

    def reduce(self, sums: torch.Tensor) -> torch.Tensor:
        return reduce_sums(sums, all_reduce=self.all_reduce, comm_device=self.comm_device,
                           copies=Copies(self.transfers))


class RuleChunkedStep:
    """One step of every group of an elementwise ``ShardedRule``, cut into chunks the
    partitioner runs (``ChunkedStep``'s protocol in adam.py, without the GPU assist): the
    hyperparameters are snapshot and the step counters advanced at once, as Adam's."""

    out_in_pass = False

    def __init__(self, opt: ShardedRule, grad_scale: float):
        self._opt, self._grad_scale = opt, grad_scale * opt.grad_divisor
        self._hyper = {g.group_index: dict(opt.param_groups[g.group_index]) for g in opt.groups}
        self._step = {}
        for i, g in enumerate(opt.groups):
            if g.master.numel():
                opt.steps[i] += 1
            self._step[g.group_index] = opt.steps[i]

    def update(self, group_index: int, lo: int, numel: int,
               out: torch.Tensor | None = None, grad: torch.Tensor | None = None) -> None:
        """The rule on elements [lo, lo + numel) of the group; ``out`` gets the new values;
        ``grad``: the chunk's gradient where the group's own is elsewhere (as Adam's)."""
        opt = self._opt
        g = opt.groups_by_index[group_index]
        state = opt.group_states[opt.position[group_index]]
        with torch.profiler.record_function(f"zeroio::{opt.rule.name}_chunk"):
            master = g.master.narrow(0, lo, numel)
            opt.rule.update(master=master,
                            grad=scaled_grad(g.grad.narrow(0, lo, numel) if grad is None
                                             else grad, self._grad_scale),
                            state={k: t.narrow(0, lo, numel) for k, t in state.items()},
                            hyper=self._hyper[group_index], step=self._step[group_index])
            if out is not None:
                out.copy_(master)


class ShardedRule(EngineOptimizer):
    """A non-Adam rule over this rank's ShardGroups (see the module docstring)."""

    def __init__(self, groups: list[ShardGroup], param_groups: list[dict], *, rule: Rule,
                 grad_divisor: float = 1.0, norms: LambNorms | None = None, state_gate=None,
                 transfers: TierStats | None = None):
        """``norms``: required for Lamb. ``state_gate``, ``transfers``: as ``ShardedAdam``'s."""
        if not rule.elementwise and norms is None:
            raise ValueError(f"{rule.name}: needs per-parameter norms (norms=)")
        self.rule, self.groups, self.param_groups = rule, groups, param_groups
        self.grad_divisor, self.norms, self.state_gate = grad_divisor, norms, state_gate
        self.transfers = transfers
        self.state_kinds = rule.kinds_for(param_groups)
        self.group_states: list[dict[str, torch.Tensor]] = [
            {k: state_like(g.master, rule.initial(k, param_groups[g.group_index]))
             for k in self.state_kinds} for g in groups]
        self.steps = [0 for _ in groups]
        self.groups_by_index = {g.group_index: g for g in groups}
        self.position = {g.group_index: i for i, g in enumerate(groups)}
        """group_index -> position in ``groups``, ``group_states`` and ``steps``."""
        self._directions: list[torch.Tensor | None] = []  # Lamb: between its two passes

    @property
    def rule_name(self) -> str:
        return self.rule.name

    @property
    def chunked_step(self) -> bool:
        """Elementwise rules step chunk by chunk ([Note: elementwise rules]); Lamb whole."""
        return self.rule.elementwise

    def begin_chunked_step(self, grad_scale: float = 1.0) -> RuleChunkedStep:
        if not self.rule.elementwise:
            raise NotImplementedError(f"{self.rule.name} has no chunked step (per-parameter norms)")
        return RuleChunkedStep(self, grad_scale)

    def step(self, grad_scale: float = 1.0, on_updated=None) -> None:
        with torch.profiler.record_function(f"zeroio::{self.rule.name}_step"):
            if not self.rule.elementwise:
                self._lamb_step(grad_scale, on_updated)
                return
            chunked = RuleChunkedStep(self, grad_scale)
            for g in self.groups:
                n = g.master.numel()
                if n:
                    chunked.update(g.group_index, 0, n)
                    if on_updated is not None:
                        on_updated(g.group_index, 0, n)

    def _lamb_step(self, grad_scale: float, on_updated) -> None:
        """Moments and directions of every group, the reduced per-parameter norms, then the
        update ([Note: sharded trust ratio])."""
        total = self.norms.reduce(self.lamb_sums(grad_scale)).sqrt().tolist()
        self.lamb_apply(total, on_updated)  # every rank reduces, even with no elements

    def lamb_sums(self, grad_scale: float) -> torch.Tensor:
        """Lamb's first pass: the moments of every group (updated in place) and its direction
        ``u`` (kept for ``lamb_apply``); returns this side's per-parameter sums of ``w**2`` and
        ``u**2`` (2 x parameters, float64, on the masters' device). ``grad_scale``: the
        step's, before ``grad_divisor``."""
        grad_scale *= self.grad_divisor
        device = self.groups[0].master.device if self.groups else torch.device("cpu")
        sums = torch.zeros(2, self.norms.count, dtype=torch.float64, device=device)
        self._directions = []
        for i, g in enumerate(self.groups):
            if not g.master.numel():
                self._directions.append(None)
                continue
            u = LambRule.moments(master=g.master, grad=scaled_grad(g.grad, grad_scale),
                                 state=self.group_states[i], hyper=self.param_groups[g.group_index])
            runs = self.norms.runs[g.group_index]
            runs.add_squares(g.master, sums[0])
            runs.add_squares(u, sums[1])
            self._directions.append(u)
        return sums

    def lamb_apply(self, total: list[list[float]], on_updated=None) -> None:
        """Lamb's second pass: every group's masters moved along the directions of
        ``lamb_sums`` by each parameter's trust ratio (``total``: the norms of w and u over
        the ranks and sides, ``[2][parameters]``)."""
        rule, directions, self._directions = self.rule, self._directions, []
        for i, g in enumerate(self.groups):
            u = directions[i]
            if u is None:
                continue
            self.steps[i] += 1
            hyper = self.param_groups[g.group_index]
            size = rule.step_size(hyper, self.steps[i])
            for k, lo, n in self.norms.runs[g.group_index].runs:
                coef = rule.coefficient(total[0][k], total[1][k], hyper)
                g.master.narrow(0, lo, n).add_(u.narrow(0, lo, n), alpha=-size * coef)
            if on_updated is not None:
                on_updated(g.group_index, 0, g.master.numel())

    # ---- state access (checkpoints) -----------------------------------------------------------

    def local_tensor(self, group_index: int, kind: str) -> torch.Tensor:
        if self.state_gate is not None:
            self.state_gate()
        if kind == "fp32":
            return self.groups_by_index[group_index].master
        return self.group_states[self.position[group_index]][kind]

    def write_local(self, group_index: int, kind: str, values: torch.Tensor) -> None:
        t = self.local_tensor(group_index, kind)
        if t.data_ptr() != values.data_ptr():  # a checkpoint's host values, maybe device state
            Copies(self.transfers).into(t, values)

    def steps_taken(self, group_index: int) -> int:
        return self.steps[self.position[group_index]]

    def set_steps(self, group_index: int, steps: int) -> None:
        self.steps[self.position[group_index]] = int(steps)

    def held_tensors(self) -> list[torch.Tensor]:
        return [t for st in self.group_states for t in st.values()]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are owned by the engine."""


__all__ = ["LambNorms", "RuleChunkedStep", "ShardedRule", "scaled_grad", "state_like"]
