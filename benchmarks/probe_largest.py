"""The largest Llama-style model zeroio trains on this machine.

    python benchmarks/probe_largest.py --nvme-dir /tmp/probe-nvme            # the H200 run
    python benchmarks/probe_largest.py --plan-only --ram-gib 125 --gpu-gib 139 --disk-gib 64
    python benchmarks/probe_largest.py --plan-only --gpu-gib 139 --ram-gib 125 --disk-gib 60 \
        --hidden 5120 --intermediate 13824 --heads 40 --start-layers 40 --fraction 0.95 \
        --write-config /tmp/cfg13b.json  # 13B: the plan, and its config for train_llama.py

Width 4096, 32 heads, intermediate 11008, vocab 32000 (untied) unless
--hidden/--intermediate/--heads/--vocab say otherwise; the probe grows depth.
For each depth it picks where the state goes with ``zeroio.estimate_memory``
(stage 3; parameters and optimizer on the CPU, then the optimizer on NVMe,
then both on NVMe; for each, the smallest ``offload_optimizer.ratio`` on a
0.01 grid whose estimate fits, i.e. as much optimizer state on the GPU as it
holds, ratio 1 first when --no-ratio: the first placement that fits the
machine), trains 3 steps through train_llama.py in a
subprocess, and steps up or down by --layer-step until one depth trains and
the next does not. It records the largest that trained and how the next one
failed (GPU or host out of memory, disk full, timeout), and writes
``probe-<host>-<stamp>.json`` / ``.md`` to --out.

[Note: host memory beyond the estimate] train_llama.py builds the model
inside ``zeroio.zero.Init`` (``--zero-init``, what the probe passes): each
module's parameters become bf16 shards in host memory as it is created, so
no fp32 model exists (52 GB at 13B). Those shards (2 bytes per parameter)
are dropped only after the partitioner built every group, while it has
already allocated the 16-bit host shards (offload_param cpu) and the host
side's fp32 masters and gradients (8 bytes per host-side element; the
moments come later, with the optimizer): the host needs the larger of that
and the training state, plus HOST_BASELINE for the process itself. The GPU
needs the estimate (with the largest flat group, one decoder layer, and
``zeroio.estimate.llama_activation_bytes`` for --seq x --micro-batch) plus
GPU_BASELINE (CUDA context, cuBLAS workspace, allocator slack: none of it is
in the estimate).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import launch  # noqa: E402
import report  # noqa: E402

GIB = 1024**3
HIDDEN, HEADS, INTER, VOCAB = 4096, 32, 11008, 32000
PLACEMENTS = (("cpu", "cpu"), ("cpu", "nvme"), ("nvme", "nvme"))
"""(offload_param, offload_optimizer), cheapest first."""
RATIOS = tuple(round(0.01 * i, 2) for i in range(1, 101))
"""offload_optimizer.ratio candidates, smallest (most optimizer state on the GPU) first."""


def llama_params(layers: int, hidden: int = HIDDEN, inter: int = INTER, vocab: int = VOCAB) -> int:
    return layers * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) + 2 * vocab * hidden \
        + hidden


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capacity:
    """What the machine offers, in bytes (after the safety fraction)."""

    gpu: int
    host: int
    disk: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    """The Llama being probed, for the estimate's group size and activations."""

    hidden: int = HIDDEN
    intermediate: int = INTER
    vocab: int = VOCAB
    layers: int = 32
    seq: int = 1024
    micro_batch: int = 1

    @property
    def largest_group(self) -> int:
        """Stage 3's largest flat group: a decoder layer, or the embedding / head."""
        h = self.hidden
        return max(4 * h * h + 3 * h * self.intermediate + 2 * h, self.vocab * h)

    @property
    def activation_bytes(self) -> int:
        from zeroio.estimate import llama_activation_bytes

        return llama_activation_bytes(hidden=self.hidden, intermediate=self.intermediate,
                                      layers=self.layers, vocab=self.vocab, seq=self.seq,
                                      micro_batch=self.micro_batch)


HOST_BASELINE = 3_000_000_000
"""Host bytes of the process itself (torch, CUDA libraries, Python), not in the estimate."""
GPU_BASELINE = 3_000_000_000
"""GPU bytes outside the estimate: CUDA context, cuBLAS workspace, allocator slack."""


