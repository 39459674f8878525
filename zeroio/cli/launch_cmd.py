"""`zeroio launch`: run a script on N processes per node, through torch's own launcher.

This is ``torchrun`` with zeroio's defaults, not a new launcher: the arguments
are translated into a ``torch.distributed.run`` argument list and handed to
its ``run``. Each process gets the usual ``RANK`` / ``LOCAL_RANK`` /
``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` environment, so a script that
calls ``zeroio.initialize`` runs the same under ``zeroio launch``, ``torchrun``
and ``accelerate launch``.

On one node with no ``--master-port`` a free port is picked, so two launches
on one machine do not collide on torchrun's fixed default (29500).
"""

from __future__ import annotations

import argparse
import sys

from zeroio.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="run a script on N processes (torch.distributed.run)",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--nproc", type=int, default=None,
                   help="processes per node (default: the number of GPUs, or 1 without CUDA)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (default 0)")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of node 0 (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None,
                   help="port on node 0 (default: a free port on one node, 29500 on several)")
    p.add_argument("-m", "--module", action="store_true",
                   help="treat SCRIPT as a module name, like python -m")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=run)


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def torchrun_argv(
    script: str,
    script_args: list[str],
    *,
    nproc: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    module: bool = False,
) -> list[str]:
    """The ``torch.distributed.run`` argument list for one launch (validated)."""
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}", key="nproc")
    if nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {nnodes}", key="nnodes")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank {node_rank} must be in 0..{nnodes - 1} for --nnodes {nnodes}",
                          key="node_rank")
    if master_port is None:
        if nnodes > 1:
            master_port = 29500  # every node must agree on it, so no random choice
        else:
            from zeroio.testing.multirank import free_port

            master_port = free_port()
    argv = [
        f"--nproc-per-node={nproc}",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
    ]
    if module:
        argv.append("--module")
    return argv + [script, *script_args]


def launch(argv: list[str]) -> int:
    """Run ``torch.distributed.run`` with ``argv``; the exit status of the job (0 = every rank ok)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torch_run

    try:
        torch_run(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        # torchrun has already printed each failed rank's error; only the summary line here
        failures = e.failures  # global rank -> ProcessFailure
        rank = min(failures)
        first = failures[rank]
        print(f"zeroio launch: {len(failures)} process(es) failed; rank {rank} "
              f"exited with code {first.exitcode}", file=sys.stderr)
        return first.exitcode if isinstance(first.exitcode, int) and first.exitcode > 0 else 1
    return 0


def run(args) -> int:
    nproc = args.nproc if args.nproc is not None else default_nproc()
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    return launch(torchrun_argv(
        args.script, script_args, nproc=nproc, nnodes=args.nnodes, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port, module=args.module,
    ))
