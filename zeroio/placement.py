"""The placement: where every buffer of training state lives, and how many bytes on each tier.

[Note: one placement]
``decide_placement`` is the one function that says, for one rank, on which tier (GPU, host,
NVMe) each kind of buffer lives and how many bytes it takes there, from the model's parameter
counts, the resolved config (stage, offload, ratio, dtypes, budgets, accumulation), the world
size and the machine (``MachineMemory``). Its bytes are ``zeroio.estimate``'s arithmetic (the
one memory model), grouped by buffer kind; nothing here counts a byte a second time. The same
value is what

- ``zeroio estimate --plan`` and ``zeroio train --plan`` print as the placement table of the
  chosen config (zeroio/plan.py: ``Plan.layout``),
- the running engine decides at initialize (engine_build.py ``engine_placement``), keeps, and
  reports as ``engine.stats()["placement"]``; the host-memory preflight (preflight.py) checks
  its host rows against the machine.

Buffer kinds (``BUFFERS``): ``param16`` (16-bit parameters: replicated below stage 3, the
shard at stage 3, negative bytes where ``params_from_master`` keeps none), ``master`` (the
optimizer's master weights), ``moments`` (Adam's two moments), ``grad`` (the reduced gradient
shard the optimizer reads, at its dtype), ``grad16`` (the device's 16-bit gradients: the
replicated gradients of stages 0/1, autograd's gradients of one stage-3 group),
``accumulation`` (the device-tier accumulation buffer, config/accum_place.py), ``staging``
(pinned and device staging: accumulation staging slots, step-assist slots, shards copied in
before their gather, publish staging), ``comm`` (reduce / all-gather buckets and the stage-3
live gathered parameters, an upper bound), ``activations`` (the caller's figure), ``other``
(an estimate row this module does not name yet: counted, never dropped; tests keep it empty).

A buffer paged through host memory from an NVMe home has its host window beside its homes
(``Buffer.window_bytes``: pinned host bytes, counted in the host total): the moments' swap
buffers or swap window with ``offload_optimizer`` nvme, the parameter swap buffers with
``offload_param`` nvme. Masters homed on NVMe take the same shape (``master`` on ``nvme`` with
its host window) where the optimizer pages them.

GPU-resident optimizer chunks (the step assist's, tiering/gpu_tier.py) are a cache of host
state, not a home: ``resident_chunks`` says whether they run and their cap (None: "auto", half
of what training leaves free, decided at each step).

[Note: the host floor]
With ``offload_optimizer.device`` cpu, host memory holds the optimizer state (12 bytes per
parameter for fp32 Adam: masters and two moments) and bounded windows; a second full copy of
the parameters or the gradient only where it fits and makes the step faster. Two decisions
get it there, both made here, so the estimate, the preflight, the planner and the engine
agree (``Placement.decisions`` says why, in words):

- the gradient stays on the device where it has room and the host step reads it through
  a pinned window ([Note: the gradient's home] in config/accum_place.py);
- stage 3 with ``offload_param.device`` cpu and ``tiering.params_from_master`` "auto": the
  16-bit parameter shards (2 bytes per parameter) stay in host memory where the host holds
  them beside everything else with ``HOST_MARGIN`` left free (a gather then copies 2 bytes
  per element up instead of 4, and the step assist can write them), else each gather casts
  the fp32 master on its way up ([Note: shards read from the master] in
  partition/stage3/master_store.py) and the step assist is off (it writes those shards).
  Without a measured host (``zeroio estimate`` alone) the shards stay, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zeroio.config import Config
from zeroio.config.accum_place import ACCUM_ROW, WINDOW_ROW
from zeroio.config.policy import Policies, resolve_policies
from zeroio.errors import ConfigError
from zeroio.estimate import (
    DTYPE_BYTES,
    STREAMED,
    TIERS,
    MemoryEstimate,
    MemoryItem,
    estimate_memory,
)

HOST_MARGIN = 0.10
"""Fraction of the host's memory a placement leaves free (the planner's ``MARGIN`` for GPU and
host memory alike): what the libraries, the dataloader and the allocator take beside the
training state the estimate counts."""
BUFFERS = ("param16", "master", "moments", "grad", "grad16", "accumulation", "staging", "comm",
           "activations", "other")

# (estimate row name prefix, buffer kind, "home" or "window"); the first match wins, so the
# longer prefixes come first
_ROWS = (
    ("16-bit parameter shard not held", "param16", "home"),
    ("parameter swap buffers", "param16", "window"),
    (WINDOW_ROW, "grad", "window"),
    ("optimizer swap", "moments", "window"),
    ("optimizer moments", "moments", "home"),
    ("autograd's 16-bit gradients", "grad16", "home"),
    (ACCUM_ROW, "accumulation", "home"),
    ("gradient accumulation staging", "staging", "home"),
    ("device-side publish staging", "staging", "home"),
    ("publish staging", "staging", "home"),
    ("step assist slots", "staging", "home"),
    ("offloaded shards copied in", "staging", "home"),
    ("host fp32 masters copied in", "staging", "home"),
    ("gradient landing pieces", "grad", "window"),
    ("gradient reduce buckets", "comm", "home"),
    ("gradient buckets", "comm", "home"),
    ("all-gather bucket", "comm", "home"),
    ("live gathered parameters", "comm", "home"),
    ("gradient shard for the CPU optimizer", "grad", "home"),
    ("fp32 gradient", "grad", "home"),
    ("bf16 gradient shard", "grad", "home"),
    ("2-byte gradient shard", "grad", "home"),
    ("parameters", "param16", "home"),
    ("activations", "activations", "home"),
)


@dataclass(frozen=True, kw_only=True)
class MachineMemory:
    """The machine figures a placement is decided from (per node; bytes)."""

    gpu_bytes: int
    """Memory of one GPU (0: no GPU, the device is the CPU)."""
    host_bytes: int | None
    """Host memory training may use on the node (None: not measured)."""
    nvme_free_bytes: int
    """Free bytes under the NVMe path (0: no NVMe path)."""
    gpus_per_node: int = 1
    """Ranks per node."""
    gpu_free_bytes: int | None = None
    """Free device memory (the running engine's, measured: 0 on a CPU device; a plan's, the GPU
    memory it may use), which decides the accumulation buffer's tier; None: unknown (only an
    explicit budget places it)."""

    def __post_init__(self) -> None:
        for name in ("gpu_bytes", "host_bytes", "nvme_free_bytes", "gpus_per_node",
                     "gpu_free_bytes"):
            v = getattr(self, name)
            if v is None and name in ("host_bytes", "gpu_free_bytes"):
                continue
            low = 1 if name == "gpus_per_node" else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"machine.{name} = {v!r}: expected an integer >= {low}",
                                  key=f"machine.{name}")


@dataclass(frozen=True, kw_only=True)
class Buffer:
    """One buffer kind on one rank: bytes homed on each tier, and the pinned host window an
    NVMe home is paged through."""

    kind: str
    tiers: dict[str, int]
    """Bytes homed per tier ("gpu", "cpu", "nvme"; every tier present, 0 where none)."""
    window_bytes: int = 0
    """Pinned host bytes through which the NVMe home is read and written."""

    def to_dict(self) -> dict[str, Any]:
        return {"tiers": dict(self.tiers), "window_bytes": self.window_bytes}


@dataclass(frozen=True, kw_only=True)
class Placement:
    """The one placement of one rank's training state ([Note: one placement])."""

    stage: int
    world_size: int
    offload_optimizer: str
    offload_param: str
    ratio: float
    """``offload_optimizer.ratio``: the fraction of the optimizer elements off the GPU."""
    accumulation_steps: int
    buffers: tuple[Buffer, ...]
    budgets: dict[str, int | None]
    """``tiering.{gpu,cpu,nvme}_budget_bytes`` (None: derived by each store, "auto")."""
    machine: MachineMemory
    resident_chunks: dict[str, Any]
    """{"enabled": the step assist keeps host chunks on the GPU between steps, "cap_bytes":
    their cap, None for "auto"}."""
    estimate: MemoryEstimate = field(compare=False, repr=False)
    """The estimate the bytes come from (its itemised rows)."""
    decisions: dict[str, str] = field(default_factory=dict)
    """Why each buffer with a choice lives where it does, in words ("gradient",
    "param16"): [Note: the host floor]."""

    def buffer(self, kind: str) -> Buffer:
        return next(b for b in self.buffers if b.kind == kind)

    @property
    def accumulation_on_device(self) -> bool:
        """Whether the accumulating gradient shard is summed in a device-tier buffer ([Note:
        accumulation on the device tier] in tiering/device_accum.py): the partitioner
        follows this, it does not decide again."""
        return self.buffer("accumulation").tiers["gpu"] > 0

    @property
    def gradient_on_device(self) -> bool:
        """Whether the host optimizer's gradient stays on the device and the host step reads
        it through a pinned window ([Note: the gradient's home] in config/accum_place.py):
        the partitioner follows this, it does not decide again."""
        return any(i.name == WINDOW_ROW for i in self.estimate.items)

    @property
    def params_from_master(self) -> bool:
        """Stage 3 keeps no 16-bit parameter shard: each gather casts the master ([Note: the
        host floor]); the partitioner follows this."""
        return self.estimate.params_from_master

    def host_bytes_per_node(self) -> int:
        """Host memory this placement takes on a node: the host tier of every rank of it, and
        on a CPU device (no GPU) the device tier too."""
        per_rank = self.tier_bytes("cpu") + (self.tier_bytes("gpu")
                                             if self.machine.gpu_bytes == 0 else 0)
        return per_rank * self.machine.gpus_per_node

    def tier_bytes(self, tier: str) -> int:
        """Bytes this rank holds on ``tier``: homes, and on "cpu" the windows too."""
        return sum(b.tiers[tier] + (b.window_bytes if tier == "cpu" else 0)
                   for b in self.buffers)

    def to_dict(self) -> dict[str, Any]:
        """``engine.stats()["placement"]`` and the plan's ``"placement"`` (JSON)."""
        return {"stage": self.stage, "world_size": self.world_size,
                "offload_optimizer": self.offload_optimizer,
                "offload_param": self.offload_param, "ratio": self.ratio,
                "accumulation_steps": self.accumulation_steps,
                "buffers": {b.kind: b.to_dict() for b in self.buffers},
                "totals": {t: self.tier_bytes(t) for t in TIERS},
                "budgets": dict(self.budgets), "decisions": dict(self.decisions),
                "machine": {"gpu_bytes": self.machine.gpu_bytes,
                            "host_bytes": self.machine.host_bytes,
                            "nvme_free_bytes": self.machine.nvme_free_bytes,
                            "gpus_per_node": self.machine.gpus_per_node,
                            "gpu_free_bytes": self.machine.gpu_free_bytes},
                "resident_chunks": dict(self.resident_chunks)}