def needs(num_params: int, placement: tuple[str, str], ratio: float = 1.0,
          shape: Shape | None = None) -> dict[str, int]:
    """Bytes per tier for stage 3 with this placement and ``offload_optimizer.ratio``: the
    estimate, the zero.Init build and the baselines ([Note: host memory beyond the estimate]).
    ``shape`` None: no activations, DeepSpeed's reduce bucket for the group size."""
    from zeroio.estimate import estimate_memory, host_grad_bytes

    est = estimate_memory(num_params, stage=3, offload_param=placement[0],
                          offload_optimizer=placement[1], dtype="bf16", ratio=ratio,
                          largest_group=shape.largest_group if shape else None,
                          activation_bytes=shape.activation_bytes if shape else 0)
    host_side = num_params - est.device_elements
    grad = host_grad_bytes("bf16", placement[1], 1, host_side)  # 2 under the one-pass kernel
    build = (INIT_SHARD_BYTES * num_params
             + (BF16 * num_params if placement[0] == "cpu" else 0)
             + (FP32 + grad) * host_side)  # init shards + host shards + masters and gradients
    return {"gpu": est.gpu_bytes_per_gpu + GPU_BASELINE,
            "host": max(est.cpu_bytes_per_node, build) + HOST_BASELINE,
            "disk": est.nvme_bytes_per_node}


INIT_SHARD_BYTES = BF16 = 2
FP32 = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """Where the state goes: offload_param and offload_optimizer devices, and the ratio."""

    param: str
    optimizer: str
    ratio: float = 1.0

    @property
    def placement(self) -> tuple[str, str]:
        return (self.param, self.optimizer)

    def label(self) -> str:
        tail = f" ratio {self.ratio:g}" if self.ratio < 1.0 else ""
        return f"{self.param}/{self.optimizer}{tail}"


def _breakdown(num_params: int, plan: Plan, shape: Shape) -> list[dict]:
    """The estimate's items (GB) for the plan, so the printed plan shows where memory goes."""
    from zeroio.estimate import estimate_memory

    est = estimate_memory(num_params, stage=3, offload_param=plan.param,
                          offload_optimizer=plan.optimizer, dtype="bf16", ratio=plan.ratio,
                          largest_group=shape.largest_group,
                          activation_bytes=shape.activation_bytes)
    return [{"name": i.name, "tier": i.tier, "gb": round(i.bytes_per_gpu / 1e9, 2)}
            for i in est.items]


def _fits(n: dict[str, int], cap: Capacity) -> bool:
    return n["gpu"] <= cap.gpu and n["host"] <= cap.host and n["disk"] <= cap.disk


def placement_for(num_params: int, cap: Capacity,
                  shape: Shape | None = None) -> tuple[str, str] | None:
    """The first placement (PLACEMENTS order) whose estimate fits ``cap`` at ratio 1, or None."""
    for placement in PLACEMENTS:
        if _fits(needs(num_params, placement, shape=shape), cap):
            return placement
    return None


def plan_for(num_params: int, cap: Capacity, ratios=RATIOS,
             shape: Shape | None = None) -> Plan | None:
    """The first placement (PLACEMENTS order) with some ratio that fits, at the smallest such
    ratio (the most optimizer state on the GPU: the least CPU work per step), or None."""
    for placement in PLACEMENTS:
        for ratio in ratios:
            if _fits(needs(num_params, placement, ratio, shape), cap):
                return Plan(param=placement[0], optimizer=placement[1], ratio=ratio)
    return None


def largest_fitting_layers(cap: Capacity, max_layers: int = 400, ratios=(1.0,),
                           params=llama_params, shape_of=lambda layers: None) -> int | None:
    """The deepest model whose estimate fits some placement (the probe's first try)."""
    best = None
    for layers in range(1, max_layers + 1):
        if plan_for(params(layers), cap, ratios, shape_of(layers)) is None:
            break
        best = layers
    return best


