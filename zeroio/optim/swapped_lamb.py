"""``SwappedLamb``: Lamb whose moments live on NVMe, stepped in two passes over the pieces.

The pieces, store, read-ahead and write-behind are ``SwappedAdam``'s (swap.py); the moments
are Lamb's ``exp_avg`` and ``exp_avg_sq``. Lamb's trust ratio needs the norms of every whole
parameter before any piece of it moves ([Note: sharded trust ratio] in lamb_norms.py), which a
single sweep cannot give, so a step sweeps the pieces twice.

[Note: two passes over swapped Lamb moments]
Pass 1 (``lamb_sums``) reads each piece's moments, computes this step's moments and direction
``u`` on copies, and adds the piece's runs of ``w**2`` and ``u**2`` to the per-parameter sums;
it writes nothing (no piece is marked dirty, so none is written back for it) and leaves
``touched`` False. The sums are then added over the ranks (and, under a ratio, over the
device side: twin.py). Pass 2 (``lamb_apply``) is ``SwappedAdam``'s step with Lamb's update of
a piece: the moments again, in place, and the masters moved by each parameter's coefficient.

I/O cost: a streamed piece (one not held in the host share) is read twice per step and written
once, 3 x (moments - resident) bytes against Adam's 2 x; with a host share that holds every
moment there is no swap I/O after the first step, as for Adam. A read that fails in pass 1, or
in pass 2's first window, fails the step with nothing changed ([Note: reads before writes] in
swap.py); the engine rolls it back.
"""

from __future__ import annotations

import torch

from zeroio.optim.lamb_norms import add_run_squares
from zeroio.optim.rules import LambRule
from zeroio.optim.sharded_rule import LambNorms, scaled_grad
from zeroio.optim.swap import SwappedAdam
from zeroio.optim.swap_plan import SubGroup


class SwappedLamb(SwappedAdam):
    compiled_kernel = False
    pages_masters = False  # its update reads the host master

    def __init__(self, groups, param_groups, *, norms: LambNorms, **kwargs):
        """``norms``: the groups' parameter runs and the sum over ranks (rule_build.py)."""
        self.rule = LambRule()
        self.state_kinds = self.rule.kinds
        self.norms = norms
        super().__init__(groups, param_groups, decoupled=False, **kwargs)
        self._piece_runs = {p: norms.runs[p.group_index].within(p.start, p.numel)
                            for p in self.pieces}
        self._total: list[list[float]] = []
        self._grad_scale = 1.0  # the step's, from pass 1 to pass 2

    @property
    def rule_name(self) -> str:
        return self.rule.name

    def step(self, grad_scale: float = 1.0, on_updated=None) -> None:
        total = self.norms.reduce(self.lamb_sums(grad_scale)).sqrt().tolist()
        self.lamb_apply(total, on_updated)

    def lamb_sums(self, grad_scale: float) -> torch.Tensor:
        """Pass 1 ([Note: two passes over swapped Lamb moments]): this side's per-parameter
        sums of ``w**2`` and ``u**2`` (2 x parameters, float64, host), reading the moments
        and writing nothing (``grad_scale``: the step's, before ``grad_divisor``)."""
        self._grad_scale = grad_scale
        grad_scale *= self.grad_divisor
        sums = torch.zeros(2, self.norms.count, dtype=torch.float64)
        self.touched = False
        with torch.profiler.record_function("zeroio::lamb_norms_nvme"):
            try:
                self.store.check_writes()  # [Note: reads before writes] in swap.py
                for i, p in enumerate(self.pieces):
                    if self.plan.read_ahead:
                        self._read_ahead(i, 1 + self.plan.read_ahead)
                    exp_avg, exp_avg_sq = self._take(i)
                    g = self.groups[p.group_index]
                    master = g.master.narrow(0, p.start, p.numel)
                    u = LambRule.moments(
                        master=master,
                        grad=scaled_grad(g.grad.narrow(0, p.start, p.numel), grad_scale),
                        state={"exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()},
                        hyper=self.param_groups[p.group_index])
                    add_run_squares(self._piece_runs[p], master, sums[0])
                    add_run_squares(self._piece_runs[p], u, sums[1])
                    self._put_back_clean(i)
            except BaseException:
                self.abort_step()
                raise
        return sums

    def _put_back_clean(self, i: int) -> None:
        """Release a piece pass 1 only read (not dirty: nothing is written back for it)."""
        if i in self._held:
            return
        self._taken.discard(i)
        for k in self.state_kinds:
            self.store.release(self.pieces[i].name(k), self._tier)

    def lamb_apply(self, total: list[list[float]], on_updated=None) -> None:
        """Pass 2: ``SwappedAdam``'s sweep with Lamb's piece update (``total``: the norms of
        w and u over the ranks and sides, ``[2][parameters]``)."""
        self._total = total
        try:
            super().step(grad_scale=self._grad_scale, on_updated=on_updated)
        finally:
            self._total = []

    def _update(self, p: SubGroup, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                grad_scale: float, hypers: dict) -> None:
        """Lamb on one piece: its moments in place, then each run moved by its parameter's
        coefficient."""
        g = self.groups[p.group_index]
        master = g.master.narrow(0, p.start, p.numel)
        hyper = self.param_groups[p.group_index]
        u = LambRule.moments(master=master,
                             grad=scaled_grad(g.grad.narrow(0, p.start, p.numel), grad_scale),
                             state={"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, hyper=hyper)
        step = self.steps[p]
        step.add_(1)
        size = self.rule.step_size(hyper, int(step.item()))
        for k, lo, n in self._piece_runs[p]:
            coef = self.rule.coefficient(self._total[0][k], self._total[1][k], hyper)
            master.narrow(0, lo, n).add_(u.narrow(0, lo, n), alpha=-size * coef)


__all__ = ["SwappedLamb"]
