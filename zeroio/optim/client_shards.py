"""``ClientOnShards``: a client's own ``torch.optim.Optimizer`` class stepped on the fp32 master
shards.

DeepSpeed steps a client optimizer that is not its own on the ZeRO partitions of the fp32
weights (with optimizer offload only when ``zero_force_ds_cpu_optimizer`` is false). zeroio
does the same: the client's class is built again, with each client param group's
hyperparameters, over one leaf tensor per ShardGroup that shares the master's storage (GPU
without offload, pinned host memory with ``offload_optimizer cpu``), so its state is created
where the shard is. Before each step the client groups' hyperparameters are copied over (a
scheduler bound to the client optimizer drives them) and each shard gets its gradient, divided
by the step's ``grad_scale``.

[Note: client state in a checkpoint]
Which state the class keeps is learnt once, by stepping a throwaway instance over a 2-element
tensor: tensors as long as the parameter are per-element state (checkpoint arrays named by
their keys, e.g. "momentum_buffer"), a "step" entry is the step count; any other scalar state
cannot be checkpointed (a ``CheckpointError`` at save or load). The rule is recorded as
"client:<class name>".
"""

from __future__ import annotations

import torch

from zeroio.errors import CheckpointError, ConfigError
from zeroio.optim.interface import EngineOptimizer
from zeroio.optim.sharded_rule import scaled_grad
from zeroio.shard.types import ShardGroup
from zeroio.tiering.copies import Copies
from zeroio.tiering.stats import TierStats


def _rebuild(client: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    cls = type(client)
    try:
        return cls(groups, **client.defaults)
    except TypeError as e:
        raise ConfigError(f"client optimizer {cls.__name__} cannot be rebuilt over zeroio's "
                          f"shards as {cls.__name__}(param_groups, **defaults): {e}; configure "
                          "optimizer.type in the config instead", key="optimizer") from e


def _probe(client: torch.optim.Optimizer) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(per-element state keys, other state keys) of the client's class after one step."""
    t = torch.zeros(2)
    hyper = {k: v for k, v in client.param_groups[0].items() if k != "params"}
    opt = _rebuild(client, [dict(hyper, params=[t])])
    t.grad = torch.ones(2)
    opt.step()
    state = opt.state[t]
    per_element = tuple(k for k, v in state.items()
                        if isinstance(v, torch.Tensor) and v.numel() == 2)
    return per_element, tuple(k for k in state if k not in per_element)


class ClientOnShards(EngineOptimizer):
    def __init__(self, client: torch.optim.Optimizer, groups: list[ShardGroup], *,
                 grad_divisor: float = 1.0, state_gate=None,
                 transfers: TierStats | None = None):
        """``state_gate``, ``transfers``: as ``ShardedAdam``'s."""
        if len(client.param_groups) != len(groups):
            raise ConfigError(f"client optimizer has {len(client.param_groups)} param groups, "
                              f"zeroio built {len(groups)}", key="optimizer")
        self.client, self.groups, self.param_groups = client, groups, client.param_groups
        self.grad_divisor, self.state_gate = grad_divisor, state_gate
        self.transfers = transfers
        self.rule_name = f"client:{type(client).__name__}"
        self.state_kinds, self._scalar_keys = _probe(client)
        self._views = [g.master.detach() for g in groups]
        self.inner = _rebuild(client, [
            dict({k: v for k, v in cg.items() if k != "params"}, params=[v])
            for cg, v in zip(client.param_groups, self._views, strict=True)])

    def step(self, grad_scale: float = 1.0, on_updated=None) -> None:
        scale = grad_scale * self.grad_divisor
        with torch.profiler.record_function("zeroio::client_optimizer_step"):
            for cg, ig, view, g in zip(self.client.param_groups, self.inner.param_groups,
                                       self._views, self.groups, strict=True):
                ig.update({k: v for k, v in cg.items() if k != "params"})
                view.grad = scaled_grad(g.grad, scale)
            self.inner.step()
            for view in self._views:
                view.grad = None
        if on_updated is not None:
            for g in self.groups:
                if g.master.numel():
                    on_updated(g.group_index, 0, g.master.numel())

    # ---- state access (checkpoints: [Note: client state in a checkpoint]) --------------------

    def _state(self, group_index: int) -> dict:
        return self.inner.state[self._views[group_index]]

    def local_tensor(self, group_index: int, kind: str) -> torch.Tensor:
        """The group's ``kind`` state; created (zeros) where the class has not stepped yet."""
        if self.state_gate is not None:
            self.state_gate()
        if kind == "fp32":
            return self.groups[group_index].master
        state = self._state(group_index)
        if kind not in state:
            state[kind] = torch.zeros_like(self._views[group_index])
        return state[kind]

    def write_local(self, group_index: int, kind: str, values: torch.Tensor) -> None:
        t = self.local_tensor(group_index, kind)
        if t.data_ptr() != values.data_ptr():  # a checkpoint's host values, maybe device state
            Copies(self.transfers).into(t, values)

    def _check_scalars(self) -> None:
        other = [k for k in self._scalar_keys if k != "step"]
        if other:
            raise CheckpointError(f"{self.rule_name} keeps state {other} that zeroio cannot "
                                  "checkpoint; only per-element tensors and 'step' are saved")

    def steps_taken(self, group_index: int) -> int:
        self._check_scalars()
        step = self._state(group_index).get("step", 0)
        return int(step.item() if isinstance(step, torch.Tensor) else step)

    def set_steps(self, group_index: int, steps: int) -> None:
        self._check_scalars()
        state = self._state(group_index)
        if steps == 0:  # nothing stepped: the class creates its state at the first step
            state.clear()
        elif "step" in self._scalar_keys:
            old = state.get("step")
            state["step"] = (torch.tensor(float(steps), dtype=old.dtype, device=old.device)
                             if isinstance(old, torch.Tensor) else
                             torch.tensor(float(steps)))

    def held_tensors(self) -> list[torch.Tensor]:
        return [v for st in self.inner.state.values() for v in st.values()
                if isinstance(v, torch.Tensor)]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are owned by the engine."""


__all__ = ["ClientOnShards"]
