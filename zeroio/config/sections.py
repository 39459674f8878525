"""Top-level sections other than ZeRO: ``aio``, ``fp16``, ``bf16``, ``checkpoint``, and
zeroio's own ``distributed``.

Defaults are DeepSpeed 0.19's source defaults (swap_tensor/constants.py,
precision_config.py, runtime/constants.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from zeroio.config.fields import (
    as_bool,
    fail,
    field,
    float_coercer,
    int_coercer,
    optional,
    sub,
)
from zeroio.errors import ConfigError

MAX_AIO_BYTES = 1 << 30
"""Largest transfer of one I/O call (block_size x queue_depth): Linux moves at most ~2 GiB per
preadv/pwritev, and the engine keeps a staging buffer of that size per thread."""
MAX_QUEUE_DEPTH = 1024  # IOV_MAX on Linux
MAX_AIO_THREADS = 256


def check_aio(aio: AioConfig) -> None:
    """The cross-key bound of the ``aio`` block: one call's bytes within ``MAX_AIO_BYTES``."""
    per_call = aio.block_size * (1 if aio.single_submit else aio.queue_depth)
    if per_call > MAX_AIO_BYTES:
        raise ConfigError(
            f"aio.block_size x aio.queue_depth = {aio.block_size} x {aio.queue_depth} = {per_call} "
            f"bytes per I/O call: expected at most {MAX_AIO_BYTES} (1 GiB; each engine thread "
            "stages that much); lower one of them", key="aio.queue_depth")


@dataclass(frozen=True, kw_only=True)
class AioConfig:
    """``aio``: the NVMe I/O engine's request shape."""

    block_size: int = field(1_048_576, coerce=int_coercer(
        gt=0, le=MAX_AIO_BYTES, multiple_of=4096, why=" (direct I/O moves whole 4096-byte blocks)"))
    """Bytes per I/O request (1 MiB): a multiple of 4096, at most 1 GiB; with ``queue_depth``
    at most 1 GiB per call (``check_aio``)."""
    queue_depth: int = field(8, coerce=int_coercer(
        gt=0, le=MAX_QUEUE_DEPTH, why=" (each request is one iovec of a preadv/pwritev, which "
                                      "takes at most 1024)"))
    """Requests in flight per thread (at most 1024, the iovecs of one call)."""
    intra_op_parallelism: int = field(1, coerce=int_coercer(
        gt=0, le=MAX_AIO_THREADS, why=" (worker threads of each I/O engine)"), aliases=("thread_count",))
    """Threads splitting one read or write (DeepSpeed's older name: ``thread_count``); at
    most 256."""
    single_submit: bool = field(False, coerce=as_bool)
    """Submit requests one at a time instead of in batches."""
    overlap_events: bool = field(True, coerce=as_bool)
    """Overlap request submission with completion polling."""
    use_gds: bool = field(False, coerce=as_bool)
    """Use NVIDIA GPUDirect Storage (needs CUDA and a GDS-capable file system)."""


@dataclass(frozen=True, kw_only=True)
class FP16Config:
    """``fp16``: 16-bit float parameters with (dynamic) loss scaling."""

    enabled: bool = field(False, coerce=as_bool)
    """Train with fp16 parameters and gradients, fp32 master weights."""
    loss_scale: float = field(0.0, coerce=float_coercer(ge=0))
    """Static loss scale; 0 means dynamic loss scaling."""
    initial_scale_power: int = field(16, coerce=int_coercer(ge=0))
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = field(1000, coerce=int_coercer(gt=0))
    """Overflow-free steps before the dynamic scale is doubled."""
    hysteresis: int = field(2, coerce=int_coercer(gt=0))
    """Overflows tolerated before the dynamic scale is halved (delayed shift)."""
    consecutive_hysteresis: bool = field(False, coerce=as_bool)
    """Refill hysteresis after every overflow-free step."""
    min_loss_scale: int = field(1, coerce=int_coercer(gt=0))
    """Floor of the dynamic loss scale."""

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0