def buffer_of(item: MemoryItem, stage: int) -> tuple[str, str]:
    """(buffer kind, "home" or "window") of one estimate row (stage 0/1's replicated
    "gradients" are the device's 16-bit gradients; stage 2/3's the reduced shard); ("other",
    "home") for a row no prefix names."""
    if item.kind == "activations":
        return "activations", "home"
    if item.name.startswith("gradients"):
        return ("grad16" if stage < 2 else "grad"), "home"
    for prefix, kind, role in _ROWS:
        if item.name.startswith(prefix):
            return kind, role
    return "other", "home"


def _group(est: MemoryEstimate) -> tuple[Buffer, ...]:
    homes = {k: dict.fromkeys(TIERS, 0) for k in BUFFERS}
    windows = dict.fromkeys(BUFFERS, 0)
    k_adam = DTYPE_BYTES[est.master_dtype] + 2 * DTYPE_BYTES[est.state_dtype]
    for item in est.items:
        if item.name.startswith("optimizer states"):  # master and moments in one row
            master = item.bytes_per_gpu // k_adam * DTYPE_BYTES[est.master_dtype]
            homes["master"][item.tier] += master
            homes["moments"][item.tier] += item.bytes_per_gpu - master
            continue
        if item.name.startswith("optimizer") and "master" in item.name:
            if "window" in item.name or "buffers" in item.name:  # masters paged from NVMe
                windows["master"] += item.bytes_per_gpu
            else:
                homes["master"][item.tier] += item.bytes_per_gpu
            continue
        kind, role = buffer_of(item, est.stage)
        if role == "window":
            windows[kind] += item.bytes_per_gpu
        else:
            homes[kind][item.tier] += item.bytes_per_gpu
    return tuple(Buffer(kind=k, tiers=homes[k], window_bytes=windows[k]) for k in BUFFERS)


