"""Run one contender as its own process (group), with a deadline, and say how it ended.

A contender either prints its JSON result as the last JSON line of stdout
(train_llama.py --json, the runners' common.emit) or fails; ``Outcome``
carries which, with a one-line reason a reader of the table can act on
("GPU out of memory", "killed by SIGKILL (host out of memory?)", the last
exception line). stdout/stderr go to files beside the results, so a long
NCCL or compiler log never sits in this process's memory.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/
from procs import kill_group  # noqa: E402


class Status(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    TIMEOUT = "timeout"
    SKIPPED = "skipped"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outcome:
    status: Status
    reason: str = ""
    """Empty when OK; else one line saying how it failed."""
    result: dict[str, Any] | None = None
    """The contender's JSON result (OK only)."""
    wall_seconds: float = 0.0
    log: str = ""
    """Path of the stderr log."""


_PATTERNS = (
    (re.compile(r"CUDA out of memory|OutOfMemoryError", re.I), "GPU out of memory"),
    (re.compile(r"No space left on device|ENOSPC", re.I), "disk full (ENOSPC)"),
    (re.compile(r"Cannot allocate memory|std::bad_alloc|CapacityError", re.I),
     "host out of memory"),
)


def last_json(text: str) -> dict[str, Any] | None:
    """The last line of ``text`` that parses as a JSON object."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


def failure_reason(returncode: int, stderr: str) -> str:
    """One line: a known cause (OOM, disk full) with the error line, or the last error line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|error:)", ln)
              or "Error:" in ln]
    detail = (errors or lines or [""])[-1][:300]
    for pattern, cause in _PATTERNS:
        hit = [ln for ln in lines if pattern.search(ln)]
        if hit:
            return f"{cause}: {hit[-1][:240]}"
    if returncode < 0:
        name = signal.Signals(-returncode).name
        extra = " (host out of memory?)" if name == "SIGKILL" else ""
        return f"killed by {name}{extra}" + (f"; last line: {detail}" if detail else "")
    return f"exit code {returncode}" + (f": {detail}" if detail else "")


def run(argv: list[str], *, env: dict[str, str], timeout: float, log_dir: Path, name: str,
        cwd: str | None = None) -> Outcome:
    """Run ``argv`` in a new session; kill the whole group at ``timeout`` seconds."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
    t0 = time.perf_counter()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        err.write("$ " + " ".join(argv) + "\n")
        err.flush()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return Outcome(status=Status.TIMEOUT, reason=f"timed out after {timeout:.0f} s",
                           wall_seconds=time.perf_counter() - t0, log=str(err_path))
    wall = time.perf_counter() - t0
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    result = last_json(stdout)
    if code == 0 and result is not None:
        return Outcome(status=Status.OK, result=result, wall_seconds=wall, log=str(err_path))
    reason = failure_reason(code, stderr) if code != 0 else "exit code 0 but no JSON result"
    return Outcome(status=Status.FAILED, reason=reason, wall_seconds=wall, log=str(err_path))