@dataclass(frozen=True, kw_only=True)
class BF16Config:
    """``bf16`` (legacy name ``bfloat16``): bfloat16 parameters, fp32 master weights unless
    ``bf16_master_weights_and_grads`` (docs/engine.md, "bf16 optimizer state")."""

    enabled: bool = field(False, coerce=as_bool)
    """Train with bf16 parameters and gradients; no loss scaling."""
    bf16_master_weights_and_grads: bool = field(False, coerce=as_bool)
    """Keep this rank's master weights and gradient shard in bf16 instead of fp32 (DeepSpeed's
    switch): 2 bytes each per element instead of 4. Needs ``enabled``, ZeRO stage 1-3, and
    ``offload_optimizer`` (cpu or nvme) unless ``bf16_optimizer_states`` is on too."""
    bf16_optimizer_states: bool = field(False, coerce=as_bool)
    """Keep the Adam moments (exp_avg, exp_avg_sq) in bf16 wherever they live (GPU, host
    memory, the NVMe swap files); the update is computed in fp32 and rounded back. Needs
    ``bf16_master_weights_and_grads`` (DeepSpeed's rule)."""

    @property
    def master_dtype(self) -> str:
        """ "bf16" or "fp32": the dtype of master weights and gradient shards."""
        return "bf16" if self.bf16_master_weights_and_grads else "fp32"

    @property
    def optimizer_state_dtype(self) -> str:
        """ "bf16" or "fp32": the dtype of the Adam moments."""
        return "bf16" if self.bf16_optimizer_states else "fp32"


class TagValidation(str, enum.Enum):
    """What loading a checkpoint does when ranks disagree on the tag."""

    IGNORE = "Ignore"
    WARN = "Warn"
    FAIL = "Fail"


def _tag_validation(value, path):
    if isinstance(value, str):
        for member in TagValidation:
            if member.value.lower() == value.lower():
                return member
    raise fail(path, value, '"Ignore", "Warn" or "Fail"')


def _pipeline_stage(value, path):
    if as_bool(value, path):
        raise fail(path, value, "false (zeroio has no pipeline parallelism)")
    return False


@dataclass(frozen=True, kw_only=True)
class ParallelWriteConfig:
    """``checkpoint.parallel_write``."""

    pipeline_stage: bool = field(False, coerce=_pipeline_stage)
    """DeepSpeed pipeline-parallel option; zeroio has no pipeline stages (must stay false)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """``checkpoint``: DeepSpeed's checkpoint block."""

    tag_validation: TagValidation = field(TagValidation.WARN, coerce=_tag_validation)
    """Check that all ranks save/load the same tag: Ignore, Warn or Fail (case-insensitive)."""
    load_universal: bool = field(False, coerce=as_bool)
    """Load a universal checkpoint. zeroio checkpoints are always universal (any world
    size reads its own range), so this only documents intent."""
    use_node_local_storage: bool = field(False, coerce=as_bool)
    """Each node writes to its own local storage (rank 0 of each node writes shared files)."""
    parallel_write: ParallelWriteConfig = sub(ParallelWriteConfig)
    keep_last: int | None = field(None, coerce=optional(int_coercer(ge=1)))
    """zeroio's own key, the Hugging Face Trainer's ``save_total_limit``: after each save,
    keep the newest N complete tags of the save directory and remove the older ones that
    zeroio wrote; never the tag ``latest`` names, an incomplete tag or a folder zeroio did
    not write (``zeroio.checkpoint.retention``). None (the default): keep every tag."""


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """``distributed``: zeroio's own process-group settings (not a DeepSpeed key)."""

    timeout_s: float = field(600.0, coerce=float_coercer(gt=0))
    """Seconds a collective waits for the other ranks before it fails, naming the ranks that
    stopped answering (applies where zeroio creates the process group)."""
