"""The policy a tiered store runs by, and how unset budgets are derived.

The store reads no config block: it runs by one frozen ``TieringPolicy``
(zeroio/config/policy.py), which the config layer's ``resolve_policies`` builds
once from ``zero_optimization.tiering`` and DeepSpeed's offload blocks; a store
built from keywords (tests, tools) gets that class's defaults with the keywords
replaced. docs/tiering.md lists every field and its default.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, fields, replace

import psutil
import torch

from zeroio.config.policy import TieringPolicy
from zeroio.errors import ConfigError
from zeroio.tiering.tier import Tier

_KEY = "zero_optimization.tiering"


STORE_READ_AHEAD = 2
"""Upcoming accesses a store prefetches after each acquire under the trace policy when its
``TieringPolicy.prefetch_depth`` is None (unset)."""


def store_policy(base: TieringPolicy | None, /, **overrides: object) -> TieringPolicy:
    """The policy a ``TieredStore`` runs by: ``base`` itself (the object the config layer
    built, ``Policies.tiering``), or a copy with the fields its owner decides (``overrides``)
    replaced; with None, ``TieringPolicy``'s defaults and the keywords (tests, tools)."""
    if base is None:
        base = TieringPolicy()
    elif not isinstance(base, TieringPolicy):
        raise TypeError(f"TieredStore takes a zeroio.config.policy.TieringPolicy (Policies.tiering "
                        f"from resolve_policies) or None, got {type(base).__name__}: the config "
                        "layer resolves the tiering and offload blocks once")
    known = {f.name for f in fields(TieringPolicy)}
    for key in overrides:
        if key not in known:
            raise ConfigError(f"{_KEY}: unknown key {key!r}", key=f"{_KEY}.{key}")
    return replace(base, **overrides) if overrides else base


def _device(offload: object) -> str:
    dev = getattr(offload, "device", "none")
    return str(getattr(dev, "value", dev)).lower()


def home_for(offload: object | None) -> Tier:
    """The home tier DeepSpeed's ``offload_*.device`` asks for: none -> GPU (CPU
    without CUDA), cpu -> CPU, nvme -> NVMe."""
    dev = _device(offload) if offload is not None else "none"
    if dev == "nvme":
        return Tier.NVME
    if dev == "cpu" or not torch.cuda.is_available():
        return Tier.CPU
    return Tier.GPU


@dataclass(frozen=True, kw_only=True)
class Budgets:
    """Resolved byte budgets; 0 means the tier is absent."""

    gpu: int
    cpu: int
    nvme: int
    nvme_free: int | None = None
    """Free bytes under ``nvme_path`` when the NVMe budget was derived from them (else None)."""

    def of(self, tier: Tier) -> int:
        return {Tier.GPU: self.gpu, Tier.CPU: self.cpu, Tier.NVME: self.nvme}[tier]

    @classmethod
    def resolve(cls, cfg: TieringPolicy, *, device: torch.device | None, has_nvme: bool) -> Budgets:
        """Explicit budgets as given; unset ones derived from the machine (see the fields)."""
        if not torch.cuda.is_available():
            gpu = 0  # no GPU tier on a CPU-only host, whatever the config says
        elif cfg.gpu_budget_bytes is not None:
            gpu = cfg.gpu_budget_bytes
        else:
            free, _total = torch.cuda.mem_get_info(device)
            gpu = max(0, free - cfg.gpu_reserve_bytes)
        if cfg.cpu_budget_bytes is not None:
            cpu = cfg.cpu_budget_bytes
        else:
            cpu = max(int(psutil.virtual_memory().available * cfg.cpu_fraction), cfg.min_cpu_bytes)
        nvme_free = None
        if not has_nvme:
            nvme = 0
        elif cfg.nvme_budget_bytes is not None:
            nvme = cfg.nvme_budget_bytes
        elif cfg.nvme_path is not None:
            nvme_free = shutil.disk_usage(cfg.nvme_path).free
            nvme = max(0, nvme_free - cfg.nvme_reserve_bytes)
        else:
            nvme = 0
        return cls(gpu=int(gpu), cpu=int(cpu), nvme=int(nvme), nvme_free=nvme_free)
