"""Offload and tiering resolved once: the frozen policy objects the layers below the config
take instead of re-reading the raw ``offload_optimizer`` / ``offload_param`` / ``tiering``
blocks (or probing them with ``getattr``).

``resolve_policies(zero, accumulation_steps=..., device=...)`` reads the blocks and the
documented environment overrides (``ZEROIO_OVERLAP_STEP``, ``ZEROIO_STEP_ASSIST``: config.zero)
once; the partitioners, the engine's builders and the NVMe parameter store read fields, and
every ``TieredStore`` runs by ``Policies.tiering`` (docs/internals.md, "The tiering policy").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zeroio.config.zero import (
    EvictionPolicy,
    TieringConfig,
    masters_place,
    overlap_step_enabled,
    params_from_master_enabled,
    step_assist_enabled,
)
from zeroio.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class OffloadPolicy:
    """``zero_optimization.offload_optimizer``, resolved."""

    device: str = "none"
    """none, cpu or nvme."""
    ratio: float = 1.0
    """Fraction of the optimizer elements on the host side; 1.0 whenever ``device`` is none
    (everything is on the compute device already)."""
    pin_memory: bool = True
    nvme_path: str | None = None
    buffer_count: int = 4
    pipeline_read: bool = False
    pipeline_write: bool = False
    sub_group_size: int = 1_000_000_000
    """``zero_optimization.sub_group_size``: elements the NVMe optimizer swaps as one
    sub-group."""
    masters: str = "host"
    """``offload_optimizer.masters`` as ``masters_place`` resolves it: host, nvme or auto
    (the partitioner decides from its shard size: config/zero.py, ``masters_paged``)."""

    @property
    def cpu(self) -> bool:
        """The host side is stepped by a CPU Adam (``device: cpu``)."""
        return self.device == "cpu"

    @property
    def nvme(self) -> bool:
        """The host side is stepped by the NVMe swapper's CPU Adam (``device: nvme``: masters
        in host memory, moments swapped)."""
        return self.device == "nvme"


@dataclass(frozen=True, kw_only=True)
class ParamOffloadPolicy:
    """``zero_optimization.offload_param`` (stage 3), resolved."""

    device: str = "none"
    nvme_path: str | None = None
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    pin_memory: bool = True
    """Page-lock host shards (always with ``device: cpu``)."""


_BLOCK = TieringConfig()
"""The JSON block's defaults: the one home of every default a ``tiering`` key has."""
_KEY = "zero_optimization.tiering"
GiB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class TieringPolicy:
    """``zero_optimization.tiering`` resolved: the one policy object of the tiered store and of
    the step switches. ``resolve_policies`` builds it once from the config; every
    ``TieredStore`` runs by one (the engine's stores by this object, or a copy with the fields
    their owner decides replaced); the partitioners read the step switches. A field of a JSON
    key defaults to that key's default (``TieringConfig``); the rest are the store's own knobs,
    not JSON keys, with their defaults here. docs/tiering.md lists both."""

    policy: EvictionPolicy = _BLOCK.policy
    """Eviction rule of the store's GPU and CPU tiers: lru, fifo or trace (Belady over the
    access trace recorded in the first step; lru until then). The default is the JSON key's
    (``TieringConfig.policy``: trace), for a store built from keywords as well."""
    prefetch_depth: int | None = _BLOCK.prefetch_depth
    """Read-ahead. None: each reader keeps its own (a ``TieredStore`` prefetches
    ``STORE_READ_AHEAD`` upcoming accesses under the trace policy); 0 = demand only."""
    gpu_budget_bytes: int | None = _BLOCK.gpu_budget_bytes
    """GPU bytes the store may hold. None = free device memory at start minus
    ``gpu_reserve_bytes``; 0 without CUDA (the GPU tier is then absent)."""
    cpu_budget_bytes: int | None = _BLOCK.cpu_budget_bytes
    """Host (pinned) bytes. None = ``cpu_fraction`` of available RAM at start, at least
    ``min_cpu_bytes``."""
    nvme_budget_bytes: int | None = _BLOCK.nvme_budget_bytes
    """Bytes on NVMe. None = free space under ``nvme_path`` minus ``nvme_reserve_bytes``;
    0 when there is no ``nvme_path`` (the NVMe tier is then absent)."""
    nvme_reserve_bytes: int = _BLOCK.nvme_reserve_bytes
    """Derived NVMe budget: free disk left untouched."""
    gpu_reserve_bytes: int = 2 * GiB
    """Derived GPU budget: free memory left for activations and the allocator."""
    cpu_fraction: float = 0.5
    """Derived CPU budget: share of available host RAM."""
    nvme_path: str | None = None
    """Directory of the NVMe tier's zarr store (``offload_optimizer.nvme_path``, else
    ``offload_param.nvme_path``; each engine store replaces it with a folder of its own)."""
    pin_memory: bool = True
    """Page-lock CPU tier buffers when CUDA is present (faster, asynchronous copies)."""
    min_cpu_bytes: int = 0
    """Floor of a derived CPU budget (with ``offload_param.device`` nvme: DeepSpeed's
    ``buffer_count * buffer_size`` 16-bit elements)."""
    acquire_timeout_s: float = 120.0
    """Longest a demand ``acquire`` waits for another thread to release space before
    ``CapacityError`` (it never waits when only the caller's own acquires are in the way)."""
    overlap_step: bool = False
    """The overlapped host step, ``ZEROIO_OVERLAP_STEP`` applied, "auto" resolved for the
    training device (on for CUDA)."""
    step_assist: bool = False
    """The GPU steps a share of the host chunks: ``step_assist`` (``ZEROIO_STEP_ASSIST``
    applied) for the training device, and only with ``offload_optimizer.device: cpu``."""
    step_chunk_numel: int = _BLOCK.step_chunk_numel
    """Most elements one host Adam call updates before its chunk is published
    (``step_chunk_numel``; ``ZEROIO_STEP_CHUNK_NUMEL`` applied at load_config)."""
    params_from_master: bool = False
    """Stage 3 keeps no 16-bit parameter shards: each gather casts the master
    (``params_from_master``, "auto" resolved; partition/stage3/master_store.py)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", _eviction(self.policy))
        for name in ("gpu_reserve_bytes", "nvme_reserve_bytes", "min_cpu_bytes"):
            _check_int(name, getattr(self, name), allow_none=False)
        for name in ("prefetch_depth", "gpu_budget_bytes", "cpu_budget_bytes",
                     "nvme_budget_bytes"):
            _check_int(name, getattr(self, name), allow_none=True)
        if not float(self.acquire_timeout_s) > 0.0:
            raise ConfigError(f"{_KEY}.acquire_timeout_s must be > 0, got "
                              f"{self.acquire_timeout_s!r}", key=f"{_KEY}.acquire_timeout_s")
        if not 0.0 < float(self.cpu_fraction) <= 1.0:
            raise ConfigError(f"{_KEY}.cpu_fraction must be in (0, 1], got "
                              f"{self.cpu_fraction!r}", key=f"{_KEY}.cpu_fraction")


def _eviction(value: object) -> EvictionPolicy:
    raw = getattr(value, "value", value)
    try:
        return EvictionPolicy(str(raw).lower())
    except ValueError:
        raise ConfigError(f"{_KEY}.policy: expected 'lru', 'fifo' or 'trace', got {raw!r}",
                          key=f"{_KEY}.policy") from None


def _check_int(name: str, value: object, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{_KEY}.{name} must be a non-negative integer"
                          f"{' or null' if allow_none else ''}, got {value!r}",
                          key=f"{_KEY}.{name}")


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """The dtypes of the ZeRO optimizer's own state (``bf16.bf16_master_weights_and_grads``,
    ``bf16.bf16_optimizer_states``), as ``zeroio.dtypes.DTYPES`` names; docs/engine.md,
    "bf16 optimizer state"."""

    master: str = "fp32"
    """Master weights and gradient shards: fp32, or bf16."""
    states: str = "fp32"
    """Adam moments: fp32, or bf16."""

    @property
    def low(self) -> bool:
        """Some optimizer state is kept in bf16."""
        return self.master != "fp32" or self.states != "fp32"


@dataclass(frozen=True, kw_only=True)
class Policies:
    """Everything the builders below the config need of the offload and tiering blocks."""

    optimizer: OffloadPolicy = field(default_factory=OffloadPolicy)
    param: ParamOffloadPolicy = field(default_factory=ParamOffloadPolicy)
    tiering: TieringPolicy = field(default_factory=TieringPolicy)
    accumulation_steps: int = 1
    """``gradient_accumulation_steps``: above 1 host gradients are summed in fp32."""
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)


def _device(value) -> str:
    return str(getattr(value, "value", value))


def _store_paths(oo, op, par_dev: str) -> dict:
    """What a tiered store takes from DeepSpeed's offload blocks: the NVMe folder (the
    optimizer's first) and, with parameters on NVMe, the floor of a derived CPU budget."""
    out: dict = {}
    path = oo.nvme_path or op.nvme_path
    if path:
        out["nvme_path"] = str(path)
    if par_dev == "nvme":
        out["min_cpu_bytes"] = int(op.buffer_count) * int(op.buffer_size) * 2
    return out


