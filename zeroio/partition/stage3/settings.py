"""The stage-3 knobs, taken once from the ``zero_optimization`` config section."""

from __future__ import annotations

from dataclasses import dataclass, field

from zeroio.config.policy import OffloadPolicy, Policies, TieringPolicy, resolve_policies
from zeroio.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Stage3Settings:
    """What the stage-3 partitioner reads from the config; defaults are DeepSpeed's."""

    prefetch_bucket_size: int = 50_000_000
    """Parameter elements gathered ahead of use (``stage3_prefetch_bucket_size``); 0 = no prefetch."""
    persistence_threshold: int = 100_000
    """Parameters with fewer elements stay gathered on every rank
    (``stage3_param_persistence_threshold``)."""
    max_live_parameters: int = 1_000_000_000
    """Most gathered (non-persistent) elements kept live at once (``stage3_max_live_parameters``)."""
    max_reuse_distance: int = 1_000_000_000
    """Keep a group gathered after use when its next use, in the recorded order, is within this
    many gathered elements (``stage3_max_reuse_distance``)."""
    offload_device: str = "none"
    """Home of this rank's parameter shard: none (compute device), cpu, nvme."""
    nvme_path: str | None = None
    """Directory of NVMe-resident parameter shards (offload_param.nvme_path)."""
    pin_memory: bool = True
    """Page-lock host shards when CUDA is present (offload_param.pin_memory)."""
    host_buffer_bytes: int = 5 * 100_000_000 * 2
    """NVMe offload: host bytes for parameter swap buffers (offload_param.buffer_count *
    buffer_size 16-bit elements); the tiered store's CPU budget for parameter shards that live
    on NVMe."""
    max_in_cpu: int = 1_000_000_000
    """NVMe offload: parameter elements of this rank's shards kept resident in pinned host memory
    on top of the buffers (``offload_param.max_in_cpu``, DeepSpeed's meaning); 0 = every shard on
    NVMe. Which shards: nvme_store.resident_keys."""
    overlap_step: bool = False
    """offload_optimizer cpu: ``step()`` returns while the CPU optimizer still runs and each
    gather of the next forward waits for the step job that publishes its group
    (``zero_optimization.tiering.overlap_step``, which ``ZEROIO_OVERLAP_STEP`` replaces when
    set; see [Note: stage-3 host step] in host_step.py)."""
    optimizer_ratio: float = 1.0
    """``offload_optimizer.ratio`` when the optimizer is offloaded (1.0 otherwise): the
    fraction of this rank's optimizer elements on the host side ([Note: twin placement] in
    twin.py); the rest stays on the compute device."""
    cpu_optimizer: bool = False
    """``offload_optimizer.device`` is cpu: the host side is stepped by a CPU Adam, so its
    gradient shard may be 16-bit ([Note: 16-bit host gradients at stage 3] in grads.py)."""
    nvme_optimizer: bool = False
    """``offload_optimizer.device`` is nvme: the host side is stepped on the CPU by the
    swapper (optim/swap.py), under the same 16-bit rule; its kernel writes no 16-bit copy
    (the shards are published after the step)."""
    accumulation_steps: int = 1
    """``gradient_accumulation_steps``: above 1 the host gradients are summed in fp32."""
    accumulate_on_device: bool | None = None
    """The engine's placement's decision to sum them in a device-tier buffer ([Note:
    accumulation on the device tier] in tiering/device_accum.py); None: the partitioner
    decides by that rule itself (built without an engine)."""
    gradient_on_device: bool | None = None
    """The engine's placement's decision to keep the host side's gradient on the device and
    step it through the host step's window ([Note: the gradient's home] in
    config/accum_place.py); None: the partitioner decides by that rule itself."""
    step_chunk_numel: int = 1 << 26
    """offload_optimizer cpu: most elements one CPU Adam call updates before that chunk is
    published (cast into the 16-bit shard): ``zero_optimization.tiering.step_chunk_numel``
    (``ZEROIO_STEP_CHUNK_NUMEL`` replaces it when set). Bigger chunks pay less thread-pool overhead per
    call, smaller ones find more of the chunk in cache. 64M, as stage12.STEP_CHUNK_NUMEL: on
    the H200 machine (2026-11-29, 1.36B, overlapped step) 64M gave 0.709 s/step, 16M 0.722."""

    tiering: TieringPolicy = field(default_factory=TieringPolicy)
    """``zero_optimization.tiering``, resolved (config/policy.py): the NVMe parameter store's
    policy, read-ahead and budgets ([Note: the parameter store's config] in nvme_store.py)."""
    aio: object = None
    """The ``aio`` block: the NVMe parameter store's I/O engine settings."""

    step_assist: bool = False
    """offload_optimizer cpu with host shards on CUDA: the GPU steps a share of the host
    chunks ([Note: step assist] in shard/assist.py); ``build_stage3_partitioner`` resolves
    ``zero_optimization.tiering.step_assist`` for the device."""

    params_from_master: bool = False
    """No 16-bit shards: each gather casts this rank's master slice to the compute dtype
    (``zero_optimization.tiering.params_from_master`` resolved; [Note: shards read from the
    master] in master_store.py)."""

    optimizer_nvme_path: str | None = None
    """``offload_optimizer.nvme_path``: where paged masters are written at construction."""
    optimizer_offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    """``offload_optimizer``, resolved: the paged masters' piece cut (``sub_group_size``,
    ``pipeline_read``) and folder ([Note: paged masters] in shard/paged.py)."""
    masters: str = "host"
    """``offload_optimizer.masters`` as ``masters_place`` resolved it (host, nvme, auto): the
    partitioner decides once, from its shard size, whether the masters page through NVMe
    (``Stage3Partitioner.paged``; [Note: where the masters live] in optim/swap.py)."""
    params_from_master_forced: bool = False
    """``tiering.params_from_master`` was set true (not "auto"): paged masters then are a
    ConfigError instead of turning it off."""
    master_dtype: str = "fp32"
    """fp32 or bf16 (``bf16.bf16_master_weights_and_grads``): the masters' and gradient
    shards' dtype ([Note: bf16 shards] in shard/types.py)."""
    state_dtype: str = "fp32"
    """fp32 or bf16 (``bf16.bf16_optimizer_states``): the moments' (the one-pass CPU Adam
    variant the partitioner builds)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.optimizer_ratio <= 1.0:
            raise ConfigError(f"offload_optimizer.ratio must be in (0, 1], got "
                              f"{self.optimizer_ratio}",
                              key="zero_optimization.offload_optimizer.ratio")
        if self.offload_device not in ("none", "cpu", "nvme"):
            raise ConfigError(
                f"offload_param.device must be none, cpu or nvme, got {self.offload_device!r}",
                key="zero_optimization.offload_param.device",
            )
        if self.max_in_cpu < 0:
            raise ConfigError(f"offload_param.max_in_cpu must be >= 0, got {self.max_in_cpu}",
                              key="zero_optimization.offload_param.max_in_cpu")
        if self.step_chunk_numel < 1:
            raise ConfigError(f"stage-3 step chunk must be >= 1 element, got "
                              f"{self.step_chunk_numel}",
                              key="zero_optimization.tiering.step_chunk_numel")
        if self.offload_device == "nvme" and not self.nvme_path:
            raise ConfigError(
                "offload_param.device is nvme but offload_param.nvme_path is not set; "
                "set it to a directory on a fast local disk",
                key="zero_optimization.offload_param.nvme_path",
            )

    @staticmethod
    def from_zero_config(zero, accumulation_steps: int = 1) -> Stage3Settings:
        """From ``Config.zero_optimization`` (zeroio.config.zero.ZeroConfig) and the config's
        ``gradient_accumulation_steps``, through ``resolve_policies`` (no device: the step
        assist stays off; ``build_stage3_partitioner`` resolves it for the device)."""
        return Stage3Settings.from_policies(
            resolve_policies(zero, accumulation_steps=accumulation_steps), zero=zero)

    @staticmethod
    def from_policies(policies: Policies, *, zero, aio=None) -> Stage3Settings:
        """From the resolved offload and tiering policies (config/policy.py), the stage-3 keys
        of ``zero`` (``stage3_*``) and the ``aio`` block."""
        op = policies.param
        return Stage3Settings(
            prefetch_bucket_size=zero.stage3_prefetch_bucket_size,
            persistence_threshold=zero.stage3_param_persistence_threshold,
            max_live_parameters=zero.stage3_max_live_parameters,
            max_reuse_distance=zero.stage3_max_reuse_distance,
            offload_device=op.device,
            nvme_path=op.nvme_path,
            pin_memory=op.pin_memory,
            host_buffer_bytes=op.buffer_count * op.buffer_size * 2,
            max_in_cpu=op.max_in_cpu,
            overlap_step=policies.tiering.overlap_step,
            step_chunk_numel=policies.tiering.step_chunk_numel,
            optimizer_ratio=policies.optimizer.ratio,
            cpu_optimizer=policies.optimizer.cpu,
            nvme_optimizer=policies.optimizer.nvme,
            accumulation_steps=policies.accumulation_steps,
            tiering=policies.tiering,
            aio=aio,
            step_assist=policies.tiering.step_assist,
            params_from_master=policies.tiering.params_from_master,
            masters=policies.optimizer.masters,
            optimizer_nvme_path=policies.optimizer.nvme_path,
            optimizer_offload=policies.optimizer,
            params_from_master_forced=zero.tiering.params_from_master is True,
            master_dtype=policies.precision.master,
            state_dtype=policies.precision.states,
        )
