"""The NVMe optimizer's step alone: SwappedAdam over a made-up shard, per I/O setting.

    python benchmarks/bench_nvme_step.py --path /mnt/nvme/x --elements 4e9 --budget 4e9 \
        --threads 1,2,4 --read-ahead 3,8 --steps 2 --disk bench-io.json --out results/

No model and no GPU: one fp32 master and 16-bit gradient of ``--elements`` elements in host
memory, the Adam moments in the tiered store homed on NVMe with ``--budget`` host bytes
(the resident head plus the read-ahead window, [Note: resident head, streamed tail] in
zeroio/optim/swap.py). For each (``aio.intra_op_parallelism``, ``tiering.prefetch_depth``)
it times ``--steps`` steps after a first one that lays the files out, and reports the
bytes each way per step, the step seconds, the combined GB/s and, with ``--disk`` (a
``zeroio bench io --json`` result from the same disk), the disk bound (read bytes / best
read + written bytes / best write) and the step's ratio to it. Prints one JSON object and
writes it to ``--out/nvme-step-<host>-<stamp>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import provenance  # noqa: E402  (benchmarks/provenance.py: ZEROIO_COMMIT on the device, else git)
import torch

import zeroio
from zeroio.io.bench import disk_bound_s
from zeroio.optim.swap import SwappedAdam
from zeroio.partition.base import Segment, ShardGroup

HYPER = [{"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}]


def one(args, threads: int, ahead: int, master: torch.Tensor, grad: torch.Tensor) -> dict:
    cfg = zeroio.load_config({
        "train_batch_size": 1, "aio": {"intra_op_parallelism": threads},
        "zero_optimization": {"stage": 3, "sub_group_size": int(1e8), "offload_optimizer": {
            "device": "nvme", "nvme_path": args.path, "pipeline_read": True,
            "pipeline_write": True},
            "tiering": {"cpu_budget_bytes": int(args.budget), "prefetch_depth": ahead}}})
    n = master.numel()
    group = [ShardGroup(group_index=0, master=master, grad=grad, numel=n,
                        segments=(Segment(local_offset=0, global_offset=0, numel=n),))]
    opt = SwappedAdam(group, HYPER, decoupled=True, cfg=cfg)
    times, moved = [], []
    try:
        for s in range(1 + args.steps):
            t = time.perf_counter()
            opt.step()
            opt.store.drain()
            dt = time.perf_counter() - t
            last = opt.store.stats()["last_step"]["bytes_moved"]
            if s:
                times.append(dt)
                moved.append((last.get("nvme->cpu", 0), last.get("cpu->nvme", 0)))
    finally:
        opt.close()
    read = statistics.median(m[0] for m in moved)
    write = statistics.median(m[1] for m in moved)
    s_step = statistics.median(times)
    return {"threads": threads, "read_ahead": ahead, "s_per_step": s_step, "step_times": times,
            "read_bytes": read, "write_bytes": write, "gbps": (read + write) / s_step / 1e9,
            "streamed_bytes_plan": opt.plan.streamed_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", required=True, help="swap folder on the disk under test")
    ap.add_argument("--elements", type=float, default=2e9)
    ap.add_argument("--budget", type=float, default=2e9, help="host bytes for the moments")
    ap.add_argument("--threads", default="1,4")
    ap.add_argument("--read-ahead", default="3")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--disk", help="a `zeroio bench io --json` result of the same disk")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = ap.parse_args()
    n = int(a.elements)
    master = torch.randn(n)
    grad = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    disk = json.load(open(a.disk))["raw"] if a.disk else None
    rows = []
    for threads in (int(x) for x in a.threads.split(",")):
        for ahead in (int(x) for x in a.read_ahead.split(",")):
            row = one(a, threads, ahead, master, grad)
            if disk:
                bound = disk_bound_s(row["read_bytes"], row["write_bytes"], disk)
                row["disk_bound_s"], row["ratio_to_bound"] = bound, row["s_per_step"] / bound
            rows.append(row)
            print(json.dumps(row), flush=True)
    best = min(rows, key=lambda r: r["s_per_step"])
    result = {"machine": platform.node(), "date": datetime.datetime.now().isoformat(
        timespec="seconds"), "commit": provenance.commit(), "elements": n, "budget": a.budget,
        "disk": disk and {k: disk[k] for k in ("read_gbps", "write_gbps", "best", "mixed")},
        "rows": rows, "best": best}
    os.makedirs(a.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    with open(os.path.join(a.out, f"nvme-step-{platform.node()}-{stamp}.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({"best": best}))


if __name__ == "__main__":
    main()
