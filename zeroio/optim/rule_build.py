"""Which paths the non-Adam rules (rules.py) and client optimizers take, and the optimizer
that steps them there.

- no offload / ``offload_optimizer cpu``: ``ShardedRule`` over the partitioner's groups (GPU
  tensors, or pinned host memory);
- ``offload_optimizer nvme``: ``SwappedRule`` (its state swapped as Adam's moments are), for
  SGD, Adagrad and Lion; SGD without momentum has no state and stays in host memory; Lamb's
  moments in a ``SwappedLamb`` (two passes over the pieces: swapped_lamb.py);
- ``offload_optimizer.ratio`` < 1: a ``TwinAdam`` of two ``ShardedRule``s (or a host
  ``SwappedRule`` / ``SwappedLamb``); Lamb's per-parameter norms add up both sides before
  either applies (twin.py).

Refused with a ``ConfigError`` naming the key: bf16 master weights or optimizer states (the
rules keep fp32 state), ``tiering.step_assist`` set true (its GPU slots run Adam's fused
kernel), and Lamb with ``tiering.overlap_step`` true (the overlapped step runs chunks; Lamb
needs whole parameters); "auto" turns them off. The elementwise rules run the host step chunk
by chunk (overlapped or not) as Adam does.

A client optimizer that zeroio's Adam does not stand in for (factory.from_client) is
``ClientOnShards`` (client_shards.py) on no offload and ``offload_optimizer cpu``; NVMe and a
ratio are refused (its arbitrary state is not swapped or split).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from zeroio.errors import ConfigError
from zeroio.optim.rules import RULES
from zeroio.optim.sharded_rule import LambNorms, ShardedRule


def rule_policies(spec, cfg, policies):
    """``policies`` as the rule of ``spec`` can run them; Adam's unchanged."""
    if spec.rule == "adam":
        return policies
    name, off = spec.type_name, policies.optimizer
    if spec.rule == "client":
        _check_client_paths(name, off)
    if policies.precision.low:
        raise ConfigError(f"optimizer.type = {name!r} keeps fp32 optimizer state: set "
                          "bf16.bf16_optimizer_states and bf16.bf16_master_weights_and_grads "
                          "to false, or use Adam/AdamW", key="bf16.bf16_optimizer_states")
    t = cfg.zero_optimization.tiering
    chunked = spec.rule in RULES and RULES[spec.rule].elementwise
    keys = ("step_assist",) if chunked else ("step_assist", "overlap_step")
    for key in keys:
        if getattr(t, key) is True:
            raise ConfigError(f"zero_optimization.tiering.{key} = true steps host state chunk "
                              f"by chunk with {_CHUNKED[key]}; optimizer.type = {name!r} needs "
                              "it false or \"auto\"", key=f"zero_optimization.tiering.{key}")
    off_now = {k: False for k in keys}
    return replace(policies, tiering=replace(policies.tiering, **off_now))


_CHUNKED = {"step_assist": "Adam's GPU kernels",
            "overlap_step": "an elementwise rule (Lamb and a client optimizer step whole groups)"}


def _check_client_paths(name: str, off) -> None:
    """A client optimizer's arbitrary state is held with the shards in memory: not swapped to
    NVMe, not split by a ratio."""
    if off.device == "nvme":
        raise ConfigError(f"client optimizer {name} with offload_optimizer.device \"nvme\": "
                          "zeroio swaps only its own optimizers' state; use device \"cpu\" or "
                          "configure optimizer.type", key="zero_optimization.offload_optimizer.device")
    if off.device != "none" and off.ratio < 1.0:
        raise ConfigError(f"client optimizer {name} with offload_optimizer.ratio < 1 is not "
                          "supported: set ratio to 1", key="zero_optimization.offload_optimizer.ratio")


@dataclass(frozen=True, kw_only=True)
class RankSum:
    """How the ranks add up a tensor (Lamb's norms): the engine's in-place ``all_reduce`` over
    the partitioner's group, and the device the collective needs (CUDA under NCCL)."""

    all_reduce: Callable[[torch.Tensor], None]
    device: torch.device


def _norms(groups, partitioner, ranks: RankSum) -> LambNorms:
    return LambNorms(groups, partitioner.index, comm_device=ranks.device,
                     all_reduce=ranks.all_reduce if partitioner.stage != 0 else None,
                     transfers=partitioner.transfers)


def _sharded(groups, spec, partitioner, ranks: RankSum, divisor: float = 1.0) -> ShardedRule:
    rule = RULES[spec.rule]
    norms = None if rule.elementwise else _norms(groups, partitioner, ranks)
    return ShardedRule(groups, spec.hyper, rule=rule, grad_divisor=divisor, norms=norms,
                       state_gate=partitioner.release_device_state,
                       transfers=partitioner.transfers)


def _host_side(cfg, groups, spec, partitioner, shares, policies, rank: int, ranks: RankSum):
    rule = RULES[spec.rule]
    if policies.optimizer.device == "nvme" and not rule.elementwise:
        from zeroio.optim.swapped_lamb import SwappedLamb

        return SwappedLamb(groups, spec.hyper, norms=_norms(groups, partitioner, ranks),
                           policies=policies, aio=cfg.aio,
                           grad_divisor=partitioner.host_grad_divisor, rank=rank,
                           **(shares or {}))
    if policies.optimizer.device == "nvme" and rule.kinds_for(spec.hyper):
        from zeroio.optim.swapped_rule import SwappedRule

        return SwappedRule(groups, spec.hyper, rule=rule, policies=policies, aio=cfg.aio,
                           grad_divisor=partitioner.host_grad_divisor, rank=rank,
                           **(shares or {}))
    return _sharded(groups, spec, partitioner, ranks, partitioner.host_grad_divisor)


def build_rule_optimizer(cfg, partitioner, spec, shares, policies, *, rank: int,
                         ranks: RankSum):
    """The optimizer of a ``RULE_TYPES`` or client spec on the path ``policies`` chose
    (``rank``: the global rank, which names an NVMe swap folder)."""
    if spec.rule == "client":
        from zeroio.optim.client_shards import ClientOnShards

        return ClientOnShards(spec.client, partitioner.groups,
                              grad_divisor=partitioner.host_grad_divisor,
                              state_gate=partitioner.release_device_state,
                              transfers=partitioner.transfers)
    split = partitioner.optimizer_split
    if split is not None:
        from zeroio.optim.twin import TwinAdam

        return TwinAdam(device=_sharded(split.device, spec, partitioner, ranks),
                        host=_host_side(cfg, split.host, spec, partitioner, shares, policies,
                                        rank, ranks),
                        groups=partitioner.groups, transfers=partitioner.transfers)
    return _host_side(cfg, partitioner.groups, spec, partitioner, shares, policies, rank, ranks)


__all__ = ["RankSum", "build_rule_optimizer", "rule_policies"]
