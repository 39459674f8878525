"""CPU Adam throughput: zeroio's sharded step vs torch foreach / fused AdamW vs memory bandwidth.

    python benchmarks/bench_cpu_adam.py [--numel 50e6] [--threads N] [--repeats 5] [--json]

zeroio steps one flat fp32 shard with torch's fused AdamW kernel
(``zeroio.optim.adam.adam_update``), the way the engine does with
``offload_optimizer.device: cpu``. The peers step the same numel split into
``--tensors`` parameters (as torch.optim sees a model). The bound is the
bytes an Adam step must move per parameter (read param, grad, exp_avg,
exp_avg_sq; write param, exp_avg, exp_avg_sq: 28 B in fp32) divided by the
measured memory bandwidth (best of a large ``copy_`` and a STREAM-style triad, bytes
read + written per second).
Results go to benchmarks/results/cpu_adam-<host>-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import provenance  # benchmarks/provenance.py: machine, date, commit
import torch

from zeroio.optim.adam import AdamState, adam_update

BYTES_PER_PARAM = 28
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def _best(fn, repeats: int) -> float:
    fn()  # warm-up (page faults, thread pool start)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def copy_bandwidth(numel: int, repeats: int) -> float:
    """Host memory bandwidth: the best of a copy (``dst.copy_(src)``, 8 B/element moved) and a
    STREAM-style triad (``torch.add(a, b, alpha=s, out=c)``, 12 B/element), bytes per second."""
    a, b, c = torch.rand(numel), torch.rand(numel), torch.empty(numel)
    copy = 8 * numel / _best(lambda: c.copy_(a), repeats)
    triad = 12 * numel / _best(lambda: torch.add(a, b, alpha=0.5, out=c), repeats)
    return max(copy, triad)


def zeroio_adam(numel: int, repeats: int) -> float:
    master, grad = torch.rand(numel), torch.rand(numel)
    state = AdamState.zeros_like(master)
    return _best(lambda: adam_update(master=master, grad=grad, state=state, hyper=HYPER,
                                     decoupled=True, grad_scale=1.0), repeats)


def torch_adamw(numel: int, tensors: int, repeats: int, **kind) -> float:
    sizes = [numel // tensors] * tensors
    sizes[-1] += numel - sum(sizes)
    params = [torch.nn.Parameter(torch.rand(n)) for n in sizes]
    for p in params:
        p.grad = torch.rand_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **kind)
    return _best(opt.step, repeats)





def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=float, default=50e6)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = int(args.numel)
    bw = copy_bandwidth(n, args.repeats)
    runs = {
        "zeroio_fused_flat": zeroio_adam(n, args.repeats),
        "torch_adamw_fused": torch_adamw(n, args.tensors, args.repeats, fused=True),
        "torch_adamw_foreach": torch_adamw(n, args.tensors, args.repeats, foreach=True),
    }
    bound = bw / BYTES_PER_PARAM
    result = {
        **provenance.header(), "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "numel": n,
        "copy_bandwidth_gbps": bw / 1e9, "bound_params_per_s": bound,
        "runs": {k: {"seconds": t, "params_per_s": n / t, "fraction_of_bound": n / t / bound}
                 for k, t in runs.items()},
    }
    path = provenance.write_result(args.out, "cpu_adam", result)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{n / 1e6:.0f} M params, {result['threads']} threads, memory {bw / 1e9:.1f} GB/s, "
          f"bound {bound / 1e9:.2f} G params/s ({BYTES_PER_PARAM} B/param)")
    print(f"{'run':24s} {'s/step':>8s} {'G params/s':>11s} {'of bound':>9s}")
    for k, r in result["runs"].items():
        print(f"{k:24s} {r['seconds']:8.4f} {r['params_per_s'] / 1e9:11.3f} "
              f"{r['fraction_of_bound']:9.2f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
