"""How many processes ``accelerate launch`` was asked for, when it started this process.

[Note: the process count accelerate was asked for]
``accelerate launch --num_processes 2 script.py`` without ``--multi_gpu`` (or a config
whose ``distributed_type`` is not a multi-process one) starts *one* process and says
nothing: the script trains one rank on a machine where two were asked for.
``requested_processes`` finds the count that was asked for in the launching
``accelerate launch`` command line (the parent process: ``--num_processes``, else the
``--config_file``'s or the default config's ``num_processes``); a caller compares it with
``WORLD_SIZE``. Where the parent's command line cannot be read, a process that
accelerate's single-process launcher started with a ``MASTER_ADDR`` (which it sets only for
more than one process) but no ``WORLD_SIZE`` counts as "more than one, how many unknown"
(0). Callers: zeroio's own Trainer (zeroio/integrations/accelerate.py, ``check_launch``) and
the ``deepspeed`` facade's ``init_distributed`` (zeroio/deepspeed/api.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from zeroio import jsonlimits
from zeroio.config.launch_env import launch_env


def parent_argv() -> list[str] | None:
    """The command line of this process's parent (None where it cannot be read)."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def option(argv: Sequence[str], *names: str) -> str | None:
    """The value of the first of ``names`` before the script in ``argv``."""
    for i, arg in enumerate(argv):
        if arg.endswith(".py") or arg == "-m":  # the training script: its own options follow
            return None
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def _launch_options(argv: Sequence[str]) -> list[str] | None:
    """What follows ``accelerate launch`` (or ``python -m accelerate.commands.launch``) in a
    command line; None when it is not one."""
    for i, arg in enumerate(argv[:4]):
        if arg == "accelerate.commands.launch" or (
                arg == "launch" and any("accelerate" in a for a in argv[:i])):
            return list(argv[i + 1:])
    return None


def config_processes(path: str | None) -> int | None:
    """``num_processes`` of an accelerate config file (default: accelerate's default file)."""
    if path is None:
        try:
            from accelerate.commands.config import default_config_file
        except ImportError:
            return None
        path = default_config_file
    p = Path(path)
    if not p.is_file():
        return None
    try:
        if p.suffix == ".json":
            data = jsonlimits.loads(p.read_text(), f"accelerate config {p}")
        else:
            import yaml

            data = yaml.safe_load(p.read_text())
        n = data.get("num_processes") if isinstance(data, dict) else None
    except (ValueError, ImportError, OSError, AttributeError):
        return None
    return n if isinstance(n, int) and n > 0 else None


def requested_processes(environ: Mapping[str, str] | None = None,
                        argv: Sequence[str] | None = None) -> int | None:
    """The process count ``accelerate launch`` was asked for (see the note): None when this
    process was not started by ``accelerate launch`` or the count is unknown; 0 when it is
    known to be more than one but not how many. ``argv``: the parent's command line."""
    env = launch_env().variables if environ is None else environ
    if "ACCELERATE_MIXED_PRECISION" not in env:  # set by every accelerate launcher
        return None
    argv = parent_argv() if argv is None else list(argv)
    launch = _launch_options(argv or [])
    if launch is not None:
        n = option(launch, "--num_processes", "--num-processes")
        if n is not None:
            return int(n) if n.isdigit() else None
        return config_processes(option(launch, "--config_file", "--config-file"))
    if not argv and "MASTER_ADDR" in env and "WORLD_SIZE" not in env:
        return 0
    return None


def fewer_than_asked(environ: Mapping[str, str] | None = None,
                     argv: Sequence[str] | None = None) -> tuple[int, int] | None:
    """(asked, started) when accelerate started fewer processes than it was asked for (asked 0:
    more than one), else None."""
    env = launch_env().variables if environ is None else environ
    asked = requested_processes(env, argv)
    if asked is None:
        return None
    world = int(env.get("WORLD_SIZE", "1"))
    return None if asked == world else (asked, world)
