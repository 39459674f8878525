"""`zeroio estimate --plan`: the placement a model needs on a machine (zeroio/plan.py).

    zeroio estimate --plan --params 13B --machine machine.json [--json]
    zeroio estimate --plan --model-config config.json --gpus-per-node 8 --gpu-mem 80 \
        --host-mem 1000 --disk-free 3000 --pcie-gbps 25 --disk-read-gbps 6 \
        --disk-write-gbps 3 --cpu-adam-gelems 2 [--micro-batch 1 --seq 2048]

The machine comes from a JSON file (keys of ``zeroio.plan.Machine``, bytes and bytes per
second) or from the flags (GB = 1e9 bytes, GB/s, 1e9 elements/s); --gpus-per-node gives
the GPUs with the flags and must agree with the file's ``gpus``.
"""

from __future__ import annotations

import dataclasses
import json
import math

from zeroio.errors import ConfigError

_GB = 1e9
#: flag -> (Machine field, scale to bytes / bytes per second / elements per second)
MACHINE_FLAGS = {
    "gpu_mem": ("gpu_bytes", _GB), "host_mem": ("host_bytes", _GB),
    "disk_free": ("disk_bytes", _GB), "pcie_gbps": ("pcie_bps", _GB),
    "disk_read_gbps": ("disk_read_bps", _GB), "disk_write_gbps": ("disk_write_bps", _GB),
    "cpu_adam_gelems": ("cpu_adam_elems_per_s", _GB),
}
#: optional machine flags (the Machine field's default when absent)
OPTIONAL_FLAGS = {"disk_mixed_gbps": ("disk_mixed_bps", _GB)}
#: estimate flags that choose a placement by hand: --plan chooses it
_NOT_WITH_PLAN = ("stage", "offload_optimizer", "offload_param", "ratio", "config")
#: --plan's counts (micro batch, accumulation, sequence) and their defaults
_PLAN_COUNTS = {"micro_batch": 1, "grad_accum": 1, "seq": 2048}


def add_arguments(p) -> None:
    g = p.add_argument_group("placement planner (--plan)")
    g.add_argument("--plan", action="store_true",
                   help="choose the stage, offload and ratio that fit the machine")
    g.add_argument("--machine", metavar="machine.json",
                   help="the machine as JSON (zeroio.plan.Machine's keys); or the flags below")
    g.add_argument("--gpu-mem", type=float, help="memory of one GPU, GB")
    g.add_argument("--host-mem", type=float, help="host memory training may use, GB per node")
    g.add_argument("--disk-free", type=float, help="free space under the NVMe path, GB")
    g.add_argument("--pcie-gbps", type=float, help="host <-> GPU GB/s per GPU, each way")
    g.add_argument("--disk-read-gbps", type=float, help="NVMe read GB/s per node")
    g.add_argument("--disk-write-gbps", type=float, help="NVMe write GB/s per node")
    g.add_argument("--disk-mixed-gbps", type=float,
                   help="NVMe GB/s read and written together while the disk does both at once "
                   "(optional; without it the step time counts reads then writes)")
    g.add_argument("--cpu-adam-gelems", type=float,
                   help="CPU Adam speed, 1e9 elements per second per node")
    g.add_argument("--micro-batch", type=int, default=None,
                   help="micro batch per GPU for the activations (with --model-config; "
                   "default 1)")
    g.add_argument("--grad-accum", type=int, default=None, metavar="N",
                   help="micro-steps per optimizer step (gradient_accumulation_steps): host "
                   "gradients, their staging and the per-step traffic follow it (default 1)")
    g.add_argument("--params-from-master", choices=("true", "false", "auto"), default="auto",
                   help="plan the NVMe placements with tiering.params_from_master (auto: where "
                   "this build's config takes the key)")
    g.add_argument("--seq", type=int, default=None,
                   help="sequence length for the activations (with --model-config; default 2048)")


def check_args(args) -> None:
    """Plan-only flags without --plan, or hand placement flags with it: a ConfigError."""
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    for name in (*MACHINE_FLAGS, *OPTIONAL_FLAGS):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag(name)} must be a positive number, got {value:g}", key=name)
    for name in _PLAN_COUNTS:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"{flag(name)} must be >= 1, got {value}", key=name)
    if not args.plan:
        used = [n for n in ("machine", *MACHINE_FLAGS, *OPTIONAL_FLAGS, *_PLAN_COUNTS)
                if getattr(args, n) is not None]
        if used:
            raise ConfigError(f"{flag(used[0])} needs --plan", key=used[0])
        return
    for name in (*_NOT_WITH_PLAN, "no_buffers"):
        if getattr(args, name):
            raise ConfigError(f"{flag(name)} does not go with --plan, which chooses the "
                              "placement; drop it (or drop --plan)", key=name)


