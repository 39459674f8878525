"""I/O subsystem benchmark for a GPU machine: disk through the engine vs the raw device,
and pinned <-> GPU copies through zeroio's copy helpers vs plain ``tensor.to``.

    python benchmarks/bench_io.py --path /tmp/zeroio-bench --size 4G --copy-size 1G

Writes benchmarks/results/io-<host>-<utc date>.json (machine, date, commit, numbers)
and prints a table. Targets: engine >= 90% of the raw device for
sequential read and write, helper copies >= 90% of plain non_blocking copies.
Needs torch, numpy, tqdm and google-crc32c (not zarr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import provenance  # noqa: E402  (benchmarks/provenance.py: machine, date, commit)
import torch  # noqa: E402

from zeroio.io import AlignedBuffer  # noqa: E402
from zeroio.io.bench import bench_io, disk_table, parse_size  # noqa: E402
from zeroio.tiering.streams import copy_to_device, copy_to_host  # noqa: E402

# Engine settings tried on the disk; the best is compared with the raw device.
CANDIDATES = [
    dict(block_size=1 << 20, queue_depth=8, threads=1),  # DeepSpeed's defaults
    dict(block_size=1 << 20, queue_depth=8, threads=4),
    dict(block_size=4 << 20, queue_depth=8, threads=4),
    dict(block_size=4 << 20, queue_depth=16, threads=8),
    dict(block_size=8 << 20, queue_depth=4, threads=8),
]


def disk(path: str, size: int, raw: str, quiet: bool) -> dict:
    trials = []
    for cand in CANDIDATES:
        r = bench_io(path, size, raw="none", progress=not quiet, **cand)
        trials.append({**cand, **r["engine"]})
    best = max(trials, key=lambda t: min(t["write_gbps"], t["read_gbps"]))
    # Re-measure the best beside the raw device in one run, as `zeroio bench io` does.
    final = bench_io(path, size, raw=raw, progress=not quiet, block_size=best["block_size"],
                     queue_depth=best["queue_depth"], threads=best["threads"])
    final["trials"] = trials
    return final


def _time_cuda(fn, iters: int) -> float:
    """Seconds per call, measured with CUDA events around ``iters`` calls after a warm-up."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def _time_host(fn, iters: int) -> float:
    """Seconds per call of ``fn`` that itself waits for its copy (helper handles)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def copies(nbytes: int, iters: int) -> dict:
    host = AlignedBuffer(nbytes)  # pinned, 4096-aligned: what the engine reads into
    host.tensor.fill_(1)
    plain_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    gb = nbytes / 1e9
    out = {"bytes": nbytes, "iters": iters}

    # Baselines: plain tensor.to / copy_ with non_blocking on the current stream.
    out["plain_h2d_to_gbps"] = gb / _time_cuda(lambda: plain_host.to("cuda", non_blocking=True), iters)
    out["plain_h2d_copy_gbps"] = gb / _time_cuda(lambda: dev.copy_(plain_host, non_blocking=True), iters)
    out["plain_d2h_gbps"] = gb / _time_cuda(lambda: plain_host.copy_(dev, non_blocking=True), iters)

    # Helpers: dedicated copy stream + event per copy; host waits on the handle (worst case).
    out["helper_h2d_gbps"] = gb / _time_host(lambda: copy_to_device(host.tensor, dev).synchronize(), iters)
    out["helper_d2h_gbps"] = gb / _time_host(lambda: copy_to_host(dev, host.tensor).synchronize(), iters)

    # Pipelined helpers: issue all copies, wait on the last event only (how prefetch uses them).
    def pipelined():
        handles = [copy_to_device(host.tensor, dev) for _ in range(iters)]
        handles[-1].synchronize()

    out["helper_h2d_pipelined_gbps"] = gb * iters / _time_host(pipelined, 1)
    out["ratio_h2d"] = out["helper_h2d_gbps"] / out["plain_h2d_to_gbps"]
    out["ratio_d2h"] = out["helper_d2h_gbps"] / out["plain_d2h_gbps"]

    # Overlap: a matmul loop on the compute stream while copies run on the copy stream.
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def compute():
        for _ in range(8):
            a @ a

    t_compute = _time_cuda(compute, 3)
    t_copy = _time_cuda(lambda: copy_to_device(host.tensor, dev).wait(), 3)

    def both():
        h = copy_to_device(host.tensor, dev)
        compute()
        h.wait()

    t_both = _time_cuda(both, 3)
    out["overlap"] = {"compute_s": t_compute, "copy_s": t_copy, "together_s": t_both,
                      "hidden_fraction": max(0.0, min(1.0, (t_compute + t_copy - t_both) / min(t_compute, t_copy)))}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", default="/tmp/zeroio-bench", help="directory on the disk to test")
    p.add_argument("--size", default="4G", help="bytes per disk trial (default 4G)")
    p.add_argument("--copy-size", default="1G", help="bytes per pinned<->GPU copy (default 1G)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--raw", choices=["auto", "dd", "fio"], default="auto")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    os.makedirs(args.path, exist_ok=True)
    result = {"benchmark": "io", **provenance.header(args.path),
              "disk": disk(args.path, parse_size(args.size), args.raw, args.quiet)}
    if torch.cuda.is_available():
        result["copies"] = copies(parse_size(args.copy_size), args.iters)
    path = provenance.write_result(args.out, "io", result)
    print("\n".join(disk_table(result["disk"])))
    if "copies" in result:
        c = result["copies"]
        print(f"{'copy':10}{'helper GB/s':>12}{'plain GB/s':>12}{'ratio':>8}")
        print(f"{'h2d':10}{c['helper_h2d_gbps']:12.2f}{c['plain_h2d_to_gbps']:12.2f}{c['ratio_h2d']:8.2f}")
        print(f"{'d2h':10}{c['helper_d2h_gbps']:12.2f}{c['plain_d2h_gbps']:12.2f}{c['ratio_d2h']:8.2f}")
        print(f"overlap: {c['overlap']}")
    print(f"wrote {path}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
