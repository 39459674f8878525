"""Swap benchmark: a training-like access pattern over NVMe + CPU, per eviction policy.

Optimizer state of ``--subgroups`` sub-groups (fp32 master, exp_avg,
exp_avg_sq; ``--numel`` elements each) lives on NVMe (zarr TensorStore under
``--path``); the CPU tier holds ``--cpu-fraction`` of it. Each step reads every
sub-group in order, runs an Adam update on it, marks it dirty and releases it,
as the optimizer's sub-group pipeline does. With lru/fifo the next sub-group is
prefetched explicitly (DeepSpeed's pipeline_read); the trace policy prefetches
from its recorded trace (``prefetch_depth``). Reports, per policy, over the
steps after the first: stall seconds, bytes moved per tier pair, hits/misses
and step time; prints a table (or one JSON object with --json) and writes
benchmarks/results/swap-<host>-<utc date>.json (machine, date, commit).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import sys
import tempfile
import time

import provenance  # noqa: E402  (benchmarks/provenance.py: machine, date, commit)
import torch
from tqdm import tqdm

from zeroio.tiering import Tier, TieredStore

KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def run_policy(policy: str, args: argparse.Namespace, quiet: bool) -> dict:
    nbytes = args.numel * 4
    total = args.subgroups * len(KINDS) * nbytes
    cpu_budget = max(int(total * args.cpu_fraction), len(KINDS) * 2 * nbytes)
    store = TieredStore(None, nvme_path=args.path, policy=policy, prefetch_depth=args.prefetch_depth,
                        cpu_budget_bytes=cpu_budget, nvme_budget_bytes=total + (64 << 20),
                        gpu_budget_bytes=0)
    try:
        for g in range(args.subgroups):
            for k in KINDS:
                store.register(f"g{g}.{k}", (args.numel,), torch.float32, home=Tier.NVME)
        step_times = []
        bar = tqdm(total=args.steps * args.subgroups, desc=f"swap {policy}", disable=quiet)
        for step in range(args.steps):
            t0 = time.perf_counter()
            for g in range(args.subgroups):
                if policy != "trace" and g + 1 < args.subgroups:
                    store.prefetch([f"g{g + 1}.{k}" for k in KINDS], "cpu")
                p, m, v = (store.acquire(f"g{g}.{k}", "cpu") for k in KINDS)
                grad = torch.full_like(p, 1e-3)  # the update itself is the "compute"
                m.mul_(0.9).add_(grad, alpha=0.1)
                v.mul_(0.999).addcmul_(grad, grad, value=0.001)
                p.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-3)
                for k in KINDS:
                    store.mark_dirty(f"g{g}.{k}")
                    store.release(f"g{g}.{k}")
                bar.update(1)
            store.step_boundary()
            step_times.append(time.perf_counter() - t0)
            if step == 0:
                first = store.stats()
        bar.close()
        end = store.stats()
    finally:
        store.close()
    moved = {k: v - first["bytes_moved"].get(k, 0) for k, v in end["bytes_moved"].items()}
    later = step_times[1:] or step_times
    return {
        "policy": policy, "cpu_budget_bytes": cpu_budget, "state_bytes": total,
        "stall_seconds": end["stall_seconds"] - first["stall_seconds"],
        "bytes_moved": moved,
        "hits": end["hits"] - first["hits"], "misses": end["misses"] - first["misses"],
        "step_seconds": sum(later) / len(later), "first_step_seconds": step_times[0],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=None, help="NVMe directory (default: a temp dir)")
    ap.add_argument("--subgroups", type=int, default=16)
    ap.add_argument("--numel", type=int, default=1 << 20, help="elements per state tensor")
    ap.add_argument("--cpu-fraction", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prefetch-depth", type=int, default=3)
    ap.add_argument("--policies", default="lru,fifo,trace")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    tmp = None
    if args.path is None:
        tmp = tempfile.TemporaryDirectory(prefix="zeroio-bench-swap-")
        args.path = tmp.name
    quiet = args.quiet or args.json
    rows = [run_policy(p.strip(), args, quiet) for p in args.policies.split(",") if p.strip()]
    now = dt.datetime.now(dt.timezone.utc)
    result = {"benchmark": "swap", "date": now.isoformat(timespec="seconds"), "commit": provenance.commit(),
              "machine": provenance.machine(), "path": args.path,
              "params": {k: v for k, v in vars(args).items() if k not in ("out", "json", "quiet")},
              "results": rows}
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, f"swap-{socket.gethostname()}-{now.strftime('%Y%m%dT%H%M%SZ')}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'policy':8} {'stall s':>9} {'step s':>8} {'nvme->cpu MB':>13} {'cpu->nvme MB':>13} "
              f"{'hits':>6} {'misses':>6}")
        for r in rows:
            mb = r["bytes_moved"]
            print(f"{r['policy']:8} {r['stall_seconds']:9.3f} {r['step_seconds']:8.3f} "
                  f"{mb.get('nvme->cpu', 0) / 1e6:13.1f} {mb.get('cpu->nvme', 0) / 1e6:13.1f} "
                  f"{r['hits']:6d} {r['misses']:6d}")
        print(f"wrote {out}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