def next_layers(history: list[tuple[int, bool]], start: int, step: int,
                min_layers: int = 1) -> int | None:
    """The next depth to try given ``(layers, trained)`` so far; None when bracketed.

    Start at ``start``; after a success go up by ``step``, after a failure go
    down by ``step``, until a success sits ``step`` or fewer layers below a
    failure (or no smaller depth is left to try).
    """
    if not history:
        return start
    ok = [n for n, good in history if good]
    bad = [n for n, good in history if not good]
    best = max(ok) if ok else None
    worst = min((n for n in bad if best is None or n > best), default=None)
    if best is not None and worst is not None and worst - best <= step:
        return None
    if best is None:
        nxt = min(bad) - step
        return nxt if nxt >= min_layers else None
    return best + step


def probe_config(placement: tuple[str, str], nvme_dir: Path, micro_batch: int,
                 ratio: float = 1.0) -> dict:
    def off(device: str, sub: str) -> dict:
        d = {"device": device, "pin_memory": True}
        if device == "nvme":
            d["nvme_path"] = str(nvme_dir / sub)
        return d

    opt = off(placement[1], "optim")
    if ratio < 1.0:
        opt["ratio"] = ratio

    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
            "zero_optimization": {"stage": 3, "overlap_comm": True,
                                  "offload_param": off(placement[0], "param"),
                                  "offload_optimizer": opt}}


def machine_capacity(nvme_dir: Path, fraction: float, gpu_gib=None, ram_gib=None,
                     disk_gib=None) -> Capacity:
    import psutil
    import torch

    gpu = gpu_gib * GIB if gpu_gib else (
        torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0)
    host = ram_gib * GIB if ram_gib else psutil.virtual_memory().total
    probe = nvme_dir if nvme_dir.exists() else nvme_dir.parent
    disk = disk_gib * GIB if disk_gib else shutil.disk_usage(probe).free
    return Capacity(gpu=int(gpu * fraction), host=int(host * fraction), disk=int(disk * fraction))


def try_size(layers: int, plan: Plan, args, run_dir: Path) -> dict:
    cfg_path = run_dir / "configs" / f"layers{layers}.json"
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    nvme = args.nvme_dir / f"layers{layers}"
    shutil.rmtree(nvme, ignore_errors=True)
    cfg_path.write_text(json.dumps(probe_config(plan.placement, nvme, args.micro_batch,
                                                plan.ratio), indent=2))
    bench = Path(__file__).resolve().parent
    argv = [sys.executable, str(bench / "train_llama.py"), "--mode", "zeroio", "--config",
            str(cfg_path), "--hidden", str(args.hidden), "--heads", str(args.heads),
            "--intermediate", str(args.intermediate), "--vocab", str(args.vocab),
            "--layers", str(layers), "--seq", str(args.seq),
            "--micro-batch", str(args.micro_batch), "--steps", "3", "--warmup", "1", "--json",
            "--quiet", "--zero-init", "--mem-log", "--out", str(run_dir / "train_llama")]
    try:
        out = launch.run(argv, env=dict(os.environ), timeout=args.timeout,
                         log_dir=run_dir / "logs", name=f"layers{layers}",
                         cwd=str(bench.parent))
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    res = out.result or {}
    n = _params(args)(layers)
    return {"layers": layers, "params": n, "placement": list(plan.placement),
            "ratio": plan.ratio,
            "estimate": needs(n, plan.placement, plan.ratio, _shape(args)(layers)),
            "status": out.status.value,
            "reason": out.reason, "s_per_step": res.get("s_per_step"),
            "peak_gpu_gib": res.get("peak_gpu_gib"),
            "peak_host_rss_gib": res.get("peak_host_rss_gib"), "wall_seconds": out.wall_seconds}


def _params(args):
    return lambda layers: llama_params(layers, args.hidden, args.intermediate, args.vocab)


