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


def train_here(out: Path, args: list[str]) -> subprocess.CompletedProcess:
    """``zeroio train <args> --output out`` through the command's own ``main`` in this process,
    for command lines refused before any rank starts (a bad option, a locked or foreign
    --output): the exit status and what it printed, as a ``CompletedProcess``."""
    return zeroio_here(["train", *args, "--output", str(out)])


def zeroio_here(argv: list[str]) -> subprocess.CompletedProcess:
    """``zeroio <argv>`` through the command's own ``main`` in this process, without the
    launcher variables (never for a command that starts ranks): its exit status and what it
    printed, as a ``CompletedProcess``. An exception other than the command's own exit
    propagates (a traceback is never an answer)."""
    import contextlib
    import io

    from zeroio.cli.main import main
    from zeroio.cli.train import rundir
    from zeroio.testing.multirank import launcher_env_removed

    stdout, stderr = io.StringIO(), io.StringIO()
    with launcher_env_removed(rundir.ENV), contextlib.redirect_stdout(stdout), \
            contextlib.redirect_stderr(stderr):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's usage errors
            rc = e.code if isinstance(e.code, int) else 2
    return subprocess.CompletedProcess(argv, rc, stdout.getvalue(), stderr.getvalue())
