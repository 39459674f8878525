"""`zeroio report`: what this machine offers zeroio (like DeepSpeed's ``ds_report``).

    zeroio report [--path DIR] [--json]

Versions (zeroio, Python, torch, CUDA, driver, transformers), GPUs and their
memory, the pinned-memory limit (RLIMIT_MEMLOCK, ``ulimit -l``), CPU cores
(all, and this process's affinity) and the host step's thread count, the CPU
Adam kernel's mode and whether it can be built here. With --path DIR (an
nvme_path to be): its file system, free space and whether it opens files with
O_DIRECT (probed with a temporary file that is removed at once). --json prints
one JSON object with the same facts.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="versions, GPUs, memory limits and kernels of this machine",
                       description=__doc__.splitlines()[0])
    p.add_argument("--path", default=None, metavar="DIR",
                   help="also report DIR's file system, free space and O_DIRECT support")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def _memlock() -> dict[str, int | None]:
    """RLIMIT_MEMLOCK in bytes; None = unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def conv(v: int) -> int | None:
        return None if v == resource.RLIM_INFINITY else int(v)

    return {"soft_bytes": conv(soft), "hard_bytes": conv(hard)}


def _cpu() -> dict[str, Any]:
    from zeroio.partition.step_overlap import step_threads

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"cores": os.cpu_count(), "affinity_cores": affinity,
            "host_step_threads": step_threads()}


def _cpu_adam() -> dict[str, Any]:
    from zeroio.config.launch_env import launch_env
    from zeroio.optim import cpu_adam

    # the compilers torch inductor tries (its cpp.cxx default: $CXX, then g++), without
    # importing inductor (seconds)
    cxx = launch_env().cxx
    names = [cxx] if cxx else ["g++", "c++", "clang++"]
    compiler = next((w for w in map(shutil.which, names) if w), None)
    mode = cpu_adam.mode()
    return {"mode": mode, "compiler": compiler,
            "buildable": compiler is not None and mode != "torch",
            "note": "the one-pass kernel is compiled by torch inductor on first use (cached); "
                    "without a compiler zeroio steps with torch's fused Adam"}


def _gpus() -> list[dict[str, Any]]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "memory_bytes": int(p.total_memory),
                    "capability": f"{p.major}.{p.minor}"})
    return out


def _filesystem(path: Path) -> str | None:
    """The file system type of ``path`` from /proc/mounts (the longest mount prefix)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    real, best, kind = os.path.realpath(path), "", None
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, kind = mnt, parts[2]
    return kind


def _o_direct(path: Path) -> tuple[bool | None, str]:
    """Whether a file in ``path`` opens with O_DIRECT (and why not)."""
    from zeroio.io.files import probe_o_direct

    return probe_o_direct(path)


def path_report(path: str) -> dict[str, Any]:
    from zeroio.errors import ConfigError

    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"--path {path} is not a directory", key="path")
    usage = shutil.disk_usage(p)
    direct, why = _o_direct(p)
    return {"path": str(p.resolve()), "filesystem": _filesystem(p), "free_bytes": usage.free,
            "total_bytes": usage.total, "o_direct": direct, "o_direct_error": why or None}


def collect(path: str | None = None) -> dict[str, Any]:
    """Every fact `zeroio report` prints, as one JSON-able dict."""
    import torch

    import zeroio

    report: dict[str, Any] = {
        "zeroio": zeroio.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": _driver(),
        "transformers": _version("transformers"),
        "gpus": _gpus(),
        "pinned_memory_limit": _memlock(),
        "cpu": _cpu(),
        "cpu_adam": _cpu_adam(),
    }
    if path is not None:
        report["path"] = path_report(path)
    return report


def _bytes(n: int | None) -> str:
    return "unlimited" if n is None else f"{n / 2**30:.2f} GiB ({n:,} bytes)"


def run(args) -> int:
    r = collect(args.path)
    if args.json:
        print(json.dumps(r))
        return 0
    rows = [("zeroio", r["zeroio"]), ("python", r["python"]), ("torch", r["torch"]),
            ("CUDA (torch built with)", r["cuda"] or "none (CPU build)"),
            ("NVIDIA driver", r["driver"] or "none found"),
            ("transformers", r["transformers"] or "not installed")]
    for g in r["gpus"]:
        rows.append((f"GPU {g['index']}", f"{g['name']}, {_bytes(g['memory_bytes'])}, "
                                          f"compute {g['capability']}"))
    if not r["gpus"]:
        rows.append(("GPUs", "none visible (zeroio runs on CPU with gloo)"))
    lock = r["pinned_memory_limit"]
    rows.append(("pinned-memory limit", f"{_bytes(lock['soft_bytes'])} (ulimit -l; hard "
                                        f"{_bytes(lock['hard_bytes'])})"))
    c = r["cpu"]
    rows.append(("CPU cores", f"{c['cores']} ({c['affinity_cores']} usable by this process)"))
    rows.append(("host step threads", f"{c['host_step_threads']} (ZEROIO_STEP_THREADS)"))
    a = r["cpu_adam"]
    rows.append(("CPU Adam kernel", f"mode {a['mode']} (ZEROIO_CPU_ADAM), "
                                    + (f"buildable with {a['compiler']}" if a["buildable"]
                                       else "not built: " + ("no C++ compiler found"
                                                             if a["compiler"] is None
                                                             else "mode torch"))))
    if "path" in r:
        p = r["path"]
        rows.append(("path", p["path"]))
        rows.append(("  file system", p["filesystem"] or "unknown"))
        rows.append(("  free space", _bytes(p["free_bytes"])))
        rows.append(("  O_DIRECT", "yes" if p["o_direct"] else f"no: {p['o_direct_error']}"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:{width}s}  {v}")
    return 0