def resolve_policies(zero, *, accumulation_steps: int = 1, device=None,
                     bf16=None) -> Policies:
    """``zero``: ``Config.zero_optimization`` (config.zero.ZeroConfig). ``device``: the
    training device (its type decides ``step_assist`` and ``overlap_step`` "auto"; None: not
    known yet, both stay off unless set on). ``bf16``: ``Config.bf16`` (None: fp32 optimizer
    state); with bf16 optimizer state the step assist is off (its GPU slots step fp32 state
    only)."""
    precision = PrecisionPolicy() if bf16 is None else PrecisionPolicy(
        master=bf16.master_dtype, states=bf16.optimizer_state_dtype)
    oo, op, t = zero.offload_optimizer, zero.offload_param, zero.tiering
    opt_dev = _device(oo.device)
    optimizer = OffloadPolicy(
        device=opt_dev, ratio=1.0 if opt_dev == "none" else float(oo.ratio),
        pin_memory=bool(oo.pin_memory), nvme_path=oo.nvme_path,
        buffer_count=int(oo.buffer_count), pipeline_read=bool(oo.pipeline_read),
        pipeline_write=bool(oo.pipeline_write), sub_group_size=int(zero.sub_group_size),
        masters=masters_place(zero))
    par_dev = _device(op.device)
    param = ParamOffloadPolicy(
        device=par_dev, nvme_path=op.nvme_path, buffer_count=int(op.buffer_count),
        buffer_size=int(op.buffer_size), max_in_cpu=int(op.max_in_cpu),
        pin_memory=bool(op.pin_memory) or par_dev == "cpu")
    from_master = params_from_master_enabled(zero)
    tiering = TieringPolicy(
        policy=t.policy, prefetch_depth=t.prefetch_depth,
        gpu_budget_bytes=t.gpu_budget_bytes, cpu_budget_bytes=t.cpu_budget_bytes,
        nvme_budget_bytes=t.nvme_budget_bytes, nvme_reserve_bytes=int(t.nvme_reserve_bytes),
        overlap_step=overlap_step_enabled(t, device),
        step_assist=device is not None and opt_dev == "cpu" and not precision.low and
        not from_master and step_assist_enabled(t, device),
        step_chunk_numel=int(t.step_chunk_numel), params_from_master=from_master,
        **_store_paths(oo, op, par_dev))
    return Policies(optimizer=optimizer, param=param, tiering=tiering,
                    accumulation_steps=int(accumulation_steps), precision=precision)


__all__ = ["OffloadPolicy", "ParamOffloadPolicy", "Policies", "PrecisionPolicy", "TieringPolicy",
           "resolve_policies"]
