"""The rank side of `zeroio launch` and `zeroio train`: a rank dies with its launcher.

    python -m zeroio.cli.rank SCRIPT ARGS...        (what torchrun starts per rank)
    python -m zeroio.cli.rank -m MODULE ARGS...
    python -m zeroio.cli.rank [--local-rank-arg] [--bind-cores LIST] [--no-python] ...

[Note: ranks die with their launcher]
torch's launcher starts each rank in a session of its own, so a SIGKILL of the
launcher's process group (a scheduler's hard kill, a closed terminal) does not
reach the ranks: they would be re-parented to init and keep training and
writing checkpoints. `zeroio launch` therefore exports ``ZEROIO_LAUNCHER_PID``
(its own pid: torch's launcher runs in that process and is every rank's parent)
and starts each rank through this module, which, before the user's code runs:

1. asks the kernel for SIGKILL when the parent exits (Linux
   ``prctl(PR_SET_PDEATHSIG)``), then checks that the parent is still the
   launcher (it may have died before the request was made: exit at once);
2. where prctl is not available, starts a daemon thread that polls the parent
   pid every second and kills this process when it changes.

Only ranks started by zeroio's launcher are guarded: a script under plain
``torchrun`` or ``accelerate launch`` runs as those launchers run it.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading

from zeroio.config.launch_env import LAUNCHER_PID, launch_env

LAUNCHER_ENV = LAUNCHER_PID
_PR_SET_PDEATHSIG = 1


def _prctl_pdeathsig(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``; False where the call does not exist or fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(launcher: int, interval: float) -> None:
    import time

    while os.getppid() == launcher:
        time.sleep(interval)
    os.kill(os.getpid(), signal.SIGKILL)


def guard_parent(launcher: int | None = None, *, interval: float = 1.0) -> str:
    """Make this process die when ``launcher`` (default ``$ZEROIO_LAUNCHER_PID``) exits.

    Returns how: "prctl", "watchdog" or "off" (no launcher pid known). A parent that is
    already gone ends this process now (see [Note: ranks die with their launcher])."""
    if launcher is None:
        launcher = launch_env().launcher_pid
        if launcher is None:
            return "off"
    how = "prctl" if _prctl_pdeathsig(signal.SIGKILL) else "watchdog"
    if os.getppid() != launcher:  # the launcher died before the request took effect
        os._exit(128 + signal.SIGKILL)
    if how == "watchdog":
        threading.Thread(target=_watch, args=(launcher, interval), name="zeroio-parent-watch",
                         daemon=True).start()
    return how


def _options(argv: list[str]) -> tuple[dict[str, str | bool], list[str]]:
    """The launcher's options for this rank, given before the script (see ``main``)."""
    opts: dict[str, str | bool] = {}
    while argv[:1] and argv[0] in ("--local-rank-arg", "--no-python", "--bind-cores"):
        if argv[0] == "--bind-cores":
            if len(argv) < 2:
                raise SystemExit("zeroio.cli.rank: --bind-cores needs a core list")
            opts["bind_cores"], argv = argv[1], argv[2:]
        else:
            opts[argv[0][2:].replace("-", "_")], argv = True, argv[1:]
    return opts, argv


def bind_cores(core_list: str) -> list[int]:
    """Pin this rank to its share of ``core_list`` (zeroio/cli/launch_cores.py); the cores."""
    from zeroio.cli.launch_cores import parse_core_list, rank_cores

    env = launch_env()
    mine = rank_cores(parse_core_list(core_list), env.local_world_size or 1, env.local_rank)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, mine)
    return mine


def main(argv: list[str] | None = None) -> None:
    """Guard this rank, then run SCRIPT (or ``-m MODULE``) as ``python`` would, as __main__.

    Options before the script, set by ``zeroio launch`` from DeepSpeed's flags:
    ``--local-rank-arg`` passes ``--local_rank=N`` (this rank's ``LOCAL_RANK``) as the
    script's first argument; ``--bind-cores LIST`` pins this rank to its share of LIST;
    ``--no-python`` executes SCRIPT itself instead of running it as Python."""
    argv = list(sys.argv[1:] if argv is None else argv)
    guard_parent()
    opts, argv = _options(argv)
    module = argv[:1] == ["-m"]
    if module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m zeroio.cli.rank [--local-rank-arg] [--bind-cores LIST] "
                         "[--no-python] [-m] SCRIPT_OR_MODULE [ARGS...]")
    if opts.get("bind_cores"):
        bind_cores(str(opts["bind_cores"]))
    target, args = argv[0], argv[1:]
    if opts.get("local_rank_arg"):
        args = [f"--local_rank={launch_env().local_rank}", *args]
    if opts.get("no_python"):  # the parent-death signal survives exec (prctl(2))
        os.execvp(target, [target, *args])
    sys.argv = [target, *args]
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python SCRIPT` sets it
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
