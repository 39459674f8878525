"""Run a command and report its peaks: host memory of its process tree, bytes used on a file
system, and the GPU memory the driver reports in use.

    python3 benchmarks/peaks.py --path /scratch --json peaks.json -- zeroio train ...

Sampled every ``--every`` seconds (default 0.5) with psutil (resident set of the command and
all its children, summed) and ``shutil.disk_usage`` (used bytes of the file system holding
``--path``, minus what was used before the command started); the GPU figure comes from
``nvidia-smi`` where it exists (memory.used of every GPU, summed, minus the start). A peak
between two samples is missed, so these are lower bounds at the sampling resolution. The
command's exit status is this script's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil


def tree_rss(proc: psutil.Process) -> int:
    """Resident bytes of ``proc`` and its live descendants."""
    total = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def gpu_used() -> int | None:
    """Bytes in use on every GPU together (nvidia-smi), or None where there is none."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                              "nounits"], capture_output=True, text=True, timeout=10).stdout
        return sum(int(x) for x in out.split()) << 20
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def run(cmd: list[str], path: Path, every: float) -> dict:
    disk0 = shutil.disk_usage(path).used
    gpu0 = gpu_used()
    peaks = {"host_rss_bytes": 0, "disk_used_bytes": 0, "gpu_used_bytes": None}
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd)
    proc = psutil.Process(child.pid)
    done = threading.Event()

    def sample() -> None:
        n = 0
        while not done.is_set():
            peaks["host_rss_bytes"] = max(peaks["host_rss_bytes"], tree_rss(proc))
            peaks["disk_used_bytes"] = max(peaks["disk_used_bytes"],
                                           shutil.disk_usage(path).used - disk0)
            if gpu0 is not None and n % max(1, round(2 / every)) == 0:  # nvidia-smi is slow
                g = gpu_used()
                if g is not None:
                    peaks["gpu_used_bytes"] = max(peaks["gpu_used_bytes"] or 0, g - gpu0)
            n += 1
            done.wait(every)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    rc = child.wait()
    done.set()
    t.join()
    return {"command": cmd, "path": str(path), "every_s": every, "exit": rc,
            "wall_s": time.perf_counter() - t0, **peaks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", type=Path, required=True,
                    help="a folder on the file system whose used bytes are sampled")
    ap.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--json", type=Path, help="write the peaks here as JSON")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("give the command after --")
    if not args.path.is_dir():
        ap.error(f"--path {args.path} is not a folder")
    r = run(cmd, args.path, args.every)
    gpu = r["gpu_used_bytes"]
    print(f"peaks: host RSS {r['host_rss_bytes'] / 1e9:.2f} GB, disk {r['disk_used_bytes'] / 1e9:.2f}"
          f" GB under {args.path}" + (f", GPU {gpu / 1e9:.2f} GB" if gpu is not None else "")
          + f"; exit {r['exit']} after {r['wall_s']:.0f} s", file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    return r["exit"]


if __name__ == "__main__":
    sys.exit(main())