def machine_from_args(args):
    from zeroio.plan import Machine

    given = {n: getattr(args, n) for n in (*MACHINE_FLAGS, *OPTIONAL_FLAGS)
             if getattr(args, n) is not None}
    if args.machine is not None:
        if given:
            raise ConfigError(f"--machine and --{next(iter(given)).replace('_', '-')}: give the "
                              "machine as a file or as flags, not both", key="machine")
        m = Machine.from_json(args.machine)
        if args.gpus_per_node is not None and args.gpus_per_node != m.gpus:
            raise ConfigError(f"--gpus-per-node {args.gpus_per_node} disagrees with "
                              f"{args.machine}'s gpus = {m.gpus}", key="machine.gpus")
        return m
    missing = [n for n in MACHINE_FLAGS if n not in given]
    if missing:
        raise ConfigError("--plan needs the machine: --machine machine.json, or "
                          + ", ".join("--" + n.replace("_", "-") for n in missing),
                          key="machine")
    return Machine(gpus=1 if args.gpus_per_node is None else args.gpus_per_node,
                   **{f: given[n] * scale for n, (f, scale) in {**MACHINE_FLAGS,
                                                                **OPTIONAL_FLAGS}.items()
                      if n in given})


def _count(args, name: str) -> int:
    value = getattr(args, name, None)
    return _PLAN_COUNTS[name] if value is None else value


def run(args, shape) -> int:
    from zeroio.plan import plan_placement

    machine = machine_from_args(args)
    kw = {}
    if shape is not None:
        kw = dict(layers=shape.layers, hidden=shape.hidden, vocab=shape.vocab,
                  intermediate=shape.intermediate, largest_group=shape.layer_params)
    plan = plan_placement(shape.num_params if shape else args.params, machine,
                          dtype=args.dtype if args.dtype is not None else "bf16",
                          micro_batch=_count(args, "micro_batch"), seq=_count(args, "seq"),
                          nodes=args.nodes, accumulation=_count(args, "grad_accum"),
                          params_from_master={"true": True, "false": False}.get(
                              getattr(args, "params_from_master", "auto")), **kw)
    if args.json:
        out = plan.to_dict()
        if shape is not None:
            out["model"] = dataclasses.asdict(shape)
        print(json.dumps(out))
        return 0
    print(render(plan))
    return 0


def render(plan) -> str:
    """The plan as the human-readable table of ``zeroio estimate --plan``."""
    from zeroio.plan import MARGIN

    lines = render_fit(plan)
    lines += ["", "config (paste into the DeepSpeed JSON; replace /path/to/nvme):",
              json.dumps(plan.config, indent=2),
              f"(GB = 1e9 bytes; {MARGIN:.0%} of GPU and host memory left free)"]
    return "\n".join(lines)


def render_fit(plan) -> list[str]:
    """Lines of the plan without its config block: the placement, every tier's need against
    its budget, bytes per step, the predicted step time, the placements rejected."""
    e, m = plan.estimate, plan.machine
    lines = [f"{e.num_params:,} parameters, {m.gpus} GPU(s) x {e.nodes} node(s), {e.dtype}",
             f"plan: {plan.placement} (offload_optimizer.ratio {plan.ratio:g})", "",
             f"{'tier':36s} {'need GB':>10s} {'usable GB':>10s} {'capacity GB':>12s}"]
    from zeroio.plan import TIER_WORDS

    for t in plan.tiers:
        lines.append(f"{TIER_WORDS[t.tier]:36s} {t.need_bytes / _GB:10.2f} "
                     f"{t.usable_bytes / _GB:10.2f} {t.capacity_bytes / _GB:12.2f}")
    if getattr(plan, "layout", None) is not None:  # [Note: one placement] in zeroio/placement.py
        from zeroio.placement import render_table

        lines += [""] + render_table(plan.layout)
    lines += [f"note: {n}" for n in getattr(plan, "notes", ())]
    if plan.resident_moment_bytes:
        lines.append(f"(the host budget also keeps {plan.resident_moment_bytes / _GB:.2f} GB of "
                     "Adam moments resident per node)")
    tr = plan.traffic
    lines += ["", "bytes per step:",
              f"  GPU -> CPU  {tr['gpu->cpu'] / _GB:10.2f} GB per GPU",
              f"  CPU -> GPU  {tr['cpu->gpu'] / _GB:10.2f} GB per GPU",
              f"  NVMe -> CPU {tr['nvme->cpu'] / _GB:10.2f} GB per node",
              f"  CPU -> NVMe {tr['cpu->nvme'] / _GB:10.2f} GB per node", "",
              f"predicted step time: {plan.step_s:.2f} s, bound by {plan.bound} "
              "(the offload's floor; GPU compute not modelled)"]
    lines += [f"  {k:10s} {v:8.2f} s" for k, v in plan.times.items()]
    if plan.reasons:
        lines += ["", "placements earlier in the list that do not fit:"] + [
            f"  - {r}" for r in plan.reasons]
    compared = getattr(plan, "compared", ())
    if compared:  # the choice is the shortest predicted step (zeroio/plan.py, "The rule")
        lines += ["", "other placements that fit:"] + [f"  - {c}" for c in compared]
    return lines
