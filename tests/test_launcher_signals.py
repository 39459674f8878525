"""`zeroio launch`'s ranks die with the launcher, and its summary names the rank that failed.

A SIGKILL of the launcher's process group (a scheduler's hard kill, a closed
terminal) must not leave ranks running; a rank killed by a signal must be the
one the summary blames, not the survivor that the launcher itself stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from zeroio.testing.multirank import outside_launcher_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process model")

SLEEPER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    out = Path(sys.argv[-1])  # zeroio launch passes --local_rank=N first
    (out / f"pid.{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(120)
""")


def _env() -> dict[str, str]:
    return outside_launcher_env()


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an exited child nobody reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait_for(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def test_ranks_die_when_the_launcher_group_is_sigkilled(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "zeroio.cli.main", "launch", "--nproc", "2", str(script),
         str(tmp_path)], cwd=tmp_path, env=_env(), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        assert _wait_for(lambda: all((tmp_path / f"pid.{r}").is_file() for r in (0, 1)), 60), \
            "the ranks did not start"
        time.sleep(0.2)
        pids = [int((tmp_path / f"pid.{r}").read_text()) for r in (0, 1)]
        assert all(_alive(p) for p in pids)
        os.killpg(launcher.pid, signal.SIGKILL)  # the whole group, as a hard kill does
        launcher.wait(timeout=10)
        assert _wait_for(lambda: not any(_alive(p) for p in pids), 5), \
            f"ranks {[p for p in pids if _alive(p)]} outlived their launcher"
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


def test_watchdog_ends_a_rank_whose_parent_dies_without_prctl(tmp_path):
    """Where prctl is unavailable, the polling thread does the same job."""
    child = textwrap.dedent(f"""
        import os, sys, time
        from zeroio.cli import rank
        rank._prctl_pdeathsig = lambda sig: False
        assert rank.guard_parent(os.getppid(), interval=0.1) == "watchdog"
        open({str(tmp_path / 'child.pid')!r}, "w").write(str(os.getpid()))
        time.sleep(60)
    """)
    parent = textwrap.dedent(f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {child!r}])
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], env=_env())
    pid = None
    try:
        assert _wait_for(lambda: (tmp_path / "child.pid").is_file(), 30)
        time.sleep(0.1)
        pid = int((tmp_path / "child.pid").read_text())
        assert _alive(pid)
        proc.kill()
        proc.wait(timeout=10)
        assert _wait_for(lambda: not _alive(pid), 5), "the guarded child outlived its parent"
    finally:
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


def test_guard_exits_when_the_parent_is_already_gone():
    code = "from zeroio.cli import rank; rank.guard_parent(1); print('not reached')"
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL and "not reached" not in proc.stdout


def test_summary_names_the_rank_killed_by_a_signal(tmp_path):
    script = tmp_path / "die.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        time.sleep(1)
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """))
    proc = subprocess.run([sys.executable, "-m", "zeroio.cli.main", "launch", "--nproc", "2",
                           str(script)], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=120)
    summary = [ln for ln in proc.stderr.splitlines() if ln.startswith("zeroio launch:")]
    assert summary and "rank 1 was killed by signal 9 (SIGKILL)" in summary[-1], proc.stderr[-2000:]
    assert "rank 0" not in summary[-1]
    assert proc.returncode == 128 + signal.SIGKILL


def test_root_failure_prefers_the_rank_not_stopped_by_the_launcher():
    from types import SimpleNamespace as F

    from zeroio.cli.launch_cmd import describe_failure, root_failure

    term, kill = -int(signal.SIGTERM), -int(signal.SIGKILL)
    failures = {0: F(exitcode=term, timestamp=10), 1: F(exitcode=kill, timestamp=10),
                2: F(exitcode=term, timestamp=9)}
    assert root_failure(failures)[0] == 1
    assert root_failure({0: F(exitcode=3, timestamp=12), 1: F(exitcode=2, timestamp=11)})[0] == 1
    assert root_failure({0: F(exitcode=term, timestamp=5), 3: F(exitcode=term, timestamp=4)})[0] == 3
    assert describe_failure(2, F(exitcode=3)) == ("rank 2 exited with code 3", 3)
