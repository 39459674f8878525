"""Placement planner: which ZeRO stage and offload a model needs on a given machine.

``plan_placement(num_params, machine, micro_batch=..., seq=...)`` answers, as data, the
question a user otherwise settles by copying an ``offload_optimizer.ratio`` from a benchmark:
where does each byte of training state go on *this* machine, and how long will the offload
make a step.

The rule
--------
Count every placement zeroio supports, and of those whose bytes fit take the one with the
shortest predicted step time ("The step time" below); predictions within ``TIE`` of the
shortest (5%, or 10 ms: the model leaves out GPU compute, so closer figures do not order
two placements) count as a tie, which the earlier in this list takes (the GPU-only ones,
with no offload to time, tie at 0):

1. stage 2, everything on the GPU;
2. stage 3, everything on the GPU;
3. stage 3, ``offload_optimizer`` cpu;
4. stage 3, ``offload_optimizer`` cpu and ``offload_param`` cpu;
5. stage 3, ``offload_optimizer`` nvme;
6. stage 3, ``offload_optimizer`` nvme, ``offload_param`` cpu;
7. stage 3, ``offload_optimizer`` nvme, ``offload_param`` nvme.

A placement fits when ``zeroio.estimate.estimate_memory`` (its real buffers, activations
included) puts at most the usable bytes on each tier:

- GPU: ``(1 - MARGIN) x gpu_bytes`` per GPU (MARGIN = 10%, for the CUDA context, allocator
  fragmentation and what the estimate does not count);
- host: ``(1 - MARGIN) x host_bytes`` per node;
- disk: ``disk_bytes - DISK_RESERVE`` per node (1 GiB, what a derived NVMe budget leaves
  free: ``tiering.nvme_reserve_bytes``).

For 3 and 4 (optimizer on the CPU) the plan then keeps the largest share of the optimizer
state on the GPU that still fits: ``offload_optimizer.ratio = 1 - k / 100`` for the largest
whole percent k in 1..99 that fits (ratio 1 when not even 1% fits). With the optimizer on
NVMe (5-7) the plan takes the largest k the GPU takes first (host and disk bytes only shrink
with it), and ``tiering.cpu_budget_bytes`` is set to the usable host memory per rank: what
the state outside the NVMe store leaves of it holds Adam moments resident, and only the rest
streams to and from the disk. Where the disk cannot hold every host-side moment the resident
head has no disk home (optim/swap.py) and ``tiering.nvme_budget_bytes`` is set to the usable
disk per rank, so the engine knows it. The NVMe placements are planned with
``params_from_master`` (no 16-bit parameter shard) as its "auto" does, where the config takes
the key (or when the caller asks).

``sub_group_size`` is DeepSpeed's default (1e9) without NVMe and ``NVME_SUB_GROUP_SIZE``
(1e8) with it, which keeps the pinned optimizer swap buffers at 1.6 GB per GPU instead of 16.

``Plan.reasons`` says why each placement before the chosen one in the list was not taken
(what it overflows, or why its ratio is not lower), ``Plan.compared`` the predicted step
time of every other placement that fits. Where host memory cannot hold the optimizer state,
only the NVMe placements fit: the plan pages it through the disk. Each candidate is the
engine's placement for that config on this machine (zeroio/placement.py), so a CPU placement
keeps the 16-bit parameter shards in host memory only where they fit with the margin, and
the gradient on the GPU where it has room ([Note: the host floor] there).

When nothing fits, ``CapacityError`` names each tier the most offloaded placement (7)
overflows and by how many bytes.

The step time
-------------
Bytes each way per step (H = optimizer elements per rank off the GPU, S = the rank's shard,
D = S - H those kept on the GPU by the ratio, b = bytes of a 16-bit value, g = bytes per
element of the host gradient as ``estimate.host_grad_bytes`` decides):

- GPU -> CPU, per GPU: the gradients of the host elements, ``g x H``; with ``offload_param``
  and a ratio below 1 also the device side's updated 16-bit values published to the host
  shards, ``b x D``.
- CPU -> GPU, per GPU: without ``offload_param`` the updated 16-bit parameters of the host
  elements, ``b x H``; with it the shard copied in before each all-gather, forward and
  backward, ``2 x b x S``; with ``params_from_master`` the host fp32 masters, forward and
  backward, ``2 x 4 x H``.
- With ``accumulation`` A micro-steps per step (``gradient_accumulation_steps``), the
  gradients cross A times at stages 2 and 3 (they land every micro-step) and the parameter
  copies of forward and backward A times; the updated values and the disk's bytes once.
- NVMe -> CPU and CPU -> NVMe, per node: the Adam moments (8 bytes per element) that do not
  fit the host budget, read once and written once; with ``offload_param`` nvme also the
  parameter shards, read twice (forward, backward) and written once (an upper bound: no
  shard counted resident).

Predicted step time, from three terms: CPU Adam time (host elements per node /
``cpu_adam_elems_per_s``), PCIe time (the larger direction per GPU / ``pcie_bps``, a
full-duplex link per GPU) and disk time (read / ``disk_read_bps`` + write /
``disk_write_bps``, one device doing both; where the machine says how fast the disk reads
and writes at once, ``disk_mixed_bps``, the larger of (read + write) / ``disk_mixed_bps``
and each direction alone instead, since the step reads and writes at the same time and a
disk may serve the two together much slower than either alone: `disk_seconds`). With the
optimizer on the CPU the step is the largest term (the host step overlaps the next forward).
On NVMe it is PCIe + max(CPU Adam, disk): that optimizer steps after backward on the
training thread (no chunked step), its I/O pipelined with its CPU Adam (the 15.24B of
benchmarks/results/train-15b-h200/: 3.7-4.0 s measured, 2.0-2.2 as the largest term
alone). GPU compute is not modelled: the figure is the floor the offload puts under a
step, 0 with everything on the GPU.

The machine's figures are the caller's (measured with ``zeroio bench io`` and the like);
nothing here probes the machine. No torch at import time.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

from zeroio import placement as layout
from zeroio.config import load_config
from zeroio.config.accum_place import ACCUM_ROW
from zeroio.config.zero import params_from_master_auto
from zeroio.errors import CapacityError, ConfigError
from zeroio.estimate import (
    DTYPE_BYTES,
    MemoryEstimate,
    host_grad_bytes,
    llama_num_params,
    parse_count,
    planned_activation_bytes,
)
from zeroio.plan_machine import Machine

MARGIN = layout.HOST_MARGIN
"""Fraction of GPU and host memory the plan leaves free (the placement's, which decides by
it what it keeps in host memory: [Note: the host floor] in zeroio/placement.py)."""
DISK_RESERVE = 1 << 30
"""Free bytes under the NVMe path the plan leaves untouched (``tiering.nvme_reserve_bytes``)."""
NVME_SUB_GROUP_SIZE = 100_000_000
"""``sub_group_size`` of the NVMe placements (DeepSpeed's 1e9 otherwise)."""
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
NVME_PATH = "/path/to/nvme"
"""Placeholder ``nvme_path`` in the planned config: replace it with a folder on the NVMe."""
TIE = (0.05, 0.010)
"""Predicted step times within this fraction of the shortest, or this many seconds, tie
(module doc, "The rule")."""
MOMENT_BYTES = 8
"""Adam's two fp32 moments: what an NVMe-offloaded optimizer keeps on the disk."""


@dataclass(frozen=True)
class Placement:
    """One candidate of the rule (module doc): a stage and where the optimizer and the
    parameters live."""

    name: str
    stage: int
    optimizer: str
    param: str


PLACEMENTS = (
    Placement("stage 2, all on the GPU", 2, "none", "none"),
    Placement("stage 3, all on the GPU", 3, "none", "none"),
    Placement("stage 3, optimizer on the CPU", 3, "cpu", "none"),
    Placement("stage 3, optimizer and parameters on the CPU", 3, "cpu", "cpu"),
    Placement("stage 3, optimizer on NVMe", 3, "nvme", "none"),
    Placement("stage 3, optimizer on NVMe, parameters on the CPU", 3, "nvme", "cpu"),
    Placement("stage 3, optimizer and parameters on NVMe", 3, "nvme", "nvme"),
)


@dataclass(frozen=True, kw_only=True)
class TierFit:
    """One tier's bytes under a placement against what the machine offers."""

    tier: str  # "gpu" (per GPU), "cpu" (host, per node), "nvme" (disk, per node)
    need_bytes: int
    usable_bytes: int
    capacity_bytes: int

    @property
    def over_bytes(self) -> int:
        return max(0, self.need_bytes - self.usable_bytes)

    def to_dict(self) -> dict[str, int]:
        return {"need_bytes": self.need_bytes, "usable_bytes": self.usable_bytes,
                "capacity_bytes": self.capacity_bytes, "over_bytes": self.over_bytes}


TIER_WORDS = {"gpu": "GPU memory (per GPU)", "cpu": "host memory (per node)",
              "nvme": "disk under the NVMe path (per node)"}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What ``plan_placement`` returns; ``to_dict()`` is ``zeroio estimate --plan --json``."""

    placement: str
    config: dict[str, Any]
    """A config block to paste: ``zero_optimization`` (DeepSpeed schema) and the dtype."""
    estimate: MemoryEstimate
    tiers: tuple[TierFit, ...]
    traffic: dict[str, int]
    """Bytes per step: "gpu->cpu" and "cpu->gpu" per GPU, "nvme->cpu" and "cpu->nvme" per node."""
    resident_moment_bytes: int
    """Per node, with the optimizer on NVMe: Adam moments the host budget keeps resident."""
    times: dict[str, float]
    """Seconds per step of each term: cpu_adam_s, pcie_s, disk_s."""
    reasons: tuple[str, ...]
    """One line per placement before it in the rule's list that was not taken: what it
    overflows (and why the ratio is not lower)."""
    machine: Machine
    params_from_master: bool = False
    """Planned with ``tiering.params_from_master`` (no 16-bit parameter shard)."""
    notes: tuple[str, ...] = ()
    """What the plan assumes beyond its config block."""
    layout: layout.Placement | None = None
    """Where each buffer lives on one rank (zeroio/placement.py; the engine's ``stats()``)."""
    compared: tuple[str, ...] = ()
    """Every other placement that fits, with its predicted step time: the choice is the
    shortest (module doc, "The rule")."""

    @property
    def _serial_step(self) -> bool:
        """The optimizer is on NVMe: its step follows the parameter traffic (module doc)."""
        off = self.config.get("zero_optimization", {}).get("offload_optimizer") or {}
        return off.get("device") == "nvme"

    @property
    def step_s(self) -> float:
        if self._serial_step:
            return self.times["pcie_s"] + max(self.times["cpu_adam_s"], self.times["disk_s"])
        return max(self.times.values())

    @property
    def bound(self) -> str:
        if self.step_s == 0:
            return "gpu compute (not modelled)"
        if self._serial_step:
            step = max(("cpu_adam_s", "disk_s"), key=self.times.get)
            return f"pcie_s + {step}" if self.times["pcie_s"] else step
        return max(self.times, key=self.times.get)

    @property
    def ratio(self) -> float:
        return self.estimate.ratio

    def to_dict(self) -> dict[str, Any]:
        return {"placement": self.placement, "config": self.config,
                "offload_optimizer_ratio": self.ratio,
                "tiers": {t.tier: t.to_dict() for t in self.tiers},
                "bytes_per_step": dict(self.traffic),
                "resident_moment_bytes": self.resident_moment_bytes,
                "times": dict(self.times), "step_s": self.step_s, "bound": self.bound,
                "reasons": list(self.reasons), "compared": list(self.compared),
                "margin": MARGIN,
                "params_from_master": self.params_from_master, "notes": list(self.notes),
                "machine": self.machine.to_dict(), "estimate": self.estimate.to_dict(),
                "buffer_placement": self.layout.to_dict() if self.layout else None}


@dataclass(frozen=True, kw_only=True)
class _Model:
    """What the estimate needs beside the placement."""

    num_params: int
    dtype: str
    nodes: int
    largest_group: int | None
    activation_bytes: int
    bf16_state: bool = False
    """Both ``bf16`` optimizer-state switches on (6 bytes of optimizer state per element)."""
    params_from_master: bool = False
    """Plan the NVMe placements with ``tiering.params_from_master`` (as its "auto" does)."""
    accumulation: int = 1
    """``gradient_accumulation_steps``: micro-steps per optimizer step."""
    buffers: tuple = ()
    """(key, value) of the run's ``zero_optimization`` buffer sizes (``plan_placement``)."""


def config_knows_params_from_master() -> bool:
    """Whether this build's config loader takes ``zero_optimization.tiering.params_from_master``
    (the guard for writing it into a planned config)."""
    from zeroio.config.zero import TieringConfig

    return "params_from_master" in {f.name for f in fields(TieringConfig)}


def zero_block(p: Placement, *, ratio: float, cpu_budget: int | None,
               nvme_budget: int | None = None, params_from_master: bool = False
               ) -> dict[str, Any]:
    """The ``zero_optimization`` block of placement ``p`` (DeepSpeed schema, zeroio's
    ``tiering`` keys)."""
    nvme = "nvme" in (p.optimizer, p.param)
    block: dict[str, Any] = {"stage": p.stage, "sub_group_size":
                             NVME_SUB_GROUP_SIZE if nvme else DEFAULT_SUB_GROUP_SIZE}
    if p.optimizer != "none":
        oo: dict[str, Any] = {"device": p.optimizer, "ratio": ratio}
        if p.optimizer == "nvme":
            oo.update(nvme_path=NVME_PATH, pipeline_read=True, pipeline_write=True)
        block["offload_optimizer"] = oo
    if p.param != "none":
        block["offload_param"] = {"device": p.param}
        if p.param == "nvme":
            block["offload_param"]["nvme_path"] = NVME_PATH
    if nvme and cpu_budget is not None:
        block["tiering"] = {"cpu_budget_bytes": cpu_budget}
        if nvme_budget is not None:
            block["tiering"]["nvme_budget_bytes"] = nvme_budget
        if params_from_master and config_knows_params_from_master():
            block["tiering"]["params_from_master"] = True
    return block


def _pfm(p: Placement, model: _Model) -> bool | None:
    """Where "auto" turns it on (``params_from_master_enabled``): stage 3, optimizer on NVMe;
    None where the placement decides from the host's memory (optimizer and parameters on the
    CPU: [Note: the host floor] in zeroio/placement.py), else off."""
    if p.optimizer == "cpu" and p.param == "cpu" and model.params_from_master:
        return None
    return model.params_from_master and params_from_master_auto(p.stage, p.optimizer)


def _config(p: Placement, model: _Model, ratio: float, cpu_budget: int | None,
            nvme_budget: int | None = None, from_master: bool = False) -> dict:
    """The planned config; ``from_master``: the placement dropped the 16-bit shards of a CPU
    placement (written as ``tiering.params_from_master``, so the engine does the same)."""
    cfg: dict[str, Any] = {"zero_optimization": zero_block(
        p, ratio=ratio, cpu_budget=cpu_budget, nvme_budget=nvme_budget,
        params_from_master=bool(_pfm(p, model)))}
    if from_master and _pfm(p, model) is None and config_knows_params_from_master():
        cfg["zero_optimization"].setdefault("tiering", {})["params_from_master"] = True
    if model.accumulation > 1:  # the estimate's host gradients and staging depend on it
        cfg["gradient_accumulation_steps"] = model.accumulation
    if model.dtype in ("bf16", "fp16"):
        cfg[model.dtype] = {"enabled": True}
    if model.bf16_state:  # docs/engine.md, "bf16 optimizer state"
        cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    return cfg


def _layout(p: Placement, model: _Model, machine: Machine, ratio: float,
            cpu_budget: int | None) -> layout.Placement:
    """Candidate ``p``'s buffers ([Note: one placement] in zeroio/placement.py)."""
    # the device room the accumulation buffer is placed by: the GPU memory the plan may use,
    # as the engine reads its free memory (config/accum_place.py)
    mem = layout.MachineMemory(gpu_bytes=machine.gpu_bytes, host_bytes=machine.host_bytes,
                               nvme_free_bytes=machine.disk_bytes, gpus_per_node=machine.gpus,
                               gpu_free_bytes=int(machine.gpu_bytes * (1 - MARGIN)))
    disk = _disk_per_rank(machine) if p.optimizer == "nvme" else None
    raw = _config(p, model, ratio, cpu_budget)
    raw["zero_optimization"] = {**dict(model.buffers), **raw["zero_optimization"]}
    pfm = _pfm(p, model)
    return layout.decide_placement(
        num_params=model.num_params, config=load_config(raw),
        world_size=machine.gpus * model.nodes, machine=mem, largest_group=model.largest_group,
        dtype=model.dtype, activation_bytes=model.activation_bytes, nvme_budget_bytes=disk,
        **({} if pfm is None else {"params_from_master": pfm}))


def _disk_per_rank(machine: Machine) -> int:
    return max(0, machine.disk_bytes - DISK_RESERVE) // machine.gpus


def _split(est: MemoryEstimate) -> bool:
    """The estimate homes the resident moments in host memory (the disk holds the tail)."""
    return any(i.name.startswith("optimizer moments resident") for i in est.items)


def _fits(est: MemoryEstimate, machine: Machine) -> tuple[TierFit, ...]:
    return (
        TierFit(tier="gpu", need_bytes=est.gpu_bytes_per_gpu,
                usable_bytes=int(machine.gpu_bytes * (1 - MARGIN)),
                capacity_bytes=machine.gpu_bytes),
        TierFit(tier="cpu", need_bytes=est.cpu_bytes_per_node,
                usable_bytes=int(machine.host_bytes * (1 - MARGIN)),
                capacity_bytes=machine.host_bytes),
        TierFit(tier="nvme", need_bytes=est.nvme_bytes_per_node,
                usable_bytes=max(0, machine.disk_bytes - DISK_RESERVE),
                capacity_bytes=machine.disk_bytes),
    )


def _overflow(p: Placement, tiers: tuple[TierFit, ...]) -> str:
    over = [f"{TIER_WORDS[t.tier]} overflows by {t.over_bytes:,} bytes "
            f"({t.need_bytes / 1e9:.2f} GB needed, {t.usable_bytes / 1e9:.2f} GB usable of "
            f"{t.capacity_bytes / 1e9:.2f} GB)" for t in tiers if t.over_bytes]
    return f"{p.name}: " + "; ".join(over)


def _largest_share(p: Placement, model: _Model, machine: Machine,
                   cpu_budget: int | None = None, *, step_down: bool = True) -> int:
    """The largest whole percent k in 0..99 of the optimizer state kept on the GPU (ratio
    1 - k/100) that fits. GPU bytes grow with k, so bisect on the GPU; then (``step_down``)
    step down past any k the host does not take (its gradient dtype can change for a small
    host shard). The NVMe placements keep the largest k the GPU takes: host and disk bytes
    only shrink as k grows."""
    def ok_gpu(k: int) -> bool:
        est = _layout(p, model, machine, 1 - k / 100, cpu_budget).estimate
        return _fits(est, machine)[0].over_bytes == 0

    if not ok_gpu(0):
        return -1
    lo, hi = 0, 99
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok_gpu(mid) else (lo, mid - 1)
    while step_down and lo > 0 and any(t.over_bytes for t in _fits(
            _layout(p, model, machine, 1 - lo / 100, cpu_budget).estimate, machine)):
        lo -= 1
    return lo


def _try(p: Placement, model: _Model, machine: Machine, budget: int | None,
         reasons: list[str]):
    """(estimate, tiers, ratio) of placement ``p`` at its GPU share; where a tier overflows,
    the reason is appended: module doc, "The rule"."""
    nvme_share = p.optimizer == "nvme" and not model.bf16_state
    if nvme_share:  # the largest GPU share first: host and disk bytes only shrink with it
        k = _largest_share(p, model, machine, budget, step_down=False)
        ratio = round(1 - max(k, 0) / 100, 2)
    else:
        ratio = 1.0
    est = _layout(p, model, machine, ratio, budget).estimate
    tiers = _fits(est, machine)
    if any(t.over_bytes for t in tiers):
        at = f" at offload_optimizer.ratio {ratio:g}" if ratio < 1 else ""
        reasons.append(_overflow(p, tiers).replace(": ", f"{at}: ", 1))
        return est, tiers, ratio
    if p.optimizer == "cpu" and not model.bf16_state:  # the switches take no ratio
        k = _largest_share(p, model, machine)
        if k > 0:
            ratio = round(1 - k / 100, 2)
            est = _layout(p, model, machine, ratio, None).estimate
            tiers = _fits(est, machine)
        else:
            reasons.append(f"{p.name}: no GPU share of the optimizer state fits "
                           "(offload_optimizer.ratio below 1 needs at least 1% on the GPU)")
    return est, tiers, ratio


def _notes(est: MemoryEstimate) -> tuple[str, ...]:
    out = []
    if est.params_from_master:
        out.append("planned with zero_optimization.tiering.params_from_master (no 16-bit "
                   "parameter shard; the gather casts the fp32 master)"
                   + ("" if config_knows_params_from_master() else
                      ": this build's config does not take the key yet, so the block leaves "
                      "it out and the engine would keep the 16-bit shards"))
    if _split(est):
        out.append("the disk cannot hold every Adam moment: the resident head lives only in "
                   "host memory and tiering.nvme_budget_bytes tells the engine so")
    return tuple(out)


def _traffic(p: Placement, est: MemoryEstimate, machine: Machine, gas: int = 1):
    """(bytes per step each way, resident moment bytes per node): module doc, "The step
    time"; ``gas`` micro-steps per step."""
    b = DTYPE_BYTES[est.dtype]
    shard = math.ceil(est.num_params / est.world_size)
    host = est.placement()["offloaded_elements_per_gpu"]
    dev = shard - host if p.optimizer != "none" else 0
    on_dev = any(i.name == ACCUM_ROW for i in est.items)  # summed on the GPU: lands once, and
    g = host and host_grad_bytes(est.dtype, p.optimizer, 1 if on_dev else gas, host, stage=p.stage)
    pfm = est.params_from_master  # the host gradient is as with one micro step; stage 1 too:
    lands = gas if p.stage in (2, 3) and not on_dev else 1  # it reduces at the boundary only
    down = g * host * lands + (b * dev if p.param != "none" and not pfm else 0)
    if pfm:  # forward and backward copy the host-side fp32 masters in, then cast
        up = 2 * 4 * host * gas
    else:
        up = 2 * b * shard * gas if p.param != "none" else b * host
    read = write = resident = 0
    if p.optimizer == "nvme":
        moments = MOMENT_BYTES * DTYPE_BYTES[est.state_dtype] // 4 * host
        # the head the budget keeps in host memory (homed there, or cached beside its disk
        # home: estimate's _split_moments) is not streamed
        resident = sum(i.bytes_per_gpu for i in est.items
                       if i.name.startswith(("optimizer moments resident",
                                             "optimizer moments cached")))
        read = write = moments - resident
    if p.param == "nvme" and not pfm:
        read += 2 * b * shard
        write += b * shard
    gpus = machine.gpus
    return ({"gpu->cpu": down, "cpu->gpu": up, "nvme->cpu": read * gpus,
             "cpu->nvme": write * gpus}, resident * gpus)


def disk_seconds(read: int, write: int, machine: Machine) -> float:
    """Seconds the disk takes for ``read`` and ``write`` bytes of one step (module doc, "The
    step time"): one after the other at their own rates; with ``disk_mixed_bps`` measured,
    at least both together at the mixed rate, and never faster than either alone."""
    alone = read / machine.disk_read_bps + write / machine.disk_write_bps
    if machine.disk_mixed_bps is None:
        return alone
    return max((read + write) / machine.disk_mixed_bps, read / machine.disk_read_bps,
               write / machine.disk_write_bps)


def _times(traffic: dict[str, int], host_elems_per_node: int, machine: Machine):
    return {"cpu_adam_s": host_elems_per_node / machine.cpu_adam_elems_per_s,
            "pcie_s": max(traffic["gpu->cpu"], traffic["cpu->gpu"]) / machine.pcie_bps,
            "disk_s": disk_seconds(traffic["nvme->cpu"], traffic["cpu->nvme"], machine)}


def plan_placement(num_params: int | float | str, machine: Machine, *, dtype: str = "bf16",
                   micro_batch: int, seq: int, layers: int | None = None,
                   hidden: int | None = None, vocab: int | None = None,
                   intermediate: int | None = None, largest_group: int | None = None,
                   nodes: int = 1, bf16_optimizer_states: bool = False,
                   params_from_master: bool | None = None, accumulation: int = 1,
                   buffers: dict | None = None) -> Plan:
    """The first placement of the rule (module doc) that fits ``machine`` for a model of
    ``num_params`` parameters trained on ``nodes`` such nodes.

    Activations are counted (``estimate.llama_activation_bytes``, a Llama in bf16 without
    activation checkpointing, ``micro_batch`` x ``seq`` tokens) when ``layers``, ``hidden``
    and ``vocab`` are given; ``intermediate`` defaults to 4 x hidden. ``largest_group``
    (stage 3's largest flat group) defaults to one such decoder layer when ``hidden`` is
    given, else the estimate's stand-in. ``bf16_optimizer_states``: plan with both bf16
    optimizer-state switches on (bf16 masters, gradient shards and moments; needs ``dtype``
    bf16; no partial offload ratio). ``params_from_master``: plan the NVMe placements with
    ``tiering.params_from_master`` on, as its "auto" does (None: where this build's config
    knows the key). ``accumulation``: micro-steps per optimizer step (host gradients, staging
    and traffic follow it). ``buffers``: the run's ``zero_optimization`` buffer keys
    (``reduce_bucket_size``, ``overlap_comm``, ...; DeepSpeed's defaults where absent), which
    every candidate is counted with. Raises ``CapacityError`` when nothing fits.
    """
    if not isinstance(machine, Machine):
        raise ConfigError(f"machine = {machine!r}: expected a zeroio.plan.Machine", key="machine")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype = {dtype!r}: expected bf16, fp16 or fp32", key="dtype")
    act = planned_activation_bytes(layers=layers, hidden=hidden, vocab=vocab, intermediate=intermediate,
                       seq=seq, micro_batch=micro_batch)
    if largest_group is None and hidden is not None:
        largest_group = llama_num_params(hidden=hidden, intermediate=intermediate or 4 * hidden,
                                         layers=1, vocab=0, heads=1)[1]
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise ConfigError(f"accumulation = {accumulation!r}: expected a positive integer "
                          "(gradient_accumulation_steps)", key="gradient_accumulation_steps")
    if bf16_optimizer_states and dtype != "bf16":
        raise ConfigError(f"bf16_optimizer_states needs dtype bf16 (got {dtype})",
                          key="bf16_optimizer_states")
    model = _Model(num_params=parse_count(num_params), dtype=dtype, nodes=nodes,
                   largest_group=largest_group, activation_bytes=act,
                   bf16_state=bf16_optimizer_states, accumulation=accumulation,
                   buffers=tuple(sorted((buffers or {}).items())),
                   params_from_master=config_knows_params_from_master()
                   if params_from_master is None else bool(params_from_master))
    cpu_budget = int(machine.host_bytes * (1 - MARGIN)) // machine.gpus
    reasons: list[str] = []
    fitting: list[tuple[Plan, list[str]]] = []
    for p in PLACEMENTS:
        budget = cpu_budget if "nvme" in (p.optimizer, p.param) else None
        before = list(reasons)
        est, tiers, ratio = _try(p, model, machine, budget, reasons)
        if any(t.over_bytes for t in tiers):
            continue
        traffic, resident = _traffic(p, est, machine, model.accumulation)
        host_elems = est.placement()["offloaded_elements_per_gpu"] * machine.gpus
        nvme_budget = _disk_per_rank(machine) if _split(est) else None
        fitting.append((Plan(
            placement=p.name, estimate=est, tiers=tiers, traffic=traffic,
            config=_config(p, model, ratio, budget, nvme_budget, est.params_from_master),
            resident_moment_bytes=resident, times=_times(traffic, host_elems, machine),
            reasons=(), machine=machine, params_from_master=est.params_from_master,
            notes=_notes(est), layout=_layout(p, model, machine, ratio, budget)), before))
    if not fitting:
        raise CapacityError(f"no placement fits this machine; the most offloaded one, "
                            f"{reasons[-1]}: add memory or disk, more GPUs or nodes, or train "
                            "a smaller model")
    return _fastest(fitting, reasons)


def _fastest(fitting: list, reasons: list[str]) -> Plan:
    """Of the placements that fit (each with the reasons recorded before it was tried), the
    shortest predicted step, the earliest of those within ``TIE`` of it (module doc, "The
    rule"), with the others' times beside it."""
    shortest = min(plan.step_s for plan, _ in fitting)
    tie = max(TIE[0] * shortest, TIE[1])
    best, before = next(pb for pb in fitting if pb[0].step_s <= shortest + tie)
    after = reasons[len(before):]  # a ratio note of the chosen placement itself
    own = [r for r in after if r.startswith(best.placement + ":")]
    def why(c: Plan) -> str:
        if c.step_s > shortest + tie:
            return f"slower than the chosen {best.step_s:.3f} s"
        return (f"a tie with the chosen {best.step_s:.3f} s (within {TIE[0]:.0%} or "
                f"{TIE[1] * 1e3:.0f} ms), which comes first in the list")

    compared = tuple(f"{c.placement}: fits, predicted {c.step_s:.3f} s per step (bound by "
                     f"{c.bound}); {why(c)}" for c, _ in fitting if c is not best)
    return dataclasses.replace(best, reasons=tuple(before + own), compared=compared)


__all__ = ["Machine", "Plan", "TierFit", "Placement", "PLACEMENTS", "MARGIN", "DISK_RESERVE",
           "NVME_SUB_GROUP_SIZE", "plan_placement", "zero_block"]
