"""``zeroio.zero``: build partitioned models and look at full parameters (DESIGN.md public API).

    with zeroio.zero.Init(config=cfg):          # parameters partitioned as created
        model = LlamaForCausalLM(llama_cfg)
    with zeroio.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        model.lm_head.weight.normal_()           # rank 0's change is partitioned back on exit

``Init`` is described in zeroio/partition/stage3/init.py ([Note: partition on
registration]). ``GatheredParameters`` gathers the flat groups holding the
given parameters (stage-3 partitioner) or the per-parameter shards left by
``Init`` (before ``zeroio.initialize``), keeps them gathered inside the block,
and with a ``modifier_rank`` broadcasts that rank's values on exit and
stores them back as every rank's shard (and, for a trained model, as the fp32
optimizer masters). Parameters that are not partitioned pass through untouched.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from zeroio.errors import ConfigError
from zeroio.partition import collectives as comm
from zeroio.partition.stage3 import registry
from zeroio.partition.stage3.init import PartitionOnCreate, gather_param, repartition_param

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _config_dtype(config) -> torch.dtype | None:
    if config is None:
        return None
    if isinstance(config, (str, dict)) or hasattr(config, "__fspath__"):
        import zeroio

        config = zeroio.load_config(config, world_size=comm.world_size())
    stage = config.zero_optimization.stage
    if stage != 3:
        raise ConfigError(f"zero.Init needs zero_optimization.stage 3, the config has {stage}",
                          key="zero_optimization.stage")
    if config.bf16.enabled:
        return torch.bfloat16
    if config.fp16.enabled:
        return torch.float16
    return None


class Init(PartitionOnCreate):
    """Context manager: modules created inside have their parameters partitioned over ranks.

    ``config`` (path, dict or Config; optional) must have stage 3; its 16-bit
    setting picks the dtype the shards keep unless ``dtype`` is given (fp32
    masters of a 16-bit model then start from the 16-bit values, as DeepSpeed).
    ``enabled=False`` makes it a no-op, as in DeepSpeed.
    """

    def __init__(self, *, config=None, dtype: torch.dtype | None = None, enabled: bool = True,
                 data_parallel_group=None):
        dtype = dtype if dtype is not None else _config_dtype(config)
        super().__init__(group=data_parallel_group, dtype=dtype, enabled=enabled)


def _as_list(params) -> list[nn.Parameter]:
    if isinstance(params, torch.Tensor):
        return [params]
    return [p for p in params if p is not None] if isinstance(params, Iterable) else [params]


class GatheredParameters:
    """Full parameters inside the block; a ``modifier_rank``'s changes partitioned back on exit."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None,
                 enabled: bool = True):
        self.params = _as_list(params) if enabled else []
        self.modifier_rank = modifier_rank
        self._owned: dict[int, tuple[object, list[int]]] = {}
        self._init_params: list[nn.Parameter] = []

    def __enter__(self):
        seen = set()
        for p in self.params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            owner = registry.OWNERS.get(p)
            if owner is not None:
                entry = self._owned.setdefault(id(owner), (owner, []))
                for gi in owner.groups_of([p]):
                    if gi not in entry[1]:
                        entry[1].append(gi)
            elif p in registry.INIT_SHARDS:
                self._init_params.append(p)
        for owner, gis in self._owned.values():
            for gi in gis:
                g = owner.pgroups[gi]
                g.user_holds += 1
                g.finish_gather()
        for p in self._init_params:
            p.data = gather_param(p).clone()
        return self

    def __exit__(self, *exc):
        modify = self.modifier_rank is not None and exc[0] is None
        for owner, gis in self._owned.values():
            for gi in gis:
                g = owner.pgroups[gi]
                if modify:
                    comm.broadcast(g.full_flat(), self.modifier_rank, owner.pg).wait()
                    owner.write_back(gi)
                g.user_holds -= 1
                owner.maybe_release(gi)
        for p in self._init_params:
            if modify:
                repartition_param(p, self.modifier_rank)
            else:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return False


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed compatibility: stage 3 finds parameters used outside their module by itself
    during the first step (see [Note: parameters used outside their module])."""


__all__ = ["Init", "GatheredParameters", "register_external_parameter"]