def decide_placement(*, num_params: int, config: Config, world_size: int,
                     machine: MachineMemory, largest_group: int | None = None,
                     device_type: str = "cuda", policies: Policies | None = None,
                     **estimate_kw: Any) -> Placement:
    """[Note: one placement] for a model of ``num_params`` parameters (``largest_group``:
    elements of stage 3's largest flat group) trained with ``config`` on ``world_size`` ranks
    of ``machine``. ``device_type``: the ranks' device ("cuda", or "cpu"); ``policies``: the
    engine's resolved policies (None: resolved here from ``config`` for ``device_type``).
    ``estimate_kw``: the planner's extra inputs of ``estimate_memory`` (``activation_bytes``,
    ``params_from_master``, ``nvme_budget_bytes``, ``dtype``)."""
    gpus = machine.gpus_per_node
    if world_size < 1 or world_size % gpus:
        raise ConfigError(f"world_size {world_size} is not a multiple of the machine's "
                          f"gpus_per_node {gpus}", key="machine.gpus_per_node")
    zero = config.zero_optimization
    # stage 0: every rank holds every byte, what stage 1 holds on a world of one (the engine
    # also takes an offloaded optimizer at stage 0)
    one = {"stage": 1, "gpus_per_node": 1, "nodes": 1} if zero.stage == 0 else {
        "gpus_per_node": gpus, "nodes": world_size // gpus}
    def estimate(**kw: Any) -> MemoryEstimate:
        return estimate_memory(num_params, config=config, largest_group=largest_group,
                               device_room=machine.gpu_free_bytes, **one, **estimate_kw, **kw)

    est = estimate()
    decisions = {}
    if "params_from_master" not in estimate_kw and _shards_may_go(zero, machine):
        est, decisions["param16"] = _shards_or_masters(est, estimate, machine)
    decisions["gradient"] = _gradient_words(est)
    buffers = _group(est)
    if policies is None:
        policies = resolve_policies(zero, accumulation_steps=config.gradient_accumulation_steps,
                                    device=device_type, bf16=config.bf16)
    t = policies.tiering
    # the resident chunks' cap: a gpu_budget_bytes covers the GPU tier's fixed state first,
    # the accumulation buffer and a gradient kept on the device
    accum_gpu = sum(i.bytes_per_gpu for i in est.items if i.tier == "gpu" and (
        i.name == ACCUM_ROW or i.name.endswith(STREAMED)))
    assist = t.step_assist and t.gpu_budget_bytes != 0 and not est.params_from_master
    cap = None if t.gpu_budget_bytes is None else max(0, t.gpu_budget_bytes - accum_gpu)
    return Placement(stage=zero.stage, world_size=world_size,
                     offload_optimizer=est.offload_optimizer, offload_param=est.offload_param,
                     ratio=est.ratio, accumulation_steps=config.gradient_accumulation_steps,
                     buffers=buffers, machine=machine, estimate=est,
                     budgets={"gpu": t.gpu_budget_bytes, "cpu": t.cpu_budget_bytes,
                              "nvme": t.nvme_budget_bytes},
                     resident_chunks={"enabled": assist, "cap_bytes": cap if assist else 0},
                     decisions={k: v for k, v in decisions.items() if v})


def _shards_may_go(zero, machine: MachineMemory) -> bool:
    """Whether the 16-bit shards are this placement's to keep or drop ([Note: the host
    floor]): stage 3, optimizer and parameters offloaded to cpu, ``params_from_master`` and
    ``step_assist`` left to zeroio ("auto"), the host's memory known."""
    return (zero.stage == 3 and zero.offload_optimizer.device == "cpu" and
            zero.offload_param.device == "cpu" and zero.tiering.params_from_master is None and
            zero.tiering.step_assist is not True and machine.host_bytes is not None)


def _host_usable(machine: MachineMemory) -> int:
    return int(machine.host_bytes * (1 - HOST_MARGIN))


def _shards_or_masters(est: MemoryEstimate, estimate, machine: MachineMemory
                       ) -> tuple[MemoryEstimate, str]:
    """The estimate with the 16-bit shards kept in host memory where they fit, else the
    one without them (``params_from_master``), and why ([Note: the host floor])."""
    probe = Placement(stage=est.stage, world_size=est.world_size, ratio=est.ratio,
                      offload_optimizer=est.offload_optimizer, offload_param=est.offload_param,
                      accumulation_steps=1, buffers=_group(est), budgets={}, machine=machine,
                      resident_chunks={}, estimate=est)
    need, usable = probe.host_bytes_per_node(), _host_usable(machine)
    shards = probe.buffer("param16").tiers["cpu"] * machine.gpus_per_node
    words = (f"{need / 1e9:.2f} GB of host memory per node with the 16-bit parameter shards "
             f"({shards / 1e9:.2f} GB), {usable / 1e9:.2f} GB usable ({1 - HOST_MARGIN:.0%} of "
             f"{machine.host_bytes / 1e9:.2f} GB)")
    if need <= usable:
        return est, (f"16-bit parameter shards kept in host memory: {words}; a gather copies "
                     "2 bytes per element up instead of 4")
    return estimate(params_from_master=True), (
        f"no 16-bit parameter shards (params_from_master: each gather casts the fp32 master on "
        f"its way up, 4 bytes per element instead of 2; the step assist is off): {words}")


def _gradient_words(est: MemoryEstimate) -> str:
    """Where the host optimizer's gradient lives and why ([Note: the gradient's home])."""
    if est.offload_optimizer != "cpu":
        return ""
    rows = {i.name: i for i in est.items}
    if WINDOW_ROW in rows:
        home = "the accumulation buffer" if ACCUM_ROW in rows else \
            "a gradient shard of the host gradient's dtype"
        return (f"on the device ({home}); the host step reads it through a pinned window of "
                f"{rows[WINDOW_ROW].bytes_per_gpu / 1e9:.3f} GB per rank: no host gradient shard")
    if ACCUM_ROW in rows:
        return ("summed on the device, then copied into a host gradient shard once per step "
                "(the optimizer steps whole shards)")
    return ("in host memory: the device has no room for it where it may use memory "
            "(tiering.gpu_budget_bytes 0 or too small, or half the free memory less 2 GiB), "
            "or the micro steps are summed on the host, or the optimizer steps whole shards")


def render_table(placement: Placement) -> list[str]:
    """The placement as text lines: one row per buffer kind, its bytes per tier (GB = 1e9)
    and its host window, then the totals and the budgets."""
    def gb(n: int | None) -> str:
        return "auto" if n is None else f"{n / 1e9:.3f}"

    lines = [f"placement per rank (stage {placement.stage}, {placement.world_size} rank(s), "
             f"offload_optimizer {placement.offload_optimizer} ratio {placement.ratio:g}, "
             f"offload_param {placement.offload_param}, accumulation "
             f"{placement.accumulation_steps}):",
             f"  {'buffer':13s} {'GPU GB':>10s} {'host GB':>10s} {'NVMe GB':>10s} "
             f"{'window GB':>10s}"]
    for b in placement.buffers:
        if any(b.tiers.values()) or b.window_bytes:
            lines.append(f"  {b.kind:13s} {gb(b.tiers['gpu']):>10s} {gb(b.tiers['cpu']):>10s} "
                         f"{gb(b.tiers['nvme']):>10s} {gb(b.window_bytes):>10s}")
    lines.append(f"  {'total':13s} " + " ".join(f"{gb(placement.tier_bytes(t)):>10s}"
                                                for t in TIERS))
    lines.append("  budgets GB: " + ", ".join(f"{t} {gb(v)}" for t, v in
                                               placement.budgets.items()))
    lines += [f"  {kind}: {why}" for kind, why in placement.decisions.items()]
    rc = placement.resident_chunks
    if rc["enabled"]:
        lines.append(f"  GPU-resident optimizer chunks: cap {gb(rc['cap_bytes'])} GB (a cache "
                     "of host state)")
    return lines


__all__ = ["BUFFERS", "HOST_MARGIN", "Buffer", "MachineMemory", "Placement", "buffer_of", "decide_placement",
           "render_table"]
