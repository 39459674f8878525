"""Measuring the machine `zeroio train --plan` runs on, as a ``zeroio.plan.Machine``.

[Note: measuring the machine] One short probe per figure the planner reads, each a
function of ``Probes`` so a test can hand in its own:

- GPU memory: ``torch.cuda.mem_get_info`` of each GPU the run uses (local ranks 0..n-1);
  the smallest free figure, since every rank holds the same shard.
- host memory: ``psutil.virtual_memory().available``.
- disk: the free bytes of the file system under the NVMe path, and a sequential write then
  read through zeroio's own I/O engine (``io.bench.engine_bandwidth``: O_DIRECT where the
  file system takes it, the page cache dropped before the read otherwise); 256 MiB by
  default, at most a quarter of the free bytes; then one file read while another is
  written, both at once (``io.bench.engine_mixed_bandwidth``: the NVMe step's pattern; a
  disk may serve the two together much slower than either alone), an eighth of the free
  bytes each at most. The probe files are deleted at once.
- host <-> GPU: a pinned 64 MiB buffer copied to the GPU and back, best of three, the
  slower direction.
- CPU Adam: torch's fused CPU AdamW over 64M fp32 elements (1 GiB with its state), best of
  three steps after a warm-up, with every thread this process has (the whole node, as
  ``Machine`` counts it).

CPU-only runs: each rank's device is host memory. The planner checks the device tier and
the host tier separately, so handing it the same memory twice would let an offload count
the same bytes on both. The available host memory is therefore split in half: each rank's
"GPU" gets its share of one half, the host tier the other half, and "host <-> GPU" is a
plain memory copy. A line of the plan says so.

Nothing is cached: each planned run measures again unless ``--machine FILE`` is given.
Under CUDA the launcher measures in a child process (``python -m zeroio.cli.train.machine``)
so that it holds no CUDA context on the GPUs its ranks then train on.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from zeroio.errors import CapacityError

DISK_PROBE_BYTES = 256 << 20
COPY_PROBE_BYTES = 64 << 20
ADAM_PROBE_ELEMS = 1 << 26
"""64M elements, the host step's chunk: 4M read 0.80 G elements/s on a 16-core H200 host whose
training chunks ran at about 2.6 (thread start-up dominates a 5 ms step)."""
_MIN_DISK_PROBE = 1 << 20
_REPEATS = 3


def gpu_free_bytes(n: int) -> list[int]:
    """Free bytes of CUDA devices 0..n-1 (``torch.cuda.mem_get_info``)."""
    import torch

    have = torch.cuda.device_count()
    if have < n:
        raise CapacityError(f"the run wants {n} GPU(s) (--nproc {n}) but {have} are visible; "
                            "lower --nproc or check CUDA_VISIBLE_DEVICES")
    return [int(torch.cuda.mem_get_info(i)[0]) for i in range(n)]


def host_available_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def disk_free_bytes(directory: Path) -> int:
    return int(shutil.disk_usage(directory).free)


def disk_bandwidth(directory: Path, size: int) -> tuple[float, float, bool]:
    """(read bytes/s, write bytes/s, direct I/O) of ``size`` bytes through zeroio's I/O engine."""
    from zeroio.io.bench import GB, direct_io_supported, engine_bandwidth
    from zeroio.io.engine import IOEngine

    with IOEngine() as engine:
        bw = engine_bandwidth(engine, str(directory), size, progress=False)
        direct = engine.direct_enabled and direct_io_supported(str(directory))
    return bw.read_gbps * GB, bw.write_gbps * GB, direct


def disk_mixed_bandwidth(directory: Path, size: int) -> float:
    """Bytes/s read and written together, ``size`` bytes each way at once, through zeroio's
    I/O engine."""
    from zeroio.io.bench import GB, engine_mixed_bandwidth
    from zeroio.io.engine import IOEngine

    with IOEngine() as engine:
        return engine_mixed_bandwidth(engine, str(directory), size) * GB


def _best(fn: Callable[[], None], sync: Callable[[], None] = lambda: None) -> float:
    fn()  # warm-up: first-touch page faults, allocator, kernel load
    sync()
    best = float("inf")
    for _ in range(_REPEATS):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def copy_bandwidth(nbytes: int, cuda: bool) -> float:
    """Bytes/s of the slower direction host <-> device (pinned, CUDA device 0), or of a plain
    host memory copy without CUDA."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    if not cuda:
        dst = torch.empty_like(src)
        return nbytes / _best(lambda: dst.copy_(src))

    def both_ways() -> float:
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        sync = torch.cuda.synchronize
        up = _best(lambda: dev.copy_(src, non_blocking=True), sync)
        down = _best(lambda: src.copy_(dev, non_blocking=True), sync)
        return max(up, down)

    slower = both_ways()
    torch.cuda.empty_cache()  # the probe's device buffer is gone with both_ways' frame
    return nbytes / slower


def cpu_adam_speed(numel: int) -> float:
    """Elements per second of torch's fused CPU AdamW over ``numel`` fp32 elements."""
    import torch

    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.full((numel,), 1e-3)
    try:
        opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
        opt.step()
    except (RuntimeError, TypeError):  # a build without the fused CPU kernel
        opt = torch.optim.AdamW([p], lr=1e-3, foreach=False)
    return numel / _best(opt.step)


