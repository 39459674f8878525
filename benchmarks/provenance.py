"""Where a benchmark result came from: the machine, the date and the commit.

One home for what every script in benchmarks/ records beside its numbers.
The device machine receives a copy of the working tree without .git, so the
commit can be passed in as ZEROIO_COMMIT; otherwise git is asked.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

GIB = 1 << 30
_REPO = Path(__file__).resolve().parent.parent


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit() -> str:
    """The commit of the code that ran (ZEROIO_COMMIT, else git, else "unknown")."""
    return (os.environ.get("ZEROIO_COMMIT")
            or _run(["git", "-C", str(_REPO), "rev-parse", "HEAD"]) or "unknown")


def dirty() -> bool | None:
    """True when tracked files differ from the commit; None when unknown (no .git)."""
    if os.environ.get("ZEROIO_COMMIT"):
        return None
    out = _run(["git", "-C", str(_REPO), "status", "--porcelain", "--untracked-files=no"])
    return bool(out)


def now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def stamp(t: _dt.datetime | None = None) -> str:
    return (t or now()).strftime("%Y%m%dT%H%M%SZ")


def machine(disk_path: str | Path | None = None) -> dict[str, Any]:
    """GPUs (nvidia-smi), CPUs, RAM, torch, and free disk where state goes."""
    import psutil

    gpus = [g for g in _run(["nvidia-smi", "--query-gpu=name,memory.total",
                             "--format=csv,noheader"]).splitlines() if g]
    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "gpus": gpus,
        "gpu_count": len(gpus),
        "cpu_count": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / GIB, 1),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    if disk_path is not None:
        probe = Path(disk_path)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        info["disk_free_gib"] = round(shutil.disk_usage(probe).free / GIB, 1)
    return info


def header(disk_path: str | Path | None = None) -> dict[str, Any]:
    """The block every results file starts with."""
    t = now()
    return {"machine": machine(disk_path), "date": t.isoformat(timespec="seconds"),
            "commit": commit(), "dirty": dirty()}


def write_result(out_dir: str | Path, kind: str, result: dict[str, Any]) -> Path:
    """Write ``result`` as ``<out_dir>/<kind>-<host>-<stamp>.json``; returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{kind}-{platform.node()}-{stamp()}.json"
    path.write_text(json.dumps(result, indent=2))
    return path
