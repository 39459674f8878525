"""The ``zero_optimization`` section: stage, buckets, offload and tiering.

Defaults are DeepSpeed 0.19's source defaults (deepspeed/runtime/zero/config.py
and offload_config.py); docs/config.md lists where DeepSpeed's documentation
says otherwise. Attribute names are DeepSpeed's JSON names: where DeepSpeed's
pydantic field is ``prefetch_bucket_size`` with JSON alias
``stage3_prefetch_bucket_size``, the attribute is the JSON name and the field
name is accepted as an alias.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from zeroio.config.fields import (
    as_bool,
    as_str,
    enum_coercer,
    fail,
    field,
    float_coercer,
    int_coercer,
    optional,
    sub,
)
from zeroio.errors import ConfigError

_NONNEG = int_coercer(ge=0)


def _bool_or_auto(value, path):
    if value is None or value == "auto":
        return None
    if isinstance(value, bool):
        return value
    raise fail(path, value, 'true, false or "auto"')


class OffloadDevice(str, enum.Enum):
    """Where a kind of state lives when it is not on the GPU."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class EvictionPolicy(str, enum.Enum):
    """Which resident tensor the tiered store evicts when a tier is full."""

    LRU = "lru"
    FIFO = "fifo"
    TRACE = "trace"


MASTERS_PLACES = ("auto", "nvme", "host")


def _masters(value, path):
    if value == "auto":
        return "auto"
    text = as_str(value, path).lower()
    if text not in MASTERS_PLACES:
        raise fail(path, value, '"auto", "nvme" or "host"')
    return text


def _path(value, path):
    return as_str(value, path)


