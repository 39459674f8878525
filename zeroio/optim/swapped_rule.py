"""``SwappedRule``: SGD (with momentum), Adagrad or Lion whose state lives on NVMe.

The same pieces, store, read-ahead and write-behind as ``SwappedAdam`` (swap.py, [Note:
resident head, streamed tail]); only the swapped tensors (the rule's ``kinds``: one per element
for these rules) and the update of a piece differ. The rules are elementwise ([Note:
elementwise rules] in rules.py), so a piece-by-piece step equals a whole-group one. The host
budget is planned as for Adam's two moments: a one-state rule keeps at most half the share
it could. Lamb, not elementwise, is ``SwappedLamb`` (swapped_lamb.py).
"""

from __future__ import annotations

from zeroio.optim.rules import Rule
from zeroio.optim.sharded_rule import scaled_grad
from zeroio.optim.swap import SwappedAdam
from zeroio.optim.swap_plan import SubGroup


class SwappedRule(SwappedAdam):
    compiled_kernel = False
    pages_masters = False  # its update reads the host master

    def __init__(self, groups, param_groups, *, rule: Rule, **kwargs):
        if not rule.elementwise:
            raise ValueError(f"SwappedRule: {rule.name} is not elementwise")
        self.rule = rule
        self.state_kinds = rule.kinds_for(param_groups)
        super().__init__(groups, param_groups, decoupled=False, **kwargs)
        self._fill_initial()

    @property
    def rule_name(self) -> str:
        return self.rule.name

    def _fill_initial(self) -> None:
        """State that starts at a nonzero value (Adagrad's ``initial_accumulator_value``),
        written piece by piece through the store."""
        for kind in self.state_kinds:
            for sub in self.pieces:
                value = self.rule.initial(kind, self.param_groups[sub.group_index])
                if value:
                    for t, _ in self._resident_pieces(sub.group_index, kind, sub.start,
                                                      sub.numel, dirty=True):
                        t.fill_(value)

    def _update(self, p: SubGroup, *args) -> None:
        """The rule on one piece: ``args`` are its state tensors, then ``grad_scale`` and the
        step's hyperparameter cache (Adam's; unused here)."""
        *state, grad_scale, _ = args
        g = self.groups[p.group_index]
        master, grad = g.master.narrow(0, p.start, p.numel), g.grad.narrow(0, p.start, p.numel)
        step = self.steps[p]
        step.add_(1)
        self.rule.update(master=master, grad=scaled_grad(grad, grad_scale),
                         state=dict(zip(self.state_kinds, state, strict=True)),
                         hyper=self.param_groups[g.group_index], step=int(step.item()))


__all__ = ["SwappedRule"]
