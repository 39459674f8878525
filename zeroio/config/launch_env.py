"""What the launcher told this process through the environment, read in one place.

``torchrun`` (and ``zeroio launch``, ``accelerate launch``) describe the world in
environment variables: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``ACCELERATE_*``. Code
below the launcher takes them from a frozen ``LaunchEnv`` (``launch_env()``), read
when asked, instead of reading ``os.environ`` itself. ``CXX`` (the compiler torch
inductor would use) is here too, for ``zeroio report``. zeroio's own switches
(``ZEROIO_*``) are not launch variables: they are config keys or documented
overrides (``zeroio.config.overrides``); the two exceptions are how zeroio's own
launcher talks to the ranks it starts: ``ZEROIO_LAUNCHER_PID`` (the ranks die with
it: cli/rank.py) and ``ZEROIO_RUN_LOCK`` (the run directory's lock token, so a rank
of the holder's job does not take the lock again: cli/train/rundir.py). ``export``
sets one for the children a block starts and restores it after.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from zeroio.errors import ConfigError

#: The variables a launcher sets that zeroio reads (prefixes end in "_").
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "ACCELERATE_")
LAUNCHER_PID = "ZEROIO_LAUNCHER_PID"
"""Set by zeroio's launcher for its ranks: its pid."""
RUN_LOCK = "ZEROIO_RUN_LOCK"
"""Set by the holder of a run directory's lock for the ranks it starts: path and token."""


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment {name}={raw!r}: expected an integer (the launcher sets "
                          "it; unset it to run as one process)", key=name) from None


@dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """The launcher's description of this process; every field None where it is not set."""

    rank: int | None = None
    """``RANK``: this process's global rank."""
    world_size: int | None = None
    """``WORLD_SIZE``: processes in the job."""
    local_rank: int = 0
    """``LOCAL_RANK`` (0 when unset): the GPU this process uses on its host."""
    local_world_size: int | None = None
    """``LOCAL_WORLD_SIZE`` when a positive integer: processes on this host."""
    master_addr: str | None = None
    """``MASTER_ADDR``: the rendezvous host."""
    cxx: str | None = None
    """``CXX``: the C++ compiler torch inductor tries first."""
    launcher_pid: int | None = None
    """``ZEROIO_LAUNCHER_PID`` when a pid: zeroio's launcher started this process."""
    run_lock: str | None = None
    """``ZEROIO_RUN_LOCK``: the run directory lock this process's launcher holds (JSON)."""
    variables: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Every launch variable that is set (``LAUNCH_VARS``), as written."""

    @property
    def launched(self) -> bool:
        """A launcher described a world to join (``WORLD_SIZE`` and ``MASTER_ADDR`` set)."""
        return self.world_size is not None and self.master_addr is not None

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        """From ``environ`` (default: this process's environment, read now)."""
        env = os.environ if environ is None else environ
        local = env.get("LOCAL_WORLD_SIZE", "").strip()
        return cls(
            rank=_int(env, "RANK"), world_size=_int(env, "WORLD_SIZE"),
            local_rank=_int(env, "LOCAL_RANK") or 0,
            local_world_size=int(local) if local.isdigit() and int(local) > 0 else None,
            master_addr=env.get("MASTER_ADDR"), cxx=env.get("CXX") or None,
            launcher_pid=int(pid) if (pid := env.get(LAUNCHER_PID, "").strip()).isdigit()
            else None,
            run_lock=env.get(RUN_LOCK) or None,
            variables=MappingProxyType({k: v for k, v in env.items()
                                        if k in LAUNCH_VARS or k.startswith("ACCELERATE_")}))


def launch_env() -> LaunchEnv:
    """This process's ``LaunchEnv``, read now (tests and launchers change the environment
    between engines, so nothing is cached)."""
    return LaunchEnv.read()


@contextlib.contextmanager
def export(name: str, value: str) -> Iterator[None]:
    """``name=value`` in this process's environment (so the processes it starts inherit it)
    for the block; the previous value (or its absence) after."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


__all__ = ["LAUNCHER_PID", "LAUNCH_VARS", "RUN_LOCK", "LaunchEnv", "export", "launch_env"]
