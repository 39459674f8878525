"""Child processes of the benchmark scripts (standard library only: tools/device_batch.py
imports it before anything is installed on the device machine)."""

from __future__ import annotations

import os
import signal
import subprocess


def kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM ``proc``'s process group (a launcher and its ranks), then SIGKILL.

    ``proc`` must have been started with ``start_new_session=True`` so the group is its own.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
