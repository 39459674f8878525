"""Measuring the machine for `zeroio train --plan` (zeroio/cli/train/machine.py): the figures
from injected probes land in the Machine as the note says (CUDA and CPU-only), the disk probe
is sized from the free bytes, and the real probes run on this CPU in about a second."""

from __future__ import annotations

import os
from pathlib import Path

from zeroio.cli.train.machine import Probes, measure
from zeroio.plan import Machine

GB = 10**9


def _probes(calls: list, *, disk_free: int = 500 * GB) -> Probes:
    def disk_bw(where: Path, size: int):
        calls.append(("disk", where, size))
        return 6 * GB, 3 * GB, True

    def mixed(where: Path, size: int):
        calls.append(("mixed", where, size))
        return 2 * GB

    def copy(nbytes: int, cuda: bool):
        calls.append(("copy", nbytes, cuda))
        return 25 * GB

    def adam(numel: int):
        calls.append(("adam", numel))
        return 2 * GB

    return Probes(gpu_free=lambda n: [80 * GB, 79 * GB][:n], host_available=lambda: 200 * GB,
                  disk_free=lambda where: disk_free, disk_bandwidth=disk_bw,
                  disk_mixed=mixed, copy_bandwidth=copy, cpu_adam=adam)


def test_cuda_machine_takes_each_probe(tmp_path):
    calls: list = []
    m = measure(gpus=2, nvme_path=tmp_path / "nvme" / "swap", cuda=True, probes=_probes(calls))
    assert m.machine == Machine(gpus=2, gpu_bytes=79 * GB, host_bytes=200 * GB,
                                disk_bytes=500 * GB, pcie_bps=25 * GB, disk_read_bps=6 * GB,
                                disk_write_bps=3 * GB, cpu_adam_elems_per_s=2 * GB,
                                disk_mixed_bps=2 * GB)
    # the disk is probed where the swap folder will be: its nearest existing parent
    assert calls == [("disk", tmp_path, 256 << 20), ("mixed", tmp_path, 256 << 20),
                     ("copy", 64 << 20, True), ("adam", 1 << 26)]
    assert any("reading and writing at once 2.00 GB/s together" in n for n in m.notes)
    assert any("2 x 79.00 GB free" in n for n in m.notes)


def test_cpu_only_splits_host_memory_between_the_device_and_host_tiers(tmp_path):
    calls: list = []
    m = measure(gpus=4, nvme_path=tmp_path, cuda=False, probes=_probes(calls))
    assert m.machine.gpu_bytes == 200 * GB // 8 and m.machine.host_bytes == 100 * GB
    assert m.machine.gpus * m.machine.gpu_bytes + m.machine.host_bytes == 200 * GB
    assert ("copy", 64 << 20, False) in calls
    assert any(n.startswith("CPU-only run:") for n in m.notes)


def test_disk_probe_is_a_quarter_of_the_free_bytes_at_most(tmp_path):
    calls: list = []
    measure(gpus=1, nvme_path=tmp_path, cuda=True, probes=_probes(calls, disk_free=100 << 20))
    # a quarter for the write-then-read file; the mixed probe's two files an eighth each
    assert calls[:2] == [("disk", tmp_path, 25 << 20), ("mixed", tmp_path, 12 << 20)]
    calls.clear()
    m = measure(gpus=1, nvme_path=tmp_path, cuda=True,
                probes=_probes(calls, disk_free=3 << 20))  # under 1 MiB a quarter: no probe
    assert [c[0] for c in calls] == ["copy", "adam"]
    assert m.machine.disk_bytes == 3 << 20 and m.machine.disk_read_bps == 1.0
    assert m.machine.disk_mixed_bps is None
    assert any("too few to probe" in n for n in m.notes)


def test_real_probes_on_this_cpu(tmp_path):
    import psutil

    m = measure(gpus=1, nvme_path=tmp_path / "nvme", cuda=False, disk_probe_bytes=8 << 20,
                copy_probe_bytes=8 << 20, adam_elems=1 << 18)
    mach = m.machine
    avail = psutil.virtual_memory().available
    assert abs(mach.host_bytes * 2 - avail) < 0.25 * avail  # half of what is available
    assert abs(mach.disk_bytes - os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize) \
        < 1 << 30
    for bps in (mach.pcie_bps, mach.disk_read_bps, mach.disk_write_bps, mach.disk_mixed_bps):
        assert bps > 1e7  # 10 MB/s: any disk or memory copy beats it
    assert mach.cpu_adam_elems_per_s > 1e6
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    assert m.seconds < 30