def _shape(args):
    return lambda layers: Shape(hidden=args.hidden, intermediate=args.intermediate,
                                vocab=args.vocab, layers=layers, seq=args.seq,
                                micro_batch=args.micro_batch)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme-dir", type=Path, default=Path("/tmp/zeroio-probe-nvme"))
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--layer-step", type=int, default=8, help="layers added or removed per try")
    ap.add_argument("--start-layers", type=int, help="first depth (default: the estimate's)")
    ap.add_argument("--max-tries", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=540, help="seconds per try")
    ap.add_argument("--fraction", type=float, default=0.95,
                    help="of GPU/RAM/disk the estimate may use (baselines are counted apart)")
    ap.add_argument("--gpu-gib", type=float)
    ap.add_argument("--ram-gib", type=float)
    ap.add_argument("--disk-gib", type=float)
    ap.add_argument("--plan-only", action="store_true", help="print the estimate's plan, train nothing")
    ap.add_argument("--write-config", type=Path, metavar="JSON",
                    help="also write the plan's zeroio config (start depth) to this file")
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--intermediate", type=int, default=INTER)
    ap.add_argument("--heads", type=int, default=HEADS)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--no-ratio", action="store_true",
                    help="plan with offload_optimizer.ratio 1 only (all optimizer state offloaded)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    args.nvme_dir.mkdir(parents=True, exist_ok=True)
    cap = machine_capacity(args.nvme_dir, args.fraction, args.gpu_gib, args.ram_gib,
                           args.disk_gib)
    ratios = (1.0,) if args.no_ratio else RATIOS
    params, shape_of = _params(args), _shape(args)
    start = args.start_layers or largest_fitting_layers(cap, ratios=ratios, params=params,
                                                        shape_of=shape_of)
    first = plan_for(params(start), cap, ratios, shape_of(start)) if start else None
    plan = {"capacity_gib": {k: v / GIB for k, v in vars(cap).items()}, "start_layers": start,
            "start_params": params(start) if start else None,
            "shape": {"hidden": args.hidden, "intermediate": args.intermediate,
                      "heads": args.heads, "vocab": args.vocab},
            "placement": list(first.placement) if first else None,
            "ratio": first.ratio if first else None,
            "estimate_bytes": needs(params(start), first.placement, first.ratio, shape_of(start))
            if first else None,
            "estimate_breakdown": _breakdown(params(start), first, shape_of(start))
            if first else None}
    if args.write_config and first is not None:  # the plan's config, for one direct run
        args.write_config.parent.mkdir(parents=True, exist_ok=True)
        args.write_config.write_text(json.dumps(probe_config(
            first.placement, args.nvme_dir / f"layers{start}", args.micro_batch, first.ratio),
            indent=2) + "\n")
    if args.plan_only or start is None or first is None:
        print(json.dumps(plan))
        return plan
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = f"probe-{platform.node()}-{stamp}"
    run_dir = args.out / stem
    history: list[tuple[int, bool]] = []
    tries = []
    layers = start
    while layers is not None and len(tries) < args.max_tries:
        chosen = plan_for(params(layers), cap, ratios, shape_of(layers)) or Plan(param="nvme", optimizer="nvme",
                                                               ratio=min(ratios))
        print(f"trying {layers} layers ({params(layers) / 1e9:.2f} B params), "
              f"param/optimizer on {chosen.label()}", flush=True)
        t = try_size(layers, chosen, args, run_dir)
        print(f"  -> {t['status']} {t['reason']}", flush=True)
        tries.append(t)
        history.append((layers, t["status"] == "ok"))
        layers = next_layers(history, start, args.layer_step)
    ok = [t for t in tries if t["status"] == "ok"]
    best = max(ok, key=lambda t: t["layers"]) if ok else None
    above = [t for t in tries if t["status"] != "ok" and (best is None or t["layers"] > best["layers"])]
    doc = {"kind": "probe_largest", "machine": report.machine(args.nvme_dir),
           "provenance": report.provenance(Path(__file__).resolve().parents[1]), "plan": plan,
           "largest_trained": best, "next_failed": min(above, key=lambda t: t["layers"]) if above else None,
           "tries": tries, "bracketed": layers is None}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    lines = [f"# largest model probe ({doc['provenance']['date']}, commit {doc['provenance']['commit']})",
             "", "| layers | params (B) | param/optimizer | ratio | status | s/step | peak GPU GiB | "
             "peak host GiB |", "|---|---|---|---|---|---|---|---|"]
    for t in tries:
        lines.append(f"| {t['layers']} | {t['params'] / 1e9:.2f} | {'/'.join(t['placement'])} | "
                     f"{t['ratio']:g} | "
                     f"{t['status']}{': ' + t['reason'] if t['reason'] else ''} | "
                     f"{t['s_per_step'] or ''} | {t['peak_gpu_gib'] or ''} | {t['peak_host_rss_gib'] or ''} |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return doc


if __name__ == "__main__":
    main()
