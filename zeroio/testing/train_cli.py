"""Run `zeroio train --json` in a fresh process, as a user would, and read its one summary line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def run_train(out: Path, args: list[str], environ: dict[str, str], *,
              timeout: float = 300) -> dict:
    """``zeroio train <args> --output out`` (``args`` must hold ``--json``) in ``environ`` (the
    caller's ``os.environ``) without its launcher variables, one thread per process; the parsed
    summary. AssertionError, with stderr's tail, when it fails or prints anything but one JSON
    line."""
    env = dict(environ, OMP_NUM_THREADS="1")
    for k in _LAUNCH_VARS:
        env.pop(k, None)
    cmd = [sys.executable, "-m", "zeroio.cli.main", "train", *args, "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=out.parent)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stderr[-4000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"--json must print exactly one line, got:\n{proc.stdout}"
    return json.loads(lines[0])
