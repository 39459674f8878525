"""Where the offloaded optimizer step loses time: CPU AdamW over a flat host shard, alone and
with what runs beside it in a training step.

    python benchmarks/bench_host_step.py [--numel 1.364e9] [--chunk 64M] [--repeats 3] [--json]

Each variant steps the same ``--numel`` fp32 elements (zeroio.io.hostmem memory, as the
engine allocates them) and reports seconds per step:

- ``one_call``: one fused AdamW call on the main thread, grad_scale 2 (clipping active);
  torch's kernel then writes the unscaled gradient back (4 more bytes per element).
- ``one_call_no_scale``: the same without a grad_scale (the raw memory-bandwidth bound).
- ``chunks_main``: the same in ``--chunk``-element chunks on the main thread.
- ``chunks_worker``: the chunks on a worker thread (as StepRunner runs them).
- ``chunks_worker_h2d``: + each chunk's fp32 master copied to the GPU on a copy stream and
  cast to bf16 there (stage 1/2 publication), double-buffered.
- ``chunks_worker_h2d_gpu_busy``: + the main thread keeps the GPU busy with matmuls (the next
  forward in the overlapped step), launching kernels while the worker runs.
- ``chunks_worker_threads_minus_1``: ``chunks_worker_h2d_gpu_busy`` with one thread fewer.
- ``one_pass_worker_h2d_gpu_busy``: as ``chunks_worker_h2d_gpu_busy`` with zeroio's one-pass
  kernel (zeroio/optim/cpu_adam.py) writing each chunk's bf16 values into a pinned slot that
  goes up as bf16 (what the engine runs now); ``one_pass_main``: that kernel in one call.
- ``cast_bf16``: a CPU fp32 -> bf16 cast pass over the shard (stage 3's host publish).
- ``h2d_only``: the fp32 copies alone (pinned -> GPU bandwidth).
Results go to benchmarks/results/host_step-<host>-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import provenance  # benchmarks/provenance.py: machine, date, commit
import torch

from zeroio.io.hostmem import host_empty, host_zeros
from zeroio.optim import cpu_adam
from zeroio.optim.adam import AdamState, adam_update

HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def _size(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult != 1 else t) * mult)


class Shard:
    def __init__(self, numel: int, pin: bool):
        self.n = numel
        self.master = host_empty(numel, torch.float32, pin=pin)
        self.grad = host_empty(numel, torch.float32, pin=pin)
        for t in (self.master, self.grad):
            for lo in range(0, numel, 1 << 26):  # fill in pieces: no full-size temporary
                k = min(1 << 26, numel - lo)
                t.narrow(0, lo, k).uniform_(-1, 1)
        self.m = host_zeros(numel, torch.float32, pin=pin)
        self.v = host_zeros(numel, torch.float32, pin=pin)
        self.step = torch.zeros((), dtype=torch.float32)

    def update(self, lo: int, k: int, grad_scale: float = 2.0) -> None:
        st = AdamState(exp_avg=self.m.narrow(0, lo, k), exp_avg_sq=self.v.narrow(0, lo, k),
                       step=self.step.clone())
        adam_update(master=self.master.narrow(0, lo, k), grad=self.grad.narrow(0, lo, k),
                    state=st, hyper=HYPER, decoupled=True, grad_scale=grad_scale)


def _time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=float, default=1.364e9)
    ap.add_argument("--chunk", default="64M")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = ap.parse_args()
    n, chunk = int(a.numel), _size(a.chunk)
    cuda = torch.cuda.is_available()
    threads = torch.get_num_threads()
    sh = Shard(n, pin=cuda)
    spans = [(lo, min(chunk, n - lo)) for lo in range(0, n, chunk)]
    runs: dict[str, float] = {}
    runs["one_call"] = _time(lambda: sh.update(0, n), a.repeats)
    # no grad_scale (no clipping, no loss scale): torch's kernel then leaves the gradient alone
    runs["one_call_no_scale"] = _time(lambda: sh.update(0, n, 1.0), a.repeats)

    def chunks_main():
        for lo, k in spans:
            sh.update(lo, k)

    runs["chunks_main"] = _time(chunks_main, a.repeats)

    if cuda:
        dev = torch.device("cuda")
        stream = torch.cuda.Stream()
        landing = [torch.empty(chunk, dtype=torch.float32, device=dev) for _ in range(2)]
        params16 = torch.empty(n, dtype=torch.bfloat16, device=dev)
        done = torch.cuda.Event()
    else:
        dev = stream = landing = params16 = done = None

    def publish(i, lo, k):
        with torch.cuda.stream(stream):
            land = landing[i % 2].narrow(0, 0, k)
            land.copy_(sh.master.narrow(0, lo, k), non_blocking=True)
            params16.narrow(0, lo, k).copy_(land)

    def worker(h2d: bool, n_threads: int):
        def body():
            torch.set_num_threads(n_threads)
            for i, (lo, k) in enumerate(spans):
                sh.update(lo, k)
                if h2d:
                    publish(i, lo, k)
            if h2d:
                done.record(stream)
                done.synchronize()
        th = threading.Thread(target=body)
        th.start()
        return th

    runs["chunks_worker"] = _time(lambda: worker(False, threads).join(), a.repeats)
    if cuda:
        runs["chunks_worker_h2d"] = _time(lambda: worker(True, threads).join(), a.repeats)
        x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

        def busy(n_threads):
            th = worker(True, n_threads)
            while th.is_alive():  # the main thread launches GPU work as a forward would
                for _ in range(8):
                    x @ x
                torch.cuda.current_stream().synchronize()
            th.join()

        runs["chunks_worker_h2d_gpu_busy"] = _time(lambda: busy(threads), a.repeats)
        runs["chunks_worker_threads_minus_1"] = _time(lambda: busy(max(1, threads - 1)),
                                                      a.repeats)

        if cpu_adam.wanted(n):
            h = cpu_adam.hyper_tensor(lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                      weight_decay=0.01, decoupled=True, step=1,
                                      grad_scale=2.0)
            slots = [host_empty(chunk, torch.bfloat16, pin=True) for _ in range(2)]
            free = [None, None]

            def one_pass(lo, k, out=None):
                cpu_adam.step_chunk(master=sh.master.narrow(0, lo, k),
                                    grad=sh.grad.narrow(0, lo, k), exp_avg=sh.m.narrow(0, lo, k),
                                    exp_avg_sq=sh.v.narrow(0, lo, k), hyper=h, out=out)

            runs["one_pass_main"] = _time(lambda: one_pass(0, n), a.repeats)

            def one_pass_busy():
                def body():
                    torch.set_num_threads(threads)
                    for i, (lo, k) in enumerate(spans):
                        if free[i % 2] is not None:
                            free[i % 2].synchronize()
                        out = slots[i % 2].narrow(0, 0, k)
                        one_pass(lo, k, out)
                        with torch.cuda.stream(stream):
                            params16.narrow(0, lo, k).copy_(out, non_blocking=True)
                            free[i % 2] = torch.cuda.Event()
                            free[i % 2].record(stream)
                    stream.synchronize()
                th = threading.Thread(target=body)
                th.start()
                while th.is_alive():
                    for _ in range(8):
                        x @ x
                    torch.cuda.current_stream().synchronize()
                th.join()

            runs["one_pass_worker_h2d_gpu_busy"] = _time(one_pass_busy, a.repeats)

        def h2d_only():
            for i, (lo, k) in enumerate(spans):
                publish(i, lo, k)
            stream.synchronize()

        runs["h2d_only"] = _time(h2d_only, a.repeats)
    out16 = host_empty(n, torch.bfloat16, pin=cuda)
    runs["cast_bf16"] = _time(lambda: out16.copy_(sh.master), a.repeats)
    result = {**provenance.header(), "numel": n, "chunk": chunk, "threads": threads,
              "gpu": torch.cuda.get_device_name() if cuda else None,
              "runs": {k: {"seconds": v, "g_params_per_s": n / v / 1e9} for k, v in runs.items()}}
    path = provenance.write_result(a.out, "host_step", result)
    if a.json:
        print(json.dumps(result))
        return
    print(f"{n / 1e9:.3f} G elements, chunk {chunk >> 20}M, {threads} threads")
    for k, v in runs.items():
        print(f"{k:32s} {v:8.4f} s  {n / v / 1e9:6.2f} G/s")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
