"""The largest Llama the masters-nvme suite can train on this machine, from its free disk and host.

    python benchmarks/masters_nvme_size.py --nvme DIR [--host-bytes N] [--disk-bytes N] \
        [--out size.json]

Reads the free bytes under ``--nvme`` (``df``; ``--disk-bytes`` stands in for it) and the
host memory available (psutil; ``--host-bytes``), then picks the most decoder layers of the
width the suite trains (hidden 4096, intermediate 11008, 32 heads, vocab 32000: the shape of
tools/device_batch.py's SHAPE_4B) that both runs of the suite fit, and says why:

- the paged run (configs/zero3-nvme.json, masters paged, host budget a quarter of the
  optimizer state) keeps on the disk 14 bytes per parameter: fp32 masters 4, moments 8, the
  bf16 gradient 2 ([Note: paged gradients] in zeroio/shard/paged_grads.py), and 2 for each
  bf16 parameter not resident in host memory (``offload_param.max_in_cpu``, 1e9 elements in
  the config, within half the budget less one layer's shard: zeroio/config/host_split.py;
  90% of that is counted, the shards are kept whole), beside ``tiering.nvme_reserve_bytes``
  (1 GiB) kept free and a 2% margin;
- the resident run (masters on the host, a budget that holds every master and moment) keeps
  about 14 bytes per parameter in host memory (masters 4, moments 8, gradient 2) and 3 GB of
  parameter swap buffers, resident shards and the process, with a 10% margin.

Prints one line per constraint and the choice; ``--out`` writes them as JSON
(``{"layers", "params", "args", "budget_paged", "budget_resident", "why"}``), whose ``args``
are benchmarks/train_llama.py's shape flags. Exit status 1 when not even one layer fits (the
suite's runs then skip with that line).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

HIDDEN, INTERMEDIATE, HEADS, VOCAB = 4096, 11008, 32, 32000
GB = 1e9
RESERVE = 1 << 30
"""zero_optimization.tiering.nvme_reserve_bytes's default: kept free on the disk."""
DISK_MARGIN = 0.02
HOST_MARGIN = 0.10
PAGED_DISK_PER_PARAM = 14
PARAM_BYTES = 2
MAX_IN_CPU = 1_000_000_000
"""configs/zero3-nvme.json's offload_param.max_in_cpu."""
RESIDENT_HOST_PER_PARAM = 14
RESIDENT_HOST_FIXED = 3 * GB


def params_of(layers: int) -> int:
    """Parameters of the suite's Llama with ``layers`` decoder layers (train_llama.py's count:
    untied embedding and head, two norms a layer, the final norm)."""
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN
    return layers * per_layer + 2 * VOCAB * HIDDEN + HIDDEN


def resident_params(params: int) -> int:
    """Parameters whose 16-bit shard the paged run keeps in host memory (counted at 90%)."""
    layer = params_of(1) - params_of(0)
    cap = max(0, (3 * params // 2 - PARAM_BYTES * layer) // PARAM_BYTES)
    return int(0.9 * min(MAX_IN_CPU, cap, params))


def disk_need(params: int) -> int:
    """Bytes the paged run keeps on the disk (module doc)."""
    return PAGED_DISK_PER_PARAM * params + PARAM_BYTES * (params - resident_params(params))


def size(disk_free: int, host_available: int) -> dict:
    """The layers, parameters, budgets and reasons for ``disk_free`` bytes under the NVMe
    folder and ``host_available`` bytes of host memory."""
    disk_room = (disk_free - RESERVE) * (1 - DISK_MARGIN)
    host_room = (host_available * (1 - HOST_MARGIN)) - RESIDENT_HOST_FIXED
    by_host = int(host_room // RESIDENT_HOST_PER_PARAM)
    layers = 0
    while disk_need(params_of(layers + 1)) <= disk_room and params_of(layers + 1) <= by_host:
        layers += 1
    disk_bound = disk_need(params_of(layers + 1)) > disk_room
    why = [f"disk: {disk_free / GB:.1f} GB free under the NVMe folder, "
           f"{RESERVE / GB:.2f} GB kept free (nvme_reserve_bytes) and a {DISK_MARGIN:.0%} "
           f"margin: {disk_room / GB:.1f} GB; the paged run keeps {PAGED_DISK_PER_PARAM} "
           f"B/param there (fp32 masters 4, moments 8, bf16 gradient 2) and 2 for each bf16 "
           "parameter not resident in host memory (max_in_cpu)",
           f"host: {host_available / GB:.1f} GB available, a {HOST_MARGIN:.0%} margin; the "
           f"resident run keeps {RESIDENT_HOST_PER_PARAM} B/param there (masters 4, moments "
           f"8, gradient 2) and {RESIDENT_HOST_FIXED / GB:.0f} GB more: at most "
           f"{by_host / 1e9:.2f}B parameters"]
    params = params_of(layers) if layers else 0
    if layers:
        nxt = params_of(layers + 1)
        why.append(f"chosen: {layers} layers of hidden {HIDDEN}, intermediate {INTERMEDIATE}: "
                   f"{params / 1e9:.3f}B parameters, {disk_need(params) / GB:.1f} GB on the "
                   f"disk ({'disk' if disk_bound else 'host'} bound: {layers + 1} layers, "
                   f"{nxt / 1e9:.3f}B, would need {disk_need(nxt) / GB:.1f} GB)")
    else:
        why.append(f"no layer fits: one is {params_of(1) / 1e9:.3f}B parameters")
    budget = 3 * params  # a quarter of the optimizer state (12 bytes per parameter)
    return {"layers": layers, "params": params,
            "args": f"--hidden {HIDDEN} --layers {layers} --intermediate {INTERMEDIATE} "
                    f"--heads {HEADS} --vocab {VOCAB}",
            "budget_paged": budget,
            "budget_resident": int(min(100 * GB, host_available * (1 - HOST_MARGIN))),
            "disk_free": disk_free, "host_available": host_available, "why": why}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme", required=True, help="the NVMe folder (made if missing)")
    ap.add_argument("--disk-bytes", type=int, help="free bytes to size for (default: df)")
    ap.add_argument("--host-bytes", type=int, help="available host bytes (default: psutil)")
    ap.add_argument("--out", help="write the choice as JSON here")
    a = ap.parse_args(argv)
    import os

    os.makedirs(a.nvme, exist_ok=True)
    disk = a.disk_bytes if a.disk_bytes is not None else shutil.disk_usage(a.nvme).free
    if a.host_bytes is not None:
        host = a.host_bytes
    else:
        import psutil

        host = psutil.virtual_memory().available
    result = size(disk, host)
    for line in result["why"]:
        print(f"masters-nvme size: {line}")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0 if result["layers"] else 1


if __name__ == "__main__":
    sys.exit(main())
