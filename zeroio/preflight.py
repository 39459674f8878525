"""Host-memory preflight of ``initialize``: refuse a placement the machine's memory cannot hold.

[Note: host-memory preflight] Offloaded training state lives in host memory (fp32
masters and Adam moments with ``offload_optimizer`` cpu, 12 bytes per parameter; the
host gradient shard where the gradient is not kept on the device, fp32 when
``gradient_accumulation_steps`` > 1 keeps adding into it on the host; 16-bit parameter
shards where the placement keeps them; swap buffers, staging and windows: [Note: the host
floor] in placement.py). When it is more than the machine has, the
kernel kills the process in its first step, after minutes of loading, with nothing said.
The device is known here, so its free memory (``DEVICE_ROOM`` of tiering/device_accum.py)
is handed to the estimate, which plans the accumulation on the device tier as the
partitioner will place it (and with it a 16-bit host gradient where the one-pass CPU Adam
steps it: [Note: accumulation on the device tier]). Before
the partitioner pins or allocates anything, ``check_host_memory`` counts what this
placement needs in host memory with the same model as ``zeroio estimate`` and the
planner (``zeroio.estimate.estimate_memory``: its "cpu" tier, and on a CPU device its
device tier too, less the parameters the module already holds), times the ranks on this
host, and compares it with what the host has: ``psutil.virtual_memory().available``, or
the cgroup's limit less its working set where that is lower (v2 ``memory.max``, v1
``memory.limit_in_bytes``). Too much is a ``CapacityError`` with both numbers, the largest
items and the config keys that change them, raised on every rank (the verdict is
all-reduced, so no rank waits in a collective for one that raised).

The estimate is the planner's, not a measurement: it leaves out the process's own
libraries, the dataloader and allocator slack, so a placement that passes can still be
tight; one that fails is short by at least the figure shown. A virtual machine whose
memory is plugged in as it is used (a virtio-mem or balloon device, ACPI memory hotplug:
``memory_may_grow``) shows only what is plugged in so far, so there a shortfall is a
``CapacityWarning``, not an error. ``ZEROIO_HOST_MEMORY``
(config/overrides.py) replaces the measured bytes (a test's small machine, a node shared
with other jobs) or, set to ``off``, skips the check.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from zeroio.config import Config, overrides
from zeroio.config.launch_env import launch_env
from zeroio.errors import CapacityError, CapacityWarning
from zeroio.estimate import MemoryEstimate, MemoryItem, estimate_memory
from zeroio.partition import collectives as comm
from zeroio.partition.stage3.registry import true_shape
from zeroio.tiering import device_accum

GB = 10**9
CGROUP = Path("/sys/fs/cgroup")
# items that cost no new host memory on a CPU device: the module's parameters already exist
# there (its 16-bit parameters, or stage 3's shards of them wherever offload_param puts
# them, and so the shards params_from_master does not keep); the live-gather bound is not
# state the engine allocates; the step assist runs on CUDA devices only
_HELD_OR_TRANSIENT = ("parameters", "16-bit parameter shard not held",
                      "live gathered parameters (upper bound)", "step assist slots")


@dataclass(frozen=True, kw_only=True)
class HostMemory:
    """What this host can give its ranks."""

    available: int
    """Bytes: the smallest of the measurements (or ``ZEROIO_HOST_MEMORY``)."""
    source: str
    """Where the figure comes from, for the error message."""
    grows: str | None = None
    """Why the figure may be low (a virtual machine whose memory is plugged in as it is
    used); a shortfall is then a warning, not an error."""


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    return int(text) if text.isdigit() else None


def _inactive_file(stat: Path, key: str) -> int:
    try:
        lines = stat.read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError):
        return 0
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def cgroup_free(root: Path = CGROUP) -> tuple[int, str] | None:
    """(bytes the cgroup still lets this process's group use, its description), or None when
    no memory limit is set: the limit less the working set (usage less reclaimable page
    cache), cgroup v2 first, then v1."""
    for limit_f, usage_f, stat_key, name in (
            ("memory.max", "memory.current", "inactive_file", "cgroup v2 memory.max"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "total_inactive_file",
             "cgroup v1 memory.limit_in_bytes")):
        limit = _read_int(root / limit_f)
        if limit is None or limit >= 1 << 60:  # "max" (v2) or the v1 "unlimited" sentinel
            continue
        usage = _read_int(root / usage_f) or 0
        stat = root / (Path(limit_f).parent / ("memory.stat"))
        working = max(0, usage - _inactive_file(stat, stat_key))
        return max(0, limit - working), f"{name} {limit / GB:.1f} GB, {working / GB:.1f} GB in use"
    return None


VIRTIO_MEM, VIRTIO_BALLOON = "0x0018", "0x0005"  # virtio device ids


def memory_may_grow(sys_root: Path = Path("/sys")) -> str | None:
    """Why this host's available memory may grow on demand (None: it will not): a virtio-mem
    or balloon device, or an ACPI memory-hotplug slot. Such virtual machines start with a
    fraction of their memory plugged in (MemTotal 31 GiB of 256 on a 2-GPU H200 VM)."""
    for dev in sorted((sys_root / "bus/virtio/devices").glob("*")):
        kind = _read_text(dev / "device")
        if kind in (VIRTIO_MEM, VIRTIO_BALLOON):
            name = "virtio-mem" if kind == VIRTIO_MEM else "virtio-balloon"
            return f"{name} device {dev.name}: memory is added as it is used"
    if any((sys_root / "bus/acpi/devices").glob("PNP0C80:*")):
        return "ACPI memory-hotplug slots: memory can be added"
    return None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def measure_host_memory() -> HostMemory | None:
    """This host's memory for training state (None: ``ZEROIO_HOST_MEMORY=off``)."""
    forced = overrides.host_memory()
    if forced == "off":
        return None
    if forced is not None:
        return HostMemory(available=int(forced), source=f"ZEROIO_HOST_MEMORY={forced}")
    import psutil

    avail = int(psutil.virtual_memory().available)
    source = f"MemAvailable {avail / GB:.1f} GB"
    cg = cgroup_free()
    if cg is not None and cg[0] < avail:
        return HostMemory(available=cg[0], source=f"{cg[1]} (MemAvailable {avail / GB:.1f} GB)")
    return HostMemory(available=avail, source=source, grows=memory_may_grow())


def param_numel(spec) -> int:
    """Elements of the parameters ``spec``'s groups train (each parameter once, its full
    shape where zero.Init partitioned it)."""
    return sum(math.prod(true_shape(p)) for p in _params(spec))


def _params(spec) -> list[torch.nn.Parameter]:
    seen: dict[int, torch.nn.Parameter] = {}
    for group in spec.param_groups:
        for p in group:
            seen.setdefault(id(p), p)
    return list(seen.values())


def largest_group(module: torch.nn.Module) -> int:
    """Elements of the largest unit stage 3 gathers and reduces at once: a child of a
    ModuleList (a transformer layer), or the largest single parameter."""
    best = max((math.prod(true_shape(p)) for p in module.parameters()), default=0)
    for m in module.modules():
        if isinstance(m, torch.nn.ModuleList):
            for child in m:
                best = max(best, sum(math.prod(true_shape(p)) for p in child.parameters()))
    return best


def host_items(cfg: Config, module: torch.nn.Module, spec, device: torch.device, *,
               world_size: int, local_ranks: int,
               estimate: MemoryEstimate | None = None) -> list[MemoryItem]:
    """The estimate's terms that take new host memory on each rank of this host (``estimate``:
    the engine's placement's, zeroio/placement.py; made here when None, and at stage 0)."""
    psi = param_numel(spec)
    if psi == 0:
        return []
    nodes = max(1, world_size // max(1, local_ranks))
    per_node, stage = world_size // nodes, cfg.zero_optimization.stage
    if stage == 0:  # every rank holds every byte: what stage 1 holds on a world of one
        per_node, nodes, stage, estimate = 1, 1, 1, None
    est = estimate if estimate is not None else estimate_memory(
        psi, gpus_per_node=per_node, nodes=nodes, stage=stage, config=cfg,
        largest_group=largest_group(module) or None,
        device_room=device_accum.DEVICE_ROOM(device))  # as the engine plans
    host_tiers = ("cpu",) if device.type != "cpu" else ("cpu", "gpu")
    items = [i for i in est.items if i.tier in host_tiers and i.kind != "activations"
             and not (device.type == "cpu" and i.name.startswith(_HELD_OR_TRANSIENT))]
    budget, on_disk = cfg.zero_optimization.tiering.cpu_budget_bytes, est.per_gpu("nvme")
    if budget is not None and on_disk:
        # the NVMe stores keep what the rest leaves of the budget resident in host memory
        rest = sum(i.bytes_per_gpu for i in items if i.tier == "cpu")
        cached = min(max(0, budget - rest), on_disk)
        if cached:
            items.append(MemoryItem(
                name="NVMe-homed state kept resident (tiering.cpu_budget_bytes)", tier="cpu",
                bytes_per_gpu=cached, kind="zeroio_buffer",
                formula="min(cpu_budget_bytes - the host state above, NVMe-homed bytes)"))
    return items


def _remedies(cfg: Config) -> list[str]:
    zero = cfg.zero_optimization
    out = []
    if zero.offload_optimizer.device == "cpu":
        out.append("zero_optimization.offload_optimizer.device nvme (the moments go to disk)")
    nvme = zero.offload_optimizer.device == "nvme" or (
        zero.stage == 3 and zero.offload_param.device == "nvme")
    if nvme:
        verb = "lower" if zero.tiering.cpu_budget_bytes is not None else "set"
        out.append(f"{verb} zero_optimization.tiering.cpu_budget_bytes (a host cap; NVMe state "
                   "past it streams from the disk)")
    if zero.stage == 3 and zero.offload_param.device == "cpu":
        out.append("zero_optimization.offload_param.device nvme")
        if zero.tiering.params_from_master is not True:
            out.append("zero_optimization.tiering.params_from_master true (no 16-bit shards in "
                       "host memory: each gather casts the master)")
    if cfg.gradient_accumulation_steps > 1:
        out.append(f"gradient_accumulation_steps 1 (at {cfg.gradient_accumulation_steps} the host "
                   "gradient shard is fp32, added into across micro-steps), or GPU room for "
                   "the sum: zero_optimization.tiering.gpu_budget_bytes (docs/tiering.md)")
    elif zero.offload_optimizer.device == "cpu" and zero.tiering.gpu_budget_bytes == 0:
        out.append("zero_optimization.tiering.gpu_budget_bytes unset or above the gradient's "
                   "bytes (it then stays on the GPU: docs/tiering.md, \"The host floor\")")
    if not cfg.bf16.bf16_optimizer_states and cfg.compute_dtype == "bf16":
        out.append("bf16.bf16_optimizer_states (2-byte moments)")
    out.append("more ranks or nodes (ZeRO divides this state among them)")
    return out


def shortfall_message(items: list[MemoryItem], local_ranks: int, have: HostMemory,
                      cfg: Config) -> str | None:
    """The CapacityError's text when ``items`` (per rank) x ``local_ranks`` exceed ``have``."""
    per_rank = sum(i.bytes_per_gpu for i in items)
    need = per_rank * local_ranks
    if need <= have.available:
        return None
    top = sorted(items, key=lambda i: -i.bytes_per_gpu)[:4]
    parts = ", ".join(f"{i.name} {i.bytes_per_gpu / GB:.2f} GB" for i in top)
    return (f"host memory: this placement needs {need} bytes ({need / GB:.2f} GB) of host memory "
            f"on this host ({local_ranks} rank(s) x {per_rank / GB:.2f} GB: {parts}), and the host "
            f"has {have.available} bytes ({have.available / GB:.2f} GB) available ({have.source}); "
            f"the kernel would kill the run in its first step. Lower it with: "
            f"{'; '.join(_remedies(cfg))}. ZEROIO_HOST_MEMORY=off skips this check.")


def check_host_memory(cfg: Config, module: torch.nn.Module, spec, device: torch.device,
                      estimate: MemoryEstimate | None = None) -> None:
    """[Note: host-memory preflight]; collective. Call before any state is allocated.
    ``estimate``: the engine's placement's (zeroio/placement.py), checked as it is."""
    world = comm.world_size()
    local = launch_env().local_world_size or world
    have = measure_host_memory()
    message = None
    if have is not None:
        items = host_items(cfg, module, spec, device, world_size=world, local_ranks=local,
                           estimate=estimate)
        message = shortfall_message(items, local, have, cfg)
    if message is not None and have.grows:  # the figure may be low: say so, do not refuse
        warnings.warn(f"{message} This host's memory may grow as it is used ({have.grows}), "
                      "so this was not refused; set ZEROIO_HOST_MEMORY to its full size to make "
                      "it a check", CapacityWarning, stacklevel=3)
        message = None
    flag = torch.tensor([0.0 if message is None else 1.0],
                        device=device if device.type == "cuda" else "cpu")
    if world > 1:
        comm.all_reduce_scalar(flag, op="max")
    if message is not None:
        raise CapacityError(message)
    if flag.item():
        raise CapacityError("host memory: another rank's preflight found this placement larger "
                            "than its host's memory (its error gives the numbers and the keys)")