@dataclass(frozen=True, kw_only=True)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer``: optimizer state and step off the GPU."""

    device: OffloadDevice = field(OffloadDevice.NONE, coerce=enum_coercer(OffloadDevice))
    """none: optimizer state on GPU; cpu: pinned host memory, CPU Adam; nvme: zarr store
    under ``nvme_path``, streamed through host buffers in sub-groups."""
    nvme_path: str | None = field(None, coerce=optional(_path))
    """Directory for NVMe-resident optimizer state (required with device nvme).
    A relative path is relative to the working directory of the training process."""
    buffer_count: int = field(4, coerce=_NONNEG)
    """Host buffers in the NVMe swap pool (>= states per parameter: Adam has 4)."""
    pin_memory: bool = field(True, coerce=as_bool)
    """Keep offloaded state in page-locked host memory (faster copies, less pageable RAM)."""
    pipeline_read: bool = field(False, coerce=as_bool)
    """NVMe: read sub-group i+1 while sub-group i is updated."""
    pipeline_write: bool = field(False, coerce=as_bool)
    """NVMe: write sub-group i-1 while sub-group i is updated."""
    ratio: float = field(1.0, coerce=float_coercer(gt=0.0, le=1.0))
    """DeepSpeed's meaning: the fraction of the optimizer state offloaded (stages 1-3; at
    stages 1 and 2 with ``device`` cpu only; ignored with ``device`` none). With ratio r < 1
    the first (1 - r) of this rank's optimizer elements keep their fp32 master, moments and
    gradient on the compute device and are stepped there by the fused Adam
    (zeroio/optim/twin.py); the rest lives on ``device`` (cpu, or nvme at stage 3) as
    before."""

    masters: str = field("auto", coerce=lambda v, path: _masters(v, path))
    """With ``device`` nvme: where the fp32 (or bf16) master shard lives between steps.
    ``nvme``: in the optimizer's tiered store with the moments, paged through the same
    window (what DeepSpeed's ZeRO-Infinity does with its NVMe optimizer); ``host``: a whole
    tensor in (pinned) host memory; ``auto`` (the default): nvme at stages 1 to 3 when this
    rank's masters and gradient shard would take more than three quarters of
    ``tiering.cpu_budget_bytes`` (``MASTERS_ROOM``), else host ([Note: where the masters
    live] in optim/swap.py)."""

    @property
    def pipeline(self) -> bool:
        return self.pipeline_read or self.pipeline_write


@dataclass(frozen=True, kw_only=True)
class OffloadParamConfig:
    """``zero_optimization.offload_param``: 16-bit parameters off the GPU (stage 3 only)."""

    device: OffloadDevice = field(OffloadDevice.NONE, coerce=enum_coercer(OffloadDevice))
    """none: parameter shards on GPU; cpu: pinned host memory; nvme: zarr store."""
    nvme_path: str | None = field(None, coerce=optional(_path))
    """Directory for NVMe-resident parameters (required with device nvme)."""
    buffer_count: int = field(5, coerce=_NONNEG)
    """Host buffers in the parameter swap pool."""
    buffer_size: int = field(100_000_000, coerce=_NONNEG)
    """Elements per parameter swap buffer (1e8)."""
    max_in_cpu: int = field(1_000_000_000, coerce=_NONNEG)
    """With NVMe offload, parameter elements that may stay in host memory (1e9)."""
    pin_memory: bool = field(True, coerce=as_bool)
    """Keep offloaded parameters in page-locked host memory."""


@dataclass(frozen=True, kw_only=True)
class TieringConfig:
    """``zero_optimization.tiering``: zeroio's own tiered-store policy (not a DeepSpeed key).

    A budget of None is derived by the tiered store when it starts: GPU from
    the device's free memory, CPU from available host memory, NVMe from the
    free space of the file system under ``nvme_path``. An explicit budget is a
    hard cap; exceeding it is a CapacityError, never a silent overflow.
    """

    policy: EvictionPolicy = field(EvictionPolicy.TRACE, coerce=enum_coercer(EvictionPolicy))
    """Which copy of NVMe-homed state leaves host memory when the CPU budget is full, for
    the NVMe optimizer state (offload_optimizer nvme) and stage-3 NVMe parameter shards:
    trace (the default: farthest next use in the access trace recorded during the first
    step, lru until then; the optimizer keeps the pieces that fit resident and streams the
    rest, which is what that rule converges to on its cyclic sweep), lru (least recently
    used) or fifo (first in). The policy never changes the numbers, only the bytes moved
    (docs/tiering.md, "What each key changes in training")."""
    prefetch_depth: int | None = field(None, coerce=optional(_NONNEG))
    """Read-ahead of the NVMe swap: the optimizer requests this many pieces ahead of the one
    it updates, and stage 3's parameter store (trace policy) prefetches this many upcoming
    shard accesses beyond the partitioner's own prefetch. None (default): each keeps its
    built-in read-ahead (optimizer: 3 pieces with offload_optimizer.pipeline_read, else
    none; parameters: stage3_prefetch_bucket_size only). 0 = demand only."""
    gpu_budget_bytes: int | None = field(None, coerce=optional(_NONNEG))
    """offload_optimizer cpu with the step assist: GPU bytes of host optimizer state (fp32
    master and moments, 12 bytes per element) the assist may keep on the GPU between steps
    ([Note: resident chunks] in shard/assist.py). None ("auto", the default): half of the
    memory training leaves free at its peak so far, less 2 GiB, decided before each step; 0:
    none (DeepSpeed's placement: all of it in host memory). Without offload_optimizer cpu it
    has no effect (a ConfigWarning)."""
    cpu_budget_bytes: int | None = field(None, coerce=optional(_NONNEG))
    """Host bytes for ALL state the engine keeps in host memory when something is on NVMe
    (masters, gradient shards, flat buffers, staging, and the NVMe stores' buffers):
    ``engine.stats()["tiers"]["cpu"]`` stays within it. The stores get what the state
    outside them leaves (docs/tiering.md, "Budgets in training"); too small is a
    CapacityError at initialize. None = derived at start."""
    nvme_budget_bytes: int | None = field(None, coerce=optional(_NONNEG))
    """Bytes the NVMe stores may write (parameter shards first, the optimizer's moments
    the rest); None = derived at start."""
    nvme_reserve_bytes: int = field(1 << 30, coerce=_NONNEG)
    """Free bytes of the ``nvme_path`` file system a derived NVMe budget leaves untouched
    (1 GiB): with ``nvme_budget_bytes`` unset the budget is the free space minus this."""
    overlap_step: bool | None = field(None, coerce=_bool_or_auto)
    """Stages 0-3 with offload_optimizer cpu: ``step()`` returns while the CPU optimizer
    still runs and the next forward waits per module for its parameters (docs/engine.md,
    which lists every reader that waits and what else could see old values). "auto" (None,
    the default): on when training runs on a CUDA device, off on the CPU (there the forward
    and the host step would share the same cores). The environment variable
    ZEROIO_OVERLAP_STEP, when set (1/0/auto), replaces it at load_config
    (config/overrides.py)."""
    step_assist: bool | None = field(None, coerce=_bool_or_auto)
    """offload_optimizer cpu on a CUDA device: the GPU steps a share of the host optimizer's
    chunks beside the CPU, streaming them in and out ([Note: step assist] in
    shard/assist.py); state stays in host memory. "auto" (None, the default): on wherever
    it applies; false: CPU only. The environment variable ZEROIO_STEP_ASSIST, when set
    (1/0/auto), replaces it at load_config (config/overrides.py)."""
    step_chunk_numel: int = field(1 << 26, coerce=int_coercer(ge=1))
    """Stage 3 with offload_optimizer cpu: most elements one CPU Adam call updates before
    that chunk is published (cast into the 16-bit shard); 64M. The environment variable
    ZEROIO_STEP_CHUNK_NUMEL, when set, replaces it at load_config."""
    params_from_master: bool | None = field(None, coerce=_bool_or_auto)
    """Stage 3: keep no 16-bit parameter shard; each gather casts this rank's slice of the
    fp32 (or bf16) master to the compute dtype on the way to the all-gather (FSDP2's mixed
    precision): 2 bytes per parameter less where the shards lived, 4 bytes instead of 2 per
    element over PCIe for each host-side gather. "auto" (None, the default): on when
    ``offload_optimizer.device`` is nvme (the host memory it frees is what such runs are
    short of), off otherwise. Not with ``offload_param.device`` nvme, nor at stages 0-2
    (``params_from_master_enabled``)."""


def ineffective_tiering_keys(zero: ZeroConfig, raw_tiering: object) -> list[tuple[str, str]]:
    """(key path, why) for each ``zero_optimization.tiering`` key the user set (present, not
    null, not the default) that can have no effect with this ``zero`` section: the policy,
    read-ahead and the CPU / NVMe budgets act only on state offloaded to NVMe, the GPU budget
    only on the optimizer state of offload_optimizer cpu. ``load_config`` warns once per key (``ConfigWarning``)."""
    if not isinstance(raw_tiering, dict):
        return []
    defaults = TieringConfig()
    nvme = zero.offload_optimizer.device is OffloadDevice.NVME or (
        zero.stage == 3 and zero.offload_param.device is OffloadDevice.NVME)
    out = []
    for name in ("policy", "prefetch_depth", "cpu_budget_bytes", "nvme_budget_bytes",
                 "gpu_budget_bytes"):
        value = raw_tiering.get(name)
        if value is None or getattr(getattr(defaults, name), "value", getattr(defaults, name)) \
                == (value.lower() if isinstance(value, str) else value):
            continue
        key = f"zero_optimization.tiering.{name}"
        if name == "gpu_budget_bytes":
            if zero.offload_optimizer.device is not OffloadDevice.CPU:
                out.append((key, "it caps the optimizer state kept on the GPU with "
                                 "offload_optimizer.device cpu, and the optimizer is not "
                                 "offloaded to cpu here; remove the key"))
        elif not nvme:
            what = "the NVMe budget needs an nvme_path" if name == "nvme_budget_bytes" else \
                "it acts on state offloaded to NVMe"
            out.append((key, f"nothing is offloaded to NVMe (offload_optimizer.device / "
                             f"offload_param.device), and {what}; remove the key or offload "
                             "to nvme"))
    return out


def _stage(value, path):
    stage = int_coercer(ge=0)(value, path)
    if stage > 3:
        raise fail(path, value, "0, 1, 2 or 3")
    return stage


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """``zero_optimization``: which training state is partitioned, and how it moves."""

    stage: int = field(0, coerce=_stage)
    """0: replicated (DDP); 1: optimizer state partitioned; 2: + gradients; 3: + parameters."""
    overlap_comm: bool | None = field(None, coerce=optional(as_bool))
    """Overlap gradient reduction with backward. None (unset) resolves to True for stage 3
    and False otherwise, as DeepSpeed does; after load_config it is always a bool."""
    contiguous_gradients: bool = field(True, coerce=as_bool)
    """Copy gradients into one contiguous buffer as they are produced."""
    reduce_bucket_size: int = field(500_000_000, coerce=_NONNEG)
    """Elements reduced per collective (5e8); 0, as in DeepSpeed, reduces each gradient alone."""
    allgather_bucket_size: int = field(500_000_000, coerce=int_coercer(
        ge=1, why=" (DeepSpeed divides by it at stages 1 and 2; 5e8 is its default)"))
    """Elements all-gathered per collective in stage 1/2 (5e8)."""
    sub_group_size: int = field(1_000_000_000, coerce=int_coercer(
        ge=1, why=" (elements per optimizer sub-group, each its own swap arrays: DeepSpeed reads "
                  "0 as one sub-group per parameter, which zeroio's flat sub-groups do not do; "
                  "1e9 is the default)"))
    """Elements per optimizer sub-group: the unit of the pipelined NVMe optimizer step (1e9).
    At least 1, and no more than ``MAX_SUB_GROUPS`` sub-groups per rank (optim/swap_plan.py)."""
    stage3_prefetch_bucket_size: int = field(50_000_000, coerce=_NONNEG,
                                             aliases=("prefetch_bucket_size",))
    """Stage 3: parameter elements fetched ahead of use (5e7)."""
    stage3_param_persistence_threshold: int = field(
        100_000, coerce=_NONNEG, aliases=("param_persistence_threshold",))
    """Stage 3: parameters with fewer elements stay unpartitioned (1e5)."""
    stage3_max_live_parameters: int = field(1_000_000_000, coerce=_NONNEG,
                                            aliases=("max_live_parameters",))
    """Stage 3: most gathered parameter elements resident per GPU before release (1e9)."""
    stage3_max_reuse_distance: int = field(1_000_000_000, coerce=_NONNEG,
                                           aliases=("max_reuse_distance",))
    """Stage 3: keep a parameter gathered if it is reused within this many elements (1e9)."""
    stage3_gather_16bit_weights_on_model_save: bool = field(
        False, coerce=as_bool,
        aliases=("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"))
    """Stage 3: save_16bit_model gathers the full 16-bit weights."""
    offload_optimizer: OffloadOptimizerConfig = sub(OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = sub(OffloadParamConfig)
    tiering: TieringConfig = sub(TieringConfig)


def overlap_step_enabled(tiering: TieringConfig | None, device=None) -> bool:
    """Whether the host step overlaps the next forward, for every stage: ``zero_optimization.
    tiering.overlap_step`` as resolved by load_config (``ZEROIO_OVERLAP_STEP`` applied
    there). "auto" is on for a CUDA ``device`` and off otherwise (``device`` None: not known
    yet). What reads stale values meanwhile: docs/engine.md, "Overlapped optimizer step"."""
    want = None if tiering is None else tiering.overlap_step
    if want is None:
        return getattr(device, "type", str(device)) == "cuda"
    return bool(want)


def params_from_master_auto(stage: int, optimizer_device: str) -> bool:
    """``tiering.params_from_master`` "auto": on at stage 3 with ``offload_optimizer.device``
    nvme, whatever ``offload_param.device`` says (``params_from_master_enabled`` says why);
    the one rule the engine, ``zeroio.estimate`` and the planner share."""
    return stage == 3 and optimizer_device == "nvme"  # OffloadDevice is a str enum


def params_from_master_enabled(zero: ZeroConfig) -> bool:
    """Whether stage 3 derives its 16-bit shards from the masters (``zero_optimization.
    tiering.params_from_master``, "auto" resolved: on at stage 3 with ``offload_optimizer.
    device`` nvme, whatever ``offload_param.device`` says: the NVMe optimizer keeps the fp32
    masters in host memory unless they page ([Note: where the masters live] in optim/swap.py;
    paged masters turn "auto" off in the partitioner), so the gathers
    cast those and a 16-bit shard, on the host or in an NVMe home, would be a second copy
    (2 bytes per parameter, and with ``offload_param`` nvme its reads and write-back every
    step). True where it cannot apply is a ConfigError naming the key:
    stages 0-2 (their 16-bit parameters are whole replicas, not shards) and
    ``tiering.step_assist`` true (the assist writes the 16-bit shard the option removes)."""
    want = zero.tiering.params_from_master
    key = "zero_optimization.tiering.params_from_master"
    if want is None:
        return params_from_master_auto(zero.stage, zero.offload_optimizer.device)
    if not want:
        return False
    if zero.stage != 3:
        raise ConfigError(f"{key} = true needs zero_optimization.stage 3 (stage is "
                          f"{zero.stage}): only stage 3 keeps a 16-bit parameter shard beside "
                          'the master; set it to false or "auto"', key=key)
    if zero.tiering.step_assist is True:
        raise ConfigError(f"{key} = true with zero_optimization.tiering.step_assist = true: "
                          "the step assist writes 16-bit shards, which this option removes; "
                          'set one of them to false or "auto"', key=key)
    return True


MASTERS_ROOM = 4 / 3
"""Host masters and the gradient shard may take at most three quarters of
``tiering.cpu_budget_bytes`` under ``masters: "auto"``: the optimizer's window takes at most a
quarter of its share (optim/swap_plan.py), and below that the masters page."""


def masters_place(zero: ZeroConfig) -> str:
    """``offload_optimizer.masters`` resolved as far as the config allows: "host" where the
    masters cannot page (device not nvme, stage 0, ``ratio`` < 1), "nvme", or "auto" (the
    partitioner decides from this rank's shard size and ``tiering.cpu_budget_bytes``:
    ``masters_paged``). "nvme" where it cannot apply, or beside ``tiering.params_from_master``
    true (the gathers would read the masters from disk), is a ConfigError naming the key."""
    oo = zero.offload_optimizer
    want, key = oo.masters, "zero_optimization.offload_optimizer.masters"
    possible = oo.device == "nvme" and zero.stage >= 1 and float(oo.ratio) >= 1.0
    if want == "nvme" and not possible:
        raise ConfigError(
            f'{key} = "nvme" needs offload_optimizer.device nvme at zero_optimization.stage 1, '
            f"2 or 3 with offload_optimizer.ratio 1 (device is {oo.device}, stage {zero.stage}, "
            f'ratio {oo.ratio}); set it to "auto" or "host"', key=key)
    if want == "nvme" and zero.tiering.params_from_master is True:
        raise ConfigError(
            f'{key} = "nvme" with zero_optimization.tiering.params_from_master = true: the '
            "gathers would read the masters from disk; the 16-bit shards are published from "
            'each master piece instead; set params_from_master to "auto" or false',
            key="zero_optimization.tiering.params_from_master")
    return want if possible else "host"


def masters_paged(place: str, *, host_numel: int, master_bytes: int, state_bytes: int,
                  cpu_budget_bytes: int | None) -> bool:
    """Whether this rank's masters page through NVMe with the moments: ``place`` is
    ``masters_place``'s; "auto" pages them when the host budget cannot keep the masters and
    the gradient shard of ``host_numel`` elements (``master_bytes`` each, at most) with a
    quarter of it left for the moments' window: ``MASTERS_ROOM`` x (masters + gradient). The
    one rule the partitioner and ``zeroio.estimate`` share ([Note: where the masters live]
    in optim/swap.py says why not sooner). ``state_bytes``: a moment's, unused by the rule."""
    del state_bytes
    if place != "auto":
        return place == "nvme"
    need = int(host_numel * 2 * master_bytes * MASTERS_ROOM)
    return cpu_budget_bytes is not None and cpu_budget_bytes < need


def masters_paged_for(zero: ZeroConfig, *, stage: int, optimizer_device: str, ratio: float,
                      host_numel: int, master_bytes: int, state_bytes: int) -> bool:
    """``masters_paged`` for ``zeroio.estimate``, whose stage, offload device and ratio may
    differ from ``zero``'s (keyword arguments); ``masters_place``'s rule otherwise."""
    possible = optimizer_device == "nvme" and stage >= 1 and ratio >= 1.0
    return possible and masters_paged(
        zero.offload_optimizer.masters, host_numel=host_numel, master_bytes=master_bytes,
        state_bytes=state_bytes, cpu_budget_bytes=zero.tiering.cpu_budget_bytes)


def step_assist_enabled(tiering: TieringConfig | None, device) -> bool:
    """Whether the GPU takes a share of the host optimizer step ([Note: step assist]):
    ``zero_optimization.tiering.step_assist`` as resolved by load_config
    (``ZEROIO_STEP_ASSIST`` applied there). "auto" is on for a CUDA device, at any world
    size (tested on 1 and 2 GPUs). On, with no CUDA device, is an error naming the
    setting."""
    want = None if tiering is None else tiering.step_assist
    key = "zero_optimization.tiering.step_assist"
    cuda = getattr(device, "type", str(device)) == "cuda"
    if want and not cuda:
        raise ConfigError(f"{key} is on (in the config, or ZEROIO_STEP_ASSIST=1), but training "
                          f"runs on {device}: the step assist moves host optimizer chunks to a "
                          "CUDA GPU; set it to false or \"auto\"", key=key)
    return cuda if want is None else want
