"""CPU Adam and host<->GPU copies over host memory allocated three ways.

    python benchmarks/bench_host_memory.py [--numel 1.364e9] [--chunk 16e6] [--json]

Why: the optimizer step over pinned host masters measured ~0.44 s for 1.36 B
parameters on the H200 machine while the same fused kernel over ordinary
tensors measured 0.27 s. Pinned memory from torch's caching host allocator
(cudaHostAlloc) is mapped in 4 KiB pages; ordinary large allocations can be
backed by transparent huge pages. This measures, for each way of allocating
the four fp32 streams of an Adam step (master, grad, exp_avg, exp_avg_sq):

- ``pinned``: ``torch.empty(..., pin_memory=True)`` (what the engine used)
- ``pageable``: ``torch.empty`` (no pinning; copies to the GPU are staged)
- ``thp-registered``: anonymous mmap + MADV_HUGEPAGE, then cudaHostRegister

the fused AdamW step time (whole tensors and in chunks, as the engine runs
it) and the host->GPU / GPU->host copy bandwidth from the master.
"""

from __future__ import annotations

import argparse
import json
import mmap
import time

import torch

KINDS = ("pinned", "pageable", "thp-registered")


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


class HostBuffers:
    """Four fp32 host tensors of ``numel`` elements allocated as ``kind``."""

    def __init__(self, kind: str, numel: int):
        self.kind, self._maps, self._registered = kind, [], []
        self.tensors = [self._alloc(numel) for _ in range(4)]
        for t in self.tensors:
            t.uniform_(-1, 1) if t is self.tensors[0] else t.fill_(0.01)

    def _alloc(self, numel: int) -> torch.Tensor:
        if self.kind == "pinned":
            return torch.empty(numel, dtype=torch.float32, pin_memory=torch.cuda.is_available())
        if self.kind == "pageable":
            return torch.empty(numel, dtype=torch.float32)
        m = mmap.mmap(-1, numel * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE)
        self._maps.append(m)
        t = torch.frombuffer(m, dtype=torch.float32)
        t.zero_()  # fault the pages in (huge where the kernel gives them) before pinning
        if torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), numel * 4, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {rc}")
            self._registered.append(t.data_ptr())
        return t

    def close(self) -> None:
        for ptr in self._registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self.tensors = []
        for m in self._maps:
            m.close()


def adam_seconds(bufs: HostBuffers, chunk: int, repeats: int) -> float:
    master, grad, m, v = bufs.tensors
    step = torch.zeros((), dtype=torch.float32)
    n = master.numel()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for lo in range(0, n, chunk):
            k = min(chunk, n - lo)
            torch._fused_adamw_([master.narrow(0, lo, k)], [grad.narrow(0, lo, k)],
                                [m.narrow(0, lo, k)], [v.narrow(0, lo, k)], [],
                                [step.clone()], lr=1e-4, beta1=0.9, beta2=0.95,
                                weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
        best = min(best, time.perf_counter() - t)
    return best


def copy_gbps(bufs: HostBuffers, numel: int, repeats: int) -> tuple[float, float]:
    src = bufs.tensors[0].narrow(0, 0, numel)
    dev = torch.empty(numel, dtype=torch.float32, device="cuda")
    res = []
    for direction in ("h2d", "d2h"):
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            if direction == "h2d":
                dev.copy_(src, non_blocking=True)
            else:
                src.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        res.append(numel * 4 / best / 1e9)
    return res[0], res[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=float, default=1.364e9)
    ap.add_argument("--chunk", type=float, default=float(1 << 24))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    n, chunk = int(a.numel), int(a.chunk)
    rows = []
    for kind in a.kinds.split(","):
        t0 = time.perf_counter()
        bufs = HostBuffers(kind, n)
        alloc_s = time.perf_counter() - t0
        row = {"kind": kind, "alloc_s": alloc_s,
               "adam_whole_s": adam_seconds(bufs, n, a.repeats),
               "adam_chunked_s": adam_seconds(bufs, chunk, a.repeats)}
        if torch.cuda.is_available():
            row["h2d_gbps"], row["d2h_gbps"] = copy_gbps(bufs, min(n, 1 << 28), a.repeats)
        bufs.close()
        del bufs
        rows.append(row)
        if not a.json:
            print(json.dumps(row))
    out = {"numel": n, "chunk": chunk, "threads": torch.get_num_threads(), "thp": _thp_mode(),
           "rows": rows}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
