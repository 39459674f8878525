"""``zeroio launch --config_file CFG.yaml SCRIPT ARGS``: accelerate's launcher, on zeroio.

[Note: accelerate config files under zeroio launch]
An accelerate config with ``distributed_type: DEEPSPEED`` (``deepspeed_config_file`` or
inline ``zero_stage``, ``offload_*``) makes ``accelerate launch`` check that DeepSpeed is
importable before it starts anything, and start DeepSpeed's ranks with the config in their
environment. Given accelerate's ``--config_file``, ``zeroio launch`` puts zeroio's
``deepspeed`` package first on ``PYTHONPATH`` (as for every launch) and hands the command to
accelerate's own launcher (``python -m accelerate.commands.launch``, replacing this process,
so signals and the exit status are accelerate's): the check finds the facade, accelerate
reads its config file as always, and the ranks' ``import deepspeed`` is zeroio. Any
accelerate config works this way (``MULTI_GPU``, ``MULTI_CPU``, ...). zeroio's node flags
become accelerate's: ``--nproc`` (per node) times ``--nnodes`` -> ``--num_processes``
(accelerate counts every machine's), ``--nnodes`` -> ``--num_machines``, ``--node_rank`` ->
``--machine_rank``, ``--master_addr`` / ``--master_port`` -> ``--main_process_ip`` /
``--main_process_port``, ``--module`` / ``--no_python`` as they are; DeepSpeed's host and
core flags (``--hostfile``, ``--include``, ``--exclude``, ``--bind_cores_to_rank``) have no
accelerate counterpart and are refused. ``--local_rank`` is not passed (accelerate passes
none; the ranks read ``LOCAL_RANK``).
"""

from __future__ import annotations

import os
import sys

from zeroio.errors import ConfigError

_REFUSED = ("hostfile", "include", "exclude", "bind_cores_to_rank", "bind_core_list")


def accelerate_argv(args, script_args: list[str]) -> list[str]:
    """The ``python -m accelerate.commands.launch`` command for ``args`` (see the note)."""
    for name in _REFUSED:
        if getattr(args, name, None):
            raise ConfigError(f"--{name} with --config_file: accelerate launches the ranks from its "
                              "config file, which has no such setting; drop one of the two",
                              key=name)
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(args.config_file)]
    nnodes = args.nnodes
    if args.nproc is not None:
        argv += ["--num_processes", str(args.nproc * (nnodes or 1))]
    for flag, value in (("--num_machines", nnodes), ("--machine_rank", args.node_rank),
                        ("--main_process_ip", args.master_addr),
                        ("--main_process_port", args.master_port)):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--module"] if args.module else []
    argv += ["--no_python"] if args.no_python else []
    return [*argv, args.script, *script_args]


def run_accelerate(args, script_args: list[str]) -> int:
    """Replace this process with accelerate's launcher (the facade already on PYTHONPATH)."""
    if not os.path.isfile(args.config_file):
        raise ConfigError(f"--config_file {args.config_file}: no such file (an accelerate config, "
                          "as `accelerate config` writes)", key="config_file")
    argv = accelerate_argv(args, script_args)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return 0  # not reached
