"""Settings of the tiered store and how unset budgets are derived.

``TieringPolicyConfig`` is the store's own frozen keyword-only config. It is
built from plain keywords (tests, tools) or from the config layer with
``TieringPolicyConfig.from_config(cfg)``, which reads
``cfg.zero_optimization.tiering`` and DeepSpeed's ``offload_optimizer`` /
``offload_param`` blocks. docs/tiering.md lists every key and its default.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, fields, replace

import psutil
import torch

from zeroio.errors import ConfigError
from zeroio.tiering.policy import PolicyKind
from zeroio.tiering.tier import Tier

_KEY = "zero_optimization.tiering"
GiB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class TieringPolicyConfig:
    policy: PolicyKind = PolicyKind.LRU
    """Eviction rule of the GPU and CPU tiers: lru, fifo or trace (Belady over the
    access trace recorded in the first step; lru until then)."""
    prefetch_depth: int = 2
    """Trace policy: how many upcoming accesses are prefetched after each acquire
    (0 = demand only). Explicit ``prefetch`` calls work with every policy."""
    gpu_budget_bytes: int | None = None
    """GPU bytes the store may hold. None = free device memory at start minus
    ``gpu_reserve_bytes``; 0 without CUDA (the GPU tier is then absent)."""
    cpu_budget_bytes: int | None = None
    """Host (pinned) bytes. None = ``cpu_fraction`` of available RAM at start, at
    least ``offload_param.buffer_count * buffer_size`` bytes when that is set."""
    nvme_budget_bytes: int | None = None
    """Bytes on NVMe. None = free space under ``nvme_path`` minus ``nvme_reserve_bytes``;
    0 when there is no ``nvme_path`` (the NVMe tier is then absent)."""
    gpu_reserve_bytes: int = 2 * GiB
    """Derived GPU budget: free memory left for activations and the allocator."""
    cpu_fraction: float = 0.5
    """Derived CPU budget: share of available host RAM."""
    nvme_reserve_bytes: int = 1 * GiB
    """Derived NVMe budget: free disk left untouched."""
    nvme_path: str | None = None
    """Directory of the NVMe tier's zarr store (from offload_optimizer/offload_param)."""
    pin_memory: bool = True
    """Page-lock CPU tier buffers when CUDA is present (faster, asynchronous copies)."""
    min_cpu_bytes: int = 0
    """Floor of a derived CPU budget (DeepSpeed's offload_param buffer_count * buffer_size)."""
    acquire_timeout_s: float = 120.0
    """Longest a demand ``acquire`` waits for another thread to release space before
    ``CapacityError`` (it never waits when only the caller's own acquires are in the way)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", PolicyKind.parse(self.policy))
        for name in ("prefetch_depth", "gpu_reserve_bytes", "nvme_reserve_bytes", "min_cpu_bytes"):
            _check_int(name, getattr(self, name), allow_none=False)
        for name in ("gpu_budget_bytes", "cpu_budget_bytes", "nvme_budget_bytes"):
            _check_int(name, getattr(self, name), allow_none=True)
        if not float(self.acquire_timeout_s) > 0.0:
            raise ConfigError(f"{_KEY}.acquire_timeout_s must be > 0, got {self.acquire_timeout_s!r}",
                              key=f"{_KEY}.acquire_timeout_s")
        if not 0.0 < float(self.cpu_fraction) <= 1.0:
            raise ConfigError(
                f"{_KEY}.cpu_fraction must be in (0, 1], got {self.cpu_fraction!r}",
                key=f"{_KEY}.cpu_fraction",
            )

    @classmethod
    def from_config(cls, cfg: object, **overrides: object) -> TieringPolicyConfig:
        """Build from a ``Config`` (or anything with ``zero_optimization``), a tiering
        block itself, a dict, or None; keyword overrides win."""
        values: dict[str, object] = {}
        zero = getattr(cfg, "zero_optimization", None)
        block = getattr(zero, "tiering", None) if zero is not None else cfg
        if isinstance(block, dict):
            src = block
        elif block is not None:
            src = {f.name: getattr(block, f.name) for f in fields(cls) if hasattr(block, f.name)}
        else:
            src = {}
        known = {f.name for f in fields(cls)}
        for key, value in src.items():
            if key not in known:
                raise ConfigError(f"{_KEY}: unknown key {key!r}", key=f"{_KEY}.{key}")
            if key == "prefetch_depth" and value is None:
                continue  # unset in the config: the store's default (its users pick their own)
            values[key] = value
        if zero is not None:
            for off_name in ("offload_optimizer", "offload_param"):
                off = getattr(zero, off_name, None)
                path = getattr(off, "nvme_path", None)
                if path and "nvme_path" not in values:
                    values["nvme_path"] = str(path)
                if off is not None and getattr(off, "pin_memory", False):
                    values["pin_memory"] = True
            par = getattr(zero, "offload_param", None)
            if par is not None and _device(par) == "nvme":
                values["min_cpu_bytes"] = int(par.buffer_count) * int(par.buffer_size) * 2
        for key, value in overrides.items():
            if key not in known:
                raise ConfigError(f"{_KEY}: unknown key {key!r}", key=f"{_KEY}.{key}")
            values[key] = value
        return replace(cls(), **values)


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


def _check_int(name: str, value: object, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(
            f"{_KEY}.{name} must be a non-negative integer{' or null' if allow_none else ''}, "
            f"got {value!r}",
            key=f"{_KEY}.{name}",
        )


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
    def resolve(cls, cfg: TieringPolicyConfig, *, device: torch.device | None, has_nvme: bool) -> Budgets:
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