@dataclass(frozen=True, kw_only=True)
class Probes:
    """The measuring functions ([Note: measuring the machine]); tests inject fakes."""

    gpu_free: Callable[[int], list[int]] = gpu_free_bytes
    """Free bytes of each of the first n GPUs."""
    host_available: Callable[[], int] = host_available_bytes
    disk_free: Callable[[Path], int] = disk_free_bytes
    disk_bandwidth: Callable[[Path, int], tuple[float, float, bool]] = disk_bandwidth
    """(read bytes/s, write bytes/s, whether I/O was direct) for a probe of n bytes."""
    disk_mixed: Callable[[Path, int], float] = disk_mixed_bandwidth
    """Bytes/s of reads and writes together, n bytes each way at once."""
    copy_bandwidth: Callable[[int, bool], float] = copy_bandwidth
    cpu_adam: Callable[[int], float] = cpu_adam_speed


@dataclass(frozen=True, kw_only=True)
class Measured:
    """A measured machine, what the probes said beside the figures, and how long it took."""

    machine: object  # zeroio.plan.Machine
    notes: tuple[str, ...]
    seconds: float

    def to_dict(self) -> dict:
        return {"machine": self.machine.to_dict(), "notes": list(self.notes),
                "seconds": self.seconds}


def probe_dir(nvme_path: Path) -> Path:
    """Where the disk probe runs: the NVMe folder, or its nearest existing parent."""
    from zeroio.checkpoint.writer import existing_parent

    return existing_parent(Path(nvme_path))


def measure(*, gpus: int, nvme_path: Path, cuda: bool, probes: Probes | None = None,
            disk_probe_bytes: int = DISK_PROBE_BYTES, copy_probe_bytes: int = COPY_PROBE_BYTES,
            adam_elems: int = ADAM_PROBE_ELEMS) -> Measured:
    """This node as the planner sees it, for ``gpus`` ranks ([Note: measuring the machine])."""
    from zeroio.plan import Machine

    pr = probes or Probes()
    t0 = time.perf_counter()
    notes: list[str] = []
    host = pr.host_available()
    if cuda:
        free = pr.gpu_free(gpus)
        gpu_bytes, host_bytes = min(free), host
        notes.append(f"GPU: {gpus} x {gpu_bytes / 1e9:.2f} GB free (torch.cuda.mem_get_info)")
    else:
        gpu_bytes, host_bytes = host // (2 * gpus), host // 2
        notes.append(f"CPU-only run: each rank's device is host memory; the {host / 1e9:.2f} GB "
                     f"available are split in half, {gpu_bytes / 1e9:.2f} GB per rank as the "
                     f"\"GPU\" tier and {host_bytes / 1e9:.2f} GB as the host tier, so no "
                     "placement counts the same bytes twice")
    where = probe_dir(nvme_path)
    disk = pr.disk_free(where)
    size = min(disk_probe_bytes, disk // 4) // _MIN_DISK_PROBE * _MIN_DISK_PROBE
    if size >= _MIN_DISK_PROBE:
        read_bps, write_bps, direct = pr.disk_bandwidth(where, size)
        both = min(size, disk // 8 // _MIN_DISK_PROBE * _MIN_DISK_PROBE)
        mixed_bps = pr.disk_mixed(where, both) if both >= _MIN_DISK_PROBE else None
        notes.append(f"disk {where}: {disk / 1e9:.2f} GB free; {size >> 20} MiB probe through the "
                     f"I/O engine: read {read_bps / 1e9:.2f} GB/s, write {write_bps / 1e9:.2f} "
                     "GB/s" + ("" if direct else " (buffered: no O_DIRECT there)")
                     + (f"; reading and writing at once {mixed_bps / 1e9:.2f} GB/s together"
                        if mixed_bps else ""))
    else:
        read_bps = write_bps = 1.0
        mixed_bps = None
        notes.append(f"disk {where}: {disk:,} bytes free, too few to probe; NVMe placements "
                     "are out of reach there")
    pcie = pr.copy_bandwidth(copy_probe_bytes, cuda)
    notes.append(("pinned host <-> GPU copy" if cuda else "host memory copy")
                 + f": {pcie / 1e9:.2f} GB/s")
    adam = pr.cpu_adam(adam_elems)
    notes.append(f"CPU Adam (torch fused, {adam_elems:,} elements): {adam / 1e9:.3f} "
                 "G elements/s")
    machine = Machine(gpus=gpus, gpu_bytes=max(1, gpu_bytes), host_bytes=max(1, host_bytes),
                      disk_bytes=disk, pcie_bps=max(1.0, pcie), disk_read_bps=max(1.0, read_bps),
                      disk_write_bps=max(1.0, write_bps), cpu_adam_elems_per_s=max(1.0, adam),
                      disk_mixed_bps=max(1.0, mixed_bps) if mixed_bps else None)
    return Measured(machine=machine, notes=tuple(notes), seconds=time.perf_counter() - t0)


def measure_in_child(*, gpus: int, nvme_path: Path) -> Measured:
    """``measure`` in a child process (CUDA): the caller keeps no CUDA context or cached
    memory on the GPUs ([Note: measuring the machine])."""
    from zeroio.errors import ZeroIOError
    from zeroio.plan import Machine

    cmd = [sys.executable, "-m", "zeroio.cli.train.machine", "--gpus", str(gpus),
           "--nvme-path", str(nvme_path)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise ZeroIOError(f"measuring the machine ({' '.join(cmd)}) failed: "
                          f"{res.stderr.strip()[-2000:]}")
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    return Measured(machine=Machine.from_dict(doc["machine"]), notes=tuple(doc["notes"]),
                    seconds=float(doc["seconds"]))


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch

    p = argparse.ArgumentParser(prog="python -m zeroio.cli.train.machine",
                                description="measure this node for the placement planner")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--nvme-path", required=True)
    args = p.parse_args(argv)
    m = measure(gpus=args.gpus, nvme_path=Path(args.nvme_path), cuda=torch.cuda.is_available())
    print(json.dumps(m.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
