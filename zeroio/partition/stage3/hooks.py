"""Module and gradient hooks that drive gathers, releases and reductions.

[Note: when a group is gathered and released]
- forward pre-hook of a module that needs the group: forward hold, gather.
- forward post-hook: drop the forward hold; register a pre-backward hook on
  every output that requires grad; release unless in the backward pass
  (a forward recomputed by activation checkpointing keeps its groups for the
  backward that follows) or the trace says the group is reused soon.
- pre-backward hook (first gradient reaching an output of the module):
  backward hold, gather (again).
- post-accumulate-grad hook of each parameter: add the gradient into the
  group's fp32 staging bucket and drop ``param.grad``; when all trainable
  parameters of the group have reported, reduce-scatter the bucket, drop the
  backward hold and release. Autograd runs a leaf's accumulation once, after
  every use of the parameter in the graph, so a tied or twice-used parameter
  reports once per backward; a parameter that reports again (reentrant
  checkpointing runs nested backwards) starts a new bucket, flushed at
  ``finalize_gradients``. Reduction is linear, so the sum is the same.

[Note: parameters used outside their module]
A module may use another module's parameter without registering it
(``F.linear(h, self.embed.weight)``). During the first forward a torch
function mode watches every op's arguments; a managed parameter whose group
is not needed by any module on the hook stack is gathered there and added to
the needs of the innermost hooked module, so from then on that module's
hooks gather it for forward and backward. The mode is off after the first
step, so it costs nothing in steady state.
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from zeroio.partition.stage3.linear import LinearSwap
from zeroio.partition.stage3.state import PassState


class _ExternalParamMode(TorchFunctionMode):
    def __init__(self, hooks: HookSet):
        super().__init__()
        self.hooks = hooks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in ("__get__", "__set__"):
            # attribute access (our own ``param.data = ...`` included) reads no values
            return func(*args, **kwargs)
        for a in itertools.chain(args, kwargs.values()):
            if isinstance(a, nn.Parameter):
                self.hooks.touch(a)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, nn.Parameter):
                        self.hooks.touch(b)
        return func(*args, **kwargs)


class HookSet:
    """Installs and removes every hook of one stage-3 partitioner."""

    def __init__(self, part, module: nn.Module, users: dict[str, tuple[int, ...]]):
        self.part = part
        self.needs: dict[str, list[int]] = {name: list(gs) for name, gs in users.items()}
        self.stack: list[str] = []
        self._mode: _ExternalParamMode | None = None
        self._handles = []
        self._linears = LinearSwap()  # [Note: linear layers keep the parameter]
        for name, mod in module.named_modules():
            if isinstance(mod, nn.Linear) and id(mod.weight) in part.plan.slot_of:
                self._linears.apply(mod)
            if name not in self.needs:
                continue
            self._handles.append(mod.register_forward_pre_hook(
                functools.partial(self._pre_forward, name)))
            self._handles.append(mod.register_forward_hook(
                functools.partial(self._post_forward, name), always_call=True))
        seen = set()
        for p in module.parameters():
            if id(p) in part.plan.slot_of and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._linears.undo()

    # -- forward ----------------------------------------------------------------------------
    def _pre_forward(self, name, module, args):
        part = self.part
        if name == "":
            if part.pass_state is not PassState.BACKWARD:
                part.begin_forward()
            if not part.trace.frozen and self._mode is None:
                self._mode = _ExternalParamMode(self)
                self._mode.__enter__()
        self.stack.append(name)
        for gi in self.needs[name]:
            part.pgroups[gi].fwd_holds += 1
            part.use(gi)

    def _post_forward(self, name, module, args, output):
        part = self.part
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
        if name == "" and self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for gi in self.needs[name]:
            part.pgroups[gi].fwd_holds -= 1
        if torch.is_grad_enabled() and self.needs[name]:
            hook = functools.partial(self._pre_backward, name)
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(hook)
        if part.pass_state is not PassState.BACKWARD:
            for gi in self.needs[name]:
                part.maybe_release(gi)
        if name == "" and not torch.is_grad_enabled():
            part.end_inference()

    def touch(self, p: nn.Parameter) -> None:
        """See [Note: parameters used outside their module]."""
        loc = self.part.plan.slot_of.get(id(p))
        if loc is None or not self.stack:
            return
        gi = loc[0]
        if self.part.pgroups[gi].plan.persistent:
            return
        if any(gi in self.needs[m] for m in self.stack):
            return
        owner = self.stack[-1]
        self.needs[owner].append(gi)
        self.part.pgroups[gi].fwd_holds += 1
        self.part.use(gi)

    # -- backward ---------------------------------------------------------------------------
    def _pre_backward(self, name, grad):
        part = self.part
        part.pass_state = PassState.BACKWARD
        for gi in self.needs[name]:
            part.pgroups[gi].bwd_hold = True
            part.use(gi)
        return None

    def _on_grad(self, param: nn.Parameter) -> None:
        self.part.on_grad(param)
