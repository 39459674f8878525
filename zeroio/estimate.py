"""Memory model: bytes of training state per GPU, per node's CPU memory and on NVMe.

Two layers, reported separately in the breakdown:

1. Model states, exactly as the ZeRO paper counts them (Rajbhandari et al.,
   2020, section 3 and figure 1): Psi parameters, N = gpus_per_node x nodes
   data-parallel ranks, b bytes per 16-bit value (2; 4 for fp32 training) and
   K = 12 bytes of optimizer state per parameter with mixed-precision Adam
   (fp32 master weights, momentum and variance). Per GPU:
       stage 0: (b + b + K) Psi          stage 1: b Psi + b Psi + K Psi / N
       stage 2: b Psi + (b + K) Psi / N  stage 3: (b + b + K) Psi / N
   Offload moves terms between tiers as ZeRO-Offload / ZeRO-Infinity do:
   offload_optimizer moves the K term and the partitioned gradients to the
   CPU (optimizer state to NVMe with "nvme"; gradients stay in CPU memory,
   where the CPU optimizer reads them); offload_param (stage 3) moves the
   16-bit parameter shard.

2. Buffers zeroio itself holds (``zeroio_buffers=True``), from the config's
   sizes (DeepSpeed defaults when no config is given):
   - fp32 gradient shard: gradients are accumulated in fp32 over the local
     shard (4 Psi / N; 4 Psi at stage 0), on the CPU when the optimizer is
     offloaded; not counted for fp32 training, where the gradients already are fp32.
     At stage 3 this fp32 shard *is* the gradient: the reduced bucket lands in it
     straight from the device (partition/stage3/grads.py) and no 16-bit gradient
     shard exists. The model states keep the paper's b Psi / N gradient term
     (so they read 16 Psi / N at stage 3, as the paper's figure 1) and the buffer
     is the (4 - b) bytes per element the fp32 shard holds beyond it; the sum is
     the bytes training holds. At stages 1/2 with the optimizer offloaded likewise:
     one host shard, the partition term and what it holds beyond it. With
     offload_optimizer cpu or nvme (both step the host shard with a CPU Adam; nvme's
     swapper piece by piece), nothing accumulated on the host (stage 1, or stages
     2/3 with gradient_accumulation_steps 1) and the one-pass CPU Adam
     (ZEROIO_CPU_ADAM compiled, or auto, the default, for a host shard of at
     least its AUTO_MIN_NUMEL) the host part is kept in the compute dtype
     instead: b bytes per element (shard/host_grads.py decides, here and in
     the partitioners; with ratio < 1 the device side's stays fp32).
   - gradient reduce buckets: stages 0-2, reduce_bucket_size elements of b
     bytes, two when overlap_comm double-buffers them; capped at Psi. Stage 3
     reduces one flat group (a transformer layer, ``largest_group`` elements;
     reduce_bucket_size stands in when the caller does not know it) in an fp32
     bucket, one being filled while the previous one is reduced and landed
     (2 x 4 x G), plus autograd's 16-bit gradients of one group (b x G).
   - stage 1/2 all-gather bucket: allgather_bucket_size x b, capped at Psi.
   - stage 3 live parameters: at most stage3_max_live_parameters gathered
     elements plus the group in use (b bytes each), capped at Psi; with
     offload_param the shard of each of those groups is first copied to the
     GPU (b x that / N). An upper bound, not a typical value.
   - stage 3 with ratio < 1 and offload_param: the device side's 16-bit
     values go to the host shards through one GPU staging buffer of
     PUBLISH_CHUNK_NUMEL elements (b bytes each).
   - gradient accumulation (gradient_accumulation_steps > 1) with gradients on the host:
     pinned fp32 staging, or an fp32 GPU buffer (``device_room``): config/accum_place.py.
   - the gradient kept on the device (offload_optimizer cpu with Adam, ``grad_streams``;
     [Note: the gradient's home] in config/accum_place.py): the model states' gradient
     partition and the shard's rest beyond it move to the GPU tier (the accumulation buffer
     above is the home instead where it is placed), and the host holds the host step's
     window (``WINDOW_SLOTS`` pinned slots of one ``step_chunk_numel`` chunk); at stages
     1/2 the host step's pinned 16-bit publication slots are counted too (2, or 4 beside the
     step assist). That is the host floor: [Note: the host floor] in zeroio/placement.py.
   - offload_optimizer nvme: fp32 masters (4 of K bytes) in host memory, moments (8) on disk; or
     all 12 paged through the disk ([Note: where the masters live] in zeroio/optim/swap.py).
   - NVMe optimizer swap buffers (pinned CPU), without ``tiering.cpu_budget_bytes``:
     buffer_count x min(sub_group_size, Psi / N) x 4 bytes (DeepSpeed's meaning). With it,
     what the state above leaves of the budget is the optimizer's share: its swap window and
     the head of moments it holds (whole pieces) are in host memory, as the swap plan keeps
     them (shard/swap_rule.py, [Note: resident head, streamed tail]); the disk homes every
     moment (the head "cached"), or, with an NVMe budget (``nvme_budget_bytes``, or
     ``tiering.nvme_budget_bytes``) too small for every moment, only the streamed tail (the
     head "resident").
   - ``params_from_master`` (stage 3): no 16-bit shard of the sharded parameters (a negative
     buffer item beside the paper's b Psi / N, wherever offload_param put it); the gather
     casts the fp32 master, so a host-side master is copied to the GPU first (4 bytes per
     element of the live groups' shards, an upper bound like the live parameters).
   - NVMe parameter swap buffers (pinned CPU): buffer_count x buffer_size x b.

3. ``offload_optimizer.ratio`` r < 1 (stage 3, and stages 1/2 with the
   optimizer on cpu; DeepSpeed's partial offload; zeroio/partition/stage3/twin.py,
   stage12.py): the first D = floor((1 - r) x Psi/N) elements of each rank's
   shard keep their optimizer state, gradient and fp32 gradient on the GPU
   (16 bytes each: master, two moments, fp32 gradient; plus the paper's b-byte
   gradient partition where it is counted); the other Psi/N - D are placed as
   offload says. Every per-shard term above is split into a GPU item and an
   offload item. (Bucket padding of stages 1/2 is not modelled: D is taken of
   Psi/N.)

4. ``bf16.bf16_master_weights_and_grads`` / ``bf16.bf16_optimizer_states`` (docs/engine.md,
   "bf16 optimizer state"): K = M + 2 S with M the master's and S each moment's bytes per
   element (4, or 2 in bf16): 6 with both switches, 10 with bf16 masters and fp32 moments;
   with bf16 masters the gradient shard is bf16 too (2 bytes where the fp32 gradient shard
   takes 4; at stage 3 nothing beyond the model states' b-byte term), the NVMe masters stay
   M bytes in host memory and the optimizer swap buffers hold S-byte moments.

5. Activations (``activation_bytes``, the caller's figure, e.g.
   ``llama_activation_bytes``): kind "activations", on the GPU.

Not counted: the CUDA context and allocator fragmentation, the dataloader,
the process's own host memory (libraries), a model built outside
``zero.Init`` and the temporary buffers of a checkpoint save. GB in reports
is 1e9 bytes, the paper's unit.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from zeroio.config import Config, OffloadDevice, ZeroConfig, host_split
from zeroio.config.accum_place import (
    accumulation_rows,
    gradient_on_device,
    planned_on_device,
    window_rows,
)
from zeroio.config.activations import (  # noqa: F401 (re-exported)
    ACT_PER_TOKEN_LAYER,
    llama_activation_bytes,
    planned_activation_bytes,
)
from zeroio.config.model_shape import ModelShape, llama_num_params, model_shape  # noqa: F401
from zeroio.config.zero import masters_paged_for, params_from_master_auto, step_assist_enabled
from zeroio.errors import ConfigError
from zeroio.estimate_nvme import LANDING, param_share, piece_elems, split_moments

K_ADAM = 12  # fp32 master + momentum + variance, bytes per parameter
MOMENTS = {False: "optimizer moments", True: "optimizer masters and moments"}  # paged or not
FP32 = 4
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
TIERS = ("gpu", "cpu", "nvme")
_HOST_ADAM = ("cpu", "nvme")
"""offload_optimizer devices whose host shard a CPU Adam steps (the 16-bit host gradient rule's
``cpu_optimizer``: shard/host_rule.py)."""
STREAMED = " (device tier, streamed to the CPU optimizer)"
"""The suffix of the gradient rows kept on the device and read through the host step's window
([Note: the gradient's home] in config/accum_place.py)."""
PUBLISH_CHUNK_NUMEL = 1 << 26
"""Elements of the GPU staging buffer through which stage 3 with ratio < 1 publishes the
device side's 16-bit values to the host shards (``Stage3Partitioner``'s publisher; the same
number, checked by tests/test_optim_ratio.py)."""


@dataclass(frozen=True, kw_only=True)
class MemoryItem:
    """One term of the estimate, per GPU (per rank)."""

    name: str
    tier: str
    bytes_per_gpu: int
    kind: str  # "model_state" (ZeRO paper), "zeroio_buffer" or "activations"
    formula: str


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """What ``estimate_memory`` returns. ``to_dict()`` is the CLI's --json output."""

    num_params: int
    gpus_per_node: int
    nodes: int
    stage: int
    offload_optimizer: str
    offload_param: str
    dtype: str
    items: tuple[MemoryItem, ...] = field(default_factory=tuple)
    ratio: float = 1.0
    """offload_optimizer.ratio: the fraction of each rank's optimizer elements offloaded."""
    device_elements: int = 0
    """Optimizer elements per rank kept on the GPU by ``ratio`` (0 at ratio 1)."""
    master_dtype: str = "fp32"
    """Masters' and gradient shards' dtype (``bf16.bf16_master_weights_and_grads``)."""
    state_dtype: str = "fp32"
    """The Adam moments' dtype (``bf16.bf16_optimizer_states``)."""
    params_from_master: bool = False
    """Stage 3 keeps no 16-bit shard of the sharded parameters (module doc, 2.)."""

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def per_gpu(self, tier: str, kind: str | None = None) -> int:
        return sum(i.bytes_per_gpu for i in self.items
                   if i.tier == tier and (kind is None or i.kind == kind))

    @property
    def gpu_bytes_per_gpu(self) -> int:
        return self.per_gpu("gpu")

    @property
    def cpu_bytes_per_node(self) -> int:
        return self.per_gpu("cpu") * self.gpus_per_node

    @property
    def nvme_bytes_per_node(self) -> int:
        return self.per_gpu("nvme") * self.gpus_per_node

    @property
    def model_state_gpu_bytes_per_gpu(self) -> int:
        """The ZeRO paper's per-GPU model-state figure (no zeroio buffers)."""
        return self.per_gpu("gpu", "model_state")

    def placement(self) -> dict[str, int]:
        """Optimizer elements per rank on the GPU and on the offload device."""
        shard = math.ceil(self.num_params / self.world_size)
        offloaded = shard - self.device_elements if self.offload_optimizer != "none" else 0
        return {"gpu_elements_per_gpu": shard - offloaded,
                "offloaded_elements_per_gpu": offloaded}

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_params": self.num_params,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "world_size": self.world_size,
            "stage": self.stage,
            "offload_optimizer": self.offload_optimizer,
            "offload_param": self.offload_param,
            "dtype": self.dtype,
            "offload_optimizer_ratio": self.ratio,
            "master_dtype": self.master_dtype,
            "optimizer_state_dtype": self.state_dtype,
            "params_from_master": self.params_from_master,
            "optimizer_placement": self.placement(),
            "gpu_bytes_per_gpu": self.gpu_bytes_per_gpu,
            "cpu_bytes_per_node": self.cpu_bytes_per_node,
            "nvme_bytes_per_node": self.nvme_bytes_per_node,
            "model_states": {t: self.per_gpu(t, "model_state") for t in TIERS},
            "zeroio_buffers": {t: self.per_gpu(t, "zeroio_buffer") for t in TIERS},
            "activations": self.per_gpu("gpu", "activations"),
            "breakdown": [
                {"name": i.name, "tier": i.tier, "bytes_per_gpu": i.bytes_per_gpu,
                 "kind": i.kind, "formula": i.formula} for i in self.items
            ],
        }


def parse_count(text: str | int | float) -> int:
    """'7.5e9', '1.4B', '350M', '125k', '1T' or a number -> an integer count."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*",
                             str(text))
        if not match:
            raise ConfigError(f"cannot read {text!r} as a parameter count: write e.g. 7.5e9, "
                              "1.4B, 350M or 125k", key="num_params")
        scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}[match[2].lower()]
        value = float(match[1]) * scale
    if not math.isfinite(value) or value < 1:
        raise ConfigError(f"num_params = {text!r}: expected a count >= 1", key="num_params")
    return int(round(value))


def _device(value: Any, name: str) -> str:
    if isinstance(value, OffloadDevice):
        return value.value
    if isinstance(value, str) and value.lower() in ("none", "cpu", "nvme"):
        return value.lower()
    raise ConfigError(f"{name} = {value!r}: expected none, cpu or nvme", key=name)


def _positive(value: Any, name: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ConfigError(f"{name} = {value!r}: expected a positive integer", key=name)


def estimate_memory(
    num_params: int | float | str,
    gpus_per_node: int = 1,
    nodes: int = 1,
    stage: int | None = None,
    offload_optimizer: str | None = None,
    offload_param: str | None = None,
    dtype: str | None = None,
    *,
    config: Config | None = None,
    zeroio_buffers: bool = True,
    ratio: float | None = None,
    largest_group: int | None = None,
    activation_bytes: int = 0,
    master_dtype: str | None = None,
    state_dtype: str | None = None,
    params_from_master: bool | None = None,
    nvme_budget_bytes: int | None = None,
    device_room: int | None = None,
    grad_streams: bool | None = None,
) -> MemoryEstimate:
    """Estimate training-state memory for ``num_params`` parameters (see module doc).

    stage, offload_optimizer, offload_param and dtype default to the config's
    values when ``config`` is given, else to stage 3, "none", "none", "bf16".
    Bucket and swap-buffer sizes come from ``config`` (DeepSpeed defaults without one).
    ``ratio`` (offload_optimizer.ratio, default the config's or 1.0): below 1 at stages 1-3 with
    the optimizer offloaded, the first (1 - ratio) of each shard stays on the GPU (module doc).
    ``largest_group``: elements of stage 3's largest flat group (one transformer layer), which
    sizes its gradient buckets and live parameters (None: reduce_bucket_size stands in).
    ``activation_bytes``: activation memory per GPU (e.g. ``llama_activation_bytes``).
    ``master_dtype`` / ``state_dtype``: "fp32" or "bf16", the masters' (and gradient shards')
    and the moments' (default the config's ``bf16`` switches, else fp32; module doc, 4.).
    ``params_from_master`` (default: the config's ``tiering.params_from_master`` where the
    config knows the key, "auto" on at stage 3 with offload_optimizer nvme unless the masters
    page; else off) and ``nvme_budget_bytes`` (per rank; default ``tiering.nvme_budget_bytes``,
    None: room for every moment): module doc, 2. ``device_room``: the device's free bytes
    where measured (0 on a CPU device), None in a plan: config/accum_place.py.
    ``grad_streams``: the host optimizer steps its shard chunk by chunk, so its gradient may
    stay on the device ([Note: the gradient's home] in config/accum_place.py; None: with
    offload_optimizer cpu, as Adam does; the engine passes False for the other rules)."""
    psi = parse_count(num_params)
    gpus_per_node = _positive(gpus_per_node, "gpus_per_node")
    nodes = _positive(nodes, "nodes")
    zero = config.zero_optimization if config is not None else ZeroConfig()
    if stage is None:
        stage = zero.stage if config is not None else 3
    if offload_optimizer is None:
        offload_optimizer = zero.offload_optimizer.device if config is not None else "none"
    if offload_param is None:
        offload_param = zero.offload_param.device if config is not None else "none"
    if dtype is None:
        dtype = config.compute_dtype if config is not None else "bf16"
    bf16 = config.bf16 if config is not None else None
    master_dtype = master_dtype or (bf16.master_dtype if bf16 is not None else "fp32")
    state_dtype = state_dtype or (bf16.optimizer_state_dtype if bf16 is not None else "fp32")
    for key, v in (("master_dtype", master_dtype), ("state_dtype", state_dtype)):
        if v not in ("fp32", "bf16"):
            raise ConfigError(f"{key} = {v!r}: expected fp32 or bf16", key=key)
    if ratio is None:
        ratio = zero.offload_optimizer.ratio if config is not None else 1.0
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or \
            not 0.0 < ratio <= 1.0:
        raise ConfigError(f"ratio = {ratio!r}: expected a number in (0, 1] (the fraction of the "
                          "optimizer state offloaded)", key="offload_optimizer.ratio")
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(f"stage = {stage!r}: expected 0, 1, 2 or 3", key="stage")
    opt_dev = _device(offload_optimizer, "offload_optimizer")
    par_dev = _device(offload_param, "offload_param")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype = {dtype!r}: expected bf16, fp16 or fp32", key="dtype")
    if par_dev != "none" and stage != 3:
        raise ConfigError(f"offload_param = {par_dev} needs stage 3 (got stage {stage})",
                          key="offload_param")
    if opt_dev != "none" and stage == 0:
        raise ConfigError(f"offload_optimizer = {opt_dev} needs stage 1, 2 or 3 (got stage 0)",
                          key="offload_optimizer")

    if ratio < 1.0 and stage == 0:
        raise ConfigError(f"offload_optimizer.ratio = {ratio:g} needs stage 1, 2 or 3 (got "
                          "stage 0)", key="offload_optimizer.ratio")
    if ratio < 1.0 and stage in (1, 2) and opt_dev == "nvme":
        raise ConfigError(f"offload_optimizer.ratio = {ratio:g} with offload_optimizer nvme "
                          f"needs stage 3 (got stage {stage}); use offload_optimizer cpu",
                          key="offload_optimizer.ratio")

    pfm = _params_from_master(params_from_master, zero if config is not None else None,
                              stage, opt_dev)
    n = gpus_per_node * nodes
    b = DTYPE_BYTES[dtype]
    mb, sb = DTYPE_BYTES[master_dtype], DTYPE_BYTES[state_dtype]
    paged = masters_paged_for(zero, stage=stage, optimizer_device=opt_dev, ratio=ratio,
                              host_numel=math.ceil(psi / n), master_bytes=mb, state_bytes=sb)
    pfm = pfm and not (paged and params_from_master is None)  # "auto" off: they are on disk
    k_adam = mb + 2 * sb  # K: 12 for fp32 state (module doc, 4.)
    gshard = mb  # the gradient shard's bytes per element where it would be fp32
    shard = math.ceil(psi / n)
    items: list[MemoryItem] = []
    # ratio < 1: D elements of the shard stay on the GPU (same floor as twin.device_numel)
    dev = min(shard, math.floor(shard * (1.0 - ratio))) if opt_dev != "none" and \
        ratio < 1.0 else 0

    def add(name: str, tier: str, nbytes: int, kind: str, formula: str) -> None:
        if nbytes > 0:
            items.append(MemoryItem(name=name, tier=tier, bytes_per_gpu=int(nbytes), kind=kind,
                                    formula=formula))

    def add_shard(name: str, tier: str, per_elem: int, kind: str, unit: str) -> None:
        """A per-shard term (``per_elem`` bytes per element), split by ``ratio``."""
        if dev == 0:
            add(name, tier, per_elem * shard, kind, f"{unit} * Psi / N")
            return
        add(f"{name} (ratio: on GPU)", "gpu", per_elem * dev, kind,
            f"{unit} * floor((1 - ratio) * Psi / N)")
        add(name, tier, per_elem * (shard - dev), kind,
            f"{unit} * (Psi / N - floor((1 - ratio) * Psi / N))")

    state = "model_state"
    gas = getattr(config, "gradient_accumulation_steps", None) or 1
    budget = zero.tiering.cpu_budget_bytes
    # [Note: paged gradients] in shard/paged_grads.py: with paged masters at stage 3
    grads_paged = paged and stage == 3 and zeroio_buffers and gas == 1
    groups16 = host_split.group_bytes(  # stage 3's flat groups (reduce_bucket_size stands in)
        shard, math.ceil((largest_group or zero.reduce_bucket_size) / n), b)
    resident16 = 0  # module doc, 2.: offload_param.max_in_cpu's shards, in host memory
    if stage == 3 and par_dev == "nvme" and zeroio_buffers and not pfm:
        resident16 = min(b * shard, host_split.resident_bytes(
            groups16, zero.offload_param.max_in_cpu * b,
            host_split.resident_cap(budget, host_split.host_cost(max(groups16)))))
    # 16-bit parameters: replicated below stage 3.
    if stage < 3:
        add("parameters", "gpu", b * psi, state, f"{b} * Psi")
    else:
        add("parameters", "gpu" if par_dev == "none" else par_dev, b * shard - resident16,
            state, f"{b} * Psi / N" + (" - resident" if resident16 else ""))
        add("parameters resident in host memory (offload_param.max_in_cpu)", "cpu",
            resident16, state, "whole shards up to max_in_cpu (and half cpu_budget_bytes)")
        if pfm and zeroio_buffers:  # module doc, 2.: a negative item, the paper's term kept
            items.append(MemoryItem(
                name="16-bit parameter shard not held (params_from_master: the gather casts "
                "the fp32 master)", tier="gpu" if par_dev == "none" else par_dev,
                bytes_per_gpu=-b * shard, kind="zeroio_buffer", formula=f"-{b} * Psi / N"))
    # Gradients: replicated at stages 0/1, the reduced shard from stage 2.
    grad_tier = "gpu" if opt_dev == "none" else "nvme" if grads_paged else "cpu"
    # zeroio's stage 3 keeps no 16-bit gradient shard (module doc, 2.): the model states keep
    # the paper's b-byte term, the buffers below the rest of its fp32 shard
    stage3_grad = stage == 3 and zeroio_buffers and dtype != "fp32" and gshard > b
    if stage < 2:
        add("gradients", "gpu", b * psi, state, f"{b} * Psi")
        if opt_dev != "none":
            add_shard("gradient shard for the CPU optimizer", "cpu", b, state, f"{b}")
    else:
        add_shard("gradients", grad_tier, b, state, f"{b}")
    # Optimizer state: K bytes per parameter, partitioned from stage 1.
    if stage == 0:
        add("optimizer states", "gpu", k_adam * psi, state, f"{k_adam} * Psi")
    elif opt_dev == "nvme" and zeroio_buffers:
        if not paged:  # host masters ([Note: where the masters live] in optim/swap.py)
            add_shard(f"optimizer {master_dtype} masters", "cpu", mb, state, f"{mb}")
        add_shard(MOMENTS[paged], "nvme", 2 * sb + mb * paged, state, f"{2 * sb + mb * paged}")
    else:
        add_shard("optimizer states", "gpu" if opt_dev == "none" else opt_dev, k_adam, state,
                  f"{k_adam}")

    if zeroio_buffers:
        buf = "zeroio_buffer"
        accum_dev, hgas = planned_on_device(zero.tiering.gpu_budget_bytes, device_room, items,
                                            stage=stage, gas=gas, grad_tier=grad_tier,
                                            host=shard - dev)
        hg = b if host_grad_bytes(dtype, opt_dev, hgas, shard - dev, stage=stage) == b \
            else gshard  # the host gradient's bytes per element (bf16 masters: bf16)
        streamed = gradient_on_device(  # [Note: the gradient's home] in config/accum_place.py
            zero.tiering.gpu_budget_bytes, device_room, items, stage=stage, gas=gas,
            grad_tier=grad_tier, host=shard - dev, accumulates_on_device=accum_dev,
            streams=(opt_dev == "cpu") if grad_streams is None else grad_streams and
            opt_dev == "cpu", home_bytes=hg)
        if dtype != "fp32" and stage == 0:
            add("fp32 gradient accumulation", "gpu", FP32 * psi, buf, "4 * Psi")
        elif grad_tier == "cpu":
            items[:] = _host_gradient_rows(items, b=b, hg=hg, dev=dev, host=shard - dev,
                                           streamed=streamed, accum_dev=accum_dev)
            if streamed:
                window_rows(add, host=shard - dev, grad_bytes=hg, kind=buf,
                            chunk=int(zero.tiering.step_chunk_numel))
        elif dtype != "fp32":  # the optimizer on the GPU
            if stage3_grad:  # the paper's b-byte term above plus what its fp32 shard holds
                add_shard("fp32 gradient shard beyond the model states'", grad_tier,
                          gshard - b, buf, f"{gshard - b}")
            else:
                add_shard(f"{'fp32' if gshard == FP32 else master_dtype} gradient shard",
                          grad_tier, gshard, buf, f"{gshard}")
        copies = 2 if (zero.overlap_comm if zero.overlap_comm is not None else stage == 3) else 1
        if stage < 3:
            add("gradient reduce buckets", "gpu", copies * b * min(zero.reduce_bucket_size, psi),
                buf, f"{copies} * {b} * min(reduce_bucket_size, Psi)")
        if stage in (1, 2):
            add("all-gather bucket", "gpu", b * min(zero.allgather_bucket_size, psi), buf,
                f"{b} * min(allgather_bucket_size, Psi)")
            if grad_tier == "cpu" and dtype != "fp32" and shard > dev:
                # the host step's pinned 16-bit slots, [Note: step publication] in
                # partition/stage12_step.py: four with the step assist
                slots = 4 if opt_dev == "cpu" and step_assist_enabled(zero.tiering, "cuda") \
                    else 2
                add("publish staging (pinned 16-bit)", "cpu",
                    slots * b * min(int(zero.tiering.step_chunk_numel), shard - dev), buf,
                    f"{slots} * {b} * min(step_chunk_numel, offloaded elements per GPU)")
        if stage == 3:
            grp = min(psi, largest_group if largest_group else zero.reduce_bucket_size)
            gname = "largest_group" if largest_group else "reduce_bucket_size"
            add("gradient buckets (fp32, one group each)", "gpu", 2 * FP32 * grp, buf,
                f"2 * 4 * min({gname}, Psi)")
            add("autograd's 16-bit gradients of one group", "gpu", b * grp, buf,
                f"{b} * min({gname}, Psi)")
            live = min(zero.stage3_max_live_parameters + grp, psi)
            add("live gathered parameters (upper bound)", "gpu", b * live, buf,
                f"{b} * min(stage3_max_live_parameters + {gname}, Psi)")
            if pfm and opt_dev != "none" and shard > dev:
                add("host fp32 masters copied in before their cast (params_from_master)",
                    "gpu", FP32 * min(math.ceil(live / n), shard - dev), buf,
                    f"4 * min(stage3_max_live_parameters + {gname}, Psi) / N")
            elif par_dev != "none":
                add("offloaded shards copied in before their all-gather", "gpu",
                    b * math.ceil(live / n), buf,
                    f"{b} * min(stage3_max_live_parameters + {gname}, Psi) / N")
            if dev and par_dev != "none" and not pfm:
                add("device-side publish staging (ratio)", "gpu",
                    b * min(PUBLISH_CHUNK_NUMEL, dev), buf,
                    f"{b} * min(PUBLISH_CHUNK_NUMEL, floor((1 - ratio) * Psi / N))")
        if opt_dev == "cpu" and (stage < 3 or par_dev == "cpu") and shard > dev and \
                not pfm and step_assist_enabled(zero.tiering, "cuda"):
            # [Note: step assist] in shard/assist.py (assist.slot_layout); at stage 3 the
            # 16-bit result goes to the host shard through a slot buffer
            from zeroio.dtypes import DTYPES
            from zeroio.shard import assist

            per = assist.slot_element_bytes(  # it reads a streamed sum in fp32 on the GPU
                DTYPES["fp32"] if streamed and accum_dev else
                _host_grad_dtype(dtype, opt_dev, hgas, shard - dev, stage=stage),
                DTYPES[dtype] if stage == 3 else None)
            add("step assist slots (during the step)", "gpu",
                assist.SLOTS * min(assist.SLOT_NUMEL, shard - dev) * per, buf,
                f"{assist.SLOTS} * min({assist.SLOT_NUMEL}, offloaded elements per GPU) * {per}")
        from zeroio.shard.host_rule import GRAD_PIECE_NUMEL, STAGING_SLOTS

        accumulation_rows(add, staging=(STAGING_SLOTS, GRAD_PIECE_NUMEL), stage=stage,
                          dtype=dtype, gas=gas, grad_tier=grad_tier, host=shard - dev,
                          on_device=accum_dev, world=n, kind=buf,
                          group=(grp, gname) if stage == 3 else (0, ""))
        if opt_dev == "nvme":
            oo = zero.offload_optimizer
            add("optimizer swap buffers (pinned)", "cpu",
                oo.buffer_count * min(zero.sub_group_size, shard - dev) * sb, buf,
                f"buffer_count * min(sub_group_size, offloaded elements per GPU) * {sb}")
        if par_dev == "nvme":
            op = zero.offload_param
            add("parameter swap buffers (pinned)", "cpu", min(
                op.buffer_count * op.buffer_size * b, b * shard - resident16), buf,
                f"min(buffer_count * buffer_size, swapped elements per GPU) * {b}")

    g = host_grad_bytes(dtype, opt_dev, gas, shard - dev, stage=stage) if grads_paged else 0
    # the window's bytes per element of each of a piece's two tensors (paged: half the sum)
    elem = (mb + 2 * sb + g) / 2 if paged else sb
    if opt_dev == "nvme" and zeroio_buffers and budget is not None:
        if g:  # the pieces the gradient lands in, beside the window (swap_plan.py)
            add(LANDING, "cpu", host_split.landing_bytes(piece_elems(zero, shard - dev, elem), g),
                "zeroio_buffer", "(1 + optimizer groups) pieces' gradients")
        if par_dev == "nvme":  # the parameter store's share first (config/host_split.py)
            items = param_share(items, zero, shard=shard - dev, element=elem, grad=g,
                                resident=resident16, largest=max(groups16), make=MemoryItem)
        nb = zero.tiering.nvme_budget_bytes if nvme_budget_bytes is None else nvme_budget_bytes
        items = split_moments(items, zero, shard - dev, elem, nb, MOMENTS[paged],
                              make=MemoryItem)
    if activation_bytes:
        add("activations (caller's estimate)", "gpu", activation_bytes, "activations",
            "activation_bytes")

    return MemoryEstimate(num_params=psi, gpus_per_node=gpus_per_node, nodes=nodes, stage=stage,
                          offload_optimizer=opt_dev, offload_param=par_dev, dtype=dtype,
                          items=tuple(items), ratio=float(ratio), device_elements=dev,
                          master_dtype=master_dtype, state_dtype=state_dtype,
                          params_from_master=pfm)


def _host_gradient_rows(items: list[MemoryItem], *, b: int, hg: int, dev: int, host: int,
                        streamed: bool, accum_dev: bool) -> list[MemoryItem]:
    """The gradient of an offloaded optimizer (module doc, 2.): the model states' b-byte
    partition term of the ``host`` host elements (and the ``dev`` device ones of a ratio,
    fp32 there) plus what the gradient holds beyond it, where it lives: a host shard of
    ``hg`` bytes per element, or on the device (``streamed``: [Note: the gradient's home] in
    config/accum_place.py), where the accumulation buffer is the home when ``accum_dev`` (its
    own row, ``accumulation_rows``). Returns ``items`` with the partition term's host row
    moved to the device (or dropped for the accumulation buffer) and the beyond rows added."""
    names = ("gradients", "gradient shard for the CPU optimizer")
    where = STREAMED
    out = []
    for i in items:
        if i.name in names and i.tier == "cpu" and streamed:
            if accum_dev:
                continue
            i = MemoryItem(name=i.name + where, tier="gpu", bytes_per_gpu=i.bytes_per_gpu,
                           kind=i.kind, formula=i.formula)
        out.append(i)

    def beyond(name: str, tier: str, nbytes: int, formula: str) -> None:
        if nbytes > 0:
            out.append(MemoryItem(name=name, tier=tier, bytes_per_gpu=nbytes,
                                  kind="zeroio_buffer", formula=formula))

    if dev:  # the device side of a ratio keeps an fp32 gradient
        beyond("fp32 gradient shard beyond the model states' (ratio: on GPU)", "gpu",
               (FP32 - b) * dev, f"{FP32 - b} * floor((1 - ratio) * Psi / N)")
    if not (streamed and accum_dev):
        beyond("fp32 gradient shard beyond the model states'" + (where if streamed else ""),
               "gpu" if streamed else "cpu", (hg - b) * host,
               f"{hg - b} * (Psi / N - floor((1 - ratio) * Psi / N))" if dev else
               f"{hg - b} * Psi / N")
    return out


def _params_from_master(given: bool | None, zero: ZeroConfig | None, stage: int,
                        opt_dev: str) -> bool:
    """``params_from_master`` as given, else the config's ("auto" / None: what
    ``params_from_master_enabled`` decides: stage 3 with offload_optimizer nvme), else
    off."""
    if given is None:
        given = getattr(getattr(zero, "tiering", None), "params_from_master", False)
        if given is None or given == "auto":
            given = params_from_master_auto(stage, opt_dev)
    if not isinstance(given, bool):
        raise ConfigError(f"params_from_master = {given!r}: expected true, false or auto",
                          key="zero_optimization.tiering.params_from_master")
    if given and stage != 3:
        raise ConfigError(f"params_from_master needs stage 3 (got stage {stage})",
                          key="zero_optimization.tiering.params_from_master")
    return given


def host_grad_bytes(dtype: str, opt_dev: str, gas: int, host_numel: int, *,
                    stage: int = 3) -> int:
    """Bytes per element of the host gradient shard (``host_numel`` elements; offload
    ``opt_dev``, ``gradient_accumulation_steps`` ``gas``), as the partitioner will decide it
    (``host_grad_dtype`` in zeroio/shard/host_grads.py, from ZEROIO_CPU_ADAM without
    compiling anything): the same rules, without importing torch."""
    from zeroio.optim.cpu_adam_plan import planned
    from zeroio.shard.host_rule import host_grad_may_be_16bit

    half = host_grad_may_be_16bit(stage=stage, half=dtype in ("bf16", "fp16"),
                                  cpu_optimizer=opt_dev in _HOST_ADAM, accumulation_steps=gas,
                                  host_numel=host_numel)
    return 2 if half and planned(host_numel) else FP32


def _host_grad_dtype(dtype: str, opt_dev: str, gas: int, host_numel: int, *, stage: int):
    """The torch dtype of ``host_grad_bytes`` (for the step assist's slot sizes)."""
    from zeroio.dtypes import DTYPES
    from zeroio.optim import cpu_adam_plan
    from zeroio.shard.host_grads import host_grad_dtype

    return host_grad_dtype(stage=stage, compute_dtype=DTYPES[dtype],
                           cpu_optimizer=opt_dev in _HOST_ADAM, accumulation_steps=gas,
                           host_numel=host_numel, kernel=cpu_adam_plan, plan_only=True)


__all__ = ["estimate_memory", "llama_num_params", "model_shape", "ModelShape", "host_grad_bytes",
           "llama_activation_bytes", "MemoryEstimate", "MemoryItem", "parse_count",
           "planned_activation_bytes"]
