"""Sequential bandwidth of the IOEngine beside the raw device, and the tuning sweep.

[Note: fair comparison] Both sides move the same number of bytes through
the same directory in the same run: the engine writes a fresh file then
reads it back; the raw side does the same with ``fio`` (libaio, direct,
when installed: the best over a sweep of queue depths and jobs, [Note: the raw
disk's best]) or ``dd`` (``oflag=direct conv=fsync`` / ``iflag=direct``).
Writes are timed up to and including ``fsync``. The page cache is kept out
by O_DIRECT; where the engine fell back to buffered I/O, the file is evicted
with ``posix_fadvise(DONTNEED)`` before it is read, and a size larger than
RAM is the only sure way (the result says whether I/O was direct).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from tqdm import tqdm

from zeroio.errors import SwapIOError
from zeroio.io.buffers import AlignedBuffer
from zeroio.io.engine import O_DIRECT, IOEngine
from zeroio.io.files import fsync_file

GB = 1e9
_WINDOW = 64 << 20  # bytes per engine request in the benchmark
_IN_FLIGHT = 4  # engine requests outstanding at once

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1000, "KIB": 1 << 10, "M": 1 << 20, "MB": 1000**2,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1000**3, "GIB": 1 << 30, "T": 1 << 40, "TB": 1000**4, "TIB": 1 << 40}


def parse_size(text: str | int) -> int:
    """'4G' / '512MiB' / '100MB' / '1048576' -> bytes (K/M/G alone are binary)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise SwapIOError(22, f"cannot read size {text!r}; use e.g. 4G, 512M, 100MB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass
class Bandwidth:
    write_gbps: float
    read_gbps: float


def _check_dir(path: str, size: int) -> None:
    if not os.path.isdir(path):
        raise SwapIOError(2, f"bench: {path} is not a directory (create it first)")
    if not os.access(path, os.W_OK):
        raise SwapIOError(13, f"bench: {path} is not writable by this process")
    free = shutil.disk_usage(path).free
    if size * 1.05 > free:
        raise SwapIOError(28, f"bench: {path} needs {size} bytes for the test file, {free} bytes free")


def _stream(submit: Callable[[int, int], list], size: int, window: int,
            done: Callable[[int], object] = lambda n: None) -> None:
    """``submit(offset, n)`` for each ``window`` of ``size`` bytes in order (its futures), at
    most _IN_FLIGHT windows outstanding; ``done(n)`` as each window's futures complete."""
    def land(futures: list, n: int) -> None:
        for f in futures:
            f.result()
        done(n)

    pending: list[tuple[list, int]] = []
    for off in range(0, size, window):
        n = min(window, size - off)
        pending.append((submit(off, n), n))
        if len(pending) >= _IN_FLIGHT:
            land(*pending.pop(0))
    for futures, n in pending:
        land(futures, n)


def engine_bandwidth(engine: IOEngine, directory: str, size: int, *, progress: bool = True) -> Bandwidth:
    """Sequential write then read of ``size`` bytes through ``engine``; see [Note: fair comparison]."""
    path = os.path.join(directory, "zeroio-bench-engine.bin")
    window = min(_WINDOW, size)
    buf = AlignedBuffer(window)
    buf.tensor.copy_(torch_randbytes(window))
    try:
        if os.path.exists(path):
            os.unlink(path)
        bar = tqdm(total=2 * size, unit="B", unit_scale=True, desc="engine", disable=not progress)

        def run(submit: Callable) -> float:
            t0 = time.perf_counter()
            _stream(lambda off, n: [submit(buf.tensor[:n], off)], size, window, bar.update)
            return time.perf_counter() - t0

        t_write = run(lambda t, off: engine.write(path, t, off))
        t0 = time.perf_counter()
        fsync_file(path)
        t_write += time.perf_counter() - t0
        engine.drop_cache(path)
        t_read = run(lambda t, off: engine.read(path, t, off))
        bar.close()
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return Bandwidth(size / t_write / GB, size / t_read / GB)


def engine_mixed_bandwidth(engine: IOEngine, directory: str, size: int) -> float:
    """GB/s of reads and writes together when ``engine`` reads one file of ``size`` bytes
    while it writes another of the same size (its read and write lanes at once, as the NVMe
    optimizer step reads the next moments while it writes the last ones back): 2 x size
    over the time both take, the write's fsync included. Both files are deleted after."""
    src = os.path.join(directory, "zeroio-bench-mixed-src.bin")
    dst = os.path.join(directory, "zeroio-bench-mixed-dst.bin")
    window = min(_WINDOW, size)
    wbuf, rbuf = AlignedBuffer(window), AlignedBuffer(window)
    wbuf.tensor.copy_(torch_randbytes(window))
    try:
        for f in (src, dst):
            if os.path.exists(f):
                os.unlink(f)
        _stream(lambda off, n: [engine.write(src, wbuf.tensor[:n], off)], size, window)
        fsync_file(src)
        engine.drop_cache(src)
        t0 = time.perf_counter()
        _stream(lambda off, n: [engine.read(src, rbuf.tensor[:n], off),
                                engine.write(dst, wbuf.tensor[:n], off)], size, window)
        fsync_file(dst)
        elapsed = time.perf_counter() - t0
    finally:
        for f in (src, dst):
            if os.path.exists(f):
                os.unlink(f)
    return 2 * size / elapsed / GB


def torch_randbytes(n: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def raw_tool(fio: str | None = None) -> str:
    return "fio" if (fio or shutil.which("fio")) else "dd"


FIO_QUEUE_DEPTHS = (1, 4, 16, 32)
"""I/O depths per job of fio's sweep ([Note: the raw disk's best])."""
FIO_JOBS = (1, 4)
"""Jobs of fio's sweep, each on its own region of the file (``offset_increment``)."""
FIO_BLOCKS = (1 << 20, 8 << 20)
"""Block sizes of the sweep: the engine's default block (1 MiB) and one syscall of its
default queue depth (8 x 1 MiB)."""
FIO_RUNTIME_S = 5
"""Seconds at most per run of the sweep (fio's ``runtime``: the run ends at ``size`` or then)."""

# [Note: the raw disk's best]
# What a step's NVMe bytes are held against is the disk's best sequential bandwidth, not one
# tool run at one queue depth (``dd`` at depth 1 undersells a virtual or NVMe disk by 2x and
# more). With fio the raw side sweeps FIO_QUEUE_DEPTHS x FIO_JOBS, libaio, O_DIRECT,
# sequential, at FIO_BLOCKS, each run at most FIO_RUNTIME_S, writes timed with
# ``end_fsync``, and takes the best of each direction; the
# sweep's rows stay in the result. It also runs one mixed job (half reads, half writes, at
# the best read setting), the pattern of a swapped optimizer step, for reference. The disk
# bound of a step is then ``read bytes / best read + written bytes / best write`` (one device
# doing both): ``disk_bound_s``.


def raw_bandwidth(directory: str, size: int, *, tool: str = "auto", block_size: int = 64 << 20,
                  queue_depth: int = 8, fio: str | None = None,
                  sweep: bool = True) -> tuple[Bandwidth, dict]:
    """The device through a standard tool, same directory and size; returns (bandwidth, how).
    ``fio``: the fio binary (None: the one on PATH); ``sweep``: fio's best over the sweep of
    [Note: the raw disk's best] (False: one run at ``block_size`` x ``queue_depth``)."""
    tool = raw_tool(fio) if tool == "auto" else tool
    path = os.path.join(directory, "zeroio-bench-raw.bin")
    try:
        if tool == "fio":
            exe = fio or shutil.which("fio") or "fio"
            if sweep:
                return fio_sweep(exe, path, size)
            return _fio(exe, path, size, block_size, queue_depth)
        return _dd(path, size, block_size)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if res.returncode != 0:
        raise SwapIOError(5, f"bench: {' '.join(cmd)} failed: {res.stderr.strip()[-500:]}")
    return dt


def _dd(path: str, size: int, bs: int) -> tuple[Bandwidth, dict]:
    bs = min(bs, size)
    count = max(1, size // bs)
    nbytes = bs * count
    direct = direct_io_supported(os.path.dirname(path))
    oflag = ["oflag=direct"] if direct else []
    iflag = ["iflag=direct"] if direct else []
    write_cmd = ["dd", "if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}", "conv=fsync", *oflag]
    t_write = _timed(write_cmd)
    _evict(path)
    read_cmd = ["dd", f"if={path}", "of=/dev/null", f"bs={bs}", *iflag]
    t_read = _timed(read_cmd)
    how = {"tool": "dd", "write_cmd": " ".join(write_cmd), "read_cmd": " ".join(read_cmd), "direct": direct}
    return Bandwidth(nbytes / t_write / GB, nbytes / t_read / GB), how


def _fio_cmd(exe: str, path: str, size: int, rw: str, *, bs: int, qd: int, jobs: int,
             timed: bool = True) -> list[str]:
    """One fio run; ``timed``: at most FIO_RUNTIME_S (else the whole ``size``)."""
    per_job = max(bs, size // jobs // bs * bs)
    cmd = [exe, "--name=zeroio", f"--filename={path}", f"--size={per_job}", f"--bs={bs}",
           f"--iodepth={qd}", "--ioengine=libaio", "--direct=1", "--output-format=json",
           f"--rw={rw}", f"--numjobs={jobs}", "--group_reporting=1"]
    if timed:
        cmd.append(f"--runtime={FIO_RUNTIME_S}")
    if jobs > 1:
        cmd.append(f"--offset_increment={per_job}")
    if rw in ("write", "rw"):
        cmd.append("--end_fsync=1")
    if rw == "rw":
        cmd.append("--rwmixread=50")
    return cmd


def fio_gbps(stdout: str) -> dict[str, float]:
    """GB/s per direction of one fio JSON report (``group_reporting``: one job entry)."""
    try:
        job = json.loads(stdout[stdout.index("{"):])["jobs"][0]
    except (ValueError, KeyError, IndexError) as e:
        raise SwapIOError(5, f"bench: cannot read fio's JSON report ({e}): {stdout[:300]!r}") from e
    out = {}
    for rw in ("read", "write"):
        side = job.get(rw) or {}
        ms = side.get("runtime") or 0
        out[rw] = side.get("io_bytes", 0) / (ms / 1000) / GB if ms else 0.0
    return out


def _run_fio(cmd: list[str]) -> dict[str, float]:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SwapIOError(5, f"bench: {' '.join(cmd)} failed: {res.stderr.strip()[-500:]}")
    return fio_gbps(res.stdout)


def _fio(exe: str, path: str, size: int, bs: int, qd: int) -> tuple[Bandwidth, dict]:
    out = {rw: _run_fio(_fio_cmd(exe, path, size, rw, bs=bs, qd=qd, jobs=1))[rw]
           for rw in ("write", "read")}
    cmd = _fio_cmd(exe, path, size, "read", bs=bs, qd=qd, jobs=1)
    return Bandwidth(out["write"], out["read"]), {"tool": "fio", "cmd": " ".join(cmd),
                                                  "direct": True}


def fio_sweep(exe: str, path: str, size: int, *, queue_depths=FIO_QUEUE_DEPTHS, jobs=FIO_JOBS,
              blocks=FIO_BLOCKS) -> tuple[Bandwidth, dict]:
    """fio's best sequential write and read over ``blocks`` x ``queue_depths`` x ``jobs``
    ([Note: the raw disk's best]); ``how`` holds every row, the best settings and the mixed
    job."""
    rows, best = [], {"write": None, "read": None}
    for rw in ("write", "read"):  # the writes lay the file out for the reads
        for bs in blocks:
            for j in jobs:
                for qd in queue_depths:
                    gbps = _run_fio(_fio_cmd(exe, path, size, rw, bs=bs, qd=qd, jobs=j))[rw]
                    row = {"rw": rw, "iodepth": qd, "numjobs": j, "block_size": bs, "gbps": gbps}
                    rows.append(row)
                    if best[rw] is None or gbps > best[rw]["gbps"]:
                        best[rw] = row
    r = best["read"]
    at = {"bs": r["block_size"], "qd": r["iodepth"], "jobs": r["numjobs"]}
    mixed = _run_fio(_fio_cmd(exe, path, size, "rw", **at))
    how = {"tool": "fio", "sweep": rows, "best": best, "direct": True,
           "mixed": {"iodepth": r["iodepth"], "numjobs": r["numjobs"],
                     "block_size": r["block_size"], "read_gbps": mixed["read"],
                     "write_gbps": mixed["write"]},
           "cmd": " ".join(_fio_cmd(exe, path, size, "read", **at))}
    return Bandwidth(best["write"]["gbps"], best["read"]["gbps"]), how


def fio_sustained(exe: str, path: str, size: int, best: dict) -> dict:
    """fio over a file of ``size`` bytes with no time limit, at the sweep's best settings: a
    write, a read, then reads and writes at once ([Note: burst and sustained rates])."""
    out = {"size_bytes": size}
    for rw in ("write", "read"):
        b = best[rw]
        out[f"{rw}_gbps"] = _run_fio(_fio_cmd(exe, path, size, rw, bs=b["block_size"],
                                              qd=b["iodepth"], jobs=b["numjobs"], timed=False))[rw]
    r = best["read"]
    mixed = _run_fio(_fio_cmd(exe, path, size, "rw", bs=r["block_size"], qd=r["iodepth"],
                              jobs=r["numjobs"], timed=False))
    out["mixed"] = {"read_gbps": mixed["read"], "write_gbps": mixed["write"]}
    return out


# [Note: burst and sustained rates]
# A virtual disk may serve a short run far faster than a long one (a burst allowance, a
# write cache): on the H200 hosts the 2 GiB sweep's best read 1.87 GB/s and wrote 2.88, and
# fio over 6 GiB per job right after read 1.29 and wrote 1.37, with reads and writes at once
# 1.26 together. A step that moves tens of GB runs at the sustained rate, so
# ``zeroio bench io --sustained SIZE`` adds one untimed write, read and mixed run of SIZE at
# the sweep's best settings (``raw["sustained"]``); ``disk_bound_s`` stays the sweep's.


def disk_bound_s(read_bytes: float, write_bytes: float, bw: Bandwidth | dict) -> float | None:
    """Seconds the disk needs at least to read and write these bytes, one device doing both
    ([Note: the raw disk's best]); None without a bandwidth."""
    rd = bw["read_gbps"] if isinstance(bw, dict) else bw.read_gbps
    wr = bw["write_gbps"] if isinstance(bw, dict) else bw.write_gbps
    if not rd or not wr:
        return None
    return read_bytes / (rd * GB) + write_bytes / (wr * GB)


def direct_io_supported(directory: str) -> bool:
    """Whether files in ``directory`` can be opened with O_DIRECT (tmpfs, e.g., refuses)."""
    probe = os.path.join(directory, ".zeroio-odirect-probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return O_DIRECT != 0


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_io(directory: str, size: int, *, block_size: int | None = None, queue_depth: int | None = None,
             threads: int | None = None, raw: str = "auto", progress: bool = True,
             aio_cfg: object | None = None, fio: str | None = None, sweep: bool = True,
             sustained: int | None = None) -> dict:
    """The ``zeroio bench io`` result: engine and raw bandwidth, their ratio, the settings;
    ``sustained``: also fio's untimed runs over a file of that many bytes ([Note: burst and
    sustained rates]; needs fio and its sweep)."""
    directory = os.path.abspath(directory)
    _check_dir(directory, size)
    if sustained is not None:
        if (raw_tool(fio) if raw == "auto" else raw) != "fio" or not sweep:
            raise SwapIOError(22, "bench: --sustained runs fio at the sweep's best settings; "
                              "give --fio PATH (or put fio on PATH) and drop --no-sweep / "
                              "--raw none / --raw dd")
        _check_dir(directory, sustained)
    with IOEngine(aio_cfg, block_size=block_size, queue_depth=queue_depth, thread_count=threads) as engine:
        eng = engine_bandwidth(engine, directory, size, progress=progress)
        settings = asdict(engine.settings)
        direct = engine.direct_enabled and direct_io_supported(directory)
    result = {"engine": asdict(eng), "path": directory, "size_bytes": size, "direct": direct,
              "settings": settings}
    if raw != "none":
        rb, how = raw_bandwidth(directory, size, tool=raw, queue_depth=settings["queue_depth"],
                                fio=fio, sweep=sweep)
        result["raw"] = {**asdict(rb), **how}
        if sustained is not None:
            path = os.path.join(directory, "zeroio-bench-sustained.bin")
            try:
                result["raw"]["sustained"] = fio_sustained(fio or shutil.which("fio") or "fio",
                                                           path, sustained, how["best"])
            finally:
                if os.path.exists(path):
                    os.unlink(path)
        result["ratio"] = {
            "write": eng.write_gbps / rb.write_gbps if rb.write_gbps else None,
            "read": eng.read_gbps / rb.read_gbps if rb.read_gbps else None,
        }
    return result


def tune_io(directory: str, size: int, block_sizes: list[int], queue_depths: list[int],
            thread_counts: list[int], *, progress: bool = True) -> tuple[dict, list[dict]]:
    """Sweep block size x queue depth x threads; best by harmonic mean of read and write GB/s."""
    directory = os.path.abspath(directory)
    _check_dir(directory, size)
    rows = []
    combos = [(b, q, t) for b in block_sizes for q in queue_depths for t in thread_counts]
    for b, q, t in tqdm(combos, desc="tune io", disable=not progress):
        with IOEngine(block_size=b, queue_depth=q, thread_count=t) as engine:
            bw = engine_bandwidth(engine, directory, size, progress=False)
        score = 2 / (1 / bw.write_gbps + 1 / bw.read_gbps)
        rows.append({"block_size": b, "queue_depth": q, "thread_count": t,
                     "write_gbps": bw.write_gbps, "read_gbps": bw.read_gbps, "score": score})
    best = max(rows, key=lambda r: r["score"])
    aio = {"block_size": best["block_size"], "queue_depth": best["queue_depth"],
           "intra_op_parallelism": best["thread_count"], "single_submit": False,
           "overlap_events": True, "use_gds": False}
    return aio, rows


def disk_table(result: dict) -> list[str]:
    """Lines of the table ``zeroio bench io`` prints for a ``bench_io`` result."""
    st = result["settings"]
    lines = [f"path {result['path']}  size {result['size_bytes']} B  direct I/O: {result['direct']}",
             f"engine (block_size {st['block_size']}, queue_depth {st['queue_depth']}, "
             f"threads {st['thread_count']})",
             f"{'':8}{'write GB/s':>12}{'read GB/s':>12}",
             f"{'engine':8}{result['engine']['write_gbps']:12.3f}{result['engine']['read_gbps']:12.3f}"]
    if "raw" in result:
        raw, r = result["raw"], result["ratio"]
        lines.append(f"{raw['tool']:8}{raw['write_gbps']:12.3f}{raw['read_gbps']:12.3f}")
        lines.append(f"{'ratio':8}{r['write']:12.2f}{r['read']:12.2f}   (target >= 0.90)")
        if "best" in raw:
            b = raw["best"]
            lines.append(f"fio best of {len(raw['sweep'])} runs: write at iodepth "
                         f"{b['write']['iodepth']} x {b['write']['numjobs']} jobs x "
                         f"{b['write']['block_size'] >> 20} MiB, read at iodepth "
                         f"{b['read']['iodepth']} x {b['read']['numjobs']} jobs x "
                         f"{b['read']['block_size'] >> 20} MiB; mixed 50/50: "
                         f"{raw['mixed']['write_gbps']:.3f} write + {raw['mixed']['read_gbps']:.3f}"
                         f" read GB/s")
        if "sustained" in raw:
            su = raw["sustained"]
            lines.append(f"fio over {su['size_bytes'] >> 20} MiB, no time limit: write "
                         f"{su['write_gbps']:.3f}, read {su['read_gbps']:.3f}, mixed "
                         f"{su['mixed']['write_gbps']:.3f} write + {su['mixed']['read_gbps']:.3f}"
                         " read GB/s")
    return lines
